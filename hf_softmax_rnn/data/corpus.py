"""Text corpora: the offline default (Python's own documentation), Hub datasets and local files.

Several sources join with "+" (`load_sources`): e.g. "pydoc+generated" trains on Python's
documentation and on text the model writes itself (`data.generated`), and holds out the
first source's test split.

Every machine with Python has `pydoc_data.topics`: about 465k characters of English prose
about Python in 79 topics. Topics are split deterministically (every `test_every`-th
sorted topic is held out), so train and test never share a document.
"""

from __future__ import annotations

import codecs
import glob
import logging
import os
from pathlib import Path

import pyarrow.compute
from datasets import Dataset, DatasetDict, IterableDataset, concatenate_datasets, load_dataset
from datasets.exceptions import DatasetsError

from hf_softmax_rnn.errors import UserInputError

logger = logging.getLogger(__name__)

DEFAULT_CORPUS = "pydoc"
#: The column of texts in every loaded corpus (a source's own text column is renamed to it).
TEXT_COLUMN = "text"
_FILE_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
#: Bytes of each local text-format file checked for UTF-8 before `datasets` reads it.
_SNIFF_BYTES = 1 << 16
#: Suffixes of compressed files, which are named as such when given as a dataset file.
_COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".zip", ".lz4")


def pydoc_corpus(test_every: int = 10) -> DatasetDict:
    """The offline default corpus as {"train", "test"} datasets with one "text" column."""
    import pydoc_data.topics

    topics = sorted(pydoc_data.topics.topics.items())
    split = {"train": [], "test": []}
    for index, (_, text) in enumerate(topics):
        split["test" if index % test_every == test_every - 1 else "train"].append(text.strip())
    return DatasetDict({name: Dataset.from_dict({TEXT_COLUMN: texts}) for name, texts in split.items()})


SOURCE_SEPARATOR = "+"


def source_names(dataset: str | None) -> list[str]:
    """The sources of a '+'-joined dataset argument, in order ("pydoc+generated" -> two); a file or folder
    that exists under the whole name (`a+b.txt`) is one source."""
    if dataset is not None and SOURCE_SEPARATOR in dataset and Path(dataset).exists():
        return [dataset]
    names = [name.strip() for name in (DEFAULT_CORPUS if dataset is None else dataset).split(SOURCE_SEPARATOR)]
    if not all(names) or len(set(names)) != len(names):
        raise UserInputError(
            f"dataset={dataset!r} is not allowed; expected sources joined by {SOURCE_SEPARATOR!r}, each named once "
            "(e.g. 'pydoc+generated')"
        )
    return names


def join_corpora(parts: list[DatasetDict]) -> DatasetDict:
    """Train splits concatenated (shuffled later by the block reader); the first part's test split."""
    if len(parts) == 1:
        return parts[0]
    if any(isinstance(part["train"], IterableDataset) for part in parts):
        raise UserInputError("A streamed dataset cannot be joined with other sources; pass it alone")
    train = concatenate_datasets([part["train"].select_columns(["text"]) for part in parts])
    return DatasetDict({"train": train, "test": parts[0]["test"]})


def load_corpus(
    dataset: str | None = None,
    *,
    config_name: str | None = None,
    text_column: str = TEXT_COLUMN,
    test_fraction: float = 0.1,
    seed: int = 0,
    streaming: bool = False,
) -> DatasetDict:
    """Load texts as {"train", "test"} with a "text" column.

    Args:
        dataset: None or "pydoc" for the offline default corpus; a local file, directory or
            glob of .txt/.json/.jsonl/.parquet/.csv files; or a Hub dataset name.
        text_column: the column holding the text (renamed to "text").
        test_fraction: held-out share when the source has no "test"/"validation" split.
        streaming: stream a large Hub dataset instead of downloading it whole.
    """
    if dataset in (None, DEFAULT_CORPUS):
        return pydoc_corpus()
    if not dataset.strip():
        raise UserInputError(
            f"dataset={dataset!r} names no source; expected {DEFAULT_CORPUS!r} (offline default), a local file or "
            "folder, or a Hub dataset name"
        )
    loaded = _load(dataset, config_name, streaming)
    _check_text_column(loaded["train"], text_column, dataset)
    for split, rows in loaded.items():
        _check_no_missing_text(rows, text_column, dataset, split)
    if text_column != TEXT_COLUMN:
        loaded = loaded.rename_column(text_column, TEXT_COLUMN)
    held_out = next((name for name in ("test", "validation") if name in loaded), None)
    if held_out is not None:
        return DatasetDict({"train": loaded["train"], "test": loaded[held_out]})
    if streaming:
        raise UserInputError(f"Streaming dataset {dataset!r} has no test/validation split; pass one as files")
    try:
        parts = loaded["train"].train_test_split(test_size=test_fraction, seed=seed)
    except ValueError as error:
        raise UserInputError(f"Dataset {dataset!r} is too small to hold out a test split: {error}") from error
    return DatasetDict({"train": parts["train"], "test": parts["test"]})


