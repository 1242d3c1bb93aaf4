"""The single functional entry point: `attention(q, k, v, spec, mode=...)`."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

import torch

from hf_softmax_rnn.attention_spec import DEFAULT_MAX_STATE_BYTES, AttentionSpec
from hf_softmax_rnn.ops.backends import polynomial_backend, window_backend
from hf_softmax_rnn.ops.checks import INPUT_DTYPES, check_arguments, check_inputs, check_softcap, check_state
from hf_softmax_rnn.ops.decay import MIN_LOG_DECAY
from hf_softmax_rnn.ops.delta import parallel_delta_values, read_with_mass
from hf_softmax_rnn.ops.feature_maps import build_kernel
from hf_softmax_rnn.ops.flex_window import combine_window_and_linear, flex_window_attention
from hf_softmax_rnn.ops.grouping import grouped_matmul
from hf_softmax_rnn.ops.kept import rank_scores, select_kept
from hf_softmax_rnn.ops.kernels import AttentionParams, FeatureKernel
from hf_softmax_rnn.ops.linear import chunked_linear_attention, recurrent_linear_attention
from hf_softmax_rnn.ops.normalizers import normalize
from hf_softmax_rnn.ops.parallel import parallel_parts, parallel_scores, visible_counts
from hf_softmax_rnn.ops.recurrent_state import RecurrentState, state_tag
from hf_softmax_rnn.ops.sinks import add_sink_attention, filled_sinks, visible_ranks
from hf_softmax_rnn.ops.softmax import softmax_attention
from hf_softmax_rnn.ops.window import banded_exp_attention, merge_exact, mix_weight, window_saliency
from hf_softmax_rnn.ops.window_step import window_hybrid_step, window_in_order

_HALF_DTYPES = (torch.float16, torch.bfloat16)
#: A chunked call on a CPU without autograd (prefill, scoring) longer than this many positions runs in
#: segments of this many, the state handed from each to the next (`_in_segments`).
PREFILL_SEGMENT = 2048


def _autocast_dtype(q, k, v) -> torch.dtype | None:
    """The dtype autocast runs an attention of q, k, v in (as it runs `scaled_dot_product_attention`),
    or None: outside autocast, for float64 inputs (autocast leaves them alone) or for inputs the call
    itself refuses."""
    if not all(isinstance(x, torch.Tensor) and x.is_floating_point() for x in (q, k, v)):
        return None
    device_type = q.device.type
    if not torch.amp.is_autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return None
    return None if torch.float64 in (q.dtype, k.dtype, v.dtype) else torch.get_autocast_dtype(device_type)


def _one_op_under_autocast(function: Callable) -> Callable:
    """Under autocast, `function(q, k, v, ..., io_dtype=None)` is one operation, as autocast treats SDPA:
    its `io_dtype` (unless given) is autocast's dtype, and the body runs with autocast off, so that the
    fused kernels read that dtype (bfloat16, not the float32 in which q and k leave RoPE) and the PyTorch
    forms compute in float32 as they do outside autocast (autocast would run their products in bfloat16).
    As autocast lets SDPA take q, k, v of mixed dtypes (q and k leave RoPE in float32, v its projection in
    bfloat16), they are cast to their promoted dtype first; outside autocast they must share one."""

    @functools.wraps(function)
    def one_op(q, k, v, *args, **kwargs):
        dtype = _autocast_dtype(q, k, v)
        if dtype is None:
            return function(q, k, v, *args, **kwargs)
        one = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)  # as SDPA, mixed dtypes are one
        with torch.autocast(q.device.type, enabled=False):
            return function(
                q.to(one), k.to(one), v.to(one), *args, **{**kwargs, "io_dtype": kwargs.get("io_dtype") or dtype}
            )

    return one_op


@_one_op_under_autocast
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    spec: AttentionSpec,
    *,
    mode: str = "parallel",
    attention_mask: torch.Tensor | None = None,
    gates: Mapping[str, torch.Tensor] | None = None,
    state: RecurrentState | None = None,
    params: AttentionParams | None = None,
    scale: float | None = None,
    max_state_bytes: int = DEFAULT_MAX_STATE_BYTES,
    return_state: bool = True,
    update_state_in_place: bool = False,
    io_dtype: torch.dtype | None = None,
    softcap: float | None = None,
    check_gate_values: bool = True,
) -> tuple[torch.Tensor, RecurrentState | None]:
    """Causal attention of any variant in any of the three modes.

    Args:
        q: `[B, H, L, D]` queries (after RoPE); H a multiple of Hkv.
        k: `[B, Hkv, Lk, D]` keys. In parallel mode Lk >= L and the queries are the last L
            positions (decoding from a KV cache); otherwise Lk == L.
        v: `[B, Hkv, Lk, D]` values. With `spec.input_gate` the caller passes the gated values
            (so that a KV cache holds them).
        spec: the attention variant (an `AttentionSpec`, a dict of its fields or a preset name).
        mode: "parallel" (masked L x L, every variant), "chunked" or "recurrent" (finite
            state only: linear feature maps or Taylor order N, no score clamp).
        attention_mask: `[B, L_total]` padding mask (1 = token, 0 = padding; left padding
            supported); its last Lk (parallel) or L (chunked/recurrent) columns are used.
        gates: {"output": `[B, H, L]`} sigmoid gate values, when the spec has an output gate;
            {"decay": `[B, Hkv, Lk]`} log-decays <= 0 of the finite state (`ops.decay`), when the spec
            has a decay (padding positions are set to 0 here: they never decay the state; values below
            `ops.decay.MIN_LOG_DECAY`, -inf included, are raised to it: the state is forgotten there);
            {"delta": `[B, Hkv, Lk]`} write strengths in [0, 1] of a delta-rule state (`ops.delta`), one
            per step (with a window, the step at which a key enters the state), when the spec has one.
        state: the `RecurrentState` from the previous call (chunked/recurrent), None = empty.
        params: the learned tensors the spec needs (`AttentionParams`).
        scale: the softmax scaling of q.k (default 1/sqrt(D)): exact exp uses it, and so does
            the kernel unless `spec.qk_scale` sets its own.
        max_state_bytes: largest per-KV-head state the finite modes accept.
        return_state: False when the caller has no use for the new state (training, scoring
            without a cache); a state-free fused GPU kernel may then run (`ops.backends`).
        update_state_in_place: recurrent mode without autograd (decoding): the finite-state part
            of `state` is updated in place and the returned state holds the same tensor.
        io_dtype: the dtype of the output, which the fused kernels (and SDPA, for exact softmax) read;
            None: the dtype of q, k and v, or autocast's dtype under autocast (as autocast runs SDPA;
            autocast is off inside). q, k and v share one real floating dtype; under autocast they may
            differ, as SDPA's may (q and k leave RoPE in float32, v its projection in bfloat16), and are
            cast to their promoted dtype first. The PyTorch forms compute in that dtype, float32 at
            least, whatever `io_dtype` is.
        softcap: c > 0 caps the scaled scores s of exact softmax at c tanh(s / c) (Gemma 2's
            `attn_logit_softcapping`): for spec kind "softmax", and for a window hybrid its exact part
            (window, sinks, kept keys, and the window softmax that ranks the kept keys), in every mode; a
            hybrid's finite state stays uncapped (the cap does not factor into a feature map), and a spec
            without an exact part raises (`AttentionSpec.softcap_applies`). None: no cap.
        check_gate_values: False where the gates are in their ranges by construction (a layer's sigmoid and
            log-sigmoid): their values are then not read, which costs a read on the host per call.

    Returns:
        `([B, H, L, Dv] output, new RecurrentState, or None in parallel mode or without
        return_state)`.
    """
    switches = {
        "return_state": return_state,
        "update_state_in_place": update_state_in_place,
        "check_gate_values": check_gate_values,
    }
    spec, gates, params, softmax_scale, tag = _checked_inputs(
        q, k, v, spec, mode, attention_mask, gates, state, params, scale, max_state_bytes, switches, io_dtype, softcap
    )
    out_dtype = q.dtype if io_dtype is None else io_dtype
    k, v, key_mask, log_decay, strength = _masked_inputs(k, v, attention_mask, gates.get("decay"), gates.get("delta"))
    padding = None if attention_mask is None else key_mask
    if q.shape[-2] == 0:
        return q.new_zeros(*q.shape[:3], v.shape[-1], dtype=out_dtype), state if mode != "parallel" else None

    needs_state = mode != "parallel" and return_state
    exact_hybrid = _every_key_exact(spec, k.shape[-2], state is None, needs_state)
    if spec.kind == "softmax" or exact_hybrid:
        out = _exact_softmax(q, k, v, padding, spec, gates.get("output"), softmax_scale, softcap, out_dtype)
        if exact_hybrid and torch.is_grad_enabled():
            out = _with_zero_gradients(out, params, log_decay)
        return out, None

    compute_dtype = torch.float32 if q.dtype in _HALF_DTYPES else q.dtype
    kernel = build_kernel(spec, spec.qk_scale or softmax_scale, params)
    fused = polynomial_backend(q.device.type, out_dtype, spec, mode, needs_state, q.shape[-1], v.shape[-1])
    log_shift, new_state = None, None
    if fused == "taylor2":
        numerator, denominator = _fused_taylor2(q, k, v, padding, kernel, out_dtype)
        visible = visible_counts(key_mask, q.shape[-2])
    elif mode == "parallel":
        numerator, denominator, log_shift = _parallel_form(
            q, k, v, key_mask, spec, kernel, softmax_scale, params, log_decay, strength, compute_dtype, softcap
        )
        visible = visible_counts(key_mask, q.shape[-2])
    else:
        numerator, denominator, visible, new_state = _finite_state_form(
            q,
            k,
            v,
            key_mask,
            state,
            spec,
            mode,
            kernel,
            softmax_scale,
            params,
            log_decay,
            strength,
            compute_dtype,
            out_dtype,
            keep_state=needs_state,
            in_place=update_state_in_place,
            softcap=softcap,
        )
        new_state.made_by = tag
        new_state = new_state if return_state else None
    output_gate = gates.get("output") if spec.output_gate else None
    out = _normalized(numerator, denominator, visible, log_shift, q.shape, spec, params, output_gate)
    return out.to(out_dtype), new_state


def _checked_inputs(
    q,
    k,
    v,
    spec,
    mode,
    attention_mask,
    gates,
    state,
    params,
    scale,
    max_state_bytes,
    switches: dict[str, object],
    io_dtype,
    softcap,
) -> tuple[AttentionSpec, Mapping[str, torch.Tensor], AttentionParams, float, tuple]:
    """Every check of `attention`'s arguments, in the order they run, before any work: each bad value raises
    an error that names it and what is allowed (`ops.checks`). `switches`: {name: value} of the flag arguments.

    Returns (the spec as an `AttentionSpec`, the gates (`{}` for None), the params (an empty `AttentionParams`
    for None), the scaling of q.k (default 1/sqrt(D)), the `state_tag` a state of this call carries).
    """
    if not isinstance(spec, AttentionSpec) and type(spec).__name__ == AttentionSpec.__name__:
        spec = AttentionSpec.from_dict(spec.to_dict())  # another copy of this module (remote code loads one)
    if not isinstance(spec, (AttentionSpec, str, dict)):
        raise TypeError(
            f"attention: spec must be an AttentionSpec, a dict of its fields or a preset name; got {spec!r}"
        )
    spec = AttentionSpec.coerce(spec)
    check_arguments(gates, params, scale, max_state_bytes, switches)
    check_softcap(softcap, spec)
    gates, params = gates or {}, params or AttentionParams()
    check_inputs(q, k, v, spec, mode, attention_mask, gates, state, params, scale, switches["check_gate_values"])
    if io_dtype is not None and io_dtype not in INPUT_DTYPES:
        raise ValueError(
            f"attention: io_dtype={io_dtype!r} is not allowed; expected None or one of {list(INPUT_DTYPES)}"
        )
    if switches["update_state_in_place"] and (mode != "recurrent" or torch.is_grad_enabled()):
        raise ValueError(
            f"attention: update_state_in_place needs mode='recurrent' without autograd (torch.no_grad()); got "
            f"mode={mode!r}, grad enabled={torch.is_grad_enabled()}"
        )
    spec.check_mode(mode, q.shape[-1], max_state_bytes)
    heads, head_dim = q.shape[1], q.shape[-1]
    softmax_scale = head_dim**-0.5 if scale is None else float(scale)
    tag = state_tag(spec, softmax_scale, heads, k.shape[1], head_dim, v.shape[-1], softcap)
    if state is not None:
        check_state(state, q, k, v, spec, tag)
    return spec, gates, params, softmax_scale, tag


def _masked_inputs(
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask: torch.Tensor | None,
    log_decay: torch.Tensor | None,
    strength: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(k, v zero at padding, the key mask `[B, Lk]` of bools, the log-decays and the delta rule's write
    strengths `[B, Hkv, Lk]` or None) for the call's Lk keys (in chunked and recurrent mode as many as the
    queries): the padding mask's last Lk columns (no mask: every key a token). Padding may hold anything, NaN
    included: it must not leak. Log-decays are 0 at padding (it never decays the state) and at least
    `MIN_LOG_DECAY`; write strengths are 0 at padding (it writes nothing)."""
    batch, key_len = k.shape[0], k.shape[-2]
    if attention_mask is None:
        key_mask = torch.ones(batch, key_len, dtype=torch.bool, device=k.device)
    else:
        key_mask = attention_mask[:, -key_len:].bool()
        hidden = ~key_mask[:, None, :, None]
        k, v = k.masked_fill(hidden, 0.0), v.masked_fill(hidden, 0.0)
    if log_decay is not None:
        if attention_mask is not None:  # (without a mask no position is padding)
            log_decay = log_decay.masked_fill(~key_mask[:, None, :], 0.0)
        log_decay = log_decay.clamp_min(MIN_LOG_DECAY)
    if strength is not None and attention_mask is not None:
        strength = strength.masked_fill(~key_mask[:, None, :], 0.0)
    return k, v, key_mask, log_decay, strength


