"""Kept positions: K keys older than the window, chosen by how much their window attended to them.

A hybrid with `kept=K` scores exactly, beside the window (and the sinks), the K older positions
that rank highest by saliency, and sends every other older position through the finite state:

    saliency(s) = max over the queries t in [s, s + W - 1] and the query heads of the KV head of
                  softmax_{window(t)}(x_t)[s]      (the window-only softmax weight, sinks left out)
    rank(s)     = max(saliency(s), saliency(s - 1))

A key's saliency is final when it leaves the window, and so is its predecessor's. A key ranks with
its predecessor because what follows a salient token belongs to it: the last digit of a number,
the end of a name, which nothing attends to sharply (0 before the first position). For query t,
the kept set is the K keys of highest rank among the keys that have left the window (ties go to the
earlier position); sinks and padding are never kept. Keys outside the kept set enter the finite
state at the step they leave it: when they leave the window unkept, or later, when a higher-ranked
key displaces them. At most one key enters per step, so the finite-state part is causal linear attention over
a re-ordered stream of keys (with a decay, a key decays from its own entry step).

- `rank_scores`: the rank of each key from its saliency and its predecessor's.
- `kept_schedule`: the parallel (L x L) form, the reference of the others: the kept mask and
  each key's entry step, from all rank scores at once.
- `select_kept`: the chunked and recurrent form, block by block over the steps of a call: a block
  of C steps ranks the N <= K + C candidates (the kept slots in use and its C leaving keys) by one
  sort and counts, for each step, the arrived candidates above each one (`_outranked`; the pairwise
  comparison `_ranks_above` is its reference), so time and memory are O(L N) for L steps (and a
  sort of N per block), and the K keys, values, rank scores and positions are the state. Slots that
  cannot hold a kept key yet are left out (a call that starts empty compares at most the keys that
  have left its window so far, not K), and put back as empty slots at the end.
- `kept_step`: one step (decoding) in fewer operations, the same sets: the leaving key takes the
  weakest slot when it ranks above it (`ops.window_step` scores the kept keys with the window's).

Shapes: grouped q `[B, Hkv, G, L, D]`, keys `[B, Hkv, L, D]`, augmented values
`[B, Hkv, L, Dv + 1]`, saliencies `[B, Hkv, L]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_softmax_rnn.ops.window import masked_exp_part


def _ranks_above(scores: torch.Tensor, positions: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """`[..., N, N]` bool: candidate i ranks above j (a higher score, or an equal one and earlier)."""
    above = (scores[..., :, None] > scores[..., None, :]) | (
        (scores[..., :, None] == scores[..., None, :]) & (positions[..., :, None] < positions[..., None, :])
    )
    return above & candidate[..., :, None]


def rank_scores(saliency: torch.Tensor, first_predecessor: torch.Tensor) -> torch.Tensor:
    """`[B, Hkv, N]` rank(s) = max(saliency(s), saliency(s - 1)) of N consecutive keys, from their
    saliencies `[B, Hkv, N]` and the saliency `[B, Hkv]` of the key before the first (0 where none)."""
    preceding = torch.cat([first_predecessor[..., None], saliency[..., :-1]], -1)
    return torch.maximum(saliency, preceding)


def kept_schedule(
    ranking: torch.Tensor, candidate: torch.Tensor, window: int, kept: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept keys of every query and the step at which each key enters the finite state.

    Args:
        ranking: `[B, Hkv, L]` the rank score of every key (`rank_scores`; queries at every position).
        candidate: `[B, L]` bool: the key may be kept (visible and not a sink).
        window: W; kept: K.

    Returns:
        (`[B, Hkv, L, L]` bool: key s is kept for the query at t, `[B, Hkv, L]` long: the step at which
        key s enters the finite state (s + W when it is never kept; L or more when it is still kept at
        the last query)).
    """
    length = ranking.shape[-1]
    positions = torch.arange(length, device=ranking.device)
    allowed = candidate[:, None, :].expand_as(ranking)
    above = _ranks_above(ranking, positions.expand_as(ranking), allowed)  # [B, Hkv, i, s]
    outranked = above.long().cumsum(-2)  # [B, Hkv, i, s]: candidates <= i that rank above s
    left = positions[:, None] - window  # the last key out of the window at query t
    rows = outranked[..., left.clamp_min(0).squeeze(-1), :]  # [B, Hkv, t, s]
    out_of_window = positions[None, :] <= left
    kept_mask = allowed[..., None, :] & out_of_window & (rows < kept)
    entry = positions + window + kept_mask.long().sum(-2)
    return kept_mask, entry


