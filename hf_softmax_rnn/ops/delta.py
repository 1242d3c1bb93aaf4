"""The delta rule (DeltaNet) and the gated delta rule (Gated DeltaNet) for the finite state.

An additive state only sums: S_t = a_t S_{t-1} + phi(k) v^T. The delta rule corrects it toward each
new value instead. With the unit key u = phi(k) / |phi(k)|, the key's norm n = |phi(k)| and a write
strength b_t in (0, 1) per step and KV head:

    S_t = a_t (I - b_t u u^T) S_{t-1} + b_t phi(k) v'^T
        = a_t S_{t-1} + u w_t^T,   w_t = b_t (n v' - a_t S_{t-1}^T u)

where v' is the augmented value [v, 1] (its last column makes z, the denominator, ride along) and a_t
the decay (1 without one). What the state recalls along u moves a fraction b_t of the way from its old
value to n v'; keys that never share a direction add up as in linear attention when b_t = 1. The
output reads phi(q_t) S_t after the step, as the additive forms do. A step where no key enters (a
padding position, a sink leaving the window, a kept key staying) has a zero weight column in v', and
its write strength is taken as 0 there.

- `recurrent_delta_attention`: one step at a time (decoding, and the obvious reference).
- `chunked_delta_attention`: chunks of C steps in the WY / UT form (Yang et al., 2024): within a chunk
  the corrections w solve one unit lower-triangular C x C system, (I + A) w = b (n v' - Gamma U S),
  A_ts = b_t e^{g_t - g_s} u_t.u_s for s < t (g the cumulative log-decay inside the chunk); then the
  outputs and the next state are two products, as in chunked linear attention.
- `parallel_delta_values`: the corrections of every key at once for the parallel (L x L) form, whose
  keys may enter in another order than their positions (kept keys enter late).

With an additive mass (`AttentionSpec.additive_mass`, `additive_mass=True` here) the state's value columns
recall v itself, S_t = a_t (I - b_t u u^T) S_{t-1} + b_t u v^T (so S^T u -> v), read by the query's
direction, y = phi(q) S / |phi(q)|; its last column is the additive sum z_a = sum a phi(k), uncorrected
and without write strength, and the forms return m [y, 1] with m = phi(q).z_a (`read_with_mass`).

Shapes: grouped q `[B, Hkv, G, L, D]`, keys `[B, Hkv, L, D]`, augmented values `[B, Hkv, L, Dv + 1]`,
write strengths and log-decays `[B, Hkv, L]`, state `[B, Hkv, F, Dv + 1]`.
"""

from __future__ import annotations

import torch

from hf_softmax_rnn.ops.grouping import grouped_matmul
from hf_softmax_rnn.ops.kernels import FeatureKernel

#: Key features shorter than this have no direction: their unit key is (nearly) zero, so they change nothing.
_MIN_KEY_NORM = 1e-12


def unit_keys(
    key_features: torch.Tensor, values: torch.Tensor, strength: torch.Tensor, additive_mass: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unit keys u `[B, Hkv, L, F]`, written values n v' `[B, Hkv, L, Dv + 1]`, write strengths b
    `[B, Hkv, L]` zeroed where no key enters) from phi(k), the augmented values v' and b; `additive_mass`:
    the values are written as they are and only the weight column is scaled by n, [v, n w]."""
    unit, norm = _direction(key_features)
    return unit, _written(values, norm, additive_mass), strength * values[..., -1]


def _written(values: torch.Tensor, norm: torch.Tensor, additive_mass: bool) -> torch.Tensor:
    """What each key writes: n v' `[..., Dv + 1]`, or [v, n w] with `additive_mass`."""
    if additive_mass:
        return torch.cat([values[..., :-1], values[..., -1:] * norm[..., None]], dim=-1)
    return values * norm[..., None]


def read_with_mass(augmented: torch.Tensor, query_norm: torch.Tensor) -> torch.Tensor:
    """m [y, 1] `[..., Dv + 1]` from phi(q) S' = [|phi(q)| y, m] `[..., Dv + 1]` and |phi(q)| `[..., 1]`: the
    recall y read by the query's direction, weighed by the additive mass m."""
    recall, mass = augmented.split([augmented.shape[-1] - 1, 1], dim=-1)
    return torch.cat([recall * (mass / query_norm.clamp_min(_MIN_KEY_NORM)), mass], dim=-1)


def _direction(key_features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(phi(k) / |phi(k)| `[..., F]`, |phi(k)| `[...]`); a key shorter than `_MIN_KEY_NORM` gives a (near) zero one."""
    norm = torch.linalg.vector_norm(key_features, dim=-1)
    return key_features / norm.clamp_min(_MIN_KEY_NORM)[..., None], norm


def _with_additive_mass(corrections: torch.Tensor, written: torch.Tensor) -> torch.Tensor:
    """The corrections `[..., Dv]` of the value columns, then the mass column as written `[..., 1]`."""
    return torch.cat([corrections, written[..., -1:]], dim=-1)


def recurrent_delta_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    strength: torch.Tensor,
    state: torch.Tensor,
    kernel: FeatureKernel,
    in_place: bool = False,
    log_decay: torch.Tensor | None = None,
    additive_mass: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Augmented numerator `[B, Hkv, G, L, Dv + 1]` and the state after the last step, one step at a time.
    `in_place`: update `state` itself (decoding without autograd)."""
    phi_q = kernel.query_features(q)
    unit, written, strength = unit_keys(kernel.key_features(k), v, strength, additive_mass)
    corrected = slice(None, -1) if additive_mass else slice(None)
    outputs = []
    for t in range(q.shape[-2]):
        if log_decay is not None:
            factor = log_decay[..., t, None, None].exp()
            state = state.mul_(factor) if in_place else state * factor
        key, value = unit[..., t : t + 1, :], written[..., t : t + 1, :]  # [B, Hkv, 1, F], [B, Hkv, 1, Dv']
        correction = strength[..., t, None, None] * (value[..., corrected] - key @ state[..., corrected])
        update = key.mT @ (_with_additive_mass(correction, value) if additive_mass else correction)
        state = state.add_(update) if in_place else state + update
        outputs.append(grouped_matmul(phi_q[..., t : t + 1, :], state))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-2)
    return (read_with_mass(out, phi_q.norm(dim=-1, keepdim=True)) if additive_mass else out), state