def _exact_softmax(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    padding: torch.Tensor | None,
    spec: AttentionSpec,
    output_gate: torch.Tensor | None,
    scale: float,
    softcap: float | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """`[B, H, L, Dv]` causal softmax attention (SDPA) in `dtype`: spec kind "softmax" (over its window, if
    any), or a hybrid whose keys are all exact here (`_every_key_exact`: no window). `padding` `[B, Lk]`: the
    key mask, None without a padding mask. The output gate `[B, H, L]` multiplies the output when the spec
    places it after the normaliser (before the softmax normaliser it is inert)."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    window = spec.window if spec.kind == "softmax" else None
    out = softmax_attention(q, k, v, padding, scale, window, softcap)
    if spec.output_gate and spec.output_gate_position == "after_norm":
        out = out * output_gate.unsqueeze(-1).to(out.dtype)
    return out


def _with_zero_gradients(out: torch.Tensor, params: AttentionParams, log_decay: torch.Tensor | None) -> torch.Tensor:
    """`out` of an exact hybrid call, through which the learned tensors and log-decays that require grad get
    zero gradients (`_ZeroGradients`)."""
    learned = [getattr(params, field.name) for field in dataclasses.fields(params)]
    unused = [x for x in (*learned, log_decay) if isinstance(x, torch.Tensor) and x.requires_grad]
    return _ZeroGradients.apply(out, *unused) if unused else out


def _fused_taylor2(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    padding: torch.Tensor | None,
    kernel: FeatureKernel,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(numerator `[B, H, L, Dv]`, denominator `[B, H, L]`) of Taylor 2 from the fused Triton kernel
    (`ops.triton_taylor`), which reads q, k, v in `dtype` (the call's io_dtype)."""
    from hf_softmax_rnn.ops.triton_taylor import taylor2_attention  # imports triton: GPU only

    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return taylor2_attention(q, k, v, padding, kernel.scale)


def _parallel_form(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor,
    spec: AttentionSpec,
    kernel: FeatureKernel,
    softmax_scale: float,
    params: AttentionParams,
    log_decay: torch.Tensor | None,
    strength: torch.Tensor | None,
    dtype: torch.dtype,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(numerator `[B, Hkv, G, L, Dv]`, denominator `[B, Hkv, G, L]`, the per-row log factor the scores were
    divided by `[B, Hkv, G, L]` or None) of the masked L x Lk form (`ops.parallel`), computed in `dtype`;
    `log_decay` and the delta rule's write strengths `strength` are `[B, Hkv, Lk]`; `softcap` caps a hybrid's
    exact scores."""
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    batch, heads, length, head_dim = q.shape
    grouped_q = q.view(batch, k.shape[1], heads // k.shape[1], length, head_dim)
    parallel_inputs = (
        grouped_q,
        k,
        key_mask,
        kernel,
        spec.window,
        softmax_scale,
        params.linear_log_scale,
        spec.sinks,
        None if log_decay is None else log_decay.to(dtype),
        spec.kept,
        softcap,
    )
    if spec.delta_rule:
        numerator, denominator = _parallel_delta(parallel_inputs, v, key_mask, strength.to(dtype), spec.additive_mass)
        return numerator, denominator, None
    scores, log_shift = parallel_scores(*parallel_inputs)
    return grouped_matmul(scores, v), scores.sum(-1), log_shift


def _finite_state_form(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: torch.Tensor,
    state: RecurrentState | None,
    spec: AttentionSpec,
    mode: str,
    kernel: FeatureKernel,
    softmax_scale: float,
    params: AttentionParams,
    log_decay: torch.Tensor | None,
    strength: torch.Tensor | None,
    dtype: torch.dtype,
    io_dtype: torch.dtype,
    keep_state: bool,
    in_place: bool,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, RecurrentState]:
    """(numerator `[B, Hkv, G, L, Dv]`, denominator `[B, Hkv, G, L]`, visible counts `[B, 1, L]`, new state)
    of the chunked or recurrent form (`_finite_state`), computed in `dtype`, from `state` (None: the empty
    state). `io_dtype` is the call's output dtype, which FlexAttention and the fused kernels read. The new
    state's `t` counts the visible positions so far; its `made_by` is the caller's to set. `keep_state`: the
    caller wants the new state; `in_place`: the state is updated in place (decoding without autograd);
    `softcap` caps a hybrid's exact scores."""
    if _in_segments(q, k, v, mode):
        form = functools.partial(
            _finite_state_form, spec=spec, mode=mode, kernel=kernel, softmax_scale=softmax_scale, params=params,
            dtype=dtype, io_dtype=io_dtype, in_place=False, softcap=softcap,
        )  # fmt: skip
        return _in_segments_of(form, q, k, v, key_mask, state, log_decay, strength, keep_state)
    batch, heads, length, head_dim = q.shape
    kv_heads, value_dim = k.shape[1], v.shape[-1]
    input_qkv = (q, k, v)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    grouped_q = q.view(batch, kv_heads, heads // kv_heads, length, head_dim)
    window_fused = window_backend(q.device.type, io_dtype, spec, mode, keep_state, state is None, head_dim, value_dim)
    fresh_state = state is None
    if state is None:
        state = RecurrentState.zeros(
            batch,
            kv_heads,
            spec.feature_dim(head_dim),
            head_dim,
            value_dim,
            spec.window,
            q.device,
            dtype,
            sinks=spec.sinks,
            kept=spec.kept,
        )
    weights = key_mask.to(dtype)[:, None, :, None].expand(batch, kv_heads, length, 1)
    augmented_v = torch.cat([v, weights], dim=-1)  # (v is zero at padding already; F.pad's backward writes more)
    augmented, new_state = _finite_state(
        grouped_q,
        k,
        augmented_v,
        key_mask,
        state,
        kernel,
        mode,
        spec,
        softmax_scale,
        params.linear_log_scale,
        io_dtype=io_dtype,
        in_place=in_place,
        log_decay=None if log_decay is None else log_decay.to(dtype),
        delta_strength=None if strength is None else strength.to(dtype),
        flex_inputs=_flex_inputs(input_qkv, io_dtype) if window_fused == "flex" else None,
        fresh_state=fresh_state,
        keep_state=keep_state,
        softcap=softcap,
    )
    numerator, denominator = augmented.split([value_dim, 1], dim=-1)  # (backward: one cat, not two fills)
    if length == 1:  # (a decoding step: its one count, as the cumulative sum below has it)
        new_state.t = state.t + key_mask.view(batch)
        visible = new_state.t.view(batch, 1, 1)
    else:
        visible = state.t[:, None, None] + key_mask.cumsum(-1)[:, None, :]
        new_state.t = visible[:, 0, -1]
    return numerator, denominator.squeeze(-1), visible, new_state


def _in_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: str) -> bool:
    """Whether a chunked call runs in segments of `PREFILL_SEGMENT` positions: on a CPU, without autograd,
    when longer. The kept selection's counts, which grow with the square of a call's length
    (`ops.kept._exit_steps`), then grow with the square of the segment's, and each segment's blocks are a
    segment's size: the time grows linearly with the length. The result is the whole call's to round-off
    (a state handed across calls continues it exactly)."""
    return (
        mode == "chunked"
        and q.shape[-2] > PREFILL_SEGMENT
        and q.device.type == "cpu"
        and not (torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)))
    )


