"""`hf-softmax-rnn mqar`: train small models on multi-query associative recall (SPEC section 7).

For every (d_model, K, attention spec) a 2-layer Llama is trained from scratch on MQAR with
K key-value pairs and scored on a held-out set (accuracy at the value positions). The
results go to `results.csv`, `results.md` and two plots: accuracy against K and accuracy
against the size of the state the model keeps per sequence (the recurrent state for
finite-state variants, the KV cache at length T for exact exp).
"""

from __future__ import annotations

import csv
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hf_softmax_rnn import AttentionSpec
from hf_softmax_rnn.analysis.small_models import (
    batches,
    resolve_device,
    scored_loss,
    selected_logits,
    small_llama,
    train_steps,
)
from hf_softmax_rnn.data.mqar import IGNORE_INDEX, MQARConfig, mqar_splits

logger = logging.getLogger(__name__)

DEFAULT_SPECS = (
    "softmax",
    "gated_softmax_no_gate_L2norm_nodivS_noclamp",
    "softmax_taylor_2",
    "linear_elu",
    "linear_cosine",
)


@dataclass(frozen=True)
class MQARRun:
    """Training budget and model shape of one MQAR run."""

    steps: int = 3000
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup_steps: int = 150
    num_train: int = 100_000
    num_test: int = 1000
    eval_every: int = 250
    target_accuracy: float | None = 0.99
    num_layers: int = 2
    num_heads: int = 2
    seed: int = 0


@dataclass
class MQARResult:
    attention: str
    d_model: int
    seq_len: int
    num_kv_pairs: int
    vocab_size: int
    state_floats: int
    accuracy: float
    steps: int
    seconds: float
    diverged: bool


def state_floats(spec: AttentionSpec, *, d_model: int, num_heads: int, num_layers: int, seq_len: int) -> int:
    """Floats a model keeps per sequence to decode: recurrent state (S, z) for a finite-state
    spec, else the KV cache after `seq_len` tokens."""
    head_dim = d_model // num_heads
    if spec.has_finite_state:
        per_head = spec.feature_dim(head_dim) * (head_dim + 1)
    else:
        per_head = 2 * seq_len * head_dim
    return per_head * num_heads * num_layers


@torch.inference_mode()
def mqar_accuracy(model, input_ids: torch.Tensor, labels: torch.Tensor, *, batch_size: int = 256) -> float:
    """Share of value positions whose token is the argmax of the prediction made one step earlier."""
    was_training = model.training
    model.eval()
    correct = total = 0
    device = next(model.parameters()).device
    for start in range(0, input_ids.shape[0], batch_size):
        ids, lab = input_ids[start : start + batch_size].to(device), labels[start : start + batch_size].to(device)
        targets = lab[:, 1:]
        positions = torch.zeros_like(lab, dtype=torch.bool)
        positions[:, :-1] = targets != IGNORE_INDEX
        predictions = selected_logits(model, ids, positions).argmax(-1)
        correct += int((predictions == targets[targets != IGNORE_INDEX]).sum())
        total += int(positions.sum())
    model.train(was_training)
    return correct / total


def train_mqar(
    attention: str,
    task: MQARConfig,
    d_model: int,
    run: MQARRun = MQARRun(),
    *,
    device: torch.device = torch.device("cpu"),
    progress: bool = True,
) -> MQARResult:
    """Train one model on `task` and return its held-out accuracy (early stop at the target)."""
    spec = AttentionSpec.coerce(attention)
    splits = mqar_splits(run.num_train, run.num_test, task, seed=run.seed).with_format("torch")
    train, test = splits["train"][:], splits["test"][:]
    model = small_llama(
        spec, vocab_size=task.vocab_size, hidden_size=d_model, num_layers=run.num_layers, num_heads=run.num_heads,
        max_position_embeddings=task.seq_len, seed=run.seed,
    ).to(device)
    accuracy = 0.0

    def evaluate_and_stop(step: int, loss: float) -> bool:
        nonlocal accuracy
        if step % run.eval_every and step != run.steps:
            return False
        accuracy = mqar_accuracy(model, test["input_ids"], test["labels"])
        logger.info("%s d=%d K=%d step %d: loss %.4f, test accuracy %.4f", attention, d_model, task.num_kv_pairs, step, loss, accuracy)
        return run.target_accuracy is not None and accuracy >= run.target_accuracy

    start = time.perf_counter()
    with tqdm(total=run.steps, desc=f"MQAR {attention} d={d_model} K={task.num_kv_pairs}", disable=not progress) as bar:
        losses = train_steps(
            model,
            lambda batch: scored_loss(model, batch["input_ids"], batch["labels"]),
            batches(train, run.batch_size, seed=run.seed),
            steps=run.steps, lr=run.lr, weight_decay=run.weight_decay, warmup_steps=run.warmup_steps,
            device=device, callback=evaluate_and_stop, progress=bar,
        )
    diverged = not math.isfinite(losses[-1])
    return MQARResult(
        attention=attention,
        d_model=d_model,
        seq_len=task.seq_len,
        num_kv_pairs=task.num_kv_pairs,
        vocab_size=task.vocab_size,
        state_floats=state_floats(spec, d_model=d_model, num_heads=run.num_heads, num_layers=run.num_layers, seq_len=task.seq_len),
        accuracy=float("nan") if diverged else accuracy,
        steps=len(losses),
        seconds=time.perf_counter() - start,
        diverged=diverged,
    )


