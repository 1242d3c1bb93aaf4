"""The documentation site: the generated preset table, the navigation, and what the product says of itself.

`make test` builds the site with `mkdocs build --strict` (broken links, anchors and API references fail
there); these tests check what a successful build does not.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
import warnings
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from hf_softmax_rnn.attention_spec import PRESETS, AttentionSpec

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


HOOKS = _hooks()


def _preset_rows(markdown: str) -> dict[str, list[str]]:
    """Preset name -> the cells of its row, from the preset table of a rendered page."""
    header = HOOKS.preset_table().splitlines()[0]
    assert markdown.count(header) == 1
    table = markdown.split(header)[1].split("\n\n")[0]
    rows = {}
    for line in table.splitlines():
        match = re.match(r"\| `([\w]+)` \| (.*) \|$", line)
        if match:
            rows[match.group(1)] = [cell.strip() for cell in re.split(r"(?<!\\)\|", match.group(2))]
    return rows


def _spec(name: str) -> AttentionSpec:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return AttentionSpec.from_preset(name)


def test_the_presets_page_lists_every_preset_once_in_order():
    page = (DOCS / "presets.md").read_text()
    assert page.count(HOOKS.PRESET_TABLE_MARKER) == 1
    rows = _preset_rows(HOOKS.on_page_markdown(page))
    assert list(rows) == list(PRESETS)


@pytest.mark.parametrize("name", list(PRESETS))
def test_each_row_states_the_presets_meaning_modes_and_state(name):
    cells = _preset_rows(HOOKS.preset_table())[name]
    meaning, modes, decodes = cells[0], cells[3], cells[4]
    spec = _spec(name)
    assert meaning == PRESETS[name].replace("|", "\\|")
    finite = spec.fits_recurrent_state(64)
    assert modes == ("parallel, chunked, recurrent" if finite else "parallel")
    if finite:
        assert (
            f"{spec.state_bytes(64) / 1024:,.1f} KiB" in decodes and f"({spec.feature_dim(64):,} features)" in decodes
        )
    else:
        assert decodes.startswith("KV cache")


def test_the_table_follows_presets_when_they_change(monkeypatch):
    subset = {name: PRESETS[name] for name in ("linear_elu", "softmax")}
    monkeypatch.setattr("hf_softmax_rnn.presets.PRESETS", subset)
    assert list(_preset_rows(HOOKS.preset_table())) == ["linear_elu", "softmax"]


def test_a_page_without_the_marker_is_left_as_it_is():
    assert HOOKS.on_page_markdown("# A page\n\ntext\n") == "# A page\n\ntext\n"


def _nav_files(items) -> list[str]:
    files = []
    for item in items:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        files += _nav_files(value) if isinstance(value, list) else [value]
    return files


def test_every_page_is_in_the_navigation_and_every_entry_exists():
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    nav = _nav_files(config["nav"])
    pages = sorted(
        str(path.relative_to(DOCS)) for path in [*DOCS.glob("*.md"), *DOCS.glob("api/*.md"), *DOCS.glob("results/*.md")]
    )
    assert sorted(nav) == pages


PRODUCT = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *DOCS.rglob("*.md"), *(ROOT / "model_cards").rglob("*.md")]
PRODUCT += [*(ROOT / "hf_softmax_rnn").rglob("*.py"), *(ROOT / "hf_softmax_rnn").rglob("*.md")]
PRODUCT += [path for path in (ROOT / "scripts").iterdir() if path.is_file()]


def test_the_product_does_not_say_in_which_working_session_it_was_made():
    said = {
        str(path.relative_to(ROOT)): len(re.findall(r"\bsessions?\b", path.read_text(errors="replace"), re.IGNORECASE))
        for path in PRODUCT
    }
    assert len(PRODUCT) > 50 and "README.md" in said
    assert {path: count for path, count in said.items() if count} == {}, "state the date, commit and machine instead"


PACKAGE = ROOT / "hf_softmax_rnn"


def _layout_section() -> str:
    """The package layout page: the table of which file owns what, and the list of layers."""
    return (DOCS / "layout.md").read_text()


def test_the_design_layout_names_every_module_of_the_package_and_only_those():
    first_cells = re.findall(r"^\| (.+?) \|", _layout_section(), re.MULTILINE)
    named = {path for cell in first_cells for path in re.findall(r"`([\w/.]+)`", cell)}
    parts = {f"{path.name}/" for path in PACKAGE.iterdir() if (path / "__init__.py").is_file()}
    parts |= {path.name for path in PACKAGE.glob("*.py") if path.name != "__init__.py"}
    assert sorted(part for part in parts if not any(name.startswith(part) for name in named)) == []
    assert sorted(name for name in named if not (PACKAGE / name).exists()) == []


def test_the_design_layers_are_the_import_contract():
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [contract["layers"] for contract in contracts if contract["type"] == "layers"]
    lines = re.findall(r"^\d+\. (.+)$", _layout_section(), re.MULTILINE)
    assert [" | ".join(re.findall(r"`(\w+)`", line)) for line in lines] == layers


def test_the_flag_list_names_every_finetune_flag_with_its_type_default_and_help():
    from hf_softmax_rnn.flags import option_fields
    from hf_softmax_rnn.training import FinetuneConfig

    listing = HOOKS.on_page_markdown(f"# Flags\n\n{HOOKS.FINETUNE_FLAGS_MARKER}\n")
    fields = option_fields(FinetuneConfig)
    assert listing.count("\n:   ") == len(fields)
    assert "`--output-dir` · `str` · default required\n:   folder for the model" in listing
    assert "`--block-size` · `int | None` · default the attention's recipe\n:   " in listing
    for field in fields:
        assert f"\n:   {field.metadata['help']}" in listing


def test_the_field_list_gives_every_spec_field_its_default_and_meaning():
    listing = HOOKS.on_page_markdown(HOOKS.SPEC_FIELDS_MARKER)
    fields = dataclasses.fields(AttentionSpec)
    assert listing.count("\n:   ") == len(fields)
    assert listing.startswith("`kind` · `str` · default `'softmax'`\n:   \"softmax\" (exact softmax, SDPA)")
    assert "`window` · `int | None` · default `None`\n:   W for a sliding-window hybrid" in listing


def test_a_field_without_a_docstring_entry_is_refused():
    @dataclasses.dataclass
    class Half:
        """Two fields, one described.

        Attributes:
            a: the first.
        """

        a: int = 1
        b: int = 2

    with pytest.raises(ValueError, match=r"Half's docstring has no Attributes entry for \['b'\]"):
        HOOKS.field_list(Half)