def _in_segments_of(
    form: Callable, q, k, v, key_mask, state, log_decay, strength, keep_state: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, RecurrentState]:
    """`form` (`_finite_state_form` with the call's other arguments bound) over segments of `PREFILL_SEGMENT`
    positions along L, each from the state the one before left; their numerators `[B, Hkv, G, L, Dv]`,
    denominators `[B, Hkv, G, L]` and visible counts `[B, 1, L]` joined along L, and the last state."""
    numerators, denominators, visible = [], [], []
    length = q.shape[-2]
    for start in range(0, length, PREFILL_SEGMENT):
        span = slice(start, start + PREFILL_SEGMENT)
        numerator, denominator, seen, state = form(
            q=q[..., span, :],
            k=k[..., span, :],
            v=v[..., span, :],
            key_mask=key_mask[:, span],
            state=state,
            log_decay=None if log_decay is None else log_decay[..., span],
            strength=None if strength is None else strength[..., span],
            keep_state=keep_state or start + PREFILL_SEGMENT < length,
        )
        numerators.append(numerator)
        denominators.append(denominator)
        visible.append(seen)
    return torch.cat(numerators, dim=-2), torch.cat(denominators, dim=-1), torch.cat(visible, dim=-1), state


def _normalized(
    numerator: torch.Tensor,
    denominator: torch.Tensor,
    visible: torch.Tensor,
    log_shift: torch.Tensor | None,
    query_shape: torch.Size,
    spec: AttentionSpec,
    params: AttentionParams,
    output_gate: torch.Tensor | None,
) -> torch.Tensor:
    """`[B, H, L, Dv]`: the spec's normaliser (`ops.normalizers`) applied to a form's numerator (`[B, H, L, Dv]`
    or grouped, `[B, Hkv, G, L, Dv]`), denominator and log factor (`[B, H, L]` or grouped) with the visible
    counts `[B, 1, L]`; `query_shape` is q's `[B, H, L, D]`, `output_gate` `[B, H, L]` or None."""
    batch, heads, length, _ = query_shape
    return normalize(
        numerator.reshape(batch, heads, length, -1),
        denominator.reshape(batch, heads, length),
        visible,
        spec,
        params,
        output_gate,
        None if log_shift is None else log_shift.reshape(batch, heads, length),
    )


