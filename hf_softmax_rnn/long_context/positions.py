"""Perplexity by position: how well a model predicts a token given how many tokens precede it.

Each evaluation sequence of `length` tokens (the end of the last bucket) is scored in one
forward pass from position 0, without a cache (`use_cache=False`; finite-state layers of a
converted model run in the chunked mode, whose memory does not grow with the length). The token
at position t (t >= 1) is predicted from the t tokens before it; its negative log-likelihood
goes to the bucket `[start, end)` holding t (position 0 has no context and is never scored, so
the bucket (0, 64) holds 63 tokens of each sequence). The logits are never materialised for the
whole sequence: the decoder's hidden states go through the output layer a slice at a time.

Sequences come from the texts one per document (its first `length` tokens; the default), or from
the texts joined into one stream (each text followed by EOS) cut into consecutive pieces.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm

from hf_softmax_rnn.attention_spec import NO_CACHE_MODES
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.evaluation import check_texts, check_within_positions, max_positions
from hf_softmax_rnn.layers import softmax_rnn_attention_modules

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS = ((0, 64), (64, 256), (256, 1024), (1024, 2048), (2048, 4096), (4096, 8192))
#: Positions whose logits are computed at once from the hidden states (memory: slice x vocabulary).
DEFAULT_SLICE = 512


def check_buckets(buckets: Sequence[Sequence[int]]) -> tuple[tuple[int, int], ...]:
    """`buckets` as int pairs, checked: each `0 <= start < end`, sorted and not overlapping."""
    pairs = []
    for bucket in buckets:
        if (
            not isinstance(bucket, (tuple, list))
            or len(bucket) != 2
            or not all(isinstance(value, int) and not isinstance(value, bool) for value in bucket)
        ):
            raise UserInputError(f"bucket {bucket!r} is not allowed; expected a pair of ints (start, end)")
        start, end = bucket
        if not 0 <= start < end:
            raise UserInputError(f"bucket {tuple(bucket)} is not allowed; expected 0 <= start < end")
        if end < 2:
            raise UserInputError(
                f"bucket {tuple(bucket)} holds no scored position (position 0 has no context and is never scored); "
                "expected an end >= 2"
            )
        if pairs and start < pairs[-1][1]:
            raise UserInputError(
                f"bucket {tuple(bucket)} starts before the previous bucket {pairs[-1]} ends; expected sorted, "
                "non-overlapping buckets"
            )
        pairs.append((start, end))
    if not pairs:
        raise UserInputError("buckets=() is not allowed; expected at least one (start, end) pair")
    return tuple(pairs)


def buckets_from_edges(edges: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Contiguous buckets between consecutive `edges`, e.g. (0, 64, 256) -> ((0, 64), (64, 256))."""
    if len(edges) < 2 or any(later <= earlier for earlier, later in itertools.pairwise(edges)):
        raise UserInputError(
            f"bucket edges {list(edges)} are not allowed; expected at least two strictly increasing positions"
        )
    return check_buckets(list(itertools.pairwise(edges)))


