"""What a fine-tuning run reads: the model and its attention (`ModelSettings`) and the data (`DataSettings`).

Each group checks its own fields when it is built; a field left None is chosen by `FinetuneConfig`
(the attention's recipe, or a converted --model), which checks the fields of several groups together.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_softmax_rnn.attention_spec import NO_CACHE_MODES, AttentionSpec
from hf_softmax_rnn.data.corpus import DEFAULT_CORPUS, TEXT_COLUMN, _local_files, source_names
from hf_softmax_rnn.data.generated import GENERATED_CORPUS
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.flags import SHOWN_DEFAULT, option
from hf_softmax_rnn.long_context.extend import check_factor
from hf_softmax_rnn.training.attention_source import parse_attention
from hf_softmax_rnn.training.recipes import (
    BLOCK_SIZE,
    DEFAULT_ATTENTION,
    FROM_RECIPE,
    HELDOUT_BLOCK_SIZE,
    KEPT_RETRIEVAL_LAYERS,
    RECIPE_SCHEDULES,
    RETRIEVAL_KEPT,
    WIDE_WINDOW,
)
from hf_softmax_rnn.training.validation import (
    check_at_least,
    check_block_size,
    check_choice,
    check_field_types,
    check_texts,
    refuse_unused,
)

_MODEL, _DATA = "model and attention", "data"
#: Dataset sources that are read without columns (their texts are the one `TEXT_COLUMN`).
SOURCES_WITHOUT_COLUMNS = (DEFAULT_CORPUS, GENERATED_CORPUS)


@dataclass(frozen=True)
class ModelSettings:
    """The model to convert, its teacher and the attention it converts to (`--help` section "model and
    attention"). `attention_spec` is the parsed `attention` (None while it is unset)."""

    model: str = option(
        "default", "'default' (the embedded SmolLM2-135M-Instruct), a local folder or a Hub id", group=_MODEL
    )
    teacher: str | None = option(
        None,
        "when --model is converted already (a folder written by finetune or save_pretrained): the unconverted model "
        "it was converted from, which the run distils from and compares with ('default', a folder or a Hub id); "
        "--model then keeps its attention and trains on",
        group=_MODEL,
    )
    attention: str | dict | None = option(
        None,
        "preset name (`python -c 'import hf_softmax_rnn; print(*hf_softmax_rnn.PRESETS)'`), a JSON object of "
        "AttentionSpec fields, or a .json file holding one",
        group=_MODEL,
        **{SHOWN_DEFAULT: DEFAULT_ATTENTION},
    )
    layers: list[int] | None = option(None, "convert only these layer indices; the others keep softmax", group=_MODEL)
    retrieval_layers: int | None = option(
        None,
        "give this many retrieval layers (those whose heads the unconverted model uses to copy a key from far back, "
        "found on passkey prompts cut from the training text) --retrieval-kept kept positions; needs a spec with "
        f"kept (recipe: {KEPT_RETRIEVAL_LAYERS} for such a spec, else 0)",
        group=_MODEL,
        **FROM_RECIPE,
    )
    retrieval_kept: int | None = option(
        None, "kept positions of each retrieval layer", group=_MODEL, **{SHOWN_DEFAULT: RETRIEVAL_KEPT}
    )
    extend_context: float | None = option(
        None,
        "read FACTOR times the model's max_position_embeddings: its rotary embeddings (the teacher's too) rescaled "
        "by YaRN before conversion, so that the hybrid trains under the scaling "
        "(hf_softmax_rnn.long_context.extend_context)",
        metavar="FACTOR",
        group=_MODEL,
    )
    attention_mode: str = option(
        "chunked",
        "how finite-state layers compute a whole sequence while training and scoring (same result; chunked needs "
        "O(L) memory and is several times faster than the L x L parallel form)",
        choices=NO_CACHE_MODES,
        group=_MODEL,
    )
    attention_spec: AttentionSpec | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_field_types(self)
        check_texts(self)
        check_choice("attention_mode", self.attention_mode, NO_CACHE_MODES)
        if self.extend_context is not None:
            check_factor(self.extend_context)
        if self.layers is not None and any(index < 0 for index in self.layers):
            raise UserInputError(f"layers={self.layers} is not allowed; expected layer indices >= 0")
        if self.retrieval_layers is not None:
            check_at_least("retrieval_layers", self.retrieval_layers, minimum=0)
        spec = None if self.attention is None else parse_attention(self.attention)
        # (frozen: the parsed attention is set once, as the dataclass sets its fields)
        object.__setattr__(self, "attention_spec", spec)

    @property
    def continues_converted(self) -> bool:
        """Whether --model is converted already (and --teacher the model it was converted from)."""
        return self.teacher is not None

    @property
    def original(self) -> str:
        """The unconverted model: --teacher where --model is converted already, else --model."""
        return self.teacher or self.model


@dataclass(frozen=True)
class DataSettings:
    """The training and held-out data, its blocks and batches (`--help` section "data").
    `dataset_sources` are the '+'-joined sources of `dataset`, in order."""

    dataset: str = option(
        "pydoc",
        "'pydoc' (offline corpus), 'generated' (text the model writes itself, offline), local "
        ".txt/.json/.jsonl/.parquet/.csv files or folder, or a Hub dataset; join several with '+' "
        "(e.g. 'pydoc+generated': trained on all, held out from the first)",
        group=_DATA,
    )
    dataset_config: str | None = option(None, "configuration name of a Hub dataset", group=_DATA)
    text_column: str = option(
        TEXT_COLUMN,
        "column holding the text (of files and Hub datasets; 'pydoc' and 'generated' have no other)",
        group=_DATA,
    )
    streaming: bool = option(False, "stream the dataset instead of loading it whole", group=_DATA)
    test_fraction: float = option(0.1, "held-out share when the data has no test split", group=_DATA)
    block_size: int | None = option(
        None,
        f"tokens per packed training block (recipe: {RECIPE_SCHEDULES['kept_wide_window']['block_size']} for a spec "
        f"with kept positions and a window of {WIDE_WINDOW} or more, else {BLOCK_SIZE}; long blocks teach the state "
        "long range)",
        group=_DATA,
        **FROM_RECIPE,
    )
    eval_block_size: int | None = option(
        None,
        f"tokens per held-out block (default: --block-size when given, else {HELDOUT_BLOCK_SIZE}), so runs trained "
        "on other lengths compare",
        group=_DATA,
    )
    batch_size: int = option(1, "blocks per process per micro-batch", group=_DATA)
    grad_accum: int = option(1, "micro-batches per optimizer step", group=_DATA)
    eval_batch_size: int = option(8, "blocks per process per evaluation batch", group=_DATA)
    max_eval_blocks: int | None = option(
        None, "score only the first N held-out blocks (all when not given)", group=_DATA
    )
    shuffle_buffer: int = option(10_000, "shuffle buffer of a streamed dataset (1 = in order)", group=_DATA)
    generated_texts: int = option(
        256, "texts the model writes for the 'generated' source (once; then read from a cache)", group=_DATA
    )
    generated_tokens: int = option(512, "tokens of each generated text at most", group=_DATA)
    recall_facts: int = option(
        0,
        "key-value facts written into the first half of each training block and restated in its second half, "
        "so that distillation from the original teaches recall from the state (0: none; docs/finetuning_options.md)",
        group=_DATA,
    )
    dataset_sources: list[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_field_types(self)
        check_texts(self)
        for name in ("batch_size", "grad_accum", "eval_batch_size", "generated_texts", "generated_tokens"):
            check_at_least(name, getattr(self, name))
        check_at_least("shuffle_buffer", self.shuffle_buffer)
        check_at_least("recall_facts", self.recall_facts, minimum=0)
        # (frozen: the sources, which depend on the files there are, are read once)
        object.__setattr__(self, "dataset_sources", source_names(self.dataset))
        self._check_text_column()
        check_block_size("block_size", self.block_size)
        check_block_size("eval_block_size", self.eval_block_size)
        if self.max_eval_blocks is not None:
            check_at_least("max_eval_blocks", self.max_eval_blocks)
        if not 0 < self.test_fraction < 1:
            raise UserInputError(f"test_fraction={self.test_fraction} is not allowed; expected a number in (0, 1)")
        if self.dataset_config is not None and not any(map(_names_a_hub_dataset, self.dataset_sources)):
            raise UserInputError(
                f"--dataset-config {self.dataset_config!r} applies to a Hub dataset, and --dataset {self.dataset!r} "
                "names none (local files and the offline sources have no configurations); drop --dataset-config"
            )
        refuse_unused(
            self,
            ("generated_texts", "generated_tokens"),
            acts_with=f"the {GENERATED_CORPUS!r} dataset source",
            present=GENERATED_CORPUS in self.dataset_sources,
        )
        refuse_unused(
            self, ("shuffle_buffer",), acts_with="--streaming (loaded data is shuffled whole)", present=self.streaming
        )

    @property
    def heldout_block_size(self) -> int:
        """Tokens per held-out block."""
        return self.eval_block_size or self.block_size

    def _check_text_column(self) -> None:
        """A --text-column other than the default needs a source with columns (a file or a Hub dataset)."""
        if self.text_column != TEXT_COLUMN and set(self.dataset_sources) <= set(SOURCES_WITHOUT_COLUMNS):
            raise UserInputError(
                f"--text-column {self.text_column!r} does not apply to --dataset {self.dataset!r}: its sources "
                f"({', '.join(self.dataset_sources)}) have only a {TEXT_COLUMN!r} column; drop --text-column, or "
                "pass files or a Hub dataset with that column"
            )


def _names_a_hub_dataset(source: str) -> bool:
    """Whether a --dataset source is a Hub dataset (not local files, nor an offline source)."""
    return source not in SOURCES_WITHOUT_COLUMNS and _local_files(source)[0] is None