def _parallel_delta(
    parallel_inputs: tuple, v: torch.Tensor, key_mask: torch.Tensor, strength: torch.Tensor, additive_mass: bool
):
    """(numerator `[B, Hkv, G, Lq, Dv]`, denominator `[B, Hkv, G, Lq]`) of the parallel form of a delta-rule
    spec: its exact part (a hybrid's) reads the values, its finite-state part the corrections that the
    delta rule wrote for each key (`ops.delta.parallel_delta_values`), scored against the unit keys, and with
    `additive_mass` read as the recall weighed by the mass (`ops.delta.read_with_mass`)."""
    k, kernel = parallel_inputs[1], parallel_inputs[3]
    parts = parallel_parts(*parallel_inputs)
    augmented_v = torch.cat([v, key_mask.to(v.dtype)[:, None, :, None].expand(*v.shape[:-1], 1)], dim=-1)
    log_decay = parallel_inputs[8]
    corrections, inverse_norm = parallel_delta_values(
        kernel.key_features(k), augmented_v, strength, parts.entry, parts.enters, log_decay, additive_mass
    )
    augmented = grouped_matmul(parts.finite * inverse_norm[:, :, None, None, :], corrections)
    if additive_mass:
        query_norm = kernel.query_features(parallel_inputs[0]).norm(dim=-1, keepdim=True)
        augmented = read_with_mass(augmented, query_norm * parts.finite_scale)
    if parts.exact is not None:
        augmented = augmented + grouped_matmul(parts.exact, augmented_v)
    numerator, denominator = augmented.split([v.shape[-1], 1], dim=-1)
    return numerator, denominator.squeeze(-1)


