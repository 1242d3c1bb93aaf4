"""One long-context evaluation of several models on the same texts: settings, tables and plot.

`LongContextSettings` checks everything it can before a model runs (`check(model, tokenizer,
texts)` adds what needs the model and the texts); `evaluate` returns {"positions": ...,
"passkey": ...} for one model; `comparison_tables` and `plot_long_context` put models side by
side, each beside a reference (the original model).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hf_softmax_rnn.evaluation import check_within_positions
from hf_softmax_rnn.long_context.fidelity import position_fidelity
from hf_softmax_rnn.long_context.passkey import (
    DEFAULT_DEPTHS,
    check_passkey_arguments,
    check_passkey_settings,
    passkey_filler,
    passkey_retrieval,
)
from hf_softmax_rnn.long_context.positions import (
    check_buckets,
    check_count,
    check_flag,
    eval_sequences,
    position_perplexity,
)

logger = logging.getLogger(__name__)

#: Buckets and passkey lengths that are cheap enough to run after a fine-tuning run on a CPU.
QUICK_BUCKETS = ((0, 64), (64, 256), (256, 1024), (1024, 2048), (2048, 4096))
QUICK_LENGTHS = (1024, 2048)


@dataclass
class LongContextSettings:
    """What to measure: position buckets over `sequences` sequences (None: all; one per document, or
    the texts joined when `join`), passkey at `passkey_lengths` (empty: none) and `depths`, with
    `trials` prompts per (length, depth); `past_max_positions` allows buckets and lengths past a model's
    `max_position_embeddings`."""

    buckets: Sequence[Sequence[int]] = QUICK_BUCKETS
    sequences: int | None = 2
    join: bool = False
    passkey_lengths: Sequence[int] = QUICK_LENGTHS
    depths: Sequence[float] = DEFAULT_DEPTHS
    trials: int = 1
    seed: int = 0
    max_new_tokens: int = 8
    past_max_positions: bool = False

    def __post_init__(self) -> None:
        self.buckets = check_buckets(self.buckets)
        check_count("sequences", self.sequences)
        check_flag("join", self.join)
        check_flag("past_max_positions", self.past_max_positions)
        check_passkey_arguments(self.passkey_lengths, self.depths, self.trials, self.max_new_tokens, self.seed)
        self.passkey_lengths = tuple(self.passkey_lengths)
        self.depths = tuple(self.depths)

    def check(self, model, tokenizer, texts: Sequence[str]) -> None:
        """Refuse what `model` or `texts` cannot hold (positions, tokens), before anything runs."""
        length = self.buckets[-1][1]
        check_within_positions(model, length, "bucket end", past_max_positions=self.past_max_positions)
        eval_sequences(tokenizer, texts, length, num_sequences=self.sequences, join=self.join)
        if self.passkey_lengths:
            check_passkey_settings(
                model,
                self.passkey_lengths,
                self.depths,
                self.trials,
                self.max_new_tokens,
                self.past_max_positions,
                self.seed,
            )
            passkey_filler(tokenizer, texts, self.passkey_lengths, self.max_new_tokens)

    def evaluate(self, model, tokenizer, texts: Sequence[str], *, progress: bool = True) -> dict:
        """{"positions": `position_perplexity`, "passkey": `passkey_retrieval` or None} of one model."""
        positions = position_perplexity(model, tokenizer, texts, **self._sequences(), progress=progress)
        passkey = None
        if self.passkey_lengths:
            passkey = passkey_retrieval(
                model,
                tokenizer,
                texts,
                lengths=self.passkey_lengths,
                depths=self.depths,
                trials=self.trials,
                seed=self.seed,
                max_new_tokens=self.max_new_tokens,
                progress=progress,
                past_max_positions=self.past_max_positions,
            )
        return {"positions": positions, "passkey": passkey}

    def fidelity(self, model, reference, tokenizer, texts: Sequence[str], *, progress: bool = True) -> dict:
        """`position_fidelity` of `model` against `reference` on the sequences of the position buckets."""
        return position_fidelity(model, reference, tokenizer, texts, **self._sequences(), progress=progress)

    def _sequences(self) -> dict:
        """The arguments that pick the scored sequences and buckets, shared by perplexity and agreement."""
        return {
            "buckets": self.buckets,
            "num_sequences": self.sequences,
            "join": self.join,
            "past_max_positions": self.past_max_positions,
        }


#: Width and height of one panel of the long-context plot, in inches; the panels lie one under another.
PANEL_INCHES = (7.0, 3.5)


def _bucket_label(bucket: dict) -> str:
    return f"{bucket['start']:,}-{bucket['end']:,}"


def _past_limit(positions: dict) -> int | None:
    """The max_position_embeddings that the buckets of a `position_perplexity` result go past, if any."""
    limit = positions.get("max_positions")
    return limit if limit and positions["buckets"][-1]["end"] > limit else None


def comparison_tables(results: dict[str, dict], reference: str) -> str:
    """Markdown: perplexity per bucket of each model (with its ratio to `reference`), then passkey
    accuracy per length; tokens scored and wall time beside the numbers. Buckets that end past the
    reference's max_position_embeddings are marked with *."""
    base = results[reference]["positions"]["buckets"]
    limit = _past_limit(results[reference]["positions"])
    header = [_bucket_label(b) + (" *" if limit and b["end"] > limit else "") for b in base]
    lines = [
        "Perplexity by position (tokens scored per bucket: "
        + ", ".join(f"{_bucket_label(b)}: {b['tokens']:,}" for b in base)
        + (f"; in brackets the ratio to {reference}" if len(results) > 1 else "")
        + (f"; * past max_position_embeddings, {limit:,}" if limit else "")
        + ").",
        "",
        "| model | " + " | ".join(header) + " | tokens | time |",
        "|---" * (len(header) + 3) + "|",
    ]
    for name, result in results.items():
        positions = result["positions"]
        cells = [
            f"{b['perplexity']:.2f}" + ("" if name == reference else f" ({b['perplexity'] / r['perplexity']:.2f}x)")
            for b, r in zip(positions["buckets"], base, strict=False)
        ]
        lines.append(
            f"| {name} | " + " | ".join(cells) + f" | {positions['tokens']:,} | {positions['seconds']:.0f} s |"
        )
    fidelities = {name: result["fidelity"] for name, result in results.items() if result.get("fidelity")}
    if fidelities:
        lines += [
            "",
            f"Agreement with {reference} by position: top-1 agreement (positions where both models' most likely "
            f"next token is the same) and, in brackets, the mean KL({reference} || model) in nats.",
            "",
            "| model | " + " | ".join(header) + " | time |",
            "|---" * (len(header) + 2) + "|",
        ]
        for name, fidelity in fidelities.items():
            cells = [f"{b['top1_agreement']:.1%} ({b['kl']:.3f})" for b in fidelity["buckets"]]
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {fidelity['seconds']:.0f} s |")
    passkeys = {name: result["passkey"] for name, result in results.items() if result.get("passkey")}
    if passkeys:
        lengths = list(next(iter(passkeys.values()))["lengths"])
        lines += [
            "",
            "Passkey retrieval accuracy (correct / trials; prompt tokens read and wall time per length).",
            "",
            "| model | " + " | ".join(f"{int(length):,} tokens" for length in lengths) + " |",
            "|---" * (len(lengths) + 1) + "|",
        ]
        for name, passkey in passkeys.items():
            cells = [
                f"{r['accuracy']:.0%} ({r['correct']}/{r['trials']}; {r['tokens'] / 1000:.0f}k tok, "
                f"{r['seconds']:.0f} s)"
                for r in (passkey["lengths"][length] for length in lengths)
            ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_long_context(results: dict[str, dict], reference: str, path: str | Path, *, title: str = "") -> None:
    """Perplexity per position bucket of every model and, beside it when there are several, each
        model's ratio to `reference`; where agreement results exist (`position_fidelity`), a panel of each
        model's top-1 agreement with `reference` per bucket; where passkey results exist, a last panel of
        passkey accuracy against the key's depth, one line per model and prompt length. The panels lie one
    under another, each as wide as the figure, so that a page that fits the figure to its width keeps them
    readable. A model is drawn at the buckets
        of `reference` it was measured on (a run that stopped at 4,096 tokens beside a reference
        measured to 8,192) and keeps its colour in every panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = results[reference]["positions"]["buckets"]
    compared = len(results) > 1
    fidelities = {name: result["fidelity"] for name, result in results.items() if result.get("fidelity")}
    passkeys = {name: result["passkey"] for name, result in results.items() if result.get("passkey")}
    rows = (2 if compared else 1) + bool(fidelities) + bool(passkeys)
    figure, grid = plt.subplots(rows, 1, figsize=(PANEL_INCHES[0], PANEL_INCHES[1] * rows), squeeze=False)
    axes = grid[:, 0]
    curves, ratios = axes[0], axes[1 if compared else 0]
    places = range(len(base))
    place_of = {(b["start"], b["end"]): place for place, b in enumerate(base)}
    colours = {}
    for name, result in results.items():
        measured = [b for b in result["positions"]["buckets"] if (b["start"], b["end"]) in place_of]
        at = [place_of[b["start"], b["end"]] for b in measured]
        (line,) = curves.plot(at, [b["perplexity"] for b in measured], marker="o", label=name)
        colours[name] = line.get_color()
        if name != reference:
            ratios.plot(
                at,
                [b["perplexity"] / base[place]["perplexity"] for b, place in zip(measured, at, strict=True)],
                marker="o",
                label=name,
                color=colours[name],
            )
    panels = [(curves, "perplexity"), (ratios, f"perplexity / {reference}")] if compared else [(curves, "perplexity")]
    if fidelities:
        agreement = axes[len(panels)]
        for name, fidelity in fidelities.items():
            measured = [b for b in fidelity["buckets"] if (b["start"], b["end"]) in place_of]
            agreement.plot(
                [place_of[b["start"], b["end"]] for b in measured],
                [100 * b["top1_agreement"] for b in measured],
                marker="o",
                label=name,
                color=colours[name],
            )
        panels.append((agreement, f"top-1 agreement with {reference} (%)"))
    for axis, ylabel in panels:
        axis.set_xticks(places, [_bucket_label(b) for b in base], rotation=30, ha="right", fontsize=8)
        axis.set_xlabel("position bucket (tokens of context)")
        axis.set_ylabel(ylabel)
    if compared:
        ratios.axhline(1.0, color="black", linestyle="--", linewidth=1, label=reference)
    limit = _past_limit(results[reference]["positions"])
    if limit:
        first_past = next(place for place, b in enumerate(base) if b["end"] > limit)
        for axis, _ in panels:
            axis.axvline(first_past - 0.5, color="grey", linestyle=":", label=f"max_position_embeddings ({limit:,})")
    if passkeys:
        _plot_passkey(axes[-1], passkeys, colours)
    for axis in axes:
        axis.legend(fontsize=8)
    if title:
        figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _plot_passkey(axis, passkeys: dict[str, dict], colours: dict[str, str]) -> None:
    """Passkey accuracy (%) against the key's depth: a line per model (its colour) and prompt length
    (a line style per length)."""
    styles = ("-", "--", ":", "-.")
    lengths = sorted({int(length) for passkey in passkeys.values() for length in passkey["lengths"]})
    for name, passkey in passkeys.items():
        for length, record in passkey["lengths"].items():
            depths = sorted(record["depths"], key=float)
            axis.plot(
                [100 * float(depth) for depth in depths],
                [100 * record["depths"][depth] for depth in depths],
                marker="o",
                color=colours[name],
                linestyle=styles[lengths.index(int(length)) % len(styles)],
                label=f"{name}, {int(length):,} tokens",
            )
    axis.set_xlabel("depth of the key (% of the filler)")
    axis.set_ylabel("passkey accuracy (%)")
    axis.set_ylim(-5, 105)
