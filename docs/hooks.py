"""MkDocs hook: pages write a `<!-- generated: ... -->` marker where a generated list goes.

- `<!-- generated: presets -->`: the preset table, built from `hf_softmax_rnn.presets.PRESETS`
  and `AttentionSpec.from_preset`, so it lists every preset with its formula, modes and state size.
- `<!-- generated: spec fields -->`: every field of `AttentionSpec`, from `dataclasses.fields`: its type
  and default, and its meaning from the `Attributes:` section of the class docstring.
- `<!-- generated: finetune flags -->`: every flag of `hf-softmax-rnn finetune`, from the fields of
  `FinetuneConfig` and its groups (`flags.flag_fields`): its type, default and help, by help section.

Both are built at build time, so they cannot drift from the code.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import typing
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from griffe import Docstring  # noqa: E402

from hf_softmax_rnn import presets  # noqa: E402
from hf_softmax_rnn.attention_spec import MODES, AttentionSpec  # noqa: E402
from hf_softmax_rnn.flags import SHOWN_DEFAULT, flag_fields  # noqa: E402
from hf_softmax_rnn.training import FinetuneConfig  # noqa: E402

PRESET_TABLE_MARKER = "<!-- generated: presets -->"
FINETUNE_FLAGS_MARKER = "<!-- generated: finetune flags -->"
SPEC_FIELDS_MARKER = "<!-- generated: spec fields -->"
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
    for name, meaning in presets.PRESETS.items():
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


def type_name(annotation: typing.Any) -> str:
    """`int`, `list[int] | None`, `str | dict | None`: an annotation as the code writes it."""
    return annotation.__name__ if isinstance(annotation, type) else str(annotation)


def field_default(field: dataclasses.Field) -> str:
    """A dataclass field's default as code; "required" for a field without one."""
    if field.default_factory is not dataclasses.MISSING:
        return f"`{field.default_factory()!r}`"
    if field.default is dataclasses.MISSING:
        return "required"
    return f"`{field.default!r}`"


def docstring_attributes(cls: type) -> dict[str, str]:
    """Name -> description of the `Attributes:` section of a Google-style class docstring."""
    parsed = Docstring(inspect.cleandoc(cls.__doc__), parser="google").parse()
    return {
        item.name: " ".join(item.description.split())
        for section in parsed
        if section.kind.value == "attributes"
        for item in section.value
    }


def field_list(cls: type) -> str:
    """Every field of the dataclass `cls` as a definition list: name, type and default, then its meaning."""
    hints, meanings = typing.get_type_hints(cls), docstring_attributes(cls)
    missing = [field.name for field in dataclasses.fields(cls) if field.name not in meanings]
    if missing:
        raise ValueError(f"{cls.__name__}'s docstring has no Attributes entry for {missing}")
    entries = []
    for field in dataclasses.fields(cls):
        term = f"`{field.name}` · `{type_name(hints[field.name])}` · default {field_default(field)}"
        entries.append(f"{term}\n:   {meanings[field.name]}")
    return "\n\n".join(entries)


def flag_default(field: dataclasses.Field) -> str:
    """The default as `--help` shows it (a value as code, words such as "the attention's recipe" as
    they are); "required" for a field without one."""
    if SHOWN_DEFAULT in field.metadata:
        shown = field.metadata[SHOWN_DEFAULT]
        return shown if isinstance(shown, str) and " " in shown else f"`{shown}`"
    return field_default(field)


def flag_list(cls: type) -> str:
    """Every flag of `cls` (fields declared with `option`) as a definition list per help section:
    the flag, its field's type and default, then its help."""
    sections: dict[str, list[str]] = {}
    for field, annotation in flag_fields(cls):
        flag = field.metadata.get("flag", "--" + field.name.replace("_", "-"))
        if field.metadata.get("positional"):
            flag = field.name
        entry = f"`{flag}` · `{type_name(annotation)}` · default {flag_default(field)}\n:   {field.metadata['help']}"
        sections.setdefault(field.metadata.get("group", "required"), []).append(entry)
    return "\n\n".join(
        f"## {title[0].upper()}{title[1:]}\n\n" + "\n\n".join(entries) for title, entries in sections.items()
    )


def on_page_markdown(markdown: str, **kwargs) -> str:
    """MkDocs event: put the generated preset table and field and flag lists where a page asks for them."""
    if PRESET_TABLE_MARKER in markdown:
        markdown = markdown.replace(PRESET_TABLE_MARKER, preset_table())
    if SPEC_FIELDS_MARKER in markdown:
        markdown = markdown.replace(SPEC_FIELDS_MARKER, field_list(AttentionSpec))
    if FINETUNE_FLAGS_MARKER in markdown:
        markdown = markdown.replace(FINETUNE_FLAGS_MARKER, flag_list(FinetuneConfig))
    return markdown