def _every_key_exact(spec: AttentionSpec, key_len: int, fresh_state: bool, needs_state: bool) -> bool:
    """Whether a hybrid call is exact softmax attention: from an empty state, a call whose queries
    see at most `spec.exact_positions` keys sends no key to the finite state (its window, sinks and kept
    positions hold every key), so with the softmax normaliser its output is that of causal softmax over
    the visible keys. Such a call (a training block, a scored text no longer than the exact part) runs
    SDPA when no state is asked of it; its finite state's tensors (feature maps, mixing weight,
    log-decays) get zero gradients (`_ZeroGradients`), as they change nothing."""
    return (
        spec.window is not None
        and spec.has_finite_state
        and fresh_state
        and not needs_state
        and key_len <= spec.exact_positions
        and spec.normalizer == "softmax"
    )


class _ZeroGradients(torch.autograd.Function):
    """`out` unchanged, and zero gradients for the other tensors: what a hybrid's finite-state tensors
    (feature maps, mixing weight, log-decays) get from a call that sends no key to its state, as they
    would through the finite-state path. Every trained parameter then has a gradient, which data-parallel
    training (DDP without `find_unused_parameters`) and the optimizers' weight decay expect."""

    @staticmethod
    def forward(ctx, out, *tensors):
        ctx.like = [(x.shape, x.dtype, x.device) for x in tensors]
        return out.view_as(out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad, *_):
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.like))


