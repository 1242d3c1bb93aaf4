"""The paper's experiments at small scale: MQAR training, Taylor-term magnitudes, ablations.

Each experiment module is also a `hf-softmax-rnn` subcommand (`add_arguments`, `run`).
"""
