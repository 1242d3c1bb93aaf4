"""The checks `attention` runs on its arguments before it computes anything: each bad value raises a
`TypeError` or `ValueError` that names it and what is allowed."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import torch

from hf_softmax_rnn.attention_spec import MODES, AttentionSpec
from hf_softmax_rnn.ops.kernels import AttentionParams
from hf_softmax_rnn.ops.recurrent_state import RecurrentState

#: The dtypes q, k and v may have (and the dtypes `attention` returns).
INPUT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def check_padding_mask(attention_mask, name: str = "attention_mask") -> None:
    """A padding mask is a tensor of bools or of exactly 0 and 1 (1 = token); any other value raises,
    named. Reads the values (one reduction) only for a non-bool mask outside torch.compile."""
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of 0/1 or bools; got {type(attention_mask).__name__}")
    if attention_mask.dtype == torch.bool or attention_mask.device.type == "meta" or torch.compiler.is_compiling():
        return
    if attention_mask.is_cuda and torch.cuda.is_current_stream_capturing():  # a CUDA graph cannot read values
        return
    if attention_mask.is_complex():
        raise TypeError(f"{name} must hold 0/1 or bools; got dtype {attention_mask.dtype}")
    bad = (attention_mask != 0) & (attention_mask != 1)
    if bool(bad.any()):
        raise ValueError(
            f"{name} must hold only 0 (padding) and 1 (token), or bools; it holds {attention_mask[bad][0].item()!r}"
        )


def _check_tensors(q, k, v) -> None:
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"attention: {name} must be a torch.Tensor; got {type(tensor).__name__}")
        if tensor.dtype not in INPUT_DTYPES:
            raise TypeError(
                f"attention: {name} has dtype {tensor.dtype}; expected one of "
                f"{[str(dtype).removeprefix('torch.') for dtype in INPUT_DTYPES]}"
            )
    if len({q.device, k.device, v.device}) != 1:
        raise ValueError(f"attention: q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        raise TypeError(
            f"attention: q, k, v must have one dtype; got {q.dtype}, {k.dtype}, {v.dtype}; cast them to one (under "
            "autocast they may differ, as scaled_dot_product_attention's may)"
        )


def _check_shapes(q, k, v) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"attention expects q [B, H, L, D] and k, v [B, Hkv, L, D]; got shapes {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attention got mismatched shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[0] < 1 or q.shape[1] < 1 or k.shape[1] < 1 or q.shape[-1] < 1:
        raise ValueError(
            f"attention: q {tuple(q.shape)} and k {tuple(k.shape)} have {q.shape[0]} sequences, {q.shape[1]} query "
            f"heads, {k.shape[1]} key/value heads and head_dim {q.shape[-1]}; expected at least 1 of each"
        )
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"attention: query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")


def check_arguments(gates, params, scale, max_state_bytes, switches: dict[str, object] | None = None) -> None:
    """The types and ranges of the arguments other than the tensors, the spec, the mode and the state;
    `switches`: {name: value} of the flag arguments, each a bool (a string such as "no" would read as true)."""
    for name, value in (switches or {}).items():
        if not isinstance(value, bool):
            raise TypeError(f"attention: {name}={value!r} is not allowed; expected True or False")
    if gates is not None and not isinstance(gates, Mapping):
        raise TypeError(
            "attention: gates must be None or a dict of tensors ('output', 'decay', 'delta'); got "
            f"{type(gates).__name__}"
        )
    if params is not None and not _is_attention_params(params):
        raise TypeError(f"attention: params must be None or an AttentionParams; got {type(params).__name__}")
    if scale is not None and (
        not isinstance(scale, numbers.Real) or isinstance(scale, bool) or not math.isfinite(scale) or scale <= 0
    ):
        raise ValueError(f"attention: scale={scale!r} is not allowed; expected None or a finite number > 0")
    if not isinstance(max_state_bytes, numbers.Real) or isinstance(max_state_bytes, bool) or not max_state_bytes >= 0:
        raise ValueError(
            f"attention: max_state_bytes={max_state_bytes!r} is not allowed; expected a number of bytes >= 0 "
            "(math.inf: no limit)"
        )


def check_softcap(softcap, spec) -> None:
    """`softcap` is None or a finite number > 0, and only where the spec has exact softmax scores to cap
    (`AttentionSpec.softcap_applies`: exact softmax, or a window hybrid's exact part)."""
    if softcap is None:
        return
    if not isinstance(softcap, numbers.Real) or isinstance(softcap, bool) or not math.isfinite(softcap) or softcap <= 0:
        raise ValueError(f"attention: softcap={softcap!r} is not allowed; expected None or a finite number > 0")
    if not spec.softcap_applies:
        raise ValueError(
            f"attention: softcap={softcap} caps exact softmax scores, but the spec (kind={spec.kind!r}, "
            f"window={spec.window}) has none (the cap does not factor into a feature map or a finite state); "
            "expected kind='softmax', a window hybrid (window=W: its window, sinks and kept keys take the cap) "
            "or softcap=None"
        )


def _is_attention_params(params) -> bool:
    """An `AttentionParams`, of this module or of another copy of it (remote code loads one)."""
    return isinstance(params, AttentionParams) or type(params).__name__ == AttentionParams.__name__


def check_inputs(q, k, v, spec, mode, attention_mask, gates, state, params, scale, read_gates=True) -> None:
    _check_tensors(q, k, v)
    _check_shapes(q, k, v)
    if mode not in MODES:
        raise ValueError(f"attention: mode={mode!r} is not allowed; expected one of {list(MODES)}")
    if mode != "parallel" and q.shape[-2] != k.shape[-2]:
        raise ValueError(f"attention: mode={mode!r} needs as many keys as queries (the past lives in `state`)")
    if mode == "parallel" and k.shape[-2] < q.shape[-2]:
        raise ValueError(
            f"attention: mode='parallel' needs at least as many keys as queries (the queries are the last "
            f"positions); got {k.shape[-2]} keys for {q.shape[-2]} queries"
        )
    if mode == "parallel" and spec.kept is not None and k.shape[-2] != q.shape[-2]:
        raise ValueError(
            f"attention: {spec.describe()} ranks each key by the queries of its window, so mode='parallel' needs a "
            f"query at every key position; got {q.shape[-2]} queries for {k.shape[-2]} keys (decode through the "
            "recurrent state: mode='recurrent')"
        )
    if mode == "parallel" and state is not None:
        raise ValueError("attention: mode='parallel' takes no state; pass past keys and values in k, v instead")
    if attention_mask is not None:
        check_padding_mask(attention_mask)
    if attention_mask is not None and attention_mask.device != q.device:
        raise ValueError(f"attention_mask is on {attention_mask.device}, q, k and v on {q.device}; expected one device")
    if attention_mask is not None and (attention_mask.dim() != 2 or attention_mask.shape[0] != q.shape[0]):
        raise ValueError(
            f"attention_mask must be a 2-D padding mask [B, L_total]; got shape {tuple(attention_mask.shape)}"
        )
    if attention_mask is not None and attention_mask.shape[1] < k.shape[-2]:
        raise ValueError(
            f"attention_mask covers {attention_mask.shape[1]} positions, fewer than the {k.shape[-2]} keys"
        )
    _check_gates(gates, q, k, spec)
    if read_gates:
        check_gate_values(gates, attention_mask)
    _check_params(params, q, v, spec)
    if spec.effective_feature_map == "hedgehog":
        _check_hedgehog_maps(params, q, k, spec)


def _check_params(params, q: torch.Tensor, v: torch.Tensor, spec: AttentionSpec) -> None:
    """The per-head tensors the spec reads are given, and each one given is a floating tensor on q's device of
    its shape for these inputs (`[H, Dv]` norms, `[H]` others): a shape that broadcasts would mix heads."""
    if spec.window is not None and spec.has_finite_state and params.linear_log_scale is None:
        raise ValueError(
            f"{spec.describe()} needs params.linear_log_scale [H] (the weight of the part beyond the window)"
        )
    if spec.normalizer == "seqlen_pow" and params.seqlen_power is None:
        raise ValueError(f"{spec.describe()} needs params.seqlen_power [H] (the logit of each head's exponent)")
    heads, value_dim = q.shape[1], v.shape[-1]
    shapes = {
        "norm_weight": (heads, value_dim),
        "norm_bias": (heads, value_dim),
        "seqlen_power": (heads,),
        "linear_log_scale": (heads,),
    }
    for name, shape in shapes.items():
        tensor = getattr(params, name)
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.device != q.device:
            got = f"a {tensor.dtype} tensor on {tensor.device}" if isinstance(tensor, torch.Tensor) else type(tensor)
            raise TypeError(f"attention: params.{name} must be a real floating tensor on {q.device}; got {got}")
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"attention: params.{name} has shape {tuple(tensor.shape)}; expected {list(shape)} (one per query "
                f"head{', by value dimension' if len(shape) == 2 else ''}) for these inputs"
            )


