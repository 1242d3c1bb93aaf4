"""The paper's experiments at small scale: MQAR training, Taylor-term magnitudes, ablations; and what the
benchmark scripts share (report files, step profiles).

Their subcommands (`mqar`, `taylor-terms`, `ablate`) are in `hf_softmax_rnn.commands`.
"""
