"""The attention presets: the paper's variant names, then recipes for converting pretrained models, each
as a description and the `AttentionSpec` fields it sets (`AttentionSpec.from_preset(name)` builds and
validates one).

This module imports only the standard library, so that it can be copied flat next to a checkpoint for
`trust_remote_code` loading.
"""

from __future__ import annotations

from typing import Any

_C = 5.0
_RS = "recurrent_softmax"

#: Preset name -> (description, the spec fields it sets): the authors' names, then recipes for converting
#: pretrained models.
PRESET_FIELDS: dict[str, tuple[str, dict[str, Any]]] = {
    "softmax": ("exact softmax attention", dict(kind="softmax")),
    "softmax_taylor_80terms": (
        "order-79 Taylor truncation of exp with the softmax denominator",
        dict(kind=_RS, taylor_order=79, normalizer="softmax"),
    ),
    "softmax_taylor_2": (
        "order-2 Taylor truncation of exp with the softmax denominator (finite RNN)",
        dict(kind=_RS, taylor_order=2, normalizer="softmax"),
    ),
    "softmax_taylor_2_l2": (
        "order-2 Taylor truncation of exp with the l2 normaliser (finite RNN)",
        dict(kind=_RS, taylor_order=2, normalizer="l2"),
    ),
    "softmax_clamp_denom": (
        "exp clamped at 5, denominator clamped at 1",
        dict(kind=_RS, score_clamp=_C, normalizer="clamp"),
    ),
    "softmax_detach_denom": (
        "exp clamped at 5, denominator clamped at 1 and detached",
        dict(kind=_RS, score_clamp=_C, normalizer="detach"),
    ),
    "softmax_detach_denom_gate": (
        "exp clamped at 5, detached denominator + 1e-4, output gate",
        dict(kind=_RS, score_clamp=_C, normalizer="detach_eps", output_gate=True),
    ),
    "softmax_divs": (
        "exp clamped at 5, divided by sequence position",
        dict(kind=_RS, score_clamp=_C, normalizer="seqlen"),
    ),
    "softmax_gate": (
        "exp clamped at 5, no normaliser, output gate",
        dict(kind=_RS, score_clamp=_C, normalizer="none", output_gate=True),
    ),
    "softmax_divS_gate": (
        "exp clamped at 5, divided by sequence position, output gate",
        dict(kind=_RS, score_clamp=_C, normalizer="seqlen", output_gate=True),
    ),
    "softmax_divS_gatev2": (
        "exp clamped at 5, divided by sequence position, output gate (v2)",
        dict(kind=_RS, score_clamp=_C, normalizer="seqlen", output_gate=True),
    ),
    "softmax_divS_norm": (
        "exp clamped at 5, divided by sequence position, then RMSNorm",
        dict(kind=_RS, score_clamp=_C, normalizer="seqlen_rms"),
    ),
    "gated_softmax": (
        "exp clamped at 5, input and output gates, divided by position then LayerNorm",
        dict(kind=_RS, score_clamp=_C, normalizer="seqlen_layer", input_gate=True, output_gate=True),
    ),
    "gated_softmax_no_norm": (
        "exp clamped at 5, input and output gates, divided by position",
        dict(kind=_RS, score_clamp=_C, normalizer="seqlen", input_gate=True, output_gate=True),
    ),
    "gated_softmax_no_in_gate": (
        "exp clamped at 5, output gate, divided by position then LayerNorm",
        dict(kind=_RS, score_clamp=_C, normalizer="seqlen_layer", output_gate=True),
    ),
    "gated_softmax_no_out_gate": (
        "exp clamped at 5, input gate, divided by position then LayerNorm",
        dict(kind=_RS, score_clamp=_C, normalizer="seqlen_layer", input_gate=True),
    ),
    "gated_softmax_no_out_gate_no_norm": (
        "exp clamped at 5, input gate, divided by position",
        dict(kind=_RS, score_clamp=_C, normalizer="seqlen", input_gate=True),
    ),
    "gated_softmax_no_in_gate_no_norm": (
        "exp clamped at 5, output gate, divided by position",
        dict(kind=_RS, score_clamp=_C, normalizer="seqlen", output_gate=True),
    ),
    "gated_softmax_no_gate": (
        "exp clamped at 5, divided by position then LayerNorm",
        dict(kind=_RS, score_clamp=_C, normalizer="seqlen_layer"),
    ),
    "gated_softmax_no_gate_rmsnorm": (
        "exp clamped at 5, divided by position then RMSNorm",
        dict(kind=_RS, score_clamp=_C, normalizer="seqlen_rms"),
    ),
    "gated_softmax_no_gate_rmsnorm_nodivS": (
        "exp clamped at 5, RMSNorm",
        dict(kind=_RS, score_clamp=_C, normalizer="rms"),
    ),
    "gated_softmax_no_gate_L2norm_nodivS": (
        "exp clamped at 5, L2 norm",
        dict(kind=_RS, score_clamp=_C, normalizer="l2"),
    ),
    "gated_softmax_no_gate_L2norm_nodivS_noclamp": (
        "Norm(exp(QK^T)V): exp with the L2 norm in place of the denominator (the paper's headline)",
        dict(kind=_RS, normalizer="l2"),
    ),
    "gated_softmax_out_gate_L2norm_nodivS_noclamp": (
        "exp, output gate, then L2 norm (gate before the norm)",
        dict(kind=_RS, normalizer="l2", output_gate=True, output_gate_position="before_norm"),
    ),
    "gated_softmax_post_out_gate_L2norm_nodivS_noclamp": (
        "exp, L2 norm, then output gate",
        dict(kind=_RS, normalizer="l2", output_gate=True, output_gate_position="after_norm"),
    ),
    "gated_softmax_no_gate_no_norm": (
        "exp clamped at 5, divided by position",
        dict(kind=_RS, score_clamp=_C, normalizer="seqlen"),
    ),
    "gated_relu_no_in_gate_no_norm": (
        "relu(q).relu(k)/sqrt(d) clamped at 5, divided by position, output gate",
        dict(kind="linear", feature_map="relu", score_clamp=_C, normalizer="seqlen", output_gate=True),
    ),
    "gated_ReLU_no_gate_L2norm_nodivS_noclamp": (
        "relu(q).relu(k)/sqrt(d) with the L2 norm",
        dict(kind="linear", feature_map="relu", normalizer="l2"),
    ),
    "linear_elu": (
        "linear attention, elu+1 feature map, softmax-style denominator",
        dict(kind="linear", feature_map="elu", qk_scale=1.0),
    ),
    "linear_relu": (
        "linear attention, relu feature map, softmax-style denominator",
        dict(kind="linear", feature_map="relu", qk_scale=1.0),
    ),
    "linear_cosine": (
        "linear attention on L2-normalised q, k, divided by t^sigmoid(p_h)",
        dict(kind="linear", feature_map="cosine", normalizer="seqlen_pow", qk_scale=1.0),
    ),
    "linear_hedgehog": (
        "linear attention with the learned hedgehog feature map (softmax over [Wx, -Wx])",
        dict(kind="linear", feature_map="hedgehog"),
    ),
    "hedgehog_window_64": (
        "exact softmax over the last 64 positions, learned hedgehog linear attention beyond, one denominator",
        dict(kind="linear", feature_map="hedgehog", window=64),
    ),
    "hedgehog_window_64_l2": (
        "exp over the last 64 positions, hedgehog linear attention beyond, L2 norm in place of the denominator",
        dict(kind="linear", feature_map="hedgehog", window=64, normalizer="l2"),
    ),
    "taylor_2_window_64": (
        "exact softmax over the last 64 positions, order-2 Taylor exp beyond, one denominator",
        dict(kind=_RS, taylor_order=2, window=64),
    ),
    "taylor_2_l2_window_64": (
        "exp over the last 64 positions, order-2 Taylor exp beyond, L2 norm in place of the denominator",
        dict(kind=_RS, taylor_order=2, window=64, normalizer="l2"),
    ),
    "hedgehog_window_64_sinks_4": (
        "exact softmax over the first 4 and the last 64 positions, hedgehog linear attention between, one denominator",
        dict(kind="linear", feature_map="hedgehog", window=64, sinks=4),
    ),
    "taylor_2_window_64_sinks_4": (
        "exact softmax over the first 4 and the last 64 positions, order-2 Taylor exp between, one denominator",
        dict(kind=_RS, taylor_order=2, window=64, sinks=4),
    ),
    "hedgehog_window_64_sinks_4_decay": (
        "exact softmax over the first 4 and the last 64 positions, hedgehog linear attention between with a "
        "data-dependent decay of its state, one denominator",
        dict(kind="linear", feature_map="hedgehog", window=64, sinks=4, decay=True),
    ),
    "hedgehog_window_256_sinks_4_decay": (
        "exact softmax over the first 4 and the last 256 positions, hedgehog linear attention between with a "
        "data-dependent decay of its state, one denominator",
        dict(kind="linear", feature_map="hedgehog", window=256, sinks=4, decay=True),
    ),
    "hedgehog_window_256_sinks_4_kept_256_decay": (
        "exact softmax over the first 4 and the last 256 positions and the 256 most attended older ones, hedgehog "
        "linear attention over the rest with a data-dependent decay of its state, one denominator",
        dict(kind="linear", feature_map="hedgehog", window=256, sinks=4, kept=256, decay=True),
    ),
    "linear_identity_rms": (
        "linear attention with identity features and RMSNorm in place of the denominator (deltanet's additive "
        "counterpart)",
        dict(kind="linear", feature_map="identity", normalizer="rms"),
    ),
    "linear_identity_rms_decay": (
        "linear attention with identity features, a data-dependent decay and RMSNorm in place of the denominator "
        "(gated_deltanet's additive counterpart)",
        dict(kind="linear", feature_map="identity", normalizer="rms", decay=True),
    ),
    "deltanet": (
        "linear attention with a delta-rule state (DeltaNet): identity features, RMSNorm in place of the denominator",
        dict(kind="linear", feature_map="identity", normalizer="rms", delta_rule=True),
    ),
    "gated_deltanet": (
        "linear attention with a gated delta-rule state (Gated DeltaNet): identity features, a data-dependent "
        "decay, RMSNorm in place of the denominator",
        dict(kind="linear", feature_map="identity", normalizer="rms", delta_rule=True, decay=True),
    ),
    "linear_identity_rms_conv": (
        "linear_identity_rms with a short convolution of width 4 over the keys and values",
        dict(kind="linear", feature_map="identity", normalizer="rms", short_conv=4),
    ),
    "deltanet_conv": (
        "deltanet with a short convolution of width 4 over the keys and values, as DeltaNet has it",
        dict(kind="linear", feature_map="identity", normalizer="rms", delta_rule=True, short_conv=4),
    ),
    "gated_deltanet_conv": (
        "gated_deltanet with a short convolution of width 4 over the keys and values, as Gated DeltaNet has it",
        dict(kind="linear", feature_map="identity", normalizer="rms", delta_rule=True, decay=True, short_conv=4),
    ),
    "hedgehog_window_64_sinks_4_delta": (
        "exact softmax over the first 4 and the last 64 positions, hedgehog features with a gated delta-rule "
        "state beyond, one denominator",
        dict(kind="linear", feature_map="hedgehog", window=64, sinks=4, decay=True, delta_rule=True),
    ),
    "hedgehog_window_64_sinks_4_delta_conv": (
        "hedgehog_window_64_sinks_4_delta with a short convolution of width 4 over the keys and values",
        dict(kind="linear", feature_map="hedgehog", window=64, sinks=4, decay=True, delta_rule=True, short_conv=4),
    ),
    "hedgehog_window_64_sinks_4_delta_mass": (
        "hedgehog_window_64_sinks_4_delta whose state's recall weighs as much as the additive state's mass",
        dict(
            kind="linear", feature_map="hedgehog", window=64, sinks=4, decay=True, delta_rule=True, additive_mass=True
        ),
    ),
    "hedgehog_window_256_sinks_4_kept_256_delta": (
        "exact softmax over the first 4 and the last 256 positions and the 256 most attended older ones, hedgehog "
        "features with a gated delta-rule state over the rest, one denominator",
        dict(kind="linear", feature_map="hedgehog", window=256, sinks=4, kept=256, decay=True, delta_rule=True),
    ),
}

#: Preset name -> one-line description.
PRESETS: dict[str, str] = {name: desc for name, (desc, _) in PRESET_FIELDS.items()}
