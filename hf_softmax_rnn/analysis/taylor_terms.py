"""How large is each Taylor term of exp(q.k/sqrt(d))? The computation of `hf-softmax-rnn taylor-terms MODEL`
(its flags and run: `hf_softmax_rnn.commands.taylor_terms`).

exp(x) = sum_n x^n / n! (docs/design.md): order n is one additive RNN. For each layer and
order n this measures the mean of |x^n / n!| over all causal (query, key) pairs and heads,
x = q_t.k_s * scaling with q, k after RoPE, on real text, and the dominant order per layer
(the n with the largest mean). A dominant order well above 1 means linear attention
(order 1) misses most of what softmax computes (the paper's claim 5 in docs/design.md).

q and k are recomputed from each attention module's input by a forward pre-hook
(`q_proj`, `k_proj`, optional `q_norm`/`k_norm`, RoPE), so the model's own forward pass is
unchanged; this works for Llama-family models, including the SoftmaxRNN ones.

With `--truncation-orders`, it also converts the model to exp truncated at each order N
(softmax denominator, no training) and measures perplexity: how many terms this model needs
before the finite RNN behaves like its softmax (claim 1 in docs/design.md). Run it in float64
(`--dtype float64`): a truncated series at large negative scores cancels catastrophically
in float32.
"""

from __future__ import annotations

import csv
import logging
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from hf_softmax_rnn.attention_spec import AttentionSpec
from hf_softmax_rnn.convert import convert
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.evaluation import stream_nll

logger = logging.getLogger(__name__)


@dataclass
class TaylorTerms:
    """Per layer: mean |x^n/n!| over causal pairs for n = 0..max_order, and score statistics."""

    mean_abs_terms: torch.Tensor  # [layers, max_order + 1], float64
    max_abs_score: torch.Tensor  # [layers]
    mean_abs_score: torch.Tensor  # [layers]
    num_pairs: int  # causal (query, key) pairs per layer, summed over heads

    @property
    def dominant_order(self) -> torch.Tensor:
        """`[layers]`: the order with the largest mean |x^n/n!|."""
        return self.mean_abs_terms.argmax(dim=1)


def attention_modules(model) -> list[torch.nn.Module]:
    """The self-attention module of each decoder layer of a Llama-family model."""
    layers = getattr(getattr(model, "base_model", None), "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
        raise UserInputError(
            f"{type(model).__name__} has no Llama-style `base_model.layers[i].self_attn`; taylor-terms supports "
            "Llama-family models (q_proj, k_proj and RoPE position embeddings)"
        )
    for module in (layer.self_attn for layer in layers):
        if not (hasattr(module, "q_proj") and hasattr(module, "k_proj")):
            raise UserInputError(
                f"{type(module).__name__} has no q_proj/k_proj; taylor-terms supports Llama-family attention"
            )
    return [layer.self_attn for layer in layers]


def causal_scores(module, hidden_states: torch.Tensor, position_embeddings) -> torch.Tensor:
    """x = q.k * scaling of every causal (query, key) pair, flattened over batch and heads, float64."""
    batch, length, _ = hidden_states.shape
    shape = (batch, length, -1, module.head_dim)
    q = module.q_proj(hidden_states).view(shape)
    k = module.k_proj(hidden_states).view(shape)
    if hasattr(module, "q_norm"):
        q, k = module.q_norm(q), module.k_norm(k)
    q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), *position_embeddings)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = (q.double() @ k.double().transpose(-1, -2)) * module.scaling  # [B, H, L, L]
    causal = torch.ones(length, length, dtype=torch.bool, device=scores.device).tril()
    return scores[causal.expand_as(scores)]


def abs_term_sums(scores: torch.Tensor, max_order: int) -> torch.Tensor:
    """sum over `scores` of |x|^n / n! for n = 0..max_order (in place: term_n = term_{n-1} |x| / n)."""
    magnitude = scores.abs().double()
    term = torch.ones_like(magnitude)
    sums = [term.sum()]
    for order in range(1, max_order + 1):
        sums.append(term.mul_(magnitude).div_(order).sum())
    return torch.stack(sums)


