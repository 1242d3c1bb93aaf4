"""`hf-softmax-rnn taylor-terms MODEL`: how large is each Taylor term of exp(q.k/sqrt(d))?

Mean |x^n/n!| per layer and order of the attention scores of MODEL on held-out text, the dominant order
per layer and, with `--truncation-orders`, the perplexity of exp truncated at each order
(`hf_softmax_rnn.analysis.taylor_terms`). Writes CSVs and plots under `--output-dir`.
"""

from __future__ import annotations

import csv
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_softmax_rnn.analysis.taylor_terms import (
    plot_heatmap,
    plot_truncation,
    taylor_term_magnitudes,
    truncation_perplexities,
    write_csvs,
)
from hf_softmax_rnn.attention_spec import MAX_TAYLOR_ORDER
from hf_softmax_rnn.data.corpus import load_corpus, pack_texts
from hf_softmax_rnn.default_model import resolve_model
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.flags import add_dataclass_arguments, option
from hf_softmax_rnn.utils import DEVICE_HELP, check_at_least, check_distinct, resolve_device

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class TaylorTermsOptions:
    """The flags of `taylor-terms` (each field is the flag of the same name; `model` is positional)."""

    model: str = option(
        "default", '"default" (embedded model), a local directory or a Hub id', positional=True, nargs="?"
    )
    dataset: str | None = option(None, "corpus for load_corpus (default: the offline pydoc corpus)")
    split: str = option("test", "split of the corpus to score", choices=["train", "test"])
    block_size: int = option(256, "tokens per sequence")
    num_blocks: int = option(8, "sequences scored (the first N blocks of the split)")
    batch_size: int = option(1, "sequences per forward pass")
    max_order: int = option(100, "highest Taylor order n measured")
    truncation_orders: list[int] = option([], "also measure perplexity with exp truncated at these orders", nargs="*")
    truncation_tokens: int = option(1024, "tokens of held-out text for --truncation-orders")
    dtype: str = option("float32", "float64 for --truncation-orders", choices=sorted(_DTYPES))
    device: str = option("auto", DEVICE_HELP)
    output_dir: Path = option(Path("runs/taylor_terms"), "folder for CSVs and plots")
    no_progress: bool = option(False, "no progress bars")


def add_arguments(parser) -> None:
    """The flags of `TaylorTermsOptions`."""
    add_dataclass_arguments(parser, TaylorTermsOptions)


def _check_args(args) -> None:
    for flag in ("--num-blocks", "--batch-size", "--max-order"):
        check_at_least(flag, getattr(args, flag[2:].replace("-", "_")))
    check_at_least("--block-size", args.block_size, minimum=2)
    check_at_least("--truncation-tokens", args.truncation_tokens, minimum=2)
    if args.max_order > MAX_TAYLOR_ORDER:
        raise UserInputError(
            f"--max-order={args.max_order} is not allowed; expected an int from 1 to {MAX_TAYLOR_ORDER}"
        )
    if any(not 0 <= order <= MAX_TAYLOR_ORDER for order in args.truncation_orders):
        raise UserInputError(
            f"--truncation-orders={args.truncation_orders} is not allowed; expected ints from 0 to {MAX_TAYLOR_ORDER}"
        )
    check_distinct("--truncation-orders", args.truncation_orders, "its perplexity would be measured again")


def run(args) -> str:
    _check_args(args)
    device = resolve_device(args.device)
    texts = load_corpus(args.dataset)[args.split]
    model, tokenizer = resolve_model(args.model, dtype=_DTYPES[args.dtype])
    model.to(device)
    packed = pack_texts(texts, tokenizer, args.block_size)
    if len(packed) == 0:
        raise UserInputError(
            f"The {args.split} split has fewer than block_size={args.block_size} tokens; lower --block-size"
        )
    blocks = torch.tensor(packed["input_ids"][: args.num_blocks])
    logger.info("Scoring %d blocks of %d tokens", blocks.shape[0], blocks.shape[1])
    terms = taylor_term_magnitudes(
        model, blocks, max_order=args.max_order, batch_size=args.batch_size, progress=not args.no_progress
    )
    args.output_dir.mkdir(parents=True, exist_ok=True)
    paths = write_csvs(terms, args.output_dir)
    heatmap = plot_heatmap(
        terms, args.output_dir / "taylor_terms.png", f"Taylor terms of exp(q.k/sqrt(d)): {args.model}"
    )
    at_boundary = (terms.dominant_order == args.max_order).nonzero().flatten().tolist()
    if at_boundary:
        logger.warning(
            "Layers %s peak at max_order=%d: raise --max-order to find their dominant order",
            at_boundary,
            args.max_order,
        )
    report = ["| layer | dominant order | mean abs x | max abs x | order-1 share of sum |", "|---|---|---|---|---|"]
    for layer in range(terms.mean_abs_terms.shape[0]):
        row = terms.mean_abs_terms[layer]
        report.append(
            f"| {layer} | {int(terms.dominant_order[layer])} | {float(terms.mean_abs_score[layer]):.2f} | "
            f"{float(terms.max_abs_score[layer]):.1f} | {float(row[1] / row.sum()):.2e} |"
        )
    report.append("Wrote " + " ".join(map(str, (*paths, heatmap))))
    if args.truncation_orders:
        stream = torch.tensor([t for block in packed["input_ids"] for t in block][: args.truncation_tokens])
        window = min(args.block_size, len(stream))
        results = truncation_perplexities(
            model,
            stream,
            sorted(args.truncation_orders),
            max_length=window,
            stride=max(1, window // 2),
            progress=not args.no_progress,
        )
        with (args.output_dir / "truncation.csv").open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["order", "perplexity"])
            writer.writerows(results.items())
        plot = plot_truncation(results, args.output_dir / "truncation.png", f"exp truncated at order N: {args.model}")
        report += ["", "| exp truncated at order | perplexity |", "|---|---|"]
        report += [f"| {order} | {value:.4g} |" for order, value in results.items()]
        report.append(f"Wrote {args.output_dir / 'truncation.csv'} {plot}")
    return "\n".join(report)