def _load(dataset: str, config_name: str | None, streaming: bool) -> DatasetDict:
    """`load_dataset` of local files (each checked first) or of a Hub dataset, as a DatasetDict."""
    builder, data_files = _local_files(dataset)
    try:
        if builder is None:
            loaded = load_dataset(dataset, config_name, streaming=streaming)
        else:
            for path in data_files:
                _check_local_file(path)
            # the paths are files found already: escaped, as `datasets` reads data_files as glob patterns
            loaded = load_dataset(builder, data_files=[glob.escape(path) for path in data_files], streaming=streaming)
    except FileNotFoundError as error:
        raise FileNotFoundError(
            f"Dataset {dataset!r} was not found: pass 'pydoc' (offline default), a local .txt/.json/.jsonl/"
            f".parquet/.csv file or folder, or a Hub dataset name (needs network; HF_HUB_OFFLINE="
            f"{os.environ.get('HF_HUB_OFFLINE', '0')})"
        ) from error
    except (DatasetsError, StopIteration, ValueError) as error:
        if builder is None or isinstance(error, UserInputError):
            raise
        cause = _root_cause(error)
        raise UserInputError(f"Dataset {dataset!r} could not be read as {builder} files: {cause}") from error
    return loaded if isinstance(loaded, DatasetDict) or not isinstance(loaded, dict) else DatasetDict(loaded)


def _check_local_file(path: str) -> None:
    """Refuse an empty file, or a text-format file that is not UTF-8 text, naming it."""
    file = Path(path)
    if file.stat().st_size == 0:
        raise UserInputError(f"Dataset file {path!r} is empty; expected {file.suffix} data in it")
    if file.suffix == ".parquet":
        return
    with file.open("rb") as handle:
        head = handle.read(_SNIFF_BYTES)
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
        if b"\0" in head:
            raise UnicodeDecodeError("utf-8", head, head.index(b"\0"), head.index(b"\0") + 1, "NUL byte")
    except UnicodeDecodeError as error:
        raise UserInputError(
            f"Dataset file {path!r} is not UTF-8 text ({error.reason} at byte {error.start}); "
            f"expected a {file.suffix} file of UTF-8 text"
        ) from error


def _root_cause(error: BaseException) -> str:
    """The first line of the innermost cause of `error` (what `datasets` wraps)."""
    while error.__cause__ is not None:
        error = error.__cause__
    return (str(error).splitlines() or [type(error).__name__])[0][:300]


def _check_text_column(train: Dataset | IterableDataset, text_column: str, dataset: str) -> None:
    """The training split has rows and a string column `text_column`."""
    if text_column not in (train.column_names or []):
        raise UserInputError(
            f"text_column={text_column!r} is not in dataset {dataset!r}; its columns are {train.column_names}"
        )
    if isinstance(train, Dataset) and len(train) == 0:
        raise UserInputError(f"Dataset {dataset!r} is empty; expected at least one text")
    feature = (train.features or {}).get(text_column)
    dtype = getattr(feature, "dtype", type(feature).__name__)
    if feature is not None and dtype not in ("string", "large_string"):
        raise UserInputError(f"Column {text_column!r} of dataset {dataset!r} holds {dtype} values; expected strings")


