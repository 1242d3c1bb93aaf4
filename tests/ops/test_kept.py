"""Kept positions (`AttentionSpec.kept`) against a step-by-step simulation in float64.

The simulation walks the positions one at a time with explicit Python sets: it updates each
key's saliency with the window-only softmax of every query, ranks a key by the larger of its own
and its predecessor's saliency, keeps the K best keys that have left the window (ties to the
earlier position), records the step at which every other key enters the
finite state, and scores each query from those sets, one key at a time.
"""

import dataclasses
import math

import pytest
import torch

from hf_softmax_rnn import AttentionSpec
from hf_softmax_rnn.ops import attention
from hf_softmax_rnn.ops.kept import _ranks_above, _slot_groups, kept_schedule, select_kept
from hf_softmax_rnn.ops.window_step import window_in_order

from .helpers import as_params, gated, left_padding_mask, make_inputs, make_params, quiet_preset
from .kept_reference import _outranked, select_kept_blockwise
from .kernel_stand_ins import DispatchedOperations, WrittenBytes, use_stand_ins
from .test_window import _phi


def _kernel(q_t, k_s, spec, params, h, kv, scale):
    if spec.uses_taylor:
        x = scale * q_t @ k_s
        return sum(x**n / math.factorial(n) for n in range(spec.taylor_order + 1))
    hq = None if params.hedgehog_q is None else params.hedgehog_q[h]
    hk = None if params.hedgehog_k is None else params.hedgehog_k[kv]
    return scale * _phi(q_t, spec, hq) @ _phi(k_s, spec, hk)


def simulated_kept_attention(q, k, v, spec, params, mask, scale, log_decay=None, softcap=None):
    """Outputs `[B, H, L, D]` of a hybrid with kept positions, simulated one position at a time; with `softcap` c
    every exact score x (the window softmax that ranks the keys included) is c tanh(x / c), the kernel uncapped."""

    def exact_score(q_t, k_s):
        x = scale * q_t @ k_s
        return x if softcap is None else softcap * torch.tanh(x / softcap)

    batch, heads, length, head_dim = q.shape
    kv_heads = k.shape[1]
    groups, window = heads // kv_heads, spec.window
    out = torch.zeros_like(q)
    for b in range(batch):
        visible = [bool(mask[b, s]) for s in range(length)]
        rank = [sum(visible[:s]) for s in range(length)]
        sink = [visible[s] and spec.sinks is not None and rank[s] < spec.sinks for s in range(length)]
        candidate = [visible[s] and not sink[s] for s in range(length)]
        for kv in range(kv_heads):
            saliency = [0.0] * length
            kept_sets, entry = [], {}
            for t in range(length):
                near = [s for s in range(max(0, t - window + 1), t + 1) if candidate[s]]
                if visible[t] and near:
                    for h in range(kv * groups, (kv + 1) * groups):
                        weights = torch.softmax(torch.stack([exact_score(q[b, h, t], k[b, kv, s]) for s in near]), 0)
                        for s, p in zip(near, weights.tolist(), strict=True):
                            saliency[s] = max(saliency[s], p)
                left = [s for s in range(0, t - window + 1) if candidate[s]]
                rank = {s: max(saliency[s], saliency[s - 1] if s > 0 else 0.0) for s in left}
                kept = set(sorted(left, key=lambda s: (-rank[s], s))[: spec.kept])
                for s in left:
                    if s not in kept and s not in entry:
                        entry[s] = t
                kept_sets.append(kept)
            for t in range(length):
                if not visible[t]:
                    continue
                for h in range(kv * groups, (kv + 1) * groups):
                    numerator, denominator = torch.zeros(head_dim, dtype=q.dtype), torch.zeros((), dtype=q.dtype)
                    for s in range(t + 1):
                        if not visible[s]:
                            continue
                        if t - s < window or sink[s] or s in kept_sets[t]:
                            weight = torch.exp(exact_score(q[b, h, t], k[b, kv, s]))
                        else:
                            decay = 1.0
                            if log_decay is not None:
                                decay = torch.exp((log_decay[b, kv] * mask[b])[entry[s] + 1 : t + 1].sum())
                            weight = (
                                params.linear_log_scale[h].exp()
                                * decay
                                * _kernel(q[b, h, t], k[b, kv, s], spec, params, h, kv, scale)
                            )
                        numerator, denominator = numerator + weight * v[b, kv, s], denominator + weight
                    out[b, h, t] = numerator / denominator
    return out


