"""How much of a pretrained model's quality each converted attention recovers, and what it costs.

For every row: convert the model, then run `hf-softmax-rnn finetune` (the library's `Finetuner`)
with the recipe's defaults: teacher-forced attention transfer, then LoRA distilled from the
unconverted model (and for the last row, the default recipe, the state alone on 4,096-token
blocks). Held-out perplexity on long blocks (1,024 tokens by default) is measured before
conversion, right after it, after transfer, after LoRA and after the state stage, with the training tokens and
wall time of each stage beside it, and one greedy sample per row. Each row's final model is also
measured on long texts of another kind (`hf_softmax_rnn.long_context`): perplexity per position
bucket beside the base row, and passkey retrieval per length, with tokens and wall time.

    python scripts/bench_recovery.py                                   # every row, the embedded SmolLM2
    python scripts/bench_recovery.py --rows hedgehog_window_64 --transfer-steps 60 --finetune-steps 150
    python scripts/bench_recovery.py --model tiny/ --block-size 32 --eval-blocks 4 --output out/  # a quick check
    python scripts/bench_recovery.py --quick-long-eval      # long-context columns up to 4,096 tokens only

Writes `recovery.md`, `recovery.json`, `recovery.png` and `long_context.png` into `--output`
(docs/figures/recovery). The long-context evaluation at its defaults (2 documents of 8,192 tokens,
passkey at 1-8k with 2 trials per depth: 150k prompt tokens) is long on a CPU: SmolLM2-135M read
8,192 tokens of buckets in 4 minutes and 30k passkey prompt tokens in 17 minutes on 2 busy cores.
`--quick-long-eval` (4,096 tokens, passkey at 1k and 2k with 1 trial) costs about 12 minutes per row.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import tempfile
import time
from pathlib import Path

import torch

from hf_softmax_rnn.attention_spec import AttentionSpec
from hf_softmax_rnn.data.eval_texts import DEFAULT_EVAL_TEXTS, load_eval_texts
from hf_softmax_rnn.default_model import resolve_model
from hf_softmax_rnn.layers import softmax_rnn_attention_modules
from hf_softmax_rnn.long_context.positions import buckets_from_edges
from hf_softmax_rnn.long_context.report import (
    QUICK_BUCKETS,
    QUICK_LENGTHS,
    LongContextSettings,
    comparison_tables,
    plot_long_context,
)
from hf_softmax_rnn.training import FinetuneConfig
from hf_softmax_rnn.training.recipes import recipe_defaults
from hf_softmax_rnn.training.trainer import Finetuner

logger = logging.getLogger("bench_recovery")

#: Rows: name -> attention preset (None: the model as it is), or (preset, settings that differ from the
#: command line's). "window_only" is the floor any hybrid must beat: exact softmax over the last 64
#: positions and nothing beyond. The last row is the measured recipe for long contexts (finetune's default):
#: a 256-position window, 4 sinks, 256 kept positions and a decaying state, with the blocks and steps of its
#: recipe (20 distillation steps of 2,048 tokens, then 10 of the state alone on 4,096; docs/long_context.md)
#: whatever the command line says. The other rows train no state stage.
LONG_RECIPE = "hedgehog_window_256_sinks_4_kept_256_decay"
_LONG_RECIPE_RUN = recipe_defaults(AttentionSpec.from_preset(LONG_RECIPE))
ROWS: dict[str, str | None | tuple[str, dict]] = {
    "base": None,
    "window_only": "hedgehog_window_64",
    "linear_elu": "linear_elu",
    "linear_hedgehog": "linear_hedgehog",
    "softmax_taylor_2": "softmax_taylor_2",
    "hedgehog_window_64": "hedgehog_window_64",
    "taylor_2_window_64": "taylor_2_window_64",
    "hedgehog_window_64_l2": "hedgehog_window_64_l2",
    "gated_softmax_no_gate_L2norm_nodivS_noclamp": "gated_softmax_no_gate_L2norm_nodivS_noclamp",
    "hedgehog_window_64_sinks_4": "hedgehog_window_64_sinks_4",
    "hedgehog_window_64_sinks_4_decay": "hedgehog_window_64_sinks_4_decay",
    "hedgehog_window_256_sinks_4_decay": "hedgehog_window_256_sinks_4_decay",
    "hedgehog_window_256_sinks_4_kept_256_decay": "hedgehog_window_256_sinks_4_kept_256_decay",
    "long_recipe": (
        LONG_RECIPE,
        {name: _LONG_RECIPE_RUN[name] for name in ("block_size", "finetune_steps", "state_steps")},
    ),
}
POINTS = ("converted", "transfer", "finetune", "state")
POINT_LABELS = {
    "converted": "after conversion",
    "transfer": "after transfer",
    "finetune": "after LoRA",
    "state": "after the state stage",
}
PROMPT = "The for statement in Python"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), a folder or a Hub id")
    parser.add_argument("--dataset", default="pydoc", help="training and held-out text (see finetune --dataset)")
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS), help="rows to run, in order")
    parser.add_argument("--block-size", type=int, default=1024, help="tokens per training and held-out block")
    parser.add_argument("--eval-blocks", type=int, default=4, help="held-out blocks scored at each point")
    parser.add_argument("--transfer-steps", type=int, help="attention-transfer steps (default: the recipe's)")
    parser.add_argument("--finetune-steps", type=int, help="LoRA steps (default: the recipe's)")
    parser.add_argument("--batch-size", type=int, default=1, help="blocks per step")
    parser.add_argument("--sample-tokens", type=int, default=24, help="greedy tokens sampled per row")
    parser.add_argument("--output", default="docs/figures/recovery", help="folder for recovery.md/.json/.png")
    parser.add_argument("--append", action="store_true", help="add the rows to those already in --output")
    long = parser.add_argument_group("long-context evaluation of each row's final model")
    long.add_argument("--no-long-eval", dest="long_eval", action="store_false", help="skip it")
    long.add_argument("--long-texts", default=DEFAULT_EVAL_TEXTS, help="texts (see `hf-softmax-rnn evaluate --texts`)")
    long.add_argument(
        "--long-positions", type=int, nargs="+", default=[0, 64, 256, 1024, 2048, 4096, 8192], help="bucket edges"
    )
    long.add_argument("--long-sequences", type=int, default=2, help="documents scored from their start")
    long.add_argument(
        "--passkey", type=int, nargs="+", default=[1024, 2048, 4096, 8192], help="passkey lengths (0: none)"
    )
    long.add_argument("--passkey-trials", type=int, default=2, help="passkey prompts per length and depth")
    long.add_argument(
        "--quick-long-eval",
        action="store_true",
        help="buckets up to 4,096, passkey at 1,024 and 2,048 with 1 trial (overrides the three flags above)",
    )
    return parser.parse_args(argv)


def long_context_settings(args: argparse.Namespace) -> LongContextSettings | None:
    if not args.long_eval:
        return None
    if args.quick_long_eval:
        return LongContextSettings(buckets=QUICK_BUCKETS, sequences=args.long_sequences, passkey_lengths=QUICK_LENGTHS)
    return LongContextSettings(
        buckets=buckets_from_edges(args.long_positions),
        sequences=args.long_sequences,
        passkey_lengths=tuple(length for length in args.passkey if length != 0),
        trials=args.passkey_trials,
    )


def _settings(args: argparse.Namespace, preset: str, output_dir: str, row_settings: dict | None = None):
    """The run of one row: the command line's settings, then the row's own (held-out blocks keep
    --block-size, so every row is scored on the same blocks)."""
    overrides = {
        name: getattr(args, name) for name in ("transfer_steps", "finetune_steps") if getattr(args, name) is not None
    }
    settings = dict(
        output_dir=output_dir,
        model=args.model,
        attention=preset,
        dataset=args.dataset,
        block_size=args.block_size,
        eval_block_size=args.block_size,
        batch_size=args.batch_size,
        eval_batch_size=1,
        max_eval_blocks=args.eval_blocks,
        state_steps=0,
        eval_every=10**9,
        save_every=10**9,
        progress=True,
        **overrides,
    )
    return FinetuneConfig.from_flags(**{**settings, **(row_settings or {})})


def row_recipe(name: str) -> tuple[str | None, dict]:
    """(preset or None, the row's own settings) of row `name`."""
    row = ROWS[name]
    return row if isinstance(row, tuple) else (row, {})


def _sample(model, tokenizer, tokens: int) -> str:
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids.to(next(model.parameters()).device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False)
    return (
        tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).replace("\n", " ").replace("|", "/").strip()
    )


