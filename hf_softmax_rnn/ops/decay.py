"""A data-dependent decay (forget gate) of the finite state: simple gated linear attention.

With per-position log-decays g_r = log a_r <= 0 (one per KV head, 0 at padding), the state
is multiplied by a_r before the key that enters at step r is added:

    S_r = a_r S_{r-1} + phi(k_{r-W}) v_{r-W}^T     (W = the window, 0 without one)

so key s, which enters the state when it leaves the window at step s + W, weighs

    exp(sum_{r = s+W+1}^{t} g_r) phi(q_t).phi(k_s)

for query t (GLA / RetNet "simple gated" linear attention on the shifted keys; the denominator
z decays the same way). The exact window and the sinks never decay.

- `decay_weights`: the factors of the parallel (L x L) form, the reference of the others.
- `chunked_decayed_linear_attention`: chunks of C positions in PyTorch, each recomputed in the
  backward (`torch.utils.checkpoint`): the reference of the hand-written engine's decay
  (`ops.chunked`, which runs outside torch.compile), and the chunked form under torch.compile.

Shapes: grouped q `[B, Hkv, G, L, D]`, keys `[B, Hkv, L, D]`, augmented values
`[B, Hkv, L, Dv + 1]`, log-decays `[B, Hkv, L]`, state `[B, Hkv, F, Dv + 1]`.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from hf_softmax_rnn.ops.grouping import grouped_matmul
from hf_softmax_rnn.ops.kernels import FeatureKernel

#: Smallest log-decay the forms read: a_r = e^-80 = 1.8e-35 already lets no state through, and every form
#: sums log-decays (a prefix sum over the chunk or the sequence), where a value of -inf gives inf - inf = NaN
#: and one of -1e30 leaves no precision to the sums of the other positions; `attention` raises lower ones to it.
MIN_LOG_DECAY = -80.0


def decay_weights(
    log_decay: torch.Tensor, query_len: int, shift: int, entry: torch.Tensor | None = None
) -> torch.Tensor:
    """exp(sum_{r=e_s+1}^{t} g_r) for the last `query_len` positions t and every key s that entered
    the state at step e_s <= t, else 0: `[B, Hkv, 1, Lq, Lk]` from log-decays `[B, Hkv, Lk]`. The
    entry steps are e_s = s + shift, or `entry` `[B, Hkv, Lk]` when given (kept keys enter late)."""
    key_len = log_decay.shape[-1]
    cumulative = log_decay.cumsum(-1)
    if entry is None:
        entry = (torch.arange(key_len, device=log_decay.device) + shift).expand_as(log_decay)
    queries = torch.arange(key_len - query_len, key_len, device=log_decay.device)
    entered = entry[..., None, :] <= queries[:, None]
    at_entry = cumulative.gather(-1, entry.clamp_max(key_len - 1))
    exponent = cumulative[..., key_len - query_len :, None] - at_entry[..., None, :]
    return torch.exp(exponent.masked_fill(~entered, float("-inf")))[:, :, None]


def _decayed_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor, state: torch.Tensor, kernel
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk: (augmented numerator `[B, Hkv, G, C, Dv + 1]`, state after the chunk)."""
    cumulative = log_decay.cumsum(-1)  # [B, Hkv, C]
    size = k.shape[-2]
    causal = torch.ones(size, size, dtype=torch.bool, device=k.device).tril()
    inside = torch.exp((cumulative[..., :, None] - cumulative[..., None, :]).masked_fill(~causal, float("-inf")))
    query_features, key_features = kernel.query_features(q), kernel.key_features(k)  # once for all three uses
    intra = grouped_matmul(grouped_matmul(query_features, key_features.mT) * inside[:, :, None], v)
    inter = grouped_matmul(query_features * cumulative.exp()[:, :, None, :, None], state)
    total = cumulative[..., -1:]
    weighted_keys = key_features * torch.exp(total - cumulative)[..., None]
    return intra + inter, state * total.exp()[..., None] + weighted_keys.mT @ v


def chunked_decayed_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor,
    state: torch.Tensor,
    kernel: FeatureKernel,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Augmented numerator `[B, Hkv, G, L, Dv + 1]` and the state after the last position, with
    the state decayed by exp(`log_decay`) at each step before that step's key enters."""
    outputs = []
    recompute = torch.is_grad_enabled()
    for start in range(0, q.shape[-2], chunk_size):
        chunk = slice(start, start + chunk_size)
        args = (q[..., chunk, :], k[..., chunk, :], v[..., chunk, :], log_decay[..., chunk], state, kernel)
        if recompute:
            out, state = checkpoint(_decayed_chunk, *args, use_reentrant=False)
        else:
            out, state = _decayed_chunk(*args)
        outputs.append(out)
    return torch.cat(outputs, dim=-2), state
