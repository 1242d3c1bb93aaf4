"""Small models trained on multi-query associative recall (docs/design.md, MQAR), the computation of
`hf-softmax-rnn mqar` (its flags and run: `hf_softmax_rnn.commands.mqar`).

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

from hf_softmax_rnn.analysis.small_models import batches, scored_loss, selected_logits, small_llama, train_steps
from hf_softmax_rnn.attention_spec import AttentionSpec
from hf_softmax_rnn.data.mqar import IGNORE_INDEX, MQARConfig, mqar_splits
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.flags import option
from hf_softmax_rnn.training.optim import WEIGHT_DECAY_HELP
from hf_softmax_rnn.utils import check_at_least, check_positive, check_seed

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
    """Training budget and model shape of one MQAR run (each field is the `mqar` flag of the same name)."""

    steps: int = option(3000, "optimizer steps per model (fewer when --target-accuracy is reached)")
    batch_size: int = option(64, "sequences per optimizer step")
    lr: float = option(3e-3, "peak AdamW learning rate")
    weight_decay: float = option(0.1, WEIGHT_DECAY_HELP)
    warmup_steps: int = option(150, "linear learning-rate warm-up steps (then cosine decay)")
    num_train: int = option(100_000, "training sequences generated per task")
    num_test: int = option(1000, "held-out sequences generated per task")
    eval_every: int = option(250, "held-out accuracy every N steps (and at the end)")
    target_accuracy: float | None = option(0.99, "stop a run early once reached")
    num_layers: int = option(2, "decoder layers of each model")
    num_heads: int = option(2, "attention heads of each model (must divide every --d-model)")
    seed: int = option(0, "seed of the data, the initialisation and the batch order")

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "num_train", "num_test", "eval_every", "num_layers", "num_heads"):
            check_at_least(f"--{name.replace('_', '-')}", getattr(self, name))
        check_at_least("--warmup-steps", self.warmup_steps, minimum=0)
        check_positive("--lr", self.lr)
        check_at_least("--weight-decay", self.weight_decay, minimum=0)
        check_seed("--seed", self.seed)
        if self.batch_size > self.num_train:
            raise UserInputError(f"--batch-size={self.batch_size} is larger than --num-train={self.num_train}")
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 1:
            raise UserInputError(
                f"--target-accuracy={self.target_accuracy!r} is not allowed; expected a number in (0, 1]"
            )


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
    """Floats a model keeps per sequence to decode: the recurrent state for a finite-state spec (S and z, and
    what `AttentionSpec.state_bytes` adds: a window's keys and values, a short convolution's last inputs),
    else the KV cache after `seq_len` tokens."""
    head_dim = d_model // num_heads
    if spec.has_finite_state:
        per_head = spec.state_bytes(head_dim) // 4
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
    device: torch.device | str = "cpu",
    progress: bool = True,
) -> MQARResult:
    """Train one model on `task` and return its held-out accuracy (early stop at the target)."""
    spec = AttentionSpec.coerce(attention)
    splits = mqar_splits(run.num_train, run.num_test, task, seed=run.seed).with_format("torch")
    train, test = splits["train"][:], splits["test"][:]
    model = small_llama(
        spec,
        vocab_size=task.vocab_size,
        hidden_size=d_model,
        num_layers=run.num_layers,
        num_heads=run.num_heads,
        max_position_embeddings=task.seq_len,
        seed=run.seed,
    ).to(device)
    accuracy = 0.0

    def evaluate_and_stop(step: int, loss: float) -> bool:
        nonlocal accuracy
        if step % run.eval_every and step != run.steps:
            return False
        accuracy = mqar_accuracy(model, test["input_ids"], test["labels"])
        logger.info(
            "%s d=%d K=%d step %d: loss %.4f, test accuracy %.4f",
            attention,
            d_model,
            task.num_kv_pairs,
            step,
            loss,
            accuracy,
        )
        return run.target_accuracy is not None and accuracy >= run.target_accuracy

    start = time.perf_counter()
    with tqdm(total=run.steps, desc=f"MQAR {attention} d={d_model} K={task.num_kv_pairs}", disable=not progress) as bar:
        losses = train_steps(
            model,
            lambda batch: scored_loss(model, batch["input_ids"], batch["labels"]),
            batches(train, run.batch_size, seed=run.seed),
            steps=run.steps,
            lr=run.lr,
            weight_decay=run.weight_decay,
            warmup_steps=run.warmup_steps,
            device=device,
            callback=evaluate_and_stop,
            progress=bar,
        )
    diverged = not math.isfinite(losses[-1])
    return MQARResult(
        attention=attention,
        d_model=d_model,
        seq_len=task.seq_len,
        num_kv_pairs=task.num_kv_pairs,
        vocab_size=task.vocab_size,
        state_floats=state_floats(
            spec, d_model=d_model, num_heads=run.num_heads, num_layers=run.num_layers, seq_len=task.seq_len
        ),
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
            f"| {r.attention} | {r.d_model} | {r.seq_len} | {r.num_kv_pairs} | {r.state_floats:,} | {accuracy} "
            f"| {r.steps} | {r.seconds:.0f} |"
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
            lambda r: r.d_model == largest_d,
            lambda r: r.num_kv_pairs,
            "number of key-value pairs K",
            False,
            f"MQAR, d_model={largest_d}",
        ),
        "accuracy_vs_state_size.png": (
            lambda r: r.num_kv_pairs == largest_k,
            lambda r: r.state_floats,
            "state per sequence (floats)",
            True,
            f"MQAR, K={largest_k}",
        ),
    }
    paths = []
    for name, (keep, x_of, x_label, log_x, title) in views.items():
        figure, axis = plt.subplots(figsize=(6, 4))
        for attention in attentions:
            points = sorted((x_of(r), r.accuracy) for r in results if r.attention == attention and keep(r))
            if points:
                axis.plot(*zip(*points, strict=True), marker="o", label=attention)
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