def run_row(args: argparse.Namespace, name: str, workdir: Path, long_eval=None) -> dict:
    """Train one row (or, for "base" and "window_only", only measure it); returns its record.
    `long_eval`: (settings, texts) of the long-context evaluation of the row's final model, or None."""
    preset, row_settings = row_recipe(name)
    if preset is None or name == "window_only":
        config = _settings(args, preset or "hedgehog_window_64", str(workdir / name))
        finetuner = Finetuner(config)
        model = (finetuner.base_model if preset is None else _window_only(finetuner.converted)).to(
            finetuner.accelerator.device
        )
        start = time.perf_counter()
        evaluation = finetuner.evaluate(model, "converted")
        return {
            "row": name,
            "attention": preset or "unconverted",
            "points": {"converted": {**evaluation, "train_tokens": 0, "stage_seconds": 0.0}},
            "seconds": round(time.perf_counter() - start, 1),
            "sample": _sample(model, finetuner.tokenizer, args.sample_tokens),
            "long_context": _long_context(model, finetuner.tokenizer, long_eval),
        }
    start = time.perf_counter()
    finetuner = Finetuner(_settings(args, preset, str(workdir / name), row_settings))
    result = finetuner.run()
    evaluations = result.evaluations
    points = {point: evaluations[point] for point in POINTS if point in evaluations}
    for stage, seconds in result.stage_seconds.items():
        points[stage] = {**points[stage], "stage_seconds": seconds}
    return {
        "row": name,
        "attention": preset,
        "settings": row_settings,
        "base": evaluations.get("base"),
        "points": points,
        "seconds": round(time.perf_counter() - start, 1),
        "sample": _sample(result.model, result.tokenizer, args.sample_tokens),
        "layer_mse": _layer_mse(result.output_dir),
        "long_context": _long_context(result.model, result.tokenizer, long_eval),
    }