def _check_hedgehog_maps(params, q: torch.Tensor, k: torch.Tensor, spec: AttentionSpec) -> None:
    """The hedgehog maps, when given, are one [D, F] map per query head and per KV head for this head size."""
    width = spec.hedgehog_dim or q.shape[-1]
    for name, heads in (("hedgehog_q", q.shape[1]), ("hedgehog_k", k.shape[1])):
        maps = getattr(params, name)
        if maps is not None and (
            not isinstance(maps, torch.Tensor) or not maps.is_floating_point() or maps.device != q.device
        ):
            got = f"a {maps.dtype} tensor on {maps.device}" if isinstance(maps, torch.Tensor) else type(maps).__name__
            raise TypeError(f"attention: params.{name} must be a real floating tensor on {q.device}; got {got}")
        expected = (heads, q.shape[-1], width)
        if maps is not None and tuple(maps.shape) != expected:
            raise ValueError(
                f"attention: params.{name} has shape {tuple(maps.shape)}; expected {list(expected)} (heads, head_dim, "
                "hedgehog_dim) for these inputs"
            )


def _check_gates(gates: Mapping, q: torch.Tensor, k: torch.Tensor, spec: AttentionSpec) -> None:
    unknown = sorted(set(gates) - {"output", "decay", "delta"}, key=repr)
    if unknown:
        raise ValueError(
            f"attention: unknown gates {unknown}; expected only 'output', 'decay' and 'delta' (the caller gates v "
            "itself)"
        )
    for name, gate in gates.items():
        if not isinstance(gate, torch.Tensor) or not gate.is_floating_point() or gate.device != q.device:
            got = f"a {gate.dtype} tensor on {gate.device}" if isinstance(gate, torch.Tensor) else type(gate).__name__
            raise TypeError(f"attention: gates[{name!r}] must be a real floating tensor on {q.device}; got {got}")
    if spec.output_gate and "output" not in gates:
        raise ValueError(f"{spec.describe()} needs gates['output'] [B, H, L]; got gates with keys {sorted(gates)}")
    if not spec.output_gate and "output" in gates:
        raise ValueError(
            f"attention: {spec.describe()} has output_gate=False, so it takes gates['output'] only with "
            "output_gate=True (it would not be applied)"
        )
    output = gates.get("output")
    if spec.output_gate and tuple(output.shape) != tuple(q.shape[:3]):
        raise ValueError(
            f"attention: gates['output'] has shape {tuple(output.shape)}; expected one gate per query head and "
            f"query, {list(q.shape[:3])}"
        )
    _check_decay(gates.get("decay"), k, spec)
    _check_delta(gates.get("delta"), k, spec)