def _check_no_missing_text(rows: Dataset | IterableDataset, text_column: str, dataset: str, split: str) -> None:
    """Refuse a split whose `text_column` holds nulls (a JSON null, an empty CSV cell), naming the first row:
    silently dropping them would hide a problem in the data. A streamed split is not read ahead."""
    if not isinstance(rows, Dataset):
        return
    column = rows.with_format("arrow")[text_column]
    if column.null_count == 0:
        return
    first = pyarrow.compute.index(pyarrow.compute.is_null(column), True).as_py()
    _, files = _local_files(dataset)
    across = f" across its {len(files)} files in sorted order" if files and len(files) > 1 else ""
    count = f"{column.null_count} such row{'s' if column.null_count > 1 else ''}"
    raise UserInputError(
        f"Dataset {dataset!r}: column {text_column!r} holds a null (None) instead of text at row {first} of its "
        f"{split} split (counting from 0{across}; {count}); expected a string in every row: fill or remove them"
    )


def _local_files(dataset: str) -> tuple[str | None, list[str] | None]:
    """(builder, files) when `dataset` names local files, else (None, None). A file that exists is itself
    (`data[1].txt`, not the `data1.txt` its name matches as a glob), and one of another type is refused."""
    path = Path(dataset)
    if path.is_dir():
        files = sorted(str(p) for p in path.rglob("*") if p.suffix in _FILE_BUILDERS)
    elif path.is_file():
        if path.suffix not in _FILE_BUILDERS:
            compressed = " (decompress it first)" if path.suffix in _COMPRESSED_SUFFIXES else ""
            raise UserInputError(
                f"Dataset file {dataset!r} has the suffix {path.suffix!r}; expected one of {sorted(_FILE_BUILDERS)}"
                + compressed
            )
        files = [dataset]
    elif path.suffix in _FILE_BUILDERS:
        files = sorted(str(p) for p in path.parent.glob(path.name))
        if not files:
            raise FileNotFoundError(f"Dataset file {dataset!r} does not exist")
    else:
        return None, None
    if not files:
        raise FileNotFoundError(f"Dataset folder {dataset!r} holds no {sorted(_FILE_BUILDERS)} files")
    suffixes = {Path(f).suffix for f in files}
    builders = {_FILE_BUILDERS[s] for s in suffixes}
    if len(builders) != 1:
        raise UserInputError(f"Dataset {dataset!r} mixes file types {sorted(suffixes)}; pass one type at a time")
    return builders.pop(), files


def pack_texts(
    texts: Dataset | IterableDataset, tokenizer, block_size: int, *, num_proc: int | None = None
) -> Dataset | IterableDataset:
    """Tokenise, join documents with the EOS token and cut into blocks of `block_size` tokens.

    A streamed (iterable) dataset is packed lazily, 1000 documents at a time.

    Returns a dataset with "input_ids" (and "labels" equal to them) of exactly block_size
    tokens each; the tail shorter than a block is dropped. Uses `datasets.map` caching.
    """
    if block_size < 2:
        raise ValueError(f"block_size={block_size} is not allowed; expected an int >= 2")
    eos = tokenizer.eos_token_id

    def tokenize(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        return {"input_ids": [row + ([eos] if eos is not None else []) for row in ids]}

    def group(batch):
        flat = [token for row in batch["input_ids"] for token in row]
        usable = len(flat) // block_size * block_size
        blocks = [flat[i : i + block_size] for i in range(0, usable, block_size)]
        return {"input_ids": blocks, "labels": [list(b) for b in blocks]}

    columns = texts.column_names or ["text"]
    if isinstance(texts, IterableDataset):
        tokenized = texts.map(tokenize, batched=True, remove_columns=columns)
        return tokenized.map(group, batched=True, batch_size=1000)
    tokenized = texts.map(tokenize, batched=True, remove_columns=columns, num_proc=num_proc, desc="Tokenising")
    return tokenized.map(
        group, batched=True, batch_size=1000, num_proc=num_proc, desc=f"Packing into {block_size}-token blocks"
    )
