"""`hf-softmax-rnn ablate`: small Llamas trained from scratch, one per variant group of the paper.

Every variant gets the same architecture, data (byte-level text of the offline corpus, or `--dataset`),
seeds and step budget; only the attention spec differs (`hf_softmax_rnn.analysis.ablate`). Writes, under
`--output-dir`: `ablation.md`, `ablation.csv`, `curves.csv` and `loss_curves.png`.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tqdm.auto import tqdm

from hf_softmax_rnn.analysis.ablate import (
    QUICK_BUDGET,
    VARIANTS,
    AblationBudget,
    plot_curves,
    summary_table,
    token_blocks,
    train_variant,
    variant_spec,
    write_csvs,
)
from hf_softmax_rnn.analysis.byte_tokenizer import byte_tokenizer
from hf_softmax_rnn.data.corpus import load_corpus
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.flags import SHOWN_DEFAULT, add_dataclass_arguments, option
from hf_softmax_rnn.utils import DEVICE_HELP, THREADS_HELP, check_distinct, resolve_device, set_threads

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AblateOptions:
    """What `ablate` trains and where (each field is the flag of the same name; the sizes are `AblationBudget`)."""

    variants: list[str] = option(
        list(VARIANTS), f"names from {list(VARIANTS)} or preset names", shown_default="every variant"
    )
    quick: bool = option(False, "CI size: tiny model, a few steps, one seed")
    dataset: str | None = option(None, "corpus for load_corpus (default: the offline pydoc corpus)")
    device: str = option("auto", DEVICE_HELP)
    threads: int | None = option(None, THREADS_HELP)
    output_dir: Path = option(Path("runs/ablate"), "folder for the tables and plot")
    no_progress: bool = option(False, "no progress bars")


def add_arguments(parser) -> None:
    """The flags of `AblateOptions` and `AblationBudget`; a size flag left out takes the default or the
    `--quick` budget's value (both shown in `--help`)."""
    add_dataclass_arguments(parser, AblateOptions)
    sizes = add_dataclass_arguments(parser, AblationBudget, defaults={name: None for name in asdict(QUICK_BUDGET)})
    default, quick = asdict(AblationBudget()), asdict(QUICK_BUDGET)
    for action in sizes:
        setattr(action, SHOWN_DEFAULT, f"{_shown(default[action.dest])}; --quick: {_shown(quick[action.dest])}")


def _shown(value):
    """A budget value as `--help` shows it."""
    return "all" if value is None else list(value) if isinstance(value, tuple) else value


def budget_from_args(args) -> AblationBudget:
    """The default (or quick) budget with every size flag given on the command line applied."""
    base = QUICK_BUDGET if args.quick else AblationBudget()
    overrides = {name: getattr(args, name) for name in asdict(base) if getattr(args, name, None) is not None}
    if "seeds" in overrides:
        overrides["seeds"] = tuple(overrides["seeds"])
    return replace(base, **overrides)


def run(args) -> str:
    set_threads(args.threads)
    for name in args.variants:
        variant_spec(name)
    check_distinct("--variants", args.variants, "its runs would be trained and reported again")
    budget = budget_from_args(args)
    device = resolve_device(args.device)
    tokenizer = byte_tokenizer()
    corpus = load_corpus(args.dataset)
    train, test = (token_blocks(corpus[split], tokenizer, budget.seq_len) for split in ("train", "test"))
    logger.info("%d train and %d held-out blocks of %d bytes; budget %s", len(train), len(test), budget.seq_len, budget)
    for name in ("eval_blocks", "test_blocks"):
        asked = getattr(args, name, None)
        if asked is not None and asked > len(test):
            flag = "--" + name.replace("_", "-")
            raise UserInputError(
                f"{flag}={asked} is more than the {len(test)} held-out blocks of {budget.seq_len} bytes; expected at "
                f"most {len(test)} (or drop {flag}), more held-out text or shorter blocks"
            )
    runs = []
    progress = not args.no_progress
    for name in tqdm(args.variants, desc="Variants", disable=not progress):
        for seed in budget.seeds:
            runs.append(train_variant(name, train, test, budget, seed, device=device, progress=progress))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    write_csvs(runs, args.output_dir)
    table = summary_table(runs)
    (args.output_dir / "ablation.md").write_text(table)
    title = (
        f"d_model={budget.d_model}, {budget.num_layers} layers, "
        f"{budget.steps} steps x {budget.batch_size} x {budget.seq_len} bytes"
    )
    plot = plot_curves(runs, args.output_dir / "loss_curves.png", title)
    written = (args.output_dir / "ablation.md", args.output_dir / "ablation.csv", args.output_dir / "curves.csv", plot)
    return table + "\nWrote " + " ".join(map(str, written))
