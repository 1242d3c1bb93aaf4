"""Long-context evaluation: perplexity per position bucket, agreement with the original's next-token
distributions by position, and passkey retrieval (with a hybrid's finite state or without it), on
texts of another kind than the training corpus (`data/eval_texts.py`), for a model beside the
original; the retrieval heads of an unconverted model, which decide where a hybrid keeps more exact
keys; and YaRN scaling of a rotary model's positions, to read past the context it was trained for."""

from hf_softmax_rnn.long_context.extend import extend_context
from hf_softmax_rnn.long_context.fidelity import position_fidelity
from hf_softmax_rnn.long_context.passkey import DEFAULT_DEPTHS, DEFAULT_LENGTHS, passkey_retrieval
from hf_softmax_rnn.long_context.positions import DEFAULT_BUCKETS, position_perplexity
from hf_softmax_rnn.long_context.report import LongContextSettings, comparison_tables, plot_long_context
from hf_softmax_rnn.long_context.retrieval import retrieval_layer_attention, retrieval_layers, retrieval_scores
from hf_softmax_rnn.long_context.state import finite_state_off

__all__ = [
    "DEFAULT_BUCKETS",
    "DEFAULT_DEPTHS",
    "DEFAULT_LENGTHS",
    "LongContextSettings",
    "comparison_tables",
    "extend_context",
    "finite_state_off",
    "passkey_retrieval",
    "plot_long_context",
    "position_fidelity",
    "position_perplexity",
    "retrieval_layer_attention",
    "retrieval_layers",
    "retrieval_scores",
]