#: gate name -> (lowest, highest) value it may hold at a token, and what that range is.
GATE_RANGES: dict[str, tuple[float, float, str]] = {
    "output": (0.0, 1.0, "sigmoid gate values in [0, 1]"),
    "decay": (float("-inf"), 0.0, "log-decays <= 0 (-inf: forget the state)"),
    "delta": (0.0, 1.0, "write strengths in [0, 1]"),
}


def check_gate_values(gates: Mapping[str, torch.Tensor], attention_mask: torch.Tensor | None = None) -> None:
    """Each gate holds values of its range (`GATE_RANGES`, NaN outside every one) at the tokens of
    `attention_mask` (padding may hold anything: it is never read); one that does not raises, naming the value
    and where it is. The gates' shapes are checked. Reads the values (one reduction a gate) outside torch.compile
    and CUDA graph capture, as `check_padding_mask` does."""
    if torch.compiler.is_compiling():
        return
    for name, gate in gates.items():
        if gate.device.type == "meta" or (gate.is_cuda and torch.cuda.is_current_stream_capturing()):
            continue
        low, high, allowed = GATE_RANGES[name]
        tokens = None if attention_mask is None else attention_mask[:, -gate.shape[-1] :].bool()[:, None, :]
        read = gate if tokens is None else gate.masked_fill(~tokens, high)
        lowest, highest = torch.aminmax(read) if gate.numel() else (high, high)  # (NaN: both NaN)
        if lowest >= low and highest <= high:
            continue
        bad = ~((read >= low) & (read <= high))
        where = [index[0].item() for index in bad.nonzero(as_tuple=True)]
        raise ValueError(
            f"attention: gates[{name!r}] holds {gate[tuple(where)].item()!r} at [batch, head, position] = "
            f"{where}; expected {allowed}"
        )


