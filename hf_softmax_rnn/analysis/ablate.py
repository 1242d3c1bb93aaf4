"""Small Llamas trained from scratch, one per variant group of the paper: the computation of
`hf-softmax-rnn ablate` (its flags and run: `hf_softmax_rnn.commands.ablate`).

Every variant gets the same architecture, data (byte-level text of the offline corpus, or
`--dataset`), seeds and step budget; only the attention spec differs. Writes, under
`--output-dir`: `ablation.md` (final held-out loss, mean and spread over seeds),
`ablation.csv` (every run), `curves.csv` and `loss_curves.png` (held-out loss against step).
A run whose loss becomes NaN or infinite stops and is reported as diverged.
"""

from __future__ import annotations

import csv
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hf_softmax_rnn.analysis.byte_tokenizer import byte_tokenizer
from hf_softmax_rnn.analysis.small_models import batches, check_width, small_llama, train_steps
from hf_softmax_rnn.attention_spec import AttentionSpec
from hf_softmax_rnn.data.corpus import pack_texts
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.evaluation import next_token_nll
from hf_softmax_rnn.flags import option
from hf_softmax_rnn.training.optim import WEIGHT_DECAY_HELP
from hf_softmax_rnn.utils import check_at_least, check_positive, check_seeds

logger = logging.getLogger(__name__)

_RS = "recurrent_softmax"

#: name -> (group, attention). Groups follow the paper's ablations (docs/design.md, the paper's claims);
#: each attention is a preset name
#: (the authors' variant) or the fields of a spec where the paper has no preset of its own.
VARIANTS: dict[str, tuple[str, str | dict]] = {
    "softmax": ("softmax", "softmax"),
    "l2": ("norm in place of the denominator", "gated_softmax_no_gate_L2norm_nodivS_noclamp"),
    "rms": ("norm in place of the denominator", dict(kind=_RS, normalizer="rms")),
    "layer": ("norm in place of the denominator", dict(kind=_RS, normalizer="layer")),
    "seqlen": ("sequence length and gates", "softmax_divs"),
    "seqlen_out_gate": ("sequence length and gates", "softmax_divS_gate"),
    "gated_softmax": ("sequence length and gates", "gated_softmax"),
    "exp_no_norm_no_clamp": ("exp without norm or clamp", dict(kind=_RS, normalizer="none")),
    "linear_elu": ("linear attention", "linear_elu"),
    "linear_relu": ("linear attention", "linear_relu"),
    "linear_cosine": ("linear attention", "linear_cosine"),
    "taylor_1_l2": ("Taylor orders (l2 norm)", dict(kind=_RS, taylor_order=1, normalizer="l2")),
    "taylor_2_l2": ("Taylor orders (l2 norm)", dict(kind=_RS, taylor_order=2, normalizer="l2")),
    "taylor_4_l2": ("Taylor orders (l2 norm)", dict(kind=_RS, taylor_order=4, normalizer="l2")),
}


@dataclass(frozen=True)
class AblationBudget:
    """Model size and training budget, identical for every variant (each field is the `ablate` flag of that name)."""

    d_model: int = option(64, "model width")
    num_layers: int = option(2, "decoder layers")
    num_heads: int = option(2, "attention heads (must divide --d-model)")
    seq_len: int = option(128, "bytes per training and held-out block")
    batch_size: int = option(16, "blocks per optimizer step")
    steps: int = option(300, "optimizer steps per run")
    lr: float = option(3e-3, "peak AdamW learning rate")
    weight_decay: float = option(0.1, WEIGHT_DECAY_HELP)
    warmup_steps: int = option(50, "linear learning-rate warm-up steps (then cosine decay)")
    eval_every: int = option(50, "held-out loss every N steps (and at the end)")
    eval_blocks: int = option(64, "held-out blocks scored for the loss curve")
    test_blocks: int | None = option(None, "held-out blocks scored for the final loss")
    seeds: tuple[int, ...] = option((0, 1), "one run per seed")

    def __post_init__(self) -> None:
        for name in ("num_layers", "batch_size", "steps", "eval_every", "eval_blocks", "test_blocks"):
            check_at_least(f"--{name.replace('_', '-')}", getattr(self, name))
        check_at_least("--seq-len", self.seq_len, minimum=2)
        check_at_least("--warmup-steps", self.warmup_steps, minimum=0)
        check_width(self.d_model, self.num_heads)
        check_positive("--lr", self.lr)
        check_at_least("--weight-decay", self.weight_decay, minimum=0)
        check_seeds("--seeds", self.seeds)


