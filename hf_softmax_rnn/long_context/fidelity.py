"""Agreement with the original by position: how far a model's next-token distributions are from a
reference model's (the one it was converted from) given the same tokens.

Perplexity says how well each model predicts the text; two models can score alike and still
disagree on many tokens. Here, for the token at position t (t >= 1) of each evaluation sequence,
both models predict it from the t tokens before it and two numbers are kept: the KL divergence
KL(reference || model) of the two next-token distributions (nats; 0 when they are equal) and
whether both put their largest probability on the same token (top-1 agreement). They are averaged
per position bucket like `position_perplexity`'s NLL, over the same sequences (one per document's
start, or the texts joined), each model run once per sequence without a cache.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.long_context.positions import (
    DEFAULT_BUCKETS,
    bucket_values,
    checked_sequences,
    logit_slices,
    mean_and_stderr,
    scoring,
)

#: Positions compared at once (memory: a few float64 tensors of slice x vocabulary).
DEFAULT_FIDELITY_SLICE = 256


def check_same_vocabulary(model, reference) -> None:
    """Refuse two models whose output layers do not score the same vocabulary."""
    sizes = [m.get_output_embeddings().weight.shape[0] for m in (model, reference)]
    if sizes[0] != sizes[1]:
        raise UserInputError(
            f"the model scores {sizes[0]} tokens and the reference {sizes[1]}; agreement compares next-token "
            "distributions over one vocabulary: pass the model it was converted from"
        )


@torch.inference_mode()
def token_divergence(
    model, reference, input_ids: torch.Tensor, *, slice_size: int = DEFAULT_FIDELITY_SLICE
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(reference || model) (nats, float64) and top-1 agreement (bool) of the next-token
    distributions at positions 0..L-2 of `input_ids` `[B, L]` -> two `[B, L - 1]` tensors on the CPU."""
    divergences, agreements = [], []
    for (_, logits), (_, reference_logits) in zip(
        logit_slices(model, input_ids.to(next(model.parameters()).device), slice_size),
        logit_slices(reference, input_ids.to(next(reference.parameters()).device), slice_size),
        strict=True,
    ):
        log_q = torch.log_softmax(logits.double(), dim=-1)
        log_p = torch.log_softmax(reference_logits.to(log_q.device).double(), dim=-1)
        divergences.append((log_p.exp() * (log_p - log_q)).sum(-1).cpu())
        agreements.append((log_p.argmax(-1) == log_q.argmax(-1)).cpu())
    return torch.cat(divergences, dim=1), torch.cat(agreements, dim=1)


def position_fidelity(
    model,
    reference,
    tokenizer,
    texts: Sequence[str],
    buckets: Sequence[Sequence[int]] = DEFAULT_BUCKETS,
    *,
    num_sequences: int | None = None,
    join: bool = False,
    attention_mode: str | None = "chunked",
    slice_size: int = DEFAULT_FIDELITY_SLICE,
    progress: bool = True,
    past_max_positions: bool = False,
) -> dict:
    """KL divergence from `reference` and top-1 agreement with it, per position bucket of `model` on
    `texts` (see the module docstring). Both models read the same token ids (from `tokenizer`: they
    must share it); the other arguments are those of `position_perplexity`.

    Returns {"buckets": [{"start", "end", "tokens", "kl", "kl_stderr", "top1_agreement"}],
    "sequences", "sequence_length", "tokens" (fed to each model), "seconds"}; `kl` is the mean
    KL(reference || model) in nats, `top1_agreement` the fraction of positions where both models'
    most likely next token is the same.
    """
    buckets, sequences = checked_sequences(
        [model, reference],
        tokenizer,
        texts,
        buckets,
        num_sequences=num_sequences,
        join=join,
        attention_mode=attention_mode,
        slice_size=slice_size,
        past_max_positions=past_max_positions,
    )
    check_same_vocabulary(model, reference)
    start = time.perf_counter()
    with scoring(model, attention_mode), scoring(reference, attention_mode):
        pairs = [
            token_divergence(model, reference, row[None], slice_size=slice_size)
            for row in tqdm(sequences, desc="Agreement with the reference", unit="seq", disable=not progress)
        ]
    divergence = torch.cat([kl for kl, _ in pairs])
    agreement = torch.cat([agree for _, agree in pairs])
    rows = []
    for bucket in buckets:
        kl, kl_stderr = mean_and_stderr(bucket_values(divergence, bucket))
        agree = bucket_values(agreement, bucket)
        rows.append(
            {
                "start": bucket[0],
                "end": bucket[1],
                "tokens": agree.numel(),
                "kl": kl,
                "kl_stderr": kl_stderr,
                "top1_agreement": agree.mean().item(),
            }
        )
    return {
        "buckets": rows,
        "sequences": len(sequences),
        "sequence_length": sequences.shape[1],
        "tokens": sequences.numel(),
        "seconds": round(time.perf_counter() - start, 1),
    }