def _finite_state(
    q: torch.Tensor,
    k: torch.Tensor,
    augmented_v: torch.Tensor,
    key_mask: torch.Tensor,
    state: RecurrentState,
    kernel: FeatureKernel,
    mode: str,
    spec: AttentionSpec,
    window_scale: float,
    linear_log_scale: torch.Tensor | None,
    io_dtype: torch.dtype | None = None,
    in_place: bool = False,
    log_decay: torch.Tensor | None = None,
    delta_strength: torch.Tensor | None = None,
    flex_inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    fresh_state: bool = False,
    keep_state: bool = True,
    softcap: float | None = None,
) -> tuple[torch.Tensor, RecurrentState]:
    """Augmented numerator `[B, Hkv, G, L, Dv + 1]` of the chunked or recurrent form, and the new
    state (its `t` is set by the caller); `io_dtype` is the caller's dtype, which a fused GPU
    kernel reads. With a window, the finite-state part reads the keys
    that leave the window (the buffer first), and the exact part the window itself; with sinks,
    the sinks' values are zeroed on their way into the finite state and the exact part also
    reads the sink buffer (a sink inside the window is counted there once). `log_decay` `[B, Hkv, L]`
    decays the finite state at each new position before the key that enters there is added, and
    `delta_strength` `[B, Hkv, L]` (a delta-rule spec) is the write strength of each position's entering key.
    With `flex_inputs` (the caller's q `[B, H, L, D]`, k and v; given where `ops.backends` picks "flex":
    an empty buffer and no state wanted back) the exact part, sinks included, runs in FlexAttention.
    One recurrent step of a hybrid (decoding) takes `ops.window_step`, the same result in fewer
    operations. `fresh_state`: `state` is the empty state (the kept selection then scores only as many
    slots as can be filled). `keep_state=False`: the caller discards the new state (training), whose
    window buffers and finite state are then not written where that costs a pass (their fields None).
    `softcap` caps the exact part's scores (window, sinks, kept keys, and the saliencies that rank the kept
    keys), never the finite state's."""
    if spec.window is not None and mode == "recurrent" and q.shape[-2] == 1:
        return window_hybrid_step(
            q,
            k,
            augmented_v,
            key_mask,
            state,
            kernel,
            spec,
            window_scale,
            linear_log_scale,
            in_place,
            log_decay,
            delta_strength,
            softcap,
        )
    packed = state.packed.to(q.dtype)
    length = q.shape[-2]
    if spec.window is None:
        keys, values, valid = k, augmented_v, key_mask
    else:
        if not fresh_state:
            state = window_in_order(state)
        keys = torch.cat([state.window_keys.to(q.dtype), k], dim=-2)
        values = torch.cat([state.window_values.to(q.dtype), augmented_v], dim=-2)
        valid = torch.cat([state.window_valid, key_mask], dim=-1)
    entering_keys, entering = keys[..., :length, :], values[..., :length, :]
    is_sink, window_valid = None, valid
    if spec.sinks is not None or spec.kept is not None:
        ranks = visible_ranks(valid, state.t, spec.window)
    if spec.sinks is not None:
        is_sink = valid & (ranks < spec.sinks)
        entering = entering * (~is_sink[:, None, :length, None]).to(values.dtype)
        window_valid = valid & ~is_sink
    new_state = RecurrentState(packed=packed, t=state.t)
    if spec.window is not None:
        if keep_state:
            new_state.window_keys = keys[..., -spec.window :, :].clone()
            new_state.window_values = values[..., -spec.window :, :].clone()
            new_state.window_valid = valid[:, -spec.window :].clone()
            new_state.window_start = torch.zeros_like(state.t)
        exact, row_max, saliency = None, None, None
        if flex_inputs is None:
            query_valid = key_mask if spec.kept is not None else None
            band = banded_exp_attention(
                q,
                keys,
                values,
                window_valid,
                window_scale,
                spec.window,
                spec.chunk_size,
                query_valid,
                _shift_cancels(spec),
                softcap,
            )
            exact, row_max, saliency = (*band, None)[:3]
        elif spec.kept is not None:  # FlexAttention scores the window: the band only ranks its keys
            saliency = window_saliency(
                q, keys, window_valid, window_scale, spec.window, spec.chunk_size, key_mask, softcap
            )
        if spec.kept is not None:
            entering_keys, entering, exact, row_max = _kept_part(
                q,
                keys,
                entering,
                ranks,
                window_valid,
                saliency,
                exact,
                row_max,
                state,
                new_state,
                spec,
                window_scale,
                fresh_state,
                softcap,
            )
    if mode == "chunked":
        linear, packed = chunked_linear_attention(
            q,
            entering_keys,
            entering,
            packed,
            kernel,
            spec.chunk_size,
            io_dtype,
            log_decay,
            fresh_state,
            keep_state,
            delta_strength,
            spec.additive_mass,
        )
    else:
        linear, packed = recurrent_linear_attention(
            q, entering_keys, entering, packed, kernel, in_place, log_decay, delta_strength, spec.additive_mass
        )
    new_state.packed = packed
    if spec.window is None:
        return linear, new_state
    if flex_inputs is not None:
        kept_part = None if spec.kept is None else (exact, row_max)
        exact_and_linear = _flex_window_hybrid(
            *flex_inputs, key_mask, linear, window_scale, spec, linear_log_scale, kept_part, softcap
        )
        return exact_and_linear, new_state
    if spec.sinks is not None:
        old_sinks = (state.sink_keys.to(q.dtype), state.sink_values.to(q.dtype))
        sinks = filled_sinks(*old_sinks, k, augmented_v, is_sink[:, spec.window :], ranks[:, spec.window :])
        new_state.sink_keys, new_state.sink_values = sinks
        seen = state.t[:, None] + key_mask.cumsum(-1)
        exact, row_max = add_sink_attention(q, exact, row_max, *sinks, seen, window_scale, softcap)
    return exact + linear * mix_weight(linear_log_scale, row_max, k.shape[1]), new_state


