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
- `select_kept`: the chunked form, every step of a call at once. A key stays kept until K valid keys
  that rank above it have arrived, so one sort of the call's keys (and the K kept before it) by rank,
  and counts over that order at the end of each block of C steps and then within a block, give each
  key the step at which it leaves the kept set (`_exit_steps`, no autograd; O((K + L)(L / C + C))
  memory). The exact part of each block of C queries then scores the keys kept at the block's start
  and its C leaving keys, all blocks in one batched product; the key entering the finite state at a
  step is the one whose exit step it is. A few hundred operations per call whatever its length (on a
  GPU, kernel launches), and no read back from the device. The K keys, values, rank scores and
  positions are the state, the kept keys first, in the order they arrived.
- `kept_step`: one step (decoding) in fewer operations, the same sets: the leaving key takes the
  weakest slot when it ranks above it (`ops.window_step` scores the kept keys with the window's).

Shapes: grouped q `[B, Hkv, G, L, D]`, keys `[B, Hkv, L, D]`, augmented values
`[B, Hkv, L, Dv + 1]`, saliencies `[B, Hkv, L]`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hf_softmax_rnn.ops.window import blocked_exp, flash_applies, flash_block_part, per_query, query_blocks


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
    sum over the kept keys of e^{x - m} [v, 1] and m (-inf where a query has no kept key; with `any_shift`
    m may be the log-sum-exp instead of the row max). The buffers
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
    held_before: int | None = None,
    first_candidate: int = 0,
    any_shift: bool = False,
    softcap: float | None = None,
) -> KeptSelection:
    """The kept keys of each step of a call, every step at once.

    The pool is the K kept keys before the call (arrived at step -1) and the L keys that leave the window
    during it (key r at step r). `_exit_steps` gives each pool key the step at which it stops being kept
    (without autograd); key j is then kept at step t when it is a candidate, arrived_j <= t < exit_j, and
    enters the finite state at exit_j. The exact part of the queries of each block of C steps scores the
    keys kept at the block's start and its C leaving keys, one batched product per group of blocks
    (`_slot_groups`).

    Args:
        q: grouped queries `[B, Hkv, G, L, D]`; the query of step r sees the keys kept after key r left.
        leaving_keys: `[B, Hkv, L, D]`: the key that leaves the window at each step.
        leaving_values: `[B, Hkv, L, Dv + 1]`: its value.
        leaving_scores: `[B, Hkv, L]`: its rank score.
        leaving_positions: `[B, L]`: its visible rank (for ties).
        candidate: `[B, L]` bool: it may be kept.
        buffers: (keys `[B, Hkv, K, D]`, values `[B, Hkv, K, Dv + 1]`, scores `[B, Hkv, K]`, positions
            `[B, Hkv, K]` long, valid `[B, Hkv, K]` bool) kept before the call.
        scale: multiplier of q.k.
        block: steps per block C.
        held_before: at most this many keys are kept before the call (0 from an empty state; None: K).
        first_candidate: no leaving key before this step is a candidate (W from an empty state: the
            first W leaving keys are its empty window buffer). Both are bounds only: a block then scores
            about as many slots as it can hold at most (`_slot_groups`), instead of K.
        any_shift: `row_max` may be any per-row shift (the caller's normaliser divides by the
            denominator): the log-sum-exp of the fused CPU kernel where it applies (`ops.window`).
        softcap: the cap of the kept keys' scores (`ops.kernels.soft_cap`), None for none.
    """
    batch, kv_heads, length = q.shape[0], q.shape[1], q.shape[3]
    kept = buffers[0].shape[2]
    block = max(1, min(block, length))
    blocks = -(-length // block)
    keys = torch.cat([buffers[0], leaving_keys], dim=2)  # the pool [B, Hkv, P = K + L, ...]
    values = torch.cat([buffers[1], leaving_values], dim=2)
    scores = torch.cat([buffers[2], leaving_scores], dim=2)
    positions = torch.cat([buffers[3], leaving_positions[:, None, :].expand(-1, kv_heads, -1)], dim=2)
    valid = torch.cat([buffers[4], candidate[:, None, :].expand(-1, kv_heads, -1)], dim=2)
    pool = torch.arange(kept + length, device=q.device)
    arrival = (pool - kept).clamp_min(-1)  # the kept keys before the call at -1, key r at r
    with torch.no_grad():
        exits = _exit_steps(scores, positions, valid, arrival, kept, block, length)
    numerators, maxima = [], []
    for first, stop, slots in _slot_groups(blocks, block, kept, held_before, first_candidate):
        steps = torch.arange(first * block, stop * block, device=q.device).view(stop - first, block)
        index, is_kept = _block_candidates(steps, slots, valid, arrival, exits, pool, kept, length)
        numerator, row_max = _blocked_exact_part(
            q[..., first * block : stop * block, :],
            _rows(keys, index),
            _rows(values, index),
            is_kept,
            scale,
            stop - first,
            block,
            any_shift,
            softcap,
        )
        numerators.append(numerator)
        maxima.append(row_max)
    numerator, row_max = torch.cat(numerators, dim=3), torch.cat(maxima, dim=3)
    # at most one key enters the finite state per step: the one whose exit it is
    enters_at = torch.where(valid & (exits < length), exits, length)
    entering = torch.full((batch, kv_heads, length + 1), kept + length, device=q.device, dtype=torch.long)
    entering.scatter_(-1, enters_at, pool.expand(batch, kv_heads, -1))
    entering = entering[..., :length]
    stays = valid & (exits >= length)
    final = torch.where(stays, -pool.float(), float("-inf")).topk(kept, dim=-1)
    final_valid = final.values > float("-inf")
    final_index = final.indices

    def kept_after(x: torch.Tensor) -> torch.Tensor:  # the pool's rows at the final slots, zero where empty
        if x.dim() == 3:
            return torch.where(final_valid, x.gather(2, final_index), torch.zeros((), dtype=x.dtype, device=x.device))
        rows = _rows(x, final_index)
        return rows * final_valid[..., None].to(rows.dtype)

    return KeptSelection(
        keys=_rows(F.pad(keys, (0, 0, 0, 1)), entering),  # a zero row at P: no key enters
        values=_rows(F.pad(values, (0, 0, 0, 1)), entering),
        numerator=numerator,
        row_max=row_max,
        kept_keys=kept_after(keys),
        kept_values=kept_after(values),
        kept_scores=kept_after(scores),
        kept_positions=kept_after(positions),
        kept_valid=final_valid,
    )


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The rows of `x` `[B, Hkv, P, X]` at `index` `[B, Hkv, ...]` (pool positions) -> `[B, Hkv, ..., X]`."""
    flat = index.flatten(2)[..., None].expand(-1, -1, -1, x.shape[-1])
    return x.gather(2, flat).view(*index.shape, x.shape[-1])


def _slot_groups(
    blocks: int, block: int, kept: int, held_before: int | None, first_candidate: int
) -> list[tuple[int, int, int]]:
    """(first block, stop block, slots) runs of consecutive blocks that hold at most `slots` kept keys at
    their start: min(K, held_before + the candidates that can have arrived), rounded up to 2^k or
    3 * 2^(k - 2) (at most K, a third more than needed at worst), so that a call from an empty state runs
    a few products of growing width."""
    held_before = kept if held_before is None else held_before
    groups: list[tuple[int, int, int]] = []
    for index in range(blocks):
        bound = min(kept, held_before + max(0, index * block - first_candidate))
        power = 1 << (bound - 1).bit_length() if bound else 0
        slots = min(kept, power * 3 // 4 if 4 <= power and bound <= power * 3 // 4 else power)
        if groups and groups[-1][2] == slots:
            groups[-1] = (groups[-1][0], index + 1, slots)
        else:
            groups.append((index, index + 1, slots))
    return groups


def _block_candidates(
    steps: torch.Tensor,
    slots: int,
    valid: torch.Tensor,
    arrival: torch.Tensor,
    exits: torch.Tensor,
    pool: torch.Tensor,
    kept: int,
    length: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For blocks of steps `[n, C]`: the pool indices `[B, Hkv, n, slots + C]` of each block's candidates
    (the keys kept at its start, compacted into `slots` slots in pool order, then its own C leaving
    keys) and `[B, Hkv, n, C, slots + C]` bool: candidate j is kept at step c of the block."""
    batch, kv_heads, _ = valid.shape
    own = (kept + steps).clamp_max(kept + length - 1).expand(batch, kv_heads, -1, -1)
    own_valid = valid.gather(-1, own.flatten(2)).view(own.shape) & (steps < length)
    if slots:
        starts = steps[:, :1] - 1  # [n, 1]: the step before each block
        held = valid[:, :, None, :] & (arrival <= starts) & (exits[:, :, None, :] > starts)  # [B, Hkv, n, P]
        slot_order = torch.where(held, -pool.float(), float("-inf")).topk(slots, dim=-1)  # in pool order
        index = torch.cat([slot_order.indices, own], dim=-1)
        is_candidate = torch.cat([slot_order.values > float("-inf"), own_valid], dim=-1)
    else:
        index, is_candidate = own, own_valid
    step = steps[..., None]  # [n, C, 1]
    is_kept = (
        is_candidate[..., None, :]
        & (arrival[index][..., None, :] <= step)
        & (step < exits.gather(-1, index.flatten(2)).view(index.shape)[..., None, :])
    )
    return index, is_kept


def _exit_steps(
    scores: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    arrival: torch.Tensor,
    kept: int,
    block: int,
    length: int,
) -> torch.Tensor:
    """`[B, Hkv, P]` long: the step at which each pool key stops being kept, from the pool's rank scores,
    positions and validity `[B, Hkv, P]` and arrival steps `[P]` (-1: before the call).

    Key j is kept while fewer than K valid keys that rank above it (`_ranks_above`) have arrived, so it
    exits at max(arrival_j, a_j), a_j the arrival of the K-th such key (at least `length` when there is
    none). The pool is sorted once by rank; then the keys above each one are those sorted before it. A
    count at each block's end, over the sorted pool, finds the block of a_j; a count over that block's
    C steps finds the step: O(P (L / C + C)) memory, one pass of batched operations."""
    by_position = positions.argsort(dim=-1, stable=True)
    by_rank = scores.gather(-1, by_position).argsort(dim=-1, descending=True, stable=True)
    order = by_position.gather(-1, by_rank)  # [B, Hkv, P]: the pool from the highest rank down
    ranks = torch.arange(order.shape[-1], device=order.device)
    sorted_at = torch.empty_like(order).scatter_(-1, order, ranks.expand_as(order))  # each key's place in it
    sorted_arrival, sorted_valid = arrival[order], valid.gather(-1, order)
    blocks = -(-length // block)
    ends = (torch.arange(blocks + 1, device=order.device) * block - 1).clamp_max(length - 1)  # -1, then each block's
    arrived = (sorted_arrival[..., None, :] <= ends[:, None]) & sorted_valid[..., None, :]  # [B, Hkv, blocks + 1, P]
    counted = arrived.to(torch.int32)
    del arrived
    above = counted.cumsum(-1, dtype=torch.int32).sub_(counted)  # arrived valid keys ranked above, by each end
    del counted
    exit_block = (above < kept).sum(-2)  # 0: K were above before the call; blocks + 1: never K
    within = (exit_block - 1).clamp(0, blocks - 1)  # the block in which the K-th arrives
    start = within * block
    block_steps = start[..., None] + torch.arange(block, device=order.device)  # [B, Hkv, P, C]
    members = (kept + block_steps).clamp_max(order.shape[-1] - 1).flatten(-2)
    ranked_above = sorted_at.gather(-1, members).view(block_steps.shape) < ranks[:, None]
    hits = ranked_above & valid.gather(-1, members).view(block_steps.shape) & (block_steps < length)
    before = above.gather(-2, (exit_block - 1).clamp(0, blocks)[..., None, :]).squeeze(-2)
    step = start + (hits.to(torch.int32).cumsum(-1) < (kept - before)[..., None]).sum(-1)
    kth = torch.where(exit_block == 0, -1, torch.where(exit_block > blocks, length, step))
    exits_sorted = torch.where(sorted_valid, torch.maximum(sorted_arrival, kth), sorted_arrival)
    return torch.empty_like(exits_sorted).scatter_(-1, order, exits_sorted)


def _blocked_exact_part(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    visible: torch.Tensor,
    scale: float,
    blocks: int,
    block: int,
    any_shift: bool = False,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`masked_exp_part` of each block of C queries over its own N keys, all blocks in one product (with
    `any_shift` and no `softcap`, through the fused CPU kernel where it applies, under the log-sum-exp): q
    `[B, Hkv, G, L, D]`, keys `[B, Hkv, blocks, N, D]`, values `[B, Hkv, blocks, N, Dv + 1]`, visible
    `[B, Hkv, blocks, C, N]` -> (`[B, Hkv, G, L, Dv + 1]` numerator, `[B, Hkv, G, L, 1]` row max)."""
    batch, kv_heads, groups, length, _ = q.shape
    if any_shift and softcap is None and flash_applies(q, keys, values):
        numerator, shift = flash_block_part(query_blocks(q, blocks, block), keys, values, visible, scale)
        return per_query(numerator, groups, length), per_query(shift, groups, length)
    seen = visible[:, :, :, None]  # [B, Hkv, blocks, 1, C, N]
    weights, shift = blocked_exp(query_blocks(q, blocks, block), keys.mT, seen, scale, groups, softcap)
    weights = weights.view(batch, kv_heads, blocks, groups * block, -1)
    shift = shift.masked_fill(~seen.any(-1, keepdim=True), float("-inf"))
    return per_query(weights @ values, groups, length), per_query(shift, groups, length)


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
    ranked = scores.masked_fill(~valid, -torch.inf)
    lowest = ranked.amin(-1, keepdim=True)  # -inf while a slot is empty
    latest = torch.iinfo(positions.dtype).min  # below every position, -1 (nothing left the window) included
    weakest = positions.masked_fill(ranked != lowest, latest).argmax(-1, keepdim=True)  # [B, Hkv, 1]: the latest
    takes = candidate.unsqueeze(1) & (leaving_score > lowest)  # [B, Hkv, 1] (an empty slot: always, a rank is finite)
    held = valid.gather(-1, weakest)
    rows = weakest.unsqueeze(-1)
    held_key = keys.gather(2, rows.expand(-1, -1, -1, keys.shape[-1]))
    held_value = values.gather(2, rows.expand(-1, -1, -1, values.shape[-1]))
    takes_row = takes.unsqueeze(-1)
    slot = (
        torch.where(takes_row, leaving_key, held_key),
        torch.where(takes_row, leaving_value, held_value),
        torch.where(takes, leaving_score, scores.gather(-1, weakest)),
        torch.where(takes, leaving_position.unsqueeze(1), positions.gather(-1, weakest)),
        takes | held,
    )
    indices = (rows.expand_as(held_key), rows.expand_as(held_value), weakest, weakest, weakest)
    buffers = tuple(
        write_slots(buffer, 2, index, new, in_place) for buffer, index, new in zip(buffers, indices, slot, strict=True)
    )
    entering_key = torch.where(takes_row, held_key, leaving_key)
    entering_value = torch.where(takes_row, held_value * held.unsqueeze(-1), leaving_value)
    return entering_key, entering_value, buffers


def write_slots(buffer: torch.Tensor, dim: int, index: torch.Tensor, new, in_place: bool) -> torch.Tensor:
    """`buffer` with `new` (a tensor shaped as `index`, or a number) written at `index` along `dim`: into
    `buffer` itself when `in_place` (decoding without autograd: one write of the slots), else into a copy.
    `index` names one slot per position of the dimensions before `dim` (it is constant along the others).

    Under torch.compile an in-place write is an `index_put_`, which the compiler keeps in place on a
    cache's buffer (a `scatter_` there becomes a copy of the whole buffer and a copy back, each step)."""
    if not in_place:
        return buffer.scatter(dim, index, new)
    if not torch.compiler.is_compiling():
        return buffer.scatter_(dim, index, new)
    slots = index[(slice(None),) * dim + (0,) * (index.dim() - dim)]  # buffer.shape[:dim]
    leading = [
        torch.arange(size, device=buffer.device).view(-1, *[1] * (dim - 1 - axis))
        for axis, size in enumerate(buffer.shape[:dim])
    ]
    if isinstance(new, torch.Tensor):
        new = new.select(dim, 0)
    else:
        new = torch.full((), new, dtype=buffer.dtype, device=buffer.device)
    return buffer.index_put_((*leading, slots), new)


def exchange_slots(
    buffer: torch.Tensor, dim: int, index: torch.Tensor, new: torch.Tensor, in_place: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rows of `buffer` at `index`, `buffer` with `new` written there, as `write_slots` writes it).

    Under torch.compile the written rows are made to depend on the rows read (`new` wherever the index
    is valid, i.e. always), so that the compiler cannot move the read after the write: a read of the
    buffer after its in-place write makes it copy the whole buffer instead."""
    old = buffer.gather(dim, index)
    if in_place and torch.compiler.is_compiling():
        new = torch.where(index >= 0, new, old)
    return old, write_slots(buffer, dim, index, new, in_place)