def _check_delta(strength: torch.Tensor | None, k: torch.Tensor, spec: AttentionSpec) -> None:
    if spec.delta_rule != (strength is not None):
        raise ValueError(
            f"attention: {spec.describe()} has delta_rule={spec.delta_rule}, so it takes gates['delta'] (write "
            f"strengths in [0, 1], [B, Hkv, Lk]) {'and needs them' if spec.delta_rule else 'only with delta_rule=True'}"
        )
    if strength is not None and tuple(strength.shape) != tuple(k.shape[:3]):
        raise ValueError(
            f"attention: gates['delta'] has shape {tuple(strength.shape)}; expected one write strength per KV head "
            f"and key, {list(k.shape[:3])}"
        )


def _check_decay(log_decay: torch.Tensor | None, k: torch.Tensor, spec: AttentionSpec) -> None:
    if spec.decay != (log_decay is not None):
        raise ValueError(
            f"attention: {spec.describe()} has decay={spec.decay}, so it takes gates['decay'] (log-decays "
            f"[B, Hkv, Lk]) {'and needs them' if spec.decay else 'only with decay=True'}"
        )
    if log_decay is not None and tuple(log_decay.shape) != tuple(k.shape[:3]):
        raise ValueError(
            f"attention: gates['decay'] has shape {tuple(log_decay.shape)}; expected one log-decay per KV head and "
            f"key, {list(k.shape[:3])}"
        )


def check_state(state: RecurrentState, q, k, v, spec: AttentionSpec, tag: tuple) -> None:
    """A state from another spec, scale, head layout or batch raises here, naming what differs."""
    if not isinstance(state, RecurrentState):
        raise TypeError(
            f"attention: state must be the RecurrentState a previous call returned (or None); got "
            f"{type(state).__name__}"
        )
    if state.made_by is not None and state.made_by != tag:
        made, wanted = dict(state.made_by), dict(tag)
        differs = [
            f"{name}={made.get(name)!r} (here {wanted.get(name)!r})"
            for name in wanted
            if made.get(name) != wanted[name]
        ]
        raise ValueError(
            f"attention: the state was made for another attention than {spec.describe()}: it has "
            f"{', '.join(differs)}; start from state=None"
        )
    expected = (q.shape[0], k.shape[1], spec.feature_dim(q.shape[-1]), v.shape[-1] + 1)
    if tuple(state.packed.shape) != expected:
        raise ValueError(
            f"attention: the state has shape {tuple(state.packed.shape)} but {spec.describe()} with batch "
            f"{q.shape[0]}, "
            f"{k.shape[1]} KV heads and head_dim {q.shape[-1]} needs [B, Hkv, F, Dv + 1] = {list(expected)}"
        )
    has_window = state.window_keys is not None
    if has_window != (spec.window is not None) or (has_window and state.window_keys.shape[2] != spec.window):
        found = state.window_keys.shape[2] if has_window else None
        raise ValueError(
            f"attention: the state holds a window of {found} positions but the spec has window={spec.window}"
        )
    start = state.window_start
    if has_window and start is not None and (tuple(start.shape) != (q.shape[0],) or start.is_floating_point()):
        raise ValueError(
            f"attention: the state's window_start has shape {tuple(start.shape)} and dtype {start.dtype}; expected "
            f"one integer slot per sequence, [{q.shape[0]}]"
        )
    held_sinks = None if state.sink_keys is None else state.sink_keys.shape[2]
    if held_sinks != spec.sinks:
        raise ValueError(f"attention: the state holds {held_sinks} sinks but the spec has sinks={spec.sinks}")
    held_kept = None if state.kept_keys is None else state.kept_keys.shape[2]
    if held_kept != spec.kept:
        raise ValueError(f"attention: the state holds {held_kept} kept positions but the spec has kept={spec.kept}")