def _shift_cancels(spec: AttentionSpec) -> bool:
    """Whether the spec's normaliser divides by the denominator, so that any per-row shift of the exact
    part cancels (the log-sum-exp may then stand in for the row max: `ops.window`)."""
    return spec.normalizer == "softmax"


def _kept_part(
    q,
    keys,
    leaving_values,
    ranks,
    candidates,
    saliency,
    exact,
    row_max,
    state,
    new_state,
    spec,
    scale,
    fresh_state,
    softcap=None,
):
    """The kept keys of a hybrid with `spec.kept` (`ops.kept`): the stream entering the finite state
    (keys `[B, Hkv, L, D]`, values `[B, Hkv, L, Dv + 1]`), the exact part with the kept keys merged in,
    and the kept buffers and window saliencies written to `new_state`. `keys` `[B, Hkv, W + L, D]`,
    `ranks` `[B, W + L]` (visible ranks, `ops.sinks.visible_ranks`) and `candidates` (visible and not a
    sink) are the window buffer then the call's positions; `saliency` `[B, Hkv, W + L]` is the call's
    share of each key's saliency. A key ranks by the larger of its saliency and its predecessor's
    (`ops.kept`). From an empty state (`fresh_state`) nothing is kept before the call and the first W
    leaving keys are the empty window buffer. `softcap` caps the kept keys' scores."""
    window, length = spec.window, q.shape[-2]
    saliency = saliency.to(q.dtype)
    earlier = torch.maximum(saliency[..., :window], state.window_scores.to(q.dtype))  # buffer keys seen before
    saliency = torch.cat([earlier, saliency[..., window:]], -1)
    ranking = rank_scores(saliency, state.left_score.to(q.dtype))
    buffers = (
        state.kept_keys.to(q.dtype),
        state.kept_values.to(q.dtype),
        state.kept_scores.to(q.dtype),
        state.kept_positions,
        state.kept_valid,
    )
    selection = select_kept(
        q,
        keys[..., :length, :],
        leaving_values,
        ranking[..., :length],
        ranks[:, :length],
        candidates[:, :length],
        buffers,
        scale,
        spec.chunk_size,
        held_before=0 if fresh_state else None,
        first_candidate=window if fresh_state else 0,
        any_shift=_shift_cancels(spec),
        softcap=softcap,
    )
    new_state.window_scores = saliency[..., -window:]
    new_state.left_score = saliency[..., length - 1]
    new_state.kept_keys, new_state.kept_values = selection.kept_keys, selection.kept_values
    new_state.kept_scores, new_state.kept_positions = selection.kept_scores, selection.kept_positions
    new_state.kept_valid = selection.kept_valid
    if exact is None:  # the window's exact part is FlexAttention's, merged later
        return selection.keys, selection.values, selection.numerator, selection.row_max
    exact, row_max = merge_exact(exact, row_max, selection.numerator, selection.row_max)
    return selection.keys, selection.values, exact, row_max


