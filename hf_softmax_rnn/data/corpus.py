"""Text corpora: the offline default (Python's own documentation), Hub datasets and local files.

Every machine with Python has `pydoc_data.topics`: about 465k characters of English prose
about Python in 79 topics. Topics are split deterministically (every `test_every`-th
sorted topic is held out), so train and test never share a document.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from datasets import Dataset, DatasetDict, IterableDataset, load_dataset

logger = logging.getLogger(__name__)

DEFAULT_CORPUS = "pydoc"
_FILE_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def pydoc_corpus(test_every: int = 10) -> DatasetDict:
    """The offline default corpus as {"train", "test"} datasets with one "text" column."""
    import pydoc_data.topics

    topics = sorted(pydoc_data.topics.topics.items())
    split = {"train": [], "test": []}
    for index, (_, text) in enumerate(topics):
        split["test" if index % test_every == test_every - 1 else "train"].append(text.strip())
    return DatasetDict({name: Dataset.from_dict({"text": texts}) for name, texts in split.items()})


def load_corpus(
    dataset: str | None = None,
    *,
    config_name: str | None = None,
    text_column: str = "text",
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
    builder, data_files = _local_files(dataset)
    try:
        if builder is not None:
            loaded = load_dataset(builder, data_files=data_files, streaming=streaming)
        else:
            loaded = load_dataset(dataset, config_name, streaming=streaming)
    except FileNotFoundError as error:
        raise FileNotFoundError(
            f"Dataset {dataset!r} was not found: pass 'pydoc' (offline default), a local .txt/.json/.jsonl/"
            f".parquet/.csv file or folder, or a Hub dataset name (needs network; HF_HUB_OFFLINE="
            f"{os.environ.get('HF_HUB_OFFLINE', '0')})"
        ) from error
    if isinstance(loaded, dict) and not isinstance(loaded, DatasetDict):
        loaded = DatasetDict(loaded)
    if text_column not in loaded["train"].column_names:
        raise ValueError(
            f"text_column={text_column!r} is not in dataset {dataset!r}; its columns are {loaded['train'].column_names}"
        )
    if text_column != "text":
        loaded = loaded.rename_column(text_column, "text")
    held_out = next((name for name in ("test", "validation") if name in loaded), None)
    if held_out is not None:
        return DatasetDict({"train": loaded["train"], "test": loaded[held_out]})
    if streaming:
        raise ValueError(f"Streaming dataset {dataset!r} has no test/validation split; pass one as files")
    parts = loaded["train"].train_test_split(test_size=test_fraction, seed=seed)
    return DatasetDict({"train": parts["train"], "test": parts["test"]})


def _local_files(dataset: str) -> tuple[str | None, list[str] | None]:
    """(builder, files) when `dataset` names local files, else (None, None)."""
    path = Path(dataset)
    if path.is_dir():
        files = sorted(str(p) for p in path.rglob("*") if p.suffix in _FILE_BUILDERS)
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
        raise ValueError(f"Dataset {dataset!r} mixes file types {sorted(suffixes)}; pass one type at a time")
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
    return tokenized.map(group, batched=True, batch_size=1000, num_proc=num_proc, desc=f"Packing into {block_size}-token blocks")