def check_count(name: str, value: int | None, minimum: int = 1) -> None:
    """Refuse a `value` (None passes) that is not an int >= `minimum`."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < minimum):
        raise UserInputError(f"{name}={value!r} is not allowed; expected an int >= {minimum}")


def check_flag(name: str, value: bool) -> None:
    """Refuse a `value` that is not a bool (a string such as "no" would read as true)."""
    if not isinstance(value, bool):
        raise UserInputError(f"{name}={value!r} is not allowed; expected True or False")


def check_scoring_mode(mode: str | None) -> None:
    """Refuse a no-cache mode of the finite-state layers other than None (as configured) or NO_CACHE_MODES."""
    if mode is not None and mode not in NO_CACHE_MODES:
        raise UserInputError(
            f"attention_mode={mode!r} is not allowed; expected None (as configured) or one of {NO_CACHE_MODES}"
        )


def checked_sequences(
    models: Sequence,
    tokenizer,
    texts: Sequence[str],
    buckets: Sequence[Sequence[int]],
    *,
    num_sequences: int | None,
    join: bool,
    attention_mode: str | None,
    slice_size: int,
    past_max_positions: bool,
) -> tuple[tuple[tuple[int, int], ...], torch.Tensor]:
    """The arguments of a measure by position bucket checked against every model of `models`, before
    any runs: the buckets as int pairs and the evaluation sequences `[N, L]` (`eval_sequences`; L: the
    end of the last bucket)."""
    buckets = check_buckets(buckets)
    check_count("slice_size", slice_size)
    check_scoring_mode(attention_mode)
    length = buckets[-1][1]
    for model in models:
        check_within_positions(model, length, "bucket end", past_max_positions=past_max_positions)
    return buckets, eval_sequences(tokenizer, texts, length, num_sequences=num_sequences, join=join)


def eval_sequences(
    tokenizer, texts: Sequence[str], length: int, *, num_sequences: int | None = None, join: bool = False
) -> torch.Tensor:
    """Token ids `[N, length]` from `texts` (one per document, or joined with EOS when `join`);
    documents are tokenised only until `num_sequences` sequences are filled (None: all of them)."""
    check_texts(texts)
    check_count("num_sequences", num_sequences)
    check_flag("join", join)
    eos = [tokenizer.eos_token_id] if join and tokenizer.eos_token_id is not None else []
    sequences, stream, seen = [], [], 0
    for index, text in enumerate(texts):
        if num_sequences is not None and len(sequences) == num_sequences:
            break
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        seen += len(ids)
        if not join:
            if len(ids) < length:
                raise UserInputError(
                    f"evaluation text {index} has {len(ids)} tokens, fewer than the {length} positions the buckets "
                    "ask for; pass longer texts, join them into one stream, or end the buckets earlier"
                )
            sequences.append(ids[:length])
            continue
        stream += ids + eos
        while len(stream) >= length and (num_sequences is None or len(sequences) < num_sequences):
            sequences.append(stream[:length])
            stream = stream[length:]
    wanted = num_sequences or 1
    if len(sequences) < wanted:
        raise UserInputError(
            f"the evaluation texts hold {seen} tokens: {len(sequences)} sequences of {length} tokens (the end of the "
            f"last bucket), fewer than the {wanted} asked for; pass longer texts, fewer sequences or smaller buckets"
        )
    return torch.tensor(sequences, dtype=torch.long)


@contextmanager
def no_cache_mode(model, mode: str | None) -> Iterator[None]:
    """Run the finite-state layers of a converted model in `mode` ("parallel" or "chunked"; None:
    as configured) without a cache, restoring each layer's mode afterwards."""
    layers = [m for m in softmax_rnn_attention_modules(model) if m.uses_recurrent_state] if mode else []
    saved = [layer.attention_mode for layer in layers]
    for layer in layers:
        layer.attention_mode = mode
    try:
        yield
    finally:
        for layer, previous in zip(layers, saved, strict=True):
            layer.attention_mode = previous