def chunked_delta_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    strength: torch.Tensor,
    state: torch.Tensor,
    kernel: FeatureKernel,
    chunk_size: int,
    log_decay: torch.Tensor | None = None,
    additive_mass: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Augmented numerator `[B, Hkv, G, L, Dv + 1]` and the state after the last step, chunk by chunk."""
    phi_q = kernel.query_features(q)
    unit, written, strength = unit_keys(kernel.key_features(k), v, strength, additive_mass)
    if log_decay is None:
        log_decay = torch.zeros_like(strength)
    outputs = []
    for start in range(0, q.shape[-2], chunk_size):
        chunk = slice(start, start + chunk_size)
        out, state = _delta_chunk(
            phi_q[..., chunk, :], unit[..., chunk, :], written[..., chunk, :], strength[..., chunk],
            log_decay[..., chunk], state, additive_mass,
        )  # fmt: skip
        outputs.append(out)
    if not outputs:
        return q.new_empty(*q.shape[:-1], v.shape[-1]), state
    out = torch.cat(outputs, dim=-2)
    return (read_with_mass(out, phi_q.norm(dim=-1, keepdim=True)) if additive_mass else out), state


def _delta_chunk(phi_q, unit, written, strength, log_decay, state, additive_mass) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of C steps: (augmented numerator `[B, Hkv, G, C, Dv']`, state after the chunk); `additive_mass`:
    the last column is written uncorrected."""
    size = unit.shape[-2]
    cumulative = log_decay.cumsum(-1)  # [B, Hkv, C]
    causal = torch.ones(size, size, dtype=torch.bool, device=unit.device).tril()
    between = torch.exp((cumulative[..., :, None] - cumulative[..., None, :]).masked_fill(~causal, float("-inf")))
    strictly = (unit @ unit.mT) * between * strength[..., :, None]
    system = torch.eye(size, dtype=unit.dtype, device=unit.device) + strictly.tril(-1)
    since_start = cumulative.exp()[..., None]  # [B, Hkv, C, 1]
    corrected = slice(None, -1) if additive_mass else slice(None)
    target = strength[..., None] * (written[..., corrected] - since_start * (unit @ state[..., corrected]))
    corrections = torch.linalg.solve_triangular(system, target, upper=False, unitriangular=True)
    if additive_mass:
        corrections = _with_additive_mass(corrections, written)
    inter = grouped_matmul(phi_q * since_start[:, :, None], state)
    intra = grouped_matmul(grouped_matmul(phi_q, unit.mT) * between[:, :, None], corrections)
    to_end = torch.exp(cumulative[..., -1:] - cumulative)[..., None]  # [B, Hkv, C, 1]
    new_state = state * cumulative[..., -1:, None].exp() + (unit * to_end).mT @ corrections
    return inter + intra, new_state


def parallel_delta_values(
    key_features: torch.Tensor,
    values: torch.Tensor,
    strength: torch.Tensor,
    entry: torch.Tensor,
    enters: torch.Tensor,
    log_decay: torch.Tensor | None,
    additive_mass: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the corrections w `[B, Hkv, Lk, Dv + 1]` of every key, 1 / |phi(k)| `[B, Hkv, Lk]`) for the parallel
    form, whose finite-state part is then sum_s [key s entered by t] e^{g_t - g_{e_s}} (phi(q_t).phi(k_s)
    / |phi(k_s)|) w_s. Key s enters the state at step `entry` `[B, Hkv, Lk]` where `enters` `[B, 1 or Hkv, Lk]`
    is True and the step is within the call (at most one key a step), with the write strength and decay of
    that step (`strength`, `log_decay` `[B, Hkv, Lk]` per step). Its correction reads the keys that entered
    before it, so the system is triangular in entry order: solved directly when entries follow positions,
    else by LU. `additive_mass`: the value columns correct toward v itself and the last column is the mass
    n w of each key that enters, uncorrected (`unit_keys`)."""
    steps = strength.shape[-1]
    enters = enters & (entry < steps)
    at_entry = entry.clamp_max(steps - 1)
    unit, norm = _direction(key_features)
    strength = strength.gather(-1, at_entry) * enters
    cumulative = torch.zeros_like(strength) if log_decay is None else log_decay.cumsum(-1).gather(-1, at_entry)
    earlier = (entry[..., None, :] < entry[..., :, None]) & enters[..., None, :] & enters[..., :, None]
    between = torch.exp((cumulative[..., :, None] - cumulative[..., None, :]).masked_fill(~earlier, float("-inf")))
    system = torch.eye(steps, dtype=unit.dtype, device=unit.device) + (unit @ unit.mT) * between * strength[..., None]
    written = _written(values, norm, additive_mass)
    target = strength[..., None] * (written[..., :-1] if additive_mass else written)
    in_order = bool((entry[..., 1:] >= entry[..., :-1]).all())
    if in_order:
        corrections = torch.linalg.solve_triangular(system, target, upper=False, unitriangular=True)
    else:
        corrections = torch.linalg.solve(system, target)
    if additive_mass:
        corrections = _with_additive_mass(corrections, written * enters[..., None])
    return corrections, 1.0 / norm.clamp_min(_MIN_KEY_NORM)