SPECS = {
    "elu_w3_kept2": AttentionSpec(kind="linear", feature_map="elu", window=3, kept=2),
    "hedgehog_w2_kept3_sinks2_c2": AttentionSpec(
        kind="linear", feature_map="hedgehog", window=2, sinks=2, kept=3, chunk_size=2
    ),
    "taylor2_w2_kept1_decay_c3": AttentionSpec(
        kind="recurrent_softmax", taylor_order=2, window=2, kept=1, decay=True, chunk_size=3
    ),
    "elu_w1_kept4_sinks1_decay": AttentionSpec(kind="linear", feature_map="elu", window=1, sinks=1, kept=4, decay=True),
    "elu_w2_kept6_c3_fills_up": AttentionSpec(kind="linear", feature_map="elu", window=2, kept=6, chunk_size=3),
    "elu_w2_kept16_all_fit": AttentionSpec(kind="linear", feature_map="elu", window=2, kept=16, chunk_size=4),
}


def _case(spec, length=12, seed=0):
    q, k, v, logits = make_inputs(length=length, seed=seed)
    q, k = 2 * q, 2 * k  # peaked window softmaxes: the ranking matters
    v, gates = gated(spec, v, logits)
    params = as_params(make_params(spec))
    mask = left_padding_mask(2, length, [0, 3])
    return q, k, v, gates, params, mask


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("mode", ["parallel", "chunked", "recurrent"])
def test_modes_match_the_simulation(name, mode):
    spec = SPECS[name]
    q, k, v, gates, params, mask = _case(spec)
    got, _ = attention(q, k, v, spec, mode=mode, attention_mask=mask, params=params, gates=gates)
    want = simulated_kept_attention(q, k, v, spec, params, mask.bool(), 8**-0.5, gates.get("decay"))
    torch.testing.assert_close(got * mask[:, None, :, None], want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_state_handed_over_between_calls(name):
    """Prefill in pieces (one of them a single step, as in decoding) gives the one-call outputs and state."""
    spec = SPECS[name]
    q, k, v, gates, params, mask = _case(spec, length=13, seed=3)
    whole, whole_state = attention(q, k, v, spec, mode="chunked", attention_mask=mask, params=params, gates=gates)
    pieces, state = [], None
    for start, stop in ((0, 5), (5, 6), (6, 13)):
        part = slice(start, stop)
        mode = "recurrent" if stop - start == 1 else "chunked"
        piece_gates = {name: gate[..., part] for name, gate in gates.items()}
        out, state = attention(
            q[..., part, :], k[..., part, :], v[..., part, :], spec, mode=mode, attention_mask=mask[:, :stop],
            params=params, gates=piece_gates, state=state,
        )  # fmt: skip
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, dim=-2), whole, rtol=1e-10, atol=1e-12)
    _assert_same_state(state, whole_state)


def _assert_same_state(state, other):
    """Equal states; the window buffers are compared in position order, and the kept slots may hold the
    same keys in another order (compared by position)."""
    state, other = window_in_order(state), window_in_order(other)
    kept = ("kept_keys", "kept_values", "kept_scores", "kept_positions", "kept_valid")
    for field in dataclasses.fields(state):
        if field.name not in (*kept, "made_by") and getattr(state, field.name) is not None:
            got, want = getattr(state, field.name), getattr(other, field.name)
            torch.testing.assert_close(
                got, want, rtol=1e-10, atol=1e-12, msg=lambda text, name=field.name: f"{name}: {text}"
            )
    if state.kept_keys is None:
        return
    orders = [
        torch.argsort(s.kept_positions.masked_fill(~s.kept_valid, -1), dim=-1, stable=True) for s in (state, other)
    ]
    for name in kept:
        got, want = (getattr(s, name) for s in (state, other))
        got, want = (
            x.gather(2, o.view(*o.shape, *[1] * (x.dim() - 3)).expand_as(x))
            for x, o in zip((got, want), orders, strict=True)
        )
        valid = state.kept_valid.gather(2, orders[0])
        mask = valid.view(*valid.shape, *[1] * (got.dim() - 3)).expand_as(got)
        torch.testing.assert_close(got[mask], want[mask], rtol=1e-10, atol=1e-12)
    assert torch.equal(state.kept_valid.sum(-1), other.kept_valid.sum(-1))