def _long_context(model, tokenizer, long_eval) -> dict | None:
    if long_eval is None:
        return None
    settings, texts = long_eval
    return settings.evaluate(model, tokenizer, texts)


def _window_only(model):
    """The hybrid with nothing beyond the window: the finite-state part weighted by e^-10000 = 0."""
    with torch.no_grad():
        for module in softmax_rnn_attention_modules(model):
            module.rnn_params.linear_log_scale.fill_(-1e4)
    return model


def _layer_mse(output_dir: Path) -> dict | None:
    path = Path(output_dir) / "transfer_layer_mse.json"
    if not path.exists():
        return None
    points = json.loads(path.read_text())
    return {point: sum(values) for point, values in points.items()}


def _cell(point: dict | None) -> str:
    if point is None:
        return "-"
    tokens = point.get("train_tokens", 0)
    cost = f" ({tokens / 1000:.0f}k tok, {point.get('stage_seconds', 0) / 60:.1f} min)" if tokens else ""
    return f"{point['perplexity']:,.1f}{cost}"


def _settings_note(record: dict) -> str:
    settings = record.get("settings") or {}
    return "".join(f"<br>{name} {value}" for name, value in settings.items())


def table(records: list[dict], args: argparse.Namespace) -> str:
    base = next((r["points"]["converted"] for r in records if r["row"] == "base"), None)
    scored = base["eval_tokens"] if base else records[0]["points"]["converted"]["eval_tokens"]
    lines = [
        f"Held-out perplexity over {scored:,} tokens (blocks of {args.block_size}, each scored on its own); "
        "in brackets the training tokens and wall time of that stage.",
        "",
        f"| row | attention | {' | '.join(POINT_LABELS[point] for point in POINTS)} | ratio to base | transfer MSE "
        "(sum over layers) | greedy sample |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for record in records:
        points = record["points"]
        final = next(points[point] for point in reversed(POINTS) if point in points)
        ratio = f"{final['perplexity'] / base['perplexity']:.2f}x" if base else "-"
        mse = record.get("layer_mse")
        mse_cell = f"{mse['before']:.3g} -> {mse['after']:.3g}" if mse and "after" in mse else "-"
        cells = [_cell(points.get(point)) for point in POINTS]
        lines.append(
            f"| {record['row']} | `{record['attention']}`{_settings_note(record)} | {' | '.join(cells)} | {ratio} | "
            f"{mse_cell} | "
            f"{record['sample'][:90]} |"
        )
    return "\n".join(lines)


def plot(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(POINTS)
    for offset, point in enumerate(POINTS):
        values = [r["points"].get(point, {}).get("perplexity", math.nan) for r in records]
        shift = (offset - (len(POINTS) - 1) / 2) * width
        axis.bar([i + shift for i in range(len(records))], values, width, label=POINT_LABELS[point])
    base = next((r["points"]["converted"]["perplexity"] for r in records if r["row"] == "base"), None)
    if base:
        axis.axhline(base, color="black", linestyle="--", linewidth=1, label="unconverted")
    axis.set_yscale("log")
    axis.set_xticks(range(len(records)), [r["row"] for r in records], rotation=25, ha="right", fontsize=8)
    axis.set_ylabel("held-out perplexity")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    settings = long_context_settings(args)
    long_eval = None
    if settings is not None:  # checked on the model and texts before any row runs
        texts = load_eval_texts(args.long_texts)
        settings.check(*resolve_model(args.model), texts)
        long_eval = (settings, texts)
    saved = output / "recovery.json"
    records = json.loads(saved.read_text()) if args.append and saved.exists() else []
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.rows:
            records.append(run_row(args, name, Path(workdir), long_eval))
            saved.write_text(json.dumps(records, indent=1))
            logger.info("Row %s done: %s", name, json.dumps(records[-1]["points"]))
    markdown = table(records, args)
    measured = {record["row"]: record["long_context"] for record in records if record.get("long_context")}
    if measured:
        reference = "base" if "base" in measured else next(iter(measured))
        markdown += f"\n\nOn {args.long_texts}, each row's final model:\n\n" + comparison_tables(measured, reference)
        plot_long_context(measured, reference, output / "long_context.png", title=f"recovery rows on {args.long_texts}")
    (output / "recovery.md").write_text(markdown + "\n")
    plot(records, output / "recovery.png")
    print(markdown)
    return records


if __name__ == "__main__":
    main()
