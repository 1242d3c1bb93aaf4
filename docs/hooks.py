"""MkDocs hook: pages write `<!-- generated: presets -->` where the preset table goes.

The table is built from `hf_softmax_rnn.attention_spec.PRESETS` and `AttentionSpec.from_preset` at
build time, so it lists every preset with its formula, modes and state size, and cannot drift.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hf_softmax_rnn import attention_spec  # noqa: E402
from hf_softmax_rnn.attention_spec import MODES, AttentionSpec  # noqa: E402

PRESET_TABLE_MARKER = "<!-- generated: presets -->"
HEAD_DIM = 64

#: How each normaliser turns the numerator N_t (and the denominator G_t, position count t) into the output.
NORMALIZER_FORMULAS = {
    "softmax": "N / G",
    "l2": "N / ‖N‖₂",
    "rms": "RMSNorm(N)",
    "layer": "LayerNorm(N)",
    "seqlen": "N / t",
    "seqlen_rms": "RMSNorm(N / t)",
    "seqlen_layer": "LayerNorm(N / t)",
    "seqlen_pow": "N / t^σ(p_h)",
    "clamp": "N / max(G, 1)",
    "detach": "N / max(sg(G), 1)",
    "detach_eps": "N / (sg(G) + 1e-4)",
    "none": "N",
}


def score_formula(spec: AttentionSpec) -> str:
    """The weight of one (query, key) pair, x = q·k times the spec's scale."""
    if spec.kind == "linear":
        kernel = "φ(q)·φ(k)"
    elif spec.taylor_order is not None:
        kernel = f"Σ_{{n≤{spec.taylor_order}}} xⁿ/n!"
    else:
        kernel = "exp(x)"
    if spec.score_clamp is not None:
        kernel = (
            f"min({kernel}, {spec.score_clamp:g})" if spec.kind == "linear" else f"exp(min(x, {spec.score_clamp:g}))"
        )
    if spec.window is not None:
        kernel = f"exp(x) over the last {spec.window} positions, e^λ {kernel} beyond"
    if spec.kind == "linear":
        kernel += f" ({spec.feature_map} map)"
    if spec.delta_rule:
        kernel += "; gated delta-rule state" if spec.decay else "; delta-rule state"
    elif spec.decay:
        kernel += "; decayed state"
    return kernel


def output_formula(spec: AttentionSpec) -> str:
    """The normaliser, with the gates where they apply."""
    formula = NORMALIZER_FORMULAS[spec.normalizer]
    if spec.output_gate:
        formula = f"σ(o) ⊙ {formula}" if spec.output_gate_position == "after_norm" else f"{formula}, N and G gated"
    if spec.input_gate:
        formula += "; v gated"
    return formula


def modes(spec: AttentionSpec) -> list[str]:
    """The modes that can compute `spec` at head size 64."""
    supported = []
    for mode in MODES:
        try:
            spec.check_mode(mode, HEAD_DIM)
        except ValueError:
            continue
        supported.append(mode)
    return supported


def decoding(spec: AttentionSpec) -> str:
    """What generation keeps per KV head (float32, head size 64)."""
    if spec.has_finite_state and not spec.fits_recurrent_state(HEAD_DIM):
        return f"KV cache (a state would take {spec.state_bytes(HEAD_DIM):.1e} bytes)"
    if not spec.fits_recurrent_state(HEAD_DIM):
        return "KV cache, grows per token"
    return f"state of {spec.state_bytes(HEAD_DIM) / 1024:,.1f} KiB ({spec.feature_dim(HEAD_DIM):,} features)"


def preset_table() -> str:
    """A Markdown table of every preset in `PRESETS`, in its order."""
    rows = [
        "| preset | meaning | score of (q, k) | output | modes | decodes from (per KV head, d = 64, float32) |",
        "|---|---|---|---|---|---|",
    ]
    for name, meaning in attention_spec.PRESETS.items():
        with warnings.catch_warnings():  # the odd-order warning is for users choosing a spec, not for this table
            warnings.simplefilter("ignore", UserWarning)
            spec = AttentionSpec.from_preset(name)
        cells = [
            f"`{name}`",
            meaning,
            score_formula(spec),
            output_formula(spec),
            ", ".join(modes(spec)),
            decoding(spec),
        ]
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, **kwargs) -> str:
    """MkDocs event: put the generated preset table where a page asks for it."""
    if PRESET_TABLE_MARKER not in markdown:
        return markdown
    return markdown.replace(PRESET_TABLE_MARKER, preset_table())
