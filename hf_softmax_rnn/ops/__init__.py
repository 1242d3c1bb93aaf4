"""Pure attention functions: one entry point, three modes (see `attention`)."""

from hf_softmax_rnn.ops.attention import attention
from hf_softmax_rnn.ops.recurrent_state import RecurrentState
from hf_softmax_rnn.ops.softmax import softmax_attention, softmax_attention_reference
from hf_softmax_rnn.ops.taylor import taylor_exp, taylor_features, taylor_features_reference

__all__ = [
    "RecurrentState",
    "attention",
    "softmax_attention",
    "softmax_attention_reference",
    "taylor_exp",
    "taylor_features",
    "taylor_features_reference",
]
