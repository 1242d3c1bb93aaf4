"""Perplexity of any causal LM over texts: sliding window with stride over one token stream.

The texts are tokenised, joined (each followed by the EOS token when `add_eos`) into one
stream, and cut into windows of `max_length` tokens that start every `stride` tokens. Each
token of the stream except the first is scored exactly once, by the first window that
contains it with at least one token of context, so it sees between `max_length - stride`
and `max_length - 1` tokens of context (fewer near the start). Windows are batched; the
last, shorter window is right-padded and masked. The model is called with
`use_cache=False`, so this works for plain transformers models and for the SoftmaxRNN ones.
"""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from hf_softmax_rnn.errors import UserInputError

logger = logging.getLogger(__name__)

#: Window length used when neither `max_length` nor the model's config gives one.
DEFAULT_MAX_LENGTH = 1024
_MAX_LOG = math.log(1.7e308)


@dataclass(frozen=True)
class Window:
    """Tokens `[begin, end)` of the stream go in; targets `[score_from, end)` are scored."""

    begin: int
    end: int
    score_from: int


def _check_int(name: str, value, minimum: int, *, optional: bool = False) -> None:
    """Refuse anything but an int (not a bool) >= `minimum`; None too when `optional`."""
    if value is None and optional:
        return
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        allowed = f"an int >= {minimum}" + (" or None" if optional else "")
        raise TypeError(f"{name}={value!r} is not allowed; expected {allowed}")
    if value < minimum:
        raise ValueError(f"{name}={value} is not allowed; expected an int >= {minimum}")


def check_window(
    *, max_length: int | None = None, stride: int | None = None, batch_size: int = 1, optional: bool = True
) -> None:
    """Refuse window settings that are not ints in range (with `optional`, None: the default, known once
    there is a model), before anything is loaded or scored."""
    _check_int("max_length", max_length, 2, optional=optional)
    _check_int("stride", stride, 1, optional=optional)
    _check_int("batch_size", batch_size, 1)
    if max_length is not None and stride is not None and stride > max_length - 1:
        raise ValueError(
            f"stride={stride} is not allowed for max_length={max_length}; expected 1 <= stride <= {max_length - 1} "
            "(a larger stride would leave tokens with no context)"
        )


def sliding_windows(num_tokens: int, max_length: int, stride: int) -> list[Window]:
    """The windows that score every token of a `num_tokens` stream once (token 0 has no context).

    Window j covers `[j*stride, min(j*stride + max_length, num_tokens))` and scores the tokens
    after the previous window's end; the last window reaches the end of the stream.
    """
    if num_tokens < 2:
        raise ValueError(f"num_tokens={num_tokens} is too short to score; expected at least 2 tokens")
    check_window(max_length=max_length, stride=stride, optional=False)
    windows, scored_until = [], 1
    for begin in range(0, num_tokens, stride):
        end = min(begin + max_length, num_tokens)
        windows.append(Window(begin, end, scored_until))
        scored_until = end
        if end == num_tokens:
            break
    return windows


def check_texts(texts: Sequence[str]) -> None:
    """Refuse anything but a non-empty sequence of strings (a single string is not a list of texts)."""
    if isinstance(texts, str):
        raise TypeError("texts must be a list of strings, not a single string; wrap it as [text]")
    if not isinstance(texts, Sequence):
        raise TypeError(f"texts must be a list of strings, got {type(texts).__name__}")
    if not texts:
        raise ValueError("texts=[] is empty; pass at least one text")
    bad = next((i for i, text in enumerate(texts) if not isinstance(text, str)), None)
    if bad is not None:
        raise TypeError(f"texts[{bad}] is a {type(texts[bad]).__name__}; expected every text to be a string")


def token_stream(tokenizer, texts: Sequence[str], *, add_eos: bool = True) -> list[int]:
    """Token ids of `texts` joined into one stream, each text followed by EOS when `add_eos`."""
    check_texts(texts)
    if add_eos and tokenizer.eos_token_id is None:
        raise ValueError("add_eos=True needs a tokenizer with an eos_token_id; pass add_eos=False")
    suffix = [tokenizer.eos_token_id] if add_eos else []
    encoded = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    return [token for ids in encoded for token in [*ids, *suffix]]


def max_positions(model) -> int | None:
    """The model's `config.max_position_embeddings`, or None when it names none."""
    return getattr(getattr(model, "config", None), "max_position_embeddings", None)