def test_one_step_selection_matches_the_block_form():
    """Decoding one step at a time (the one-step path) gives the outputs and kept sets of one call."""
    spec = SPECS["hedgehog_w2_kept3_sinks2_c2"]
    q, k, v, gates, params, mask = _case(spec, length=14, seed=5)
    whole, whole_state = attention(q, k, v, spec, mode="chunked", attention_mask=mask, params=params, gates=gates)
    outs, state = [], None
    for step in range(14):
        part = slice(step, step + 1)
        out, state = attention(
            q[..., part, :], k[..., part, :], v[..., part, :], spec, mode="recurrent",
            attention_mask=mask[:, : step + 1], params=params, gates={n: g[..., part] for n, g in gates.items()},
            state=state,
        )  # fmt: skip
        outs.append(out)
    torch.testing.assert_close(torch.cat(outs, dim=-2), whole, rtol=1e-10, atol=1e-12)
    _assert_same_state(state, whole_state)


def test_gradients_of_chunked_match_parallel():
    spec = SPECS["hedgehog_w2_kept3_sinks2_c2"]
    q, k, v, _ = make_inputs(length=10, requires_grad=True)
    params = as_params(make_params(spec))
    grads = []
    for mode in ("parallel", "chunked"):
        out, _ = attention(2 * q, 2 * k, v, spec, mode=mode, params=params, return_state=False)
        grads.append(torch.autograd.grad((out * torch.linspace(-1, 1, 8, dtype=out.dtype)).sum(), (q, k, v)))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_state_size_is_constant_and_holds_the_best_keys():
    spec = AttentionSpec(kind="linear", feature_map="elu", window=2, kept=3, chunk_size=4)
    q, k, v, _ = make_inputs(length=20)
    _, state = attention(2 * q, 2 * k, v, spec, mode="chunked", params=as_params(make_params(spec)))
    assert state.kept_keys.shape == (2, 2, 3, 8) and state.kept_values.shape == (2, 2, 3, 9)
    assert state.kept_valid.all() and state.window_scores.shape == (2, 2, 2)
    assert state.nbytes == sum(x.numel() * x.element_size() for x in state.tensors())
    for b in range(2):
        for kv in range(2):
            slots = state.kept_positions[b, kv].tolist()
            torch.testing.assert_close(state.kept_keys[b, kv], 2 * k[b, kv, slots])
            others = [s for s in range(18) if s not in slots]  # positions 18, 19 are in the window
            saliency = [_saliency_of(q, k, b, kv, s, 2) for s in range(18)]
            rank = [max(saliency[s], saliency[s - 1] if s else 0.0) for s in range(18)]
            torch.testing.assert_close(state.kept_scores[b, kv], torch.tensor([rank[s] for s in slots]).double())
            assert state.kept_scores[b, kv].min() >= max(rank[s] for s in others)


def _saliency_of(q, k, b, kv, s, window):
    """Largest window-softmax weight key s gets from the queries s .. s + W - 1 of KV head kv (inputs doubled)."""
    best = 0.0
    for t in range(s, min(s + window, q.shape[2])):
        first = max(0, t - window + 1)
        for h in (2 * kv, 2 * kv + 1):
            x = torch.stack([4 * q[b, h, t] @ k[b, kv, r] * 8**-0.5 for r in range(first, t + 1)])
            best = max(best, torch.softmax(x, 0)[s - first].item())
    return best


def test_schedule_keeps_the_top_ranked_and_enters_the_rest_when_displaced():
    saliency = torch.tensor([[[0.9, 0.2, 0.5, 0.5, 0.95, 0.1]]], dtype=torch.float64)
    candidate = torch.tensor([[True, True, True, True, True, False]])
    kept, entry = kept_schedule(saliency, candidate, window=1, kept=2)
    # query 3 sees keys 0..2 out of its window: keeps 0 (0.9) and 2 (0.5); key 2 displaces key 1 at step 3
    assert kept[0, 0, 3].tolist() == [True, False, True, False, False, False]
    # query 4: key 3 (0.5, later than key 2) does not displace key 2; query 5: key 4 displaces key 2
    assert kept[0, 0, 4].tolist() == [True, False, True, False, False, False]
    assert kept[0, 0, 5].tolist() == [True, False, False, False, True, False]
    # entry: s + W + the steps it stays kept; keys 0 and 4 are still kept at the last query (6 = L)
    assert entry[0, 0].tolist() == [6, 3, 5, 4, 6, 6]


