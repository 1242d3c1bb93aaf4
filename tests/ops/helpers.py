"""Random inputs and learned parameters for the ops tests (float64 unless asked)."""

from __future__ import annotations

import warnings

import torch

from hf_softmax_rnn import PRESETS, AttentionSpec
from hf_softmax_rnn.ops.kernels import AttentionParams


def quiet_preset(name: str, **overrides) -> AttentionSpec:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AttentionSpec.from_preset(name, **overrides)


FINITE_STATE_PRESETS = [name for name in PRESETS if quiet_preset(name).fits_recurrent_state(8)]

#: Finite-state specs beyond the presets: every feature map and normaliser appears at least once.
EXTRA_FINITE_SPECS = {
    "linear_identity_softmax": AttentionSpec(kind="linear", feature_map="identity", normalizer="softmax"),
    "linear_taylor3_l2": AttentionSpec(kind="linear", feature_map="taylor", taylor_order=3, normalizer="l2"),
    "taylor4_rms": AttentionSpec(kind="recurrent_softmax", taylor_order=4, normalizer="rms"),
    "taylor2_layer_gates": AttentionSpec(
        kind="recurrent_softmax", taylor_order=2, normalizer="layer", input_gate=True, output_gate=True
    ),
    "taylor2_seqlen_rms": AttentionSpec(kind="recurrent_softmax", taylor_order=2, normalizer="seqlen_rms"),
    "elu_seqlen_layer": AttentionSpec(kind="linear", feature_map="elu", normalizer="seqlen_layer", qk_scale=1.0),
    "relu_seqlen_gate": AttentionSpec(kind="linear", feature_map="relu", normalizer="seqlen", output_gate=True),
    "hedgehog_detach": AttentionSpec(kind="linear", feature_map="hedgehog", normalizer="detach", hedgehog_dim=5),
    "elu_clamp_gate_before": AttentionSpec(
        kind="linear", feature_map="elu", normalizer="clamp", output_gate=True, output_gate_position="before_norm"
    ),
    "taylor2_none": AttentionSpec(kind="recurrent_softmax", taylor_order=2, normalizer="none"),
    "taylor2_detach_eps": AttentionSpec(kind="recurrent_softmax", taylor_order=2, normalizer="detach_eps"),
    "window1_elu": AttentionSpec(kind="linear", feature_map="elu", window=1),
    "window3_hedgehog": AttentionSpec(kind="linear", feature_map="hedgehog", hedgehog_dim=5, window=3),
    "window4_taylor2_l2_gates": AttentionSpec(
        kind="recurrent_softmax", taylor_order=2, normalizer="l2", window=4, input_gate=True, output_gate=True
    ),
    "window2_identity_rms": AttentionSpec(kind="linear", feature_map="identity", normalizer="rms", window=2),
    "window5_cosine_seqlen_layer": AttentionSpec(
        kind="linear", feature_map="cosine", normalizer="seqlen_layer", window=5
    ),
    "window2_sinks3_elu": AttentionSpec(kind="linear", feature_map="elu", window=2, sinks=3),
    "window3_sinks1_taylor2_rms_gates": AttentionSpec(
        kind="recurrent_softmax", taylor_order=2, normalizer="rms", window=3, sinks=1, input_gate=True, output_gate=True
    ),
    "decay_elu": AttentionSpec(kind="linear", feature_map="elu", decay=True),
    "decay_taylor2_l2": AttentionSpec(kind="recurrent_softmax", taylor_order=2, normalizer="l2", decay=True),
    "decay_window3_hedgehog_seqlen_layer": AttentionSpec(
        kind="linear", feature_map="hedgehog", hedgehog_dim=5, normalizer="seqlen_layer", window=3, decay=True
    ),
    "decay_window2_sinks2_elu_gates": AttentionSpec(
        kind="linear", feature_map="elu", window=2, sinks=2, decay=True, input_gate=True, output_gate=True
    ),
    "kept2_window3_hedgehog": AttentionSpec(kind="linear", feature_map="hedgehog", hedgehog_dim=5, window=3, kept=2),
    "kept3_decay_window2_sinks1_taylor2_gates": AttentionSpec(
        kind="recurrent_softmax", taylor_order=2, window=2, sinks=1, kept=3, decay=True, output_gate=True
    ),
    "delta_elu_l2": AttentionSpec(kind="linear", feature_map="elu", normalizer="l2", delta_rule=True),
    "delta_decay_taylor2_layer": AttentionSpec(
        kind="recurrent_softmax", taylor_order=2, normalizer="layer", decay=True, delta_rule=True
    ),
    "delta_window3_hedgehog": AttentionSpec(
        kind="linear", feature_map="hedgehog", hedgehog_dim=5, window=3, delta_rule=True
    ),
    "delta_decay_window2_sinks2_elu_gates": AttentionSpec(
        kind="linear", feature_map="elu", window=2, sinks=2, decay=True, delta_rule=True, output_gate=True
    ),
    "delta_kept2_decay_window3_sinks1_hedgehog": AttentionSpec(
        kind="linear", feature_map="hedgehog", hedgehog_dim=5, window=3, sinks=1, kept=2, decay=True, delta_rule=True
    ),
    "delta_mass_elu_softmax": AttentionSpec(kind="linear", feature_map="elu", delta_rule=True, additive_mass=True),
    "delta_mass_kept2_decay_window3_sinks1_hedgehog": AttentionSpec(
        kind="linear",
        feature_map="hedgehog",
        hedgehog_dim=5,
        window=3,
        sinks=1,
        kept=2,
        decay=True,
        delta_rule=True,
        additive_mass=True,
    ),  # fmt: skip
}