#: `--quick`: CI size, a few seconds for all variants.
QUICK_BUDGET = AblationBudget(
    d_model=32,
    num_heads=2,
    seq_len=32,
    batch_size=4,
    steps=4,
    warmup_steps=1,
    eval_every=2,
    eval_blocks=4,
    test_blocks=8,
    seeds=(0,),
)


@dataclass
class AblationRun:
    variant: str
    group: str
    seed: int
    final_loss: float  # held-out loss (nats per byte) at the end; nan if diverged
    diverged_at: int | None  # step of the first non-finite loss
    seconds: float
    curve: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out loss)

    @property
    def diverged(self) -> bool:
        return self.diverged_at is not None


def variant_spec(name: str) -> AttentionSpec:
    """The attention spec of a variant name (a key of VARIANTS, or any preset name)."""
    attention = VARIANTS[name][1] if name in VARIANTS else name
    try:
        return AttentionSpec.coerce(attention)
    except ValueError as error:
        raise UserInputError(f"Unknown variant {name!r}; expected one of {list(VARIANTS)} or a preset name") from error


def token_blocks(texts, tokenizer, seq_len: int) -> torch.Tensor:
    """`[N, seq_len]` token ids of the packed texts."""
    packed = pack_texts(texts, tokenizer, seq_len)
    if len(packed) == 0:
        raise UserInputError(f"The corpus has fewer than seq_len={seq_len} tokens; lower --seq-len")
    return packed.with_format("torch")[:]["input_ids"]


