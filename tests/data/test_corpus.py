import re

import pytest
from transformers import AutoTokenizer  # noqa: F401  (import check only)

from hf_softmax_rnn.data.corpus import load_corpus, pack_texts, source_names
from hf_softmax_rnn.errors import UserInputError


class _CharTokenizer:
    eos_token_id = 0

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[1 + (ord(c) % 50) for c in text] for text in texts]}


def test_pydoc_corpus_splits_are_disjoint_and_nonempty():
    corpus = load_corpus()
    train, test = set(corpus["train"]["text"]), set(corpus["test"]["text"])
    assert len(test) >= 5 and len(train) >= 60
    assert not train & test


def test_local_text_files(tmp_path):
    (tmp_path / "a.txt").write_text("first line\nsecond line\n" * 10)
    corpus = load_corpus(str(tmp_path / "a.txt"), test_fraction=0.25)
    assert len(corpus["train"]) + len(corpus["test"]) == 20


def test_missing_dataset_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        load_corpus(str(tmp_path / "missing.txt"))


def test_pack_texts_blocks_are_exact_and_ordered():
    from datasets import Dataset

    texts = Dataset.from_dict({"text": ["abcdefg", "hij"]})
    packed = pack_texts(texts, _CharTokenizer(), block_size=4)
    expected = [1 + (ord(c) % 50) for c in "abcdefg"] + [0] + [1 + (ord(c) % 50) for c in "hij"] + [0]
    assert packed["input_ids"] == [expected[0:4], expected[4:8], expected[8:12]]
    assert packed["labels"] == packed["input_ids"]


def test_pack_texts_streams_the_same_blocks():
    from datasets import Dataset

    texts = Dataset.from_dict({"text": ["abcdefg", "hij"]})
    streamed = pack_texts(texts.to_iterable_dataset(), _CharTokenizer(), block_size=4)
    assert [row["input_ids"] for row in streamed] == pack_texts(texts, _CharTokenizer(), block_size=4)["input_ids"]


BAD_FILES = {
    "empty-text": ("empty.txt", b"", r"Dataset file '.*empty\.txt' is empty"),
    "empty-jsonl": ("empty.jsonl", b"", r"Dataset file '.*empty\.jsonl' is empty"),
    "binary": ("binary.txt", bytes(range(256)) * 8, r"Dataset file '.*binary\.txt' is not UTF-8 text"),
    "malformed-jsonl": (
        "bad.jsonl",
        b'{"text": "a"}\n{"text": "b"\n',
        r"Dataset '.*bad\.jsonl' could not be read as json files: .*JSON parse error",
    ),
    "malformed-csv": ("bad.csv", b'text\n"a\n', r"Dataset '.*bad\.csv' could not be read as csv files: "),
    "numbers-not-text": (
        "numbers.jsonl",
        b'{"text": 5}\n{"text": 6}\n',
        r"Column 'text' of dataset '.*numbers\.jsonl' holds int64 values; expected strings",
    ),
    "blank-lines-only": ("blank.jsonl", b"\n\n", r"Dataset '.*blank\.jsonl' (is empty|could not be read)"),
}


@pytest.mark.parametrize("name,content,message", BAD_FILES.values(), ids=BAD_FILES.keys())
def test_unreadable_files_name_the_file(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(UserInputError, match=message):
        load_corpus(str(tmp_path / name))


def test_a_folder_names_the_bad_file(tmp_path):
    (tmp_path / "good.txt").write_text("a line of text\n" * 5)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UserInputError, match=r"Dataset file '.*empty\.txt' is empty"):
        load_corpus(str(tmp_path))


def _write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": rows}), path)


NULL_TEXTS = {
    "jsonl-null": ("data.jsonl", '{"body": "a b"}\n{"body": null}\n{"body": "c"}\n{"body": null}\n', 1, 2),
    "csv-empty-cell": ("data.csv", "body,id\nhello,1\nworld,2\n,3\n", 2, 1),
    "parquet-null": ("data.parquet", ["x", "y", "z", None], 3, 1),
}


@pytest.mark.parametrize("name,content,row,count", NULL_TEXTS.values(), ids=NULL_TEXTS.keys())
def test_a_text_column_with_nulls_is_refused_naming_file_column_and_row(tmp_path, name, content, row, count):
    path = tmp_path / name
    _write_parquet(path, content) if name.endswith(".parquet") else path.write_text(content)
    message = (
        rf"Dataset '{re.escape(str(path))}': column 'body' holds a null \(None\) instead of text at row {row} of "
        rf"its train split \(counting from 0; {count} such rows?\); expected a string in every row"
    )
    with pytest.raises(UserInputError, match=message):
        load_corpus(str(path), text_column="body")


def test_a_null_in_a_folder_of_files_counts_rows_across_them(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n' * 3)
    (tmp_path / "b.jsonl").write_text('{"text": "y"}\n{"text": null}\n')
    with pytest.raises(UserInputError, match=r"at row 4 of its train split \(counting from 0 across its 2 files in "
                       r"sorted order; 1 such row\)"):  # fmt: skip
        load_corpus(str(tmp_path))


@pytest.mark.parametrize("dataset", ["", "  "], ids=["empty", "blank"])
def test_an_empty_dataset_name_is_refused_not_read_as_the_default_or_the_current_folder(dataset):
    with pytest.raises(UserInputError, match=rf"^dataset={dataset!r} names no source; expected 'pydoc'"):
        load_corpus(dataset)
    with pytest.raises(UserInputError, match=rf"^dataset={dataset!r} is not allowed; expected sources joined by"):
        source_names(dataset)


def test_a_file_whose_name_is_a_glob_pattern_is_read_itself(tmp_path):
    """`data[1].txt` exists: it is read, not `data1.txt`, which its name matches as a glob."""
    (tmp_path / "data[1].txt").write_text("\n".join(f"bracketed line {i}" for i in range(20)))
    (tmp_path / "data1.txt").write_text("\n".join(f"plain line {i}" for i in range(20)))
    corpus = load_corpus(str(tmp_path / "data[1].txt"))
    texts = [*corpus["train"]["text"], *corpus["test"]["text"]]
    assert sorted(texts) == sorted(f"bracketed line {i}" for i in range(20))


def test_a_file_of_another_type_is_refused_naming_its_suffix(tmp_path):
    (tmp_path / "data.txt.gz").write_bytes(b"\x1f\x8b" + bytes(40))
    with pytest.raises(
        UserInputError, match=r"data\.txt\.gz' has the suffix '\.gz'; expected one of \['\.csv'.*\] \(decompress"
    ):
        load_corpus(str(tmp_path / "data.txt.gz"))
    (tmp_path / "notes.md").write_text("# notes\n")
    with pytest.raises(UserInputError, match=r"notes\.md' has the suffix '\.md'; expected one of \[.*'\.txt'\]$"):
        load_corpus(str(tmp_path / "notes.md"))


def test_a_file_whose_name_holds_the_source_separator_is_one_source(tmp_path):
    """`a+b.txt` exists: it is read, not split into the sources 'a' and 'b.txt'."""
    path = tmp_path / "a+b.txt"
    path.write_text("\n".join(f"line {i}" for i in range(20)))
    assert source_names(str(path)) == [str(path)]
    corpus = load_corpus(str(path))
    assert len(corpus["train"]) + len(corpus["test"]) == 20
