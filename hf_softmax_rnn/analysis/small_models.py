"""Small Llama-architecture models trained from scratch, and the training loop they share.

Used by the MQAR benchmark and the ablation runner: same architecture for every attention
variant, only the attention spec changes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from transformers import get_cosine_schedule_with_warmup

from hf_softmax_rnn.attention_spec import AttentionSpec
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.models.llama import SoftmaxRNNLlamaConfig, SoftmaxRNNLlamaForCausalLM
from hf_softmax_rnn.training.optim import weight_decay_groups

# The range checks, devices and threads the experiments share are defined in `hf_softmax_rnn.utils`;
# all but check_at_least are imported here only to stay importable from this module.
from hf_softmax_rnn.utils import (  # noqa: F401
    DEVICE_HELP,
    SEED_RANGE,
    THREADS_HELP,
    available_devices,
    check_at_least,
    check_positive,
    check_seed,
    check_seeds,
    resolve_device,
    set_threads,
)


def check_width(d_model: int, num_heads: int) -> None:
    """`--d-model` splits evenly into `--num-heads` heads."""
    check_at_least("--d-model", d_model)
    check_at_least("--num-heads", num_heads)
    if d_model % num_heads:
        raise UserInputError(f"--d-model={d_model} is not divisible by --num-heads={num_heads}")


def small_llama(
    attention: AttentionSpec | dict | str,
    *,
    vocab_size: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    max_position_embeddings: int = 256,
    seed: int = 0,
) -> SoftmaxRNNLlamaForCausalLM:
    """A from-scratch Llama (RoPE, SwiGLU MLP of width 2*hidden, untied embeddings) with `attention`."""
    if hidden_size % num_heads:
        raise UserInputError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}")
    config = SoftmaxRNNLlamaConfig(
        attention=attention,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return SoftmaxRNNLlamaForCausalLM(config)


def selected_logits(model, input_ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Logits `[B, L, V]`, or only at `positions` (bool `[B, L]`) as `[P, V]`: the LM head then runs
    on the selected hidden states alone, which is most of the cost for a large vocabulary."""
    hidden = model.base_model(input_ids=input_ids, use_cache=False).last_hidden_state
    if positions is not None:
        hidden = hidden[positions]
    return model.get_output_embeddings()(hidden)


def scored_loss(model, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the next-token predictions at positions whose label is not -100."""
    targets = labels[:, 1:]
    positions = torch.zeros_like(labels, dtype=torch.bool)
    positions[:, :-1] = targets != -100
    logits = selected_logits(model, input_ids, positions)
    return torch.nn.functional.cross_entropy(logits.float(), targets[targets != -100])


def optimizer_and_schedule(model, *, lr: float, weight_decay: float, warmup_steps: int, steps: int):
    """AdamW with the package's weight-decay rule (`training.optim.weight_decay_groups`), linear warmup
    and cosine decay."""
    optimizer = torch.optim.AdamW(weight_decay_groups(model, weight_decay), lr=lr, betas=(0.9, 0.98))
    return optimizer, get_cosine_schedule_with_warmup(optimizer, warmup_steps, steps)


def batches(tensors: dict[str, torch.Tensor], batch_size: int, *, seed: int) -> Iterator[dict[str, torch.Tensor]]:
    """Endless shuffled mini-batches of the rows of `tensors` (reshuffled every epoch)."""
    generator = torch.Generator().manual_seed(seed)
    num_rows = next(iter(tensors.values())).shape[0]
    if batch_size > num_rows:
        raise UserInputError(f"batch_size={batch_size} is larger than the {num_rows} training rows")
    while True:
        order = torch.randperm(num_rows, generator=generator)
        for start in range(0, num_rows - batch_size + 1, batch_size):
            index = order[start : start + batch_size]
            yield {name: tensor[index] for name, tensor in tensors.items()}


def train_steps(
    model,
    loss_fn: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    data: Iterator[dict[str, torch.Tensor]],
    *,
    steps: int,
    lr: float,
    weight_decay: float,
    warmup_steps: int,
    max_grad_norm: float = 1.0,
    device: torch.device,
    callback: Callable[[int, float], bool] | None = None,
    progress=None,
) -> list[float]:
    """Train for `steps` AdamW steps; returns the training losses.

    `callback(step, loss) -> stop` runs after each step (evaluation, early stopping). A
    non-finite loss stops training (the run diverged) and is returned as the last entry.
    """
    optimizer, schedule = optimizer_and_schedule(
        model, lr=lr, weight_decay=weight_decay, warmup_steps=warmup_steps, steps=steps
    )
    model.train()
    losses = []
    for step in range(1, steps + 1):
        batch = {name: tensor.to(device) for name, tensor in next(data).items()}
        loss = loss_fn(batch)
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            break
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
        if callback is not None and callback(step, losses[-1]):
            break
    return losses