@torch.inference_mode()
def held_out_loss(model, blocks: torch.Tensor, *, batch_size: int) -> float:
    """Mean next-token cross-entropy (nats) over `blocks`; nan/inf when the model produces them."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for start in range(0, blocks.shape[0], batch_size):
        ids = blocks[start : start + batch_size].to(device)
        total += next_token_nll(model(input_ids=ids, use_cache=False).logits, ids).sum().item()
        count += ids[:, 1:].numel()
    model.train(was_training)
    return total / count


def train_variant(
    name: str, train: torch.Tensor, test: torch.Tensor, budget: AblationBudget, seed: int, *, device, progress: bool
) -> AblationRun:
    """Train one variant from scratch with `seed` and return its held-out loss curve."""
    spec = variant_spec(name)
    group = VARIANTS[name][0] if name in VARIANTS else "preset"
    model = small_llama(
        spec,
        vocab_size=len(byte_tokenizer()),
        hidden_size=budget.d_model,
        num_layers=budget.num_layers,
        num_heads=budget.num_heads,
        max_position_embeddings=budget.seq_len,
        seed=seed,
    ).to(device)
    eval_subset = test[: budget.eval_blocks]
    curve = []

    def record(step: int, loss: float) -> bool:
        if step % budget.eval_every == 0 or step == budget.steps:
            curve.append((step, held_out_loss(model, eval_subset, batch_size=budget.batch_size)))
            logger.info("%s seed %d step %d: train %.4f, held-out %.4f", name, seed, step, loss, curve[-1][1])
            return not math.isfinite(curve[-1][1])
        return False

    def loss_fn(batch):
        return model(input_ids=batch["input_ids"], labels=batch["input_ids"], use_cache=False).loss

    start = time.perf_counter()
    with tqdm(total=budget.steps, desc=f"{name} seed {seed}", disable=not progress, leave=False) as bar:
        losses = train_steps(
            model,
            loss_fn,
            batches({"input_ids": train}, budget.batch_size, seed=seed),
            steps=budget.steps,
            lr=budget.lr,
            weight_decay=budget.weight_decay,
            warmup_steps=budget.warmup_steps,
            device=device,
            callback=record,
            progress=bar,
        )
    final = (
        held_out_loss(model, test[: budget.test_blocks], batch_size=budget.batch_size)
        if math.isfinite(losses[-1])
        else math.nan
    )
    finite = math.isfinite(final) and all(math.isfinite(loss) for _, loss in curve)
    return AblationRun(
        variant=name,
        group=group,
        seed=seed,
        final_loss=final if finite else math.nan,
        diverged_at=None if finite else len(losses),
        seconds=time.perf_counter() - start,
        curve=curve,
    )


# ---------------------------------------------------------------------------------- outputs
def summary_table(runs: list[AblationRun]) -> str:
    """Markdown: one row per variant, final held-out loss as mean ± std over the finite seeds."""
    lines = [
        "| group | variant | attention | held-out loss (nats/byte) | bits/byte | seeds | diverged |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(r.variant for r in runs):
        mine = [r for r in runs if r.variant == name]
        finite = [r.final_loss for r in mine if not r.diverged]
        if finite:
            mean = statistics.fmean(finite)
            spread = f" ± {statistics.stdev(finite):.3f}" if len(finite) > 1 else ""
            loss, bits = f"{mean:.3f}{spread}", f"{mean / math.log(2):.3f}"
        else:
            loss, bits = "diverged", "-"
        diverged = ", ".join(f"seed {r.seed} at step {r.diverged_at}" for r in mine if r.diverged) or "no"
        lines.append(
            f"| {mine[0].group} | {name} | {variant_spec(name).describe()} | {loss} | {bits} | {len(mine)} | "
            f"{diverged} |"
        )
    return "\n".join(lines) + "\n"


def write_csvs(runs: list[AblationRun], directory: Path) -> None:
    with (directory / "ablation.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["variant", "group", "seed", "final_loss", "diverged_at", "seconds"])
        writer.writerows((r.variant, r.group, r.seed, r.final_loss, r.diverged_at, f"{r.seconds:.1f}") for r in runs)
    with (directory / "curves.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["variant", "seed", "step", "held_out_loss"])
        writer.writerows((r.variant, r.seed, step, loss) for r in runs for step, loss in r.curve)


def plot_curves(runs: list[AblationRun], path: Path, title: str) -> Path:
    """Held-out loss against step, mean over seeds, one line per variant coloured by group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(r.group for r in runs))
    colours = plt.get_cmap("tab10")
    styles = ["-", "--", ":", "-."]
    figure, axis = plt.subplots(figsize=(8, 5))
    finite_losses = []
    for name in dict.fromkeys(r.variant for r in runs):
        mine = [r for r in runs if r.variant == name]
        group_index = groups.index(mine[0].group)
        rank_in_group = list(dict.fromkeys(r.variant for r in runs if r.group == mine[0].group)).index(name)
        by_step: dict[int, list[float]] = {}
        for run in mine:
            for step, loss in run.curve:
                if math.isfinite(loss):
                    by_step.setdefault(step, []).append(loss)
        steps = sorted(by_step)
        means = [statistics.fmean(by_step[s]) for s in steps]
        finite_losses += means
        label = name + (" (diverged)" if any(r.diverged for r in mine) else "")
        axis.plot(
            steps, means, styles[rank_in_group % len(styles)], color=colours(group_index % 10), label=label, marker="."
        )
    if finite_losses:
        low = min(finite_losses)
        axis.set_ylim(low - 0.05, min(max(finite_losses), low + 2.5))
    axis.set(xlabel="training step", ylabel="held-out loss (nats/byte)", title=title)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
