"""Small Llama-architecture models trained from scratch, and the training loop they share.

Used by the MQAR benchmark and the ablation runner: same architecture for every attention
variant, only the attention spec changes.
"""

from __future__ import annotations

import math
import numbers
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import torch
from transformers import get_cosine_schedule_with_warmup

from hf_softmax_rnn import AttentionSpec, SoftmaxRNNLlamaConfig, SoftmaxRNNLlamaForCausalLM
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.training.optim import weight_decay_groups

#: Help of the flags that every experiment shares.
DEVICE_HELP = "auto, cpu, cuda, cuda:N or mps"
THREADS_HELP = "torch CPU threads (default: torch's choice)"


def check_at_least(flag: str, value: float | None, minimum: int = 1) -> None:
    """Refuse `value` below `minimum` (None passes: the flag was not given)."""
    if value is not None and not value >= minimum:
        kind = "an int" if isinstance(value, int) else "a number"
        raise UserInputError(f"{flag}={value!r} is not allowed; expected {kind} >= {minimum}")


def check_positive(flag: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise UserInputError(f"{flag}={value!r} is not allowed; expected a number > 0")


#: Seeds that every generator of the package accepts (numpy's refuse negatives; finetune's `seed` has the same range).
SEED_RANGE = range(2**32)
_SEED_RANGE_TEXT = "from 0 to 2**32 - 1"


def _is_seed(seed) -> bool:
    return isinstance(seed, numbers.Integral) and not isinstance(seed, bool) and seed in SEED_RANGE


def check_seed(flag: str, seed: int) -> None:
    """Refuse a seed outside `SEED_RANGE`."""
    if not _is_seed(seed):
        raise UserInputError(f"{flag}={seed!r} is not allowed; expected an int {_SEED_RANGE_TEXT}")


def check_seeds(flag: str, seeds: Sequence[int]) -> None:
    """One run per seed: at least one seed, each in `SEED_RANGE`, none repeated (a repeat would be the
    same run counted twice, shown as if it were an independent seed)."""
    given = f"{flag} {' '.join(map(str, seeds))}"
    if not seeds:
        raise UserInputError(f"{flag} is empty; expected at least one seed")
    bad = next((seed for seed in seeds if not _is_seed(seed)), None)
    if bad is not None:
        raise UserInputError(f"{given} has seed {bad!r}, which is not allowed; expected ints {_SEED_RANGE_TEXT}")
    repeated = [seed for seed, count in Counter(seeds).items() if count > 1]
    if repeated:
        shown = ", ".join(map(str, repeated))
        raise UserInputError(
            f"{given} repeats seed {shown}; expected distinct seeds (each seed is one independent run)"
        )


def check_width(d_model: int, num_heads: int) -> None:
    """`--d-model` splits evenly into `--num-heads` heads."""
    check_at_least("--d-model", d_model)
    check_at_least("--num-heads", num_heads)
    if d_model % num_heads:
        raise UserInputError(f"--d-model={d_model} is not divisible by --num-heads={num_heads}")


def set_threads(threads: int | None) -> None:
    """`torch.set_num_threads(threads)`, unless None (torch's choice)."""
    check_at_least("--threads", threads)
    if threads is not None:
        torch.set_num_threads(threads)


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


def resolve_device(device: str | torch.device, *, name: str = "--device") -> torch.device:
    """ "auto" -> cuda if available, else mps, else cpu; anything else as given, if this machine has it.
    `name` is how a refusal names the setting (the flag, or a function's argument)."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps" if torch.backends.mps.is_available() else "cpu")
    allowed = "'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"{name}={device!r} is not allowed; expected {allowed}")
    try:
        resolved = torch.device(device)
    except RuntimeError as error:
        raise UserInputError(f"{name}={device!r} is not allowed; expected {allowed}") from error
    if not _is_available(resolved):
        raise UserInputError(
            f"{name}={device!r} is not available on this machine; expected one of {available_devices()}"
        )
    return resolved


def available_devices() -> list[str]:
    """The devices `resolve_device` accepts on this machine: 'auto', 'cpu', then each GPU."""
    gpus = [f"cuda:{index}" for index in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return ["auto", "cpu", *(["cuda"] if gpus else []), *gpus, *(["mps"] if torch.backends.mps.is_available() else [])]


def _is_available(device: torch.device) -> bool:
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()
    if device.type == "mps":
        return torch.backends.mps.is_available()
    backend = getattr(torch, device.type, None)
    return bool(getattr(backend, "is_available", lambda: False)())


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