def check_within_positions(model, length: int, what: str, *, past_max_positions: bool | None = None) -> None:
    """Refuse `length` tokens when the model's config names fewer positions (max_position_embeddings).
    `past_max_positions=True` scores them anyway (logged) where positions are computed (rotary), not
    looked up in a learned table that has no rows past the limit; False refuses and names that opt-in;
    None (a caller without it) refuses."""
    limit = max_positions(model)
    if limit is None or length <= limit:
        return
    config = model.config
    if past_max_positions and getattr(config, "rope_parameters", None) is None:
        raise UserInputError(
            f"{what}={length} is more than the model's {limit} positions, and {type(model).__name__} looks its "
            f"positions up in a learned table of {limit} rows (no rotary embedding), so past_max_positions cannot "
            f"score past them; expected at most {limit}"
        )
    if past_max_positions:
        logger.warning("%s=%d is past the model's %d positions (config.max_position_embeddings)", what, length, limit)
        return
    opt_in = "" if past_max_positions is None else ", or past_max_positions=True (--past-max-positions) to score them"
    raise UserInputError(
        f"{what}={length} is more than the model's {limit} positions (config.max_position_embeddings); "
        f"expected at most {limit}{opt_in}"
    )


def _default_max_length(model) -> int:
    limit = max_positions(model)
    return min(limit, DEFAULT_MAX_LENGTH) if limit else DEFAULT_MAX_LENGTH


@torch.inference_mode()
def next_token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood (nats, float64) of each next token: the logits at position t `[B, L, V]`
    predict `targets[:, t + 1]` `[B, L]` (-100 = not scored) -> `[B, L - 1]`, 0 where not scored.
    Every evaluator of the package (fine-tuning, ablation, perplexity) scores with this one function."""
    following = targets[:, 1:]
    nll = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1).double(), following.flatten(), ignore_index=-100, reduction="none"
    )
    return nll.view_as(following)


def stream_nll(
    model,
    input_ids: Sequence[int] | torch.Tensor,
    *,
    max_length: int | None = None,
    stride: int | None = None,
    batch_size: int = 1,
    progress: bool = True,
) -> tuple[float, int]:
    """Summed negative log-likelihood (nats) and number of scored tokens of one token stream.

    Args:
        model: a causal LM returning `.logits [B, L, V]`.
        input_ids: the stream, `[N]`.
        max_length: window length (context + 1); None = min(config.max_position_embeddings, 1024).
        stride: start-to-start distance of windows; None = max_length // 2.
    """
    check_window(max_length=max_length, stride=stride, batch_size=batch_size)
    ids = torch.as_tensor(input_ids, dtype=torch.long).flatten()
    max_length = _default_max_length(model) if max_length is None else max_length
    check_within_positions(model, max_length, "max_length")
    stride = max(1, max_length // 2) if stride is None else stride
    windows = sliding_windows(ids.numel(), max_length, stride)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total_nll, total_tokens = 0.0, 0
    batches = [windows[i : i + batch_size] for i in range(0, len(windows), batch_size)]
    try:
        for batch in tqdm(batches, desc="Perplexity", unit="batch", disable=not progress):
            width = max(w.end - w.begin for w in batch)
            inputs = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            labels = torch.full((len(batch), width), -100, dtype=torch.long)
            for row, w in enumerate(batch):
                n = w.end - w.begin
                inputs[row, :n] = ids[w.begin : w.end]
                mask[row, :n] = 1
                labels[row, w.score_from - w.begin : n] = ids[w.score_from : w.end]
            logits = model(input_ids=inputs.to(device), attention_mask=mask.to(device), use_cache=False).logits
            total_nll += next_token_nll(logits, labels.to(device)).sum().item()
            total_tokens += int((labels[:, 1:] != -100).sum())
    finally:
        model.train(was_training)
    return total_nll, total_tokens


def perplexity(
    model,
    tokenizer,
    texts: Sequence[str],
    *,
    max_length: int | None = None,
    stride: int | None = None,
    batch_size: int = 1,
    add_eos: bool = True,
    progress: bool = True,
) -> dict:
    """Perplexity of `model` on `texts` joined into one stream, with a sliding window.

    Each token after the first is scored once with up to `max_length - 1` tokens of context
    (see the module docstring). Returns {"perplexity", "mean_nll" (nats/token), "num_tokens"}.
    """
    ids = token_stream(tokenizer, texts, add_eos=add_eos)
    total_nll, num_tokens = stream_nll(
        model, ids, max_length=max_length, stride=stride, batch_size=batch_size, progress=progress
    )
    mean_nll = total_nll / num_tokens
    if not math.isfinite(mean_nll):
        logger.warning("Mean NLL is %s: the model produced non-finite logits", mean_nll)
    ppl = math.exp(mean_nll) if mean_nll < _MAX_LOG else math.inf
    return {"perplexity": ppl, "mean_nll": mean_nll, "num_tokens": num_tokens}