FINITE_SPECS = {**{name: quiet_preset(name) for name in FINITE_STATE_PRESETS}, **EXTRA_FINITE_SPECS}


def make_inputs(batch=2, heads=4, kv_heads=2, length=11, head_dim=8, dtype=torch.float64, requires_grad=False, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (
            (scale * torch.randn(*shape, generator=generator, dtype=torch.float64))
            .to(dtype)
            .requires_grad_(requires_grad)
        )

    q, k, v = (
        randn(batch, heads, length, head_dim),
        randn(batch, kv_heads, length, head_dim),
        randn(batch, kv_heads, length, head_dim),
    )
    gate_logits = {"input": randn(batch, kv_heads, length), "output": randn(batch, heads, length)}
    gate_logits["decay"] = randn(batch, kv_heads, length)
    gate_logits["delta"] = randn(batch, kv_heads, length)
    return q, k, v, gate_logits


def make_params(spec: AttentionSpec, heads=4, kv_heads=2, head_dim=8, dtype=torch.float64, requires_grad=False, seed=1):
    generator = torch.Generator().manual_seed(seed)
    width = spec.hedgehog_dim or head_dim

    def randn(*shape, scale=1.0, shift=0.0):
        return (
            (shift + scale * torch.randn(*shape, generator=generator, dtype=torch.float64))
            .to(dtype)
            .requires_grad_(requires_grad)
        )

    return {
        "norm_weight": randn(heads, head_dim, scale=0.3, shift=1.0),
        "norm_bias": randn(heads, head_dim, scale=0.3),
        "seqlen_power": randn(heads),
        "hedgehog_q": randn(heads, head_dim, width, scale=0.5),
        "hedgehog_k": randn(kv_heads, head_dim, width, scale=0.5),
        "linear_log_scale": randn(heads, scale=0.5),
    }


def as_params(tensors: dict) -> AttentionParams:
    """`make_params`' dict as the ops take it."""
    return AttentionParams(**tensors)


def left_padding_mask(batch: int, length: int, pads: list[int]) -> torch.Tensor:
    mask = torch.ones(batch, length, dtype=torch.long)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    return mask


def gated(spec: AttentionSpec, v: torch.Tensor, gate_logits: dict) -> tuple[torch.Tensor, dict]:
    """(values with the input gate applied as the layers do, {"output": gate, "decay": log-decays, "delta": write
    strengths}) for `spec`."""
    if spec.input_gate:
        v = v * torch.sigmoid(gate_logits["input"]).unsqueeze(-1)
    gates = {"output": torch.sigmoid(gate_logits["output"])} if spec.output_gate else {}
    if spec.decay:
        gates["decay"] = torch.nn.functional.logsigmoid(gate_logits["decay"])
    if spec.delta_rule:
        gates["delta"] = torch.sigmoid(gate_logits["delta"])
    return v, gates