# ---------------------------------------------------------------------------------- outputs
def write_table(results: list[MQARResult], path: Path) -> None:
    """Markdown table, one row per run."""
    lines = [
        "| attention | d_model | T | K | state (floats) | test accuracy | steps | time (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        accuracy = "diverged" if r.diverged else f"{r.accuracy:.3f}"
        lines.append(
            f"| {r.attention} | {r.d_model} | {r.seq_len} | {r.num_kv_pairs} | {r.state_floats:,} | {accuracy} | {r.steps} | {r.seconds:.0f} |"
        )
    path.write_text("\n".join(lines) + "\n")


def write_csv(results: list[MQARResult], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(asdict(results[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in results)


def plot_results(results: list[MQARResult], directory: Path) -> list[Path]:
    """accuracy_vs_kv_pairs.png (largest d_model) and accuracy_vs_state_size.png (largest K)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    attentions = list(dict.fromkeys(r.attention for r in results))
    largest_d = max(r.d_model for r in results)
    largest_k = max(r.num_kv_pairs for r in results)
    views = {
        "accuracy_vs_kv_pairs.png": (
            lambda r: r.d_model == largest_d, lambda r: r.num_kv_pairs, "number of key-value pairs K", False,
            f"MQAR, d_model={largest_d}",
        ),
        "accuracy_vs_state_size.png": (
            lambda r: r.num_kv_pairs == largest_k, lambda r: r.state_floats, "state per sequence (floats)", True,
            f"MQAR, K={largest_k}",
        ),
    }
    paths = []
    for name, (keep, x_of, x_label, log_x, title) in views.items():
        figure, axis = plt.subplots(figsize=(6, 4))
        for attention in attentions:
            points = sorted((x_of(r), r.accuracy) for r in results if r.attention == attention and keep(r))
            if points:
                axis.plot(*zip(*points), marker="o", label=attention)
        axis.set(xlabel=x_label, ylabel="test accuracy", title=title, ylim=(-0.02, 1.02))
        if log_x:
            axis.set_xscale("log")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
        figure.tight_layout()
        figure.savefig(directory / name, dpi=120)
        plt.close(figure)
        paths.append(directory / name)
    return paths


# ---------------------------------------------------------------------------------- CLI
def add_arguments(parser) -> None:
    parser.add_argument("--attention", nargs="+", default=list(DEFAULT_SPECS), help="attention presets to compare")
    parser.add_argument("--d-model", type=int, nargs="+", default=[64], help="model widths (state size grows with it)")
    parser.add_argument("--num-kv-pairs", type=int, nargs="+", default=[4, 8, 16], help="K values, one model per K")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--vocab-size", type=int, default=256, help="Zoology uses 8192; a small vocab trains faster on CPU")
    parser.add_argument("--power-a", type=float, default=0.01)
    defaults = MQARRun()
    for name in ("steps", "batch_size", "warmup_steps", "num_train", "num_test", "eval_every", "num_layers", "num_heads", "seed"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    for name in ("lr", "weight_decay"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(defaults, name))
    parser.add_argument("--target-accuracy", type=float, default=defaults.target_accuracy, help="stop a run early once reached")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, mps")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/mqar"))
    parser.add_argument("--no-progress", action="store_true")


def run(args) -> str:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    for name in args.attention:
        AttentionSpec.coerce(name)
    device = resolve_device(args.device)
    budget = MQARRun(
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps, num_train=args.num_train, num_test=args.num_test, eval_every=args.eval_every,
        target_accuracy=args.target_accuracy, num_layers=args.num_layers, num_heads=args.num_heads, seed=args.seed,
    )
    args.output_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for d_model in args.d_model:
        for k in args.num_kv_pairs:
            task = MQARConfig(vocab_size=args.vocab_size, seq_len=args.seq_len, num_kv_pairs=k, power_a=args.power_a)
            for attention in args.attention:
                results.append(train_mqar(attention, task, d_model, budget, device=device, progress=not args.no_progress))
                write_csv(results, args.output_dir / "results.csv")
    write_table(results, args.output_dir / "results.md")
    plots = plot_results(results, args.output_dir)
    written = (args.output_dir / "results.md", args.output_dir / "results.csv", *plots)
    return (args.output_dir / "results.md").read_text() + "\nWrote " + " ".join(map(str, written))