@dataclass
class KeptSelection:
    """What `select_kept` returns: the finite state's entering stream, the exact part over the kept
    keys and the kept buffers after the call.

    `keys` `[B, Hkv, L, D]`, `values` `[B, Hkv, L, Dv + 1]`: the key entering the finite state at each
    step (zeros where none does). `numerator` `[B, Hkv, G, L, Dv + 1]` and `row_max` `[B, Hkv, G, L, 1]`:
    sum over the kept keys of e^{x - m} [v, 1] and m (-inf where a query has no kept key). The buffers
    `kept_keys`, `kept_values`, `kept_scores`, `kept_positions`, `kept_valid` are `[B, Hkv, K, ...]`.
    """

    keys: torch.Tensor
    values: torch.Tensor
    numerator: torch.Tensor
    row_max: torch.Tensor
    kept_keys: torch.Tensor
    kept_values: torch.Tensor
    kept_scores: torch.Tensor
    kept_positions: torch.Tensor
    kept_valid: torch.Tensor


def select_kept(
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


def kept_step(
    leaving_key: torch.Tensor,
    leaving_value: torch.Tensor,
    leaving_score: torch.Tensor,
    leaving_position: torch.Tensor,
    candidate: torch.Tensor,
    buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """One step of the selection (decoding): the leaving key takes the slot of the lowest-ranked kept
    key (an empty slot first) when it ranks above it, and the displaced key enters the finite state;
    otherwise the leaving key enters. The same sets as `select_kept`; the slots may hold them in
    another order.

    Args:
        leaving_key, leaving_value: `[B, Hkv, 1, D]`, `[B, Hkv, 1, Dv + 1]`; leaving_score `[B, Hkv, 1]`;
            leaving_position `[B, 1]`; candidate `[B, 1]` bool; buffers: as `select_kept` takes them.
        in_place: write the one slot that changes into the buffers themselves (decoding without
            autograd) instead of into copies.

    Returns:
        (the key `[B, Hkv, 1, D]` and value `[B, Hkv, 1, Dv + 1]` entering the finite state (zero value
        where none does), the five buffers after the step).
    """
    keys, values, scores, positions, valid = buffers
    ranked = torch.where(valid, scores, torch.full_like(scores, -torch.inf))
    ties = ranked == ranked.amin(-1, keepdim=True)  # the empty slots if any, else the lowest rank
    lowest = torch.iinfo(positions.dtype).min  # below every position, -1 (nothing left the window) included
    weakest = positions.masked_fill(~ties, lowest).argmax(-1, keepdim=True)  # [B, Hkv, 1]: of equals, the latest
    held = valid.gather(-1, weakest)
    held_score = scores.gather(-1, weakest)
    takes = candidate[:, None, :] & (~held | (leaving_score > held_score))  # [B, Hkv, 1]
    rows = weakest[..., None]
    held_key = keys.gather(2, rows.expand(-1, -1, -1, keys.shape[-1]))
    held_value = values.gather(2, rows.expand(-1, -1, -1, values.shape[-1]))
    slot = (
        torch.where(takes[..., None], leaving_key, held_key),
        torch.where(takes[..., None], leaving_value, held_value),
        torch.where(takes, leaving_score, held_score),
        torch.where(takes, leaving_position[:, None, :], positions.gather(-1, weakest)),
        takes | held,
    )
    indices = (rows.expand_as(held_key), rows.expand_as(held_value), weakest, weakest, weakest)
    buffers = tuple(
        buffer.scatter_(2, index, new) if in_place else buffer.scatter(2, index, new)
        for buffer, index, new in zip(buffers, indices, slot)
    )
    entering_key = torch.where(takes[..., None], held_key, leaving_key)
    entering_value = torch.where(takes[..., None], held_value * held[..., None], leaving_value)
    return entering_key, entering_value, buffers