@pytest.mark.parametrize("seed", range(6))
def test_ranking_by_sort_counts_as_comparing_every_pair(seed):
    """How many arrived candidates rank above each one, by one sort, equals the pairwise comparison
    (ties in score broken by position; invalid candidates, at position -1 as empty slots are, count
    for none)."""
    generator = torch.Generator().manual_seed(seed)
    slots, steps = 6, 5
    size = slots + steps
    scores = torch.randint(0, 3, (2, 3, size), generator=generator).double()  # many equal scores
    positions = torch.stack([torch.randperm(size, generator=generator) for _ in range(6)]).view(2, 3, size)
    valid = torch.rand(2, 3, size, generator=generator) > 0.3
    positions = positions.masked_fill(~valid, -1)
    arrival = torch.cat([torch.full((slots,), -1), torch.arange(steps)])
    above = _ranks_above(scores, positions, valid)  # [B, Hkv, i, j]
    pairwise = above[:, :, :slots].sum(2, keepdim=True) + above[:, :, slots:].cumsum(2)
    assert torch.equal(_outranked(scores, positions, valid, arrival, steps).long(), pairwise)


def _random_selection_case(seed: int, kept: int, length: int):
    """A call's selection inputs: B = 2, Hkv = 2, G = 2, D = 3; rank scores with many ties, candidates
    left out at random (sinks, padding), and buffers kept before the call with empty slots among them."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    q = randn(2, 2, 2, length, 3)
    valid = torch.rand(2, 2, kept, generator=generator) > 0.4
    buffers = (
        randn(2, 2, kept, 3),
        randn(2, 2, kept, 4),
        torch.randint(0, 3, (2, 2, kept), generator=generator).double(),
        torch.stack([torch.randperm(10, generator=generator)[:kept] for _ in range(4)]).view(2, 2, kept),
        valid,
    )
    buffers = (*buffers[:3], buffers[3].masked_fill(~valid, -1), valid)
    leaving = (
        randn(2, 2, length, 3),
        randn(2, 2, length, 4),
        torch.randint(0, 3, (2, 2, length), generator=generator).double(),
        torch.arange(10, 10 + length).expand(2, length),
        torch.rand(2, length, generator=generator) > 0.25,
    )
    return q, leaving, buffers


@pytest.mark.parametrize("bounds", [False, True], ids=["any_slots", "bounded_slots"])
@pytest.mark.parametrize("block", [1, 2, 4, 16], ids=lambda b: f"block{b}")
@pytest.mark.parametrize(("kept", "length"), [(1, 5), (3, 13), (6, 7), (4, 1), (8, 30)], ids=lambda x: str(x))
@pytest.mark.parametrize("seed", range(3))
def test_exit_steps_select_as_the_block_by_block_form(seed, kept, length, block, bounds):
    """Every key's exit step at once gives the block-by-block loop's entering stream, exact part and kept
    sets (ties in score broken by position, candidates left out, empty slots in the buffers), also where
    the call says how many keys were kept before it and how many of its first leaving keys are not
    candidates (the blocks then score fewer slots)."""
    q, leaving, buffers = _random_selection_case(seed, kept, length)
    hints = {}
    if bounds:
        leaving[4][:, :3] = False
        hints = dict(held_before=int(buffers[4].sum(-1).max()), first_candidate=3)
    got = select_kept(q, *leaving, buffers, scale=0.7, block=block, **hints)
    want = select_kept_blockwise(q, *leaving, buffers, scale=0.7, block=block)
    for name in ("keys", "values", "numerator", "row_max"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-12, atol=1e-12)
    assert torch.equal(got.kept_valid.sum(-1), want.kept_valid.sum(-1))
    for selection in (got, want):  # the kept keys first, in the order they arrived
        assert torch.equal(selection.kept_valid.int(), selection.kept_valid.int().sort(dim=-1, descending=True).values)
    mask = got.kept_valid
    for name in ("kept_keys", "kept_values", "kept_scores", "kept_positions"):
        torch.testing.assert_close(getattr(got, name)[mask], getattr(want, name)[mask], rtol=0, atol=0)
        assert not getattr(got, name)[~mask].any()  # empty slots are zero


def test_blocks_are_grouped_by_the_slots_they_can_hold():
    """From an empty state with a window of 256 and blocks of 64, K = 256: no slot until a key can have
    left the window, then 64, 128, 192 and 256 (bounds rounded up to 2^k or 3 * 2^(k - 2), at most K)."""
    assert _slot_groups(blocks=9, block=64, kept=256, held_before=0, first_candidate=256) == [
        (0, 5, 0), (5, 6, 64), (6, 7, 128), (7, 8, 192), (8, 9, 256),
    ]  # fmt: skip
    assert _slot_groups(blocks=4, block=1, kept=100, held_before=4, first_candidate=0) == [
        (0, 1, 4), (1, 3, 6), (3, 4, 8),
    ]  # fmt: skip
    assert _slot_groups(blocks=3, block=64, kept=256, held_before=None, first_candidate=0) == [(0, 3, 256)]
    assert _slot_groups(blocks=2, block=4, kept=6, held_before=5, first_candidate=0) == [(0, 2, 6)]


@pytest.mark.parametrize("length", [64, 2048])
def test_the_selection_of_a_call_takes_a_bounded_number_of_operations(length):
    """The finetune default's selection (K = 256, blocks of 64) at SmolLM2's heads: under 300 dispatched
    operations forward, at 64 steps and at 2,048 (a loop over the blocks of 2,048 steps took 4,026, which
    a GPU launches one by one)."""
    kv_heads, groups, head_dim, kept = 3, 3, 8, 256
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, kv_heads, groups, length, head_dim, generator=generator)
    leaving = (
        torch.randn(1, kv_heads, length, head_dim, generator=generator),
        torch.randn(1, kv_heads, length, head_dim + 1, generator=generator),
        torch.rand(1, kv_heads, length, generator=generator),
        torch.arange(length)[None],
        torch.ones(1, length, dtype=torch.bool),
    )
    buffers = (
        torch.zeros(1, kv_heads, kept, head_dim),
        torch.zeros(1, kv_heads, kept, head_dim + 1),
        torch.zeros(1, kv_heads, kept),
        torch.zeros(1, kv_heads, kept, dtype=torch.long),
        torch.zeros(1, kv_heads, kept, dtype=torch.bool),
    )
    with DispatchedOperations() as operations:
        selection = select_kept(q, *leaving, buffers, scale=0.125, block=64)
    assert operations.count < 300, operations.count
    assert selection.kept_valid.sum().item() == kv_heads * min(kept, length)


def test_a_layer_of_the_default_spec_launches_and_writes_little_beside_the_kernels(monkeypatch):
    """One bfloat16 call of the finetune default's spec (window 256, 4 sinks, 256 kept, decay) at SmolLM2's
    heads and 1,024 tokens, forward and backward, on the GPU path (the stand-ins for fla, which runs the
    decayed part older than the window, and for FlexAttention): under 1,000 operations outside the
    kernels (each a kernel launch on a GPU; the block-by-block selection beside the PyTorch band took
    1,727), writing under 360,000 bytes per token (397,894 when the band computed a numerator that
    FlexAttention's window replaces only to rank the window's keys, and the scores were scaled after
    their product, C + W wide, instead of the queries before it, D wide)."""
    use_stand_ins(monkeypatch, flex=True)
    spec = quiet_preset("hedgehog_window_256_sinks_4_kept_256_decay")
    q, k, v, logits = make_inputs(batch=1, heads=9, kv_heads=3, length=1024, head_dim=64, dtype=torch.bfloat16)
    v, gates = gated(spec, v, logits)
    params = as_params(make_params(spec, heads=9, kv_heads=3, head_dim=64, dtype=torch.float32))
    leaves = [x.requires_grad_() for x in (q, k, v)]
    with WrittenBytes() as counter:
        out, _ = attention(*leaves, spec, mode="chunked", gates=gates, params=params, return_state=False)
        out.float().sum().backward()
    assert counter.operations < 1000, counter.operations
    assert counter.bytes / 1024 < 360_000, counter.bytes / 1024
    assert all(torch.isfinite(leaf.grad).all() for leaf in leaves)


def _buffers(scores, positions, valid, dim=2):
    """Kept buffers `[1, 1, K, ...]` with keys and values 1..K (values with the count column)."""
    slots = len(scores)
    keys = torch.arange(1.0, slots + 1, dtype=torch.float64)[:, None].expand(slots, dim)
    values = torch.cat([keys, torch.ones(slots, 1, dtype=torch.float64)], -1)
    return (
        keys[None, None].clone(),
        values[None, None].clone(),
        torch.tensor([[scores]], dtype=torch.float64),
        torch.tensor([[positions]]),
        torch.tensor([[valid]]),
    )


def _leaving(count, score=0.1, dim=2):
    """`count` leaving keys (all 9s), each a candidate with rank score `score`, at positions 10, 11, ..."""
    keys = torch.full((1, 1, count, dim), 9.0, dtype=torch.float64)
    values = torch.cat([keys, torch.ones(1, 1, count, 1, dtype=torch.float64)], -1)
    scores = torch.full((1, 1, count), score, dtype=torch.float64)
    return keys, values, scores, torch.arange(10, 10 + count)[None], torch.ones(1, count, dtype=torch.bool)


def test_one_step_fills_an_empty_slot_whatever_position_it_holds():
    """An empty slot takes the leaving key, also when it holds position -1 (no key left the window)."""
    q = torch.zeros(1, 1, 1, 1, 2, dtype=torch.float64)
    buffers = _buffers([0.5, 0.6, 0.0], [0, 1, -1], [True, True, False])
    selection = select_kept(q, *_leaving(1), buffers, scale=1.0, block=4)
    assert selection.kept_valid.tolist() == [[[True, True, True]]]
    assert selection.kept_positions.tolist() == [[[0, 1, 10]]]
    assert not selection.values.any()  # nothing displaced: nothing enters the finite state


def test_empty_slots_between_kept_keys_change_nothing():
    """A buffer with empty slots before and between its kept keys selects as its compacted form."""
    q = torch.randn(1, 1, 1, 3, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    holes = _buffers([0.0, 0.9, 0.0, 0.3, 0.0], [-1, 4, 0, 6, -1], [False, True, False, True, False])
    compact = _buffers([0.9, 0.3, 0.0, 0.0, 0.0], [4, 6, -1, -1, -1], [True, True, False, False, False])
    compact[0][0, 0, :2], compact[1][0, 0, :2] = holes[0][0, 0, [1, 3]], holes[1][0, 0, [1, 3]]
    for score in (0.1, 0.5):  # below the kept keys, and between them
        got, want = (select_kept(q, *_leaving(3, score), b, scale=1.0, block=2) for b in (holes, compact))
        for name in ("keys", "values", "numerator", "row_max"):
            torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=0, atol=0)
        assert got.kept_keys.shape == want.kept_keys.shape == (1, 1, 5, 2)
        order = [torch.argsort(s.kept_positions.masked_fill(~s.kept_valid, -9), -1) for s in (got, want)]
        assert got.kept_positions.gather(2, order[0]).tolist() == want.kept_positions.gather(2, order[1]).tolist()
        assert got.kept_valid.sum().item() == want.kept_valid.sum().item() == 5


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(kind="linear", feature_map="elu", window=2, kept=0), r"kept=0 is not allowed; expected None or an int"),
        (dict(kind="linear", feature_map="elu", kept=2), r"kept=2 is not allowed with .*set window"),
        (dict(kind="recurrent_softmax", window=2, kept=2), r"window=2 is not allowed"),
    ],
    ids=["zero", "no_window", "exact_exp"],
)
def test_bad_specs_raise(fields, message):
    with pytest.raises(ValueError, match=message):
        AttentionSpec(**fields)


def test_non_integer_kept_raises():
    with pytest.raises(TypeError, match=r"AttentionSpec.kept=2.5 has type float; expected None or an int"):
        AttentionSpec(kind="linear", feature_map="elu", window=2, kept=2.5)


def test_parallel_needs_a_query_per_key():
    spec = SPECS["elu_w3_kept2"]
    q, k, v, _ = make_inputs(length=6)
    with pytest.raises(ValueError, match=r"needs a query at every key position; got 1 queries for 6 keys"):
        attention(q[..., -1:, :], k, v, spec, mode="parallel", params=as_params(make_params(spec)))


def test_state_from_another_kept_count_raises():
    spec = SPECS["elu_w3_kept2"]
    q, k, v, _ = make_inputs(length=5)
    params = as_params(make_params(spec))
    _, state = attention(q, k, v, spec, mode="chunked", params=params)
    other = AttentionSpec(**{**spec.to_dict(), "kept": 3})
    with pytest.raises(ValueError, match=r"state was made for another attention.*kept=2 \(here 3\)"):
        attention(q, k, v, other, mode="recurrent", params=params, state=state)