@torch.inference_mode()
def taylor_term_magnitudes(
    model, blocks: torch.Tensor, *, max_order: int = 100, batch_size: int = 1, progress: bool = True
) -> TaylorTerms:
    """Mean |x^n/n!| per layer and order over the causal scores of `blocks` (`[N, L]` token ids,
    no padding: pack the text into full blocks)."""
    if max_order < 1:
        raise UserInputError(f"max_order={max_order} is not allowed; expected an int >= 1")
    modules = attention_modules(model)
    sums = torch.zeros(len(modules), max_order + 1, dtype=torch.float64)
    max_abs = torch.zeros(len(modules), dtype=torch.float64)
    abs_sum = torch.zeros(len(modules), dtype=torch.float64)
    counts = torch.zeros(len(modules), dtype=torch.long)

    def make_hook(index: int):
        def hook(module, args, kwargs):
            hidden_states = args[0] if args else kwargs["hidden_states"]
            scores = causal_scores(module, hidden_states, kwargs["position_embeddings"])
            sums[index] += abs_term_sums(scores, max_order).cpu()
            max_abs[index] = torch.maximum(max_abs[index], scores.abs().max().cpu())
            abs_sum[index] += scores.abs().sum().cpu()
            counts[index] += scores.numel()

        return hook

    handles = [m.register_forward_pre_hook(make_hook(i), with_kwargs=True) for i, m in enumerate(modules)]
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        for start in tqdm(
            range(0, blocks.shape[0], batch_size), desc="Taylor terms", unit="batch", disable=not progress
        ):
            ids = blocks[start : start + batch_size].to(device)
            model(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return TaylorTerms(
        mean_abs_terms=sums / counts[:, None],
        max_abs_score=max_abs,
        mean_abs_score=abs_sum / counts,
        num_pairs=int(counts[0]),
    )


def truncation_perplexities(
    model, input_ids: torch.Tensor, orders: list[int], *, max_length: int, stride: int, progress: bool = True
) -> dict[str, float]:
    """Perplexity of `model` and of its conversion to exp truncated at each order (softmax
    denominator), on the token stream `input_ids` `[N]`; keys "softmax" and "N"."""

    def ppl(candidate) -> float:
        total, count = stream_nll(candidate, input_ids, max_length=max_length, stride=stride, progress=False)
        return math.exp(total / count) if total / count < 700 else math.inf

    results = {"softmax": ppl(model)}
    for order in tqdm(orders, desc="Truncated exp", disable=not progress):
        with warnings.catch_warnings():  # odd orders warn about the denominator: that is what is measured
            warnings.simplefilter("ignore")
            spec = AttentionSpec(kind="recurrent_softmax", taylor_order=order, normalizer="softmax")
        results[str(order)] = ppl(convert(model, spec))
        logger.info("exp truncated at order %d: perplexity %.4g", order, results[str(order)])
    return results


# ---------------------------------------------------------------------------------- outputs
def write_csvs(terms: TaylorTerms, directory: Path) -> tuple[Path, Path]:
    """taylor_terms.csv (layer, order, mean_abs_term) and taylor_summary.csv (one row per layer)."""
    long_path, summary_path = directory / "taylor_terms.csv", directory / "taylor_summary.csv"
    with long_path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["layer", "order", "mean_abs_term"])
        for layer, row in enumerate(terms.mean_abs_terms.tolist()):
            writer.writerows((layer, order, value) for order, value in enumerate(row))
    with summary_path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["layer", "dominant_order", "mean_abs_score", "max_abs_score", "order1_share"])
        for layer in range(terms.mean_abs_terms.shape[0]):
            row = terms.mean_abs_terms[layer]
            writer.writerow(
                [
                    layer,
                    int(terms.dominant_order[layer]),
                    float(terms.mean_abs_score[layer]),
                    float(terms.max_abs_score[layer]),
                    float(row[1] / row.sum()),
                ]
            )
    return long_path, summary_path


def plot_heatmap(terms: TaylorTerms, path: Path, title: str) -> Path:
    """log10 mean |x^n/n!| relative to each layer's largest term, layers x orders, the dominant
    order of each layer marked (per-layer scaling: one layer's huge scores would hide the rest)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = terms.mean_abs_terms.clamp_min(1e-300).log10()
    values = (values - values.amax(dim=1, keepdim=True)).numpy()
    num_layers, num_orders = values.shape
    figure, axis = plt.subplots(figsize=(min(11, 4 + num_orders / 12), min(9, 2 + num_layers / 5)))
    image = axis.imshow(
        values, aspect="auto", origin="lower", cmap="viridis", vmin=-16, vmax=0, interpolation="nearest"
    )
    axis.scatter(terms.dominant_order.numpy(), range(num_layers), marker="x", color="red", s=18, label="dominant order")
    axis.set(xlabel="Taylor order n", ylabel="layer", title=title)
    figure.colorbar(image, ax=axis, label="log10 mean |x^n/n!| (relative to the layer's largest)")
    axis.legend(loc="upper right", fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def plot_truncation(results: dict[str, float], path: Path, title: str) -> Path:
    """Perplexity against truncation order (log-log), the softmax model as a horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    orders = sorted(int(k) for k in results if k != "softmax")
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot(orders, [min(results[str(n)], 1e30) for n in orders], marker="o", label="exp truncated at order N")
    axis.axhline(results["softmax"], color="black", linestyle="--", label=f"softmax ({results['softmax']:.2f})")
    axis.set(xscale="log", yscale="log", xlabel="Taylor order N", ylabel="perplexity", title=title)
    axis.grid(alpha=0.3, which="both")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
