"""The block-by-block statement of `ops.kept.select_kept`: a loop over blocks of C steps, each ranking
the N <= K + C candidates (the kept slots in use and its C leaving keys) by one sort and counting, for
each step, the arrived candidates above each one. The library's form computes every key's exit step
at once; this one is its reference in the tests (outputs, entering stream and kept sets)."""

from __future__ import annotations

import torch

from hf_softmax_rnn.ops.kept import KeptSelection
from hf_softmax_rnn.ops.window import masked_exp_part


def select_kept_blockwise(
    q: torch.Tensor,
    leaving_keys: torch.Tensor,
    leaving_values: torch.Tensor,
    leaving_scores: torch.Tensor,
    leaving_positions: torch.Tensor,
    candidate: torch.Tensor,
    buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    scale: float,
    block: int,
) -> KeptSelection:
    """The kept keys of each step of a call, block by block.

    Args:
        q: grouped queries `[B, Hkv, G, L, D]`; the query of step r sees the keys kept after key r left.
        leaving_keys, leaving_values: `[B, Hkv, L, D]`, `[B, Hkv, L, Dv + 1]`: the key that leaves the
            window at each step; leaving_scores `[B, Hkv, L]` its rank score; leaving_positions
            `[B, L]` its visible rank (for ties); candidate `[B, L]` bool: it may be kept.
        buffers: (keys `[B, Hkv, K, D]`, values `[B, Hkv, K, Dv + 1]`, scores `[B, Hkv, K]`, positions
            `[B, Hkv, K]` long, valid `[B, Hkv, K]` bool) kept before the call.
        scale: multiplier of q.k; block: steps per block C.
    """
    kept = buffers[0].shape[2]
    slots_after = _slots_in_use(buffers[4], candidate, kept)
    keys, values, scores, positions, valid = (x[:, :, : slots_after[0]] for x in buffers)
    kv_heads, length = q.shape[1], q.shape[3]
    entering_keys, entering_values, numerators, maxima = [], [], [], []
    for start in range(0, length, block):
        steps = slice(start, min(start + block, length))
        size, slots = steps.stop - start, keys.shape[2]
        cand_keys = torch.cat([keys, leaving_keys[..., steps, :]], dim=2)
        cand_values = torch.cat([values, leaving_values[..., steps, :]], dim=2)
        cand_scores = torch.cat([scores, leaving_scores[..., steps]], dim=2)
        cand_positions = torch.cat([positions, leaving_positions[:, None, steps].expand(-1, kv_heads, -1)], dim=2)
        cand_valid = torch.cat([valid, candidate[:, None, steps].expand(-1, kv_heads, -1)], dim=2)
        arrival = torch.cat(
            [torch.full((slots,), -1, device=q.device), torch.arange(size, device=q.device)]
        )  # the step of the block from which a candidate has left the window
        arrived = arrival[None, :] <= torch.arange(size, device=q.device)[:, None]  # [C, N]
        # candidates arrived by step c that rank above j: every slot, and the leaving keys up to c
        outranked = _outranked(cand_scores, cand_positions, cand_valid, arrival, size)  # [B, Hkv, C, N]
        is_kept = cand_valid[:, :, None, :] & arrived & (outranked < kept)  # [B, Hkv, C, N]
        before = torch.cat([(cand_valid & (arrival < 0))[:, :, None, :], is_kept[:, :, :-1]], dim=2)
        arriving = arrival[None, :] == torch.arange(size, device=q.device)[:, None]
        enters = (cand_valid[:, :, None, :] & arrived & ~is_kept & (before | arriving)).to(q.dtype)
        entering_keys.append(enters @ cand_keys)
        entering_values.append(enters @ cand_values)
        numerator, row_max = masked_exp_part(q[..., steps, :], cand_keys, cand_values, is_kept[:, :, None], scale)
        numerators.append(numerator)
        maxima.append(row_max)
        # the kept keys first, so the slots in use after the block hold them all
        order = torch.argsort((~is_kept[:, :, -1]).to(torch.uint8), dim=-1, stable=True)
        order = order[..., : slots_after[steps.stop]]
        keys, values = (
            cand_keys.gather(2, order[..., None].expand(-1, -1, -1, cand_keys.shape[-1])),
            cand_values.gather(2, order[..., None].expand(-1, -1, -1, cand_values.shape[-1])),
        )
        scores, positions = cand_scores.gather(2, order), cand_positions.gather(2, order)
        valid = is_kept[:, :, -1].gather(2, order)
    empty = kept - keys.shape[2]
    keys, values, scores, positions, valid = (
        torch.nn.functional.pad(x, (0, 0, 0, empty) if x.dim() == 4 else (0, empty))
        for x in (keys, values, scores, positions, valid)
    )
    return KeptSelection(
        keys=torch.cat(entering_keys, dim=2),
        values=torch.cat(entering_values, dim=2),
        numerator=torch.cat(numerators, dim=3),
        row_max=torch.cat(maxima, dim=3),
        kept_keys=keys,
        kept_values=values,
        kept_scores=scores,
        kept_positions=positions,
        kept_valid=valid,
    )


def _outranked(
    scores: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, arrival: torch.Tensor, steps: int
) -> torch.Tensor:
    """`[B, Hkv, C, N]` how many valid candidates that have arrived by step c rank above candidate j
    (`_ranks_above`: a higher score, or an equal one and an earlier position), from the scores,
    positions and validity `[B, Hkv, N]` of the candidates and the step `[N]` from which each has
    arrived (-1: before the block; C = `steps`). The candidates are sorted once by rank and each
    counts those before it: O(N (C + log N)) time and memory, where comparing every pair is O(N^2)."""
    by_position = positions.argsort(dim=-1, stable=True)
    by_rank = scores.gather(-1, by_position).argsort(dim=-1, descending=True, stable=True)
    order = by_position.gather(-1, by_rank)  # [B, Hkv, N]: the candidates from the highest rank down
    arrived = arrival[order][..., None] <= torch.arange(steps, device=scores.device)  # [B, Hkv, N, C]
    counted = (arrived & valid.gather(-1, order)[..., None]).to(torch.int32)
    above = counted.cumsum(-2, dtype=torch.int32) - counted  # those sorted before each candidate
    return torch.empty_like(above).scatter_(-2, order[..., None].expand_as(above), above).mT


def _slots_in_use(valid: torch.Tensor, candidate: torch.Tensor, kept: int) -> list[int]:
    """How many leading slots can hold a kept key: before the call (one past the last slot of `valid`
    `[B, Hkv, K]` valid in any row), then after each step r of the call (that, plus the most candidates
    `[B, L]` any row has had up to r, at most K). One read back from the device."""
    used = valid.flatten(0, 1).any(0)
    filled = (used * torch.arange(1, kept + 1, device=valid.device)).amax()
    arrived = candidate.long().cumsum(-1).amax(0)  # [L]
    return torch.cat([filled[None], (filled + arrived).clamp_max(kept)]).tolist()