def _flex_inputs(qkv: tuple[torch.Tensor, ...], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q, k, v as FlexAttention reads them: contiguous in `dtype`, each in one copy at most."""
    return tuple(x.to(dtype, memory_format=torch.contiguous_format) for x in qkv)


def _flex_window_hybrid(
    q, k, v, key_mask, linear, scale, spec, log_scale, kept_part=None, softcap=None
) -> torch.Tensor:
    """The augmented numerator `[B, Hkv, G, L, Dv + 1]` of a hybrid from an empty state: its exact part
    (window and sinks) in FlexAttention, which reads the caller's q `[B, H, L, D]`, k and v (zero at
    padding) in the caller's dtype, contiguous (`_flex_inputs`), and `linear` (`[B, Hkv, G, L, Dv + 1]`)
    beyond them. `kept_part`: the exact part over the kept keys (numerator `[B, Hkv, G, L, Dv + 1]`, row
    max `[..., 1]`), merged with the window's under one row max. `softcap` caps the window's scores."""
    out, lse = flex_window_attention(
        q,
        k,
        v,
        key_mask,
        scale,
        spec.window,
        sinks=spec.sinks or 0,
        compiled=q.is_cuda,
        softcap=softcap,
    )
    per_head = (*q.shape[:3], -1)  # [B, Hkv, G, L, X] -> [B, H, L, X]
    kept = None if kept_part is None else tuple(x.reshape(per_head) for x in kept_part)
    combined = combine_window_and_linear(out, lse, linear.reshape(per_head), log_scale, kept)
    return combined.view(linear.shape)