@contextmanager
def scoring(model, mode: str | None) -> Iterator[None]:
    """`model` in eval mode with its finite-state layers in `mode` (`no_cache_mode`), both restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        with no_cache_mode(model, mode):
            yield
    finally:
        model.train(was_training)


def logit_slices(model, input_ids: torch.Tensor, slice_size: int = DEFAULT_SLICE) -> Iterator[tuple[int, torch.Tensor]]:
    """Next-token logits of `input_ids` `[B, L]` at positions 0..L-2, `slice_size` positions at a time:
    yields `(start, logits [B, end - start, V])` in order (call under `torch.inference_mode`).

    The decoder (`model.base_model`) runs once, without a cache; its hidden states go through the
    output layer a slice at a time. A model without a separate decoder is sliced from `.logits`.
    """
    head = model.get_output_embeddings()
    decoder = model.base_model
    if head is None or decoder is model:
        hidden, head = model(input_ids=input_ids, use_cache=False).logits, None
    else:
        hidden = decoder(input_ids=input_ids, use_cache=False).last_hidden_state
    length = input_ids.shape[1]
    for start in range(0, length - 1, slice_size):
        part = hidden[:, start : min(start + slice_size, length - 1)]
        yield start, part if head is None else head(part)


@torch.inference_mode()
def token_nll(model, input_ids: torch.Tensor, *, slice_size: int = DEFAULT_SLICE) -> torch.Tensor:
    """NLL (nats, float64) of tokens 1..L-1 of `input_ids` `[B, L]` given those before -> `[B, L - 1]`
    (the logits a slice at a time: `logit_slices`)."""
    parts = []
    for start, logits in logit_slices(model, input_ids, slice_size):
        targets = input_ids[:, start + 1 : start + 1 + logits.shape[1]].to(logits.device)
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), targets.flatten(), reduction="none")
        parts.append(nll.view_as(targets))
    return torch.cat(parts, dim=1)


def bucket_values(values: torch.Tensor, bucket: tuple[int, int]) -> torch.Tensor:
    """The per-token values `[N, L - 1]` (column t - 1 = the token at position t) of the positions
    in `bucket` = `[start, end)`, flattened (position 0 has none)."""
    start, end = bucket
    return values[:, max(start, 1) - 1 : end - 1].flatten().double()


def mean_and_stderr(values: torch.Tensor) -> tuple[float, float]:
    """Mean of `values` and its standard error, the values taken as independent (NaN for one value)."""
    count = values.numel()
    return values.mean().item(), (values.std().item() / math.sqrt(count)) if count > 1 else math.nan


def bucket_statistics(nll: torch.Tensor, buckets: Sequence[tuple[int, int]]) -> list[dict]:
    """Per bucket of positions: tokens, mean NLL, its standard error and the perplexity, from the
    per-token NLL `[N, L - 1]` (column t - 1 = the token at position t)."""
    rows = []
    for start, end in buckets:
        values = bucket_values(nll, (start, end))
        mean, stderr = mean_and_stderr(values)
        rows.append(
            {
                "start": start,
                "end": end,
                "tokens": values.numel(),
                "mean_nll": mean,
                "stderr": stderr,
                "perplexity": math.exp(mean) if mean < 709 else math.inf,
            }
        )
    return rows


def position_perplexity(
    model,
    tokenizer,
    texts: Sequence[str],
    buckets: Sequence[Sequence[int]] = DEFAULT_BUCKETS,
    *,
    num_sequences: int | None = None,
    join: bool = False,
    attention_mode: str | None = "chunked",
    slice_size: int = DEFAULT_SLICE,
    progress: bool = True,
    past_max_positions: bool = False,
) -> dict:
    """Perplexity per position bucket of `model` on `texts` (see the module docstring).

    Args:
        buckets: sorted, non-overlapping `(start, end)` position ranges; the last end is the
            sequence length, at most the model's `max_position_embeddings` unless `past_max_positions`.
        num_sequences: sequences scored (None: every full sequence of the texts).
        join: take the start of each document (False) or join the texts into one stream (True).
        attention_mode: no-cache mode of a converted model's finite-state layers (None: as configured).
        past_max_positions: score positions past the model's `max_position_embeddings` too (how a model
            reads beyond the context it was trained for).

    Returns {"buckets": [{"start", "end", "tokens", "mean_nll", "stderr", "perplexity"}],
    "sequences", "sequence_length", "max_positions" (the model's max_position_embeddings or None),
    "tokens" (fed to the model), "seconds"}. The standard error
    is that of the mean over tokens taken as independent (neighbouring tokens are not, so it is a
    lower bound).
    """
    buckets, sequences = checked_sequences(
        [model],
        tokenizer,
        texts,
        buckets,
        num_sequences=num_sequences,
        join=join,
        attention_mode=attention_mode,
        slice_size=slice_size,
        past_max_positions=past_max_positions,
    )
    device = next(model.parameters()).device
    start = time.perf_counter()
    with scoring(model, attention_mode):
        nll = torch.cat(
            [
                token_nll(model, row[None].to(device), slice_size=slice_size).cpu()
                for row in tqdm(sequences, desc="Position perplexity", unit="seq", disable=not progress)
            ]
        )
    return {
        "buckets": bucket_statistics(nll, buckets),
        "sequences": len(sequences),
        "sequence_length": sequences.shape[1],
        "max_positions": max_positions(model),
        "tokens": sequences.numel(),
        "seconds": round(time.perf_counter() - start, 1),
    }
