"""Stand-ins for the fused GPU kernels (fla's `chunk_simple_gla`, FlexAttention) that keep what the
kernels keep for the backward pass, and counters of the bytes the PyTorch around them writes and keeps.

A stand-in computes the kernel's values with its float64 statement; while it runs, the written-bytes
count is paused, so that a count is what this package adds around the kernels, forward and backward.
"""

from __future__ import annotations

import contextlib
import importlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_softmax_rnn.ops import backends
from hf_softmax_rnn.ops.fla_linear import chunk_simple_gla_reference
from hf_softmax_rnn.ops.flex_window import window_attention_reference

#: Operations that are not marked as views but return a view of their input (no kernel, no bytes):
#: `_unsafe_view` reshapes the result of a batched product back to the caller's batch dimensions.
ALIASING_OPERATIONS = (torch.ops.aten._unsafe_view.default,)
#: In-place writes of the entries an index names (a row of a ring buffer, a kept slot): they return their
#: whole target but write only index.numel() entries of it.
INDEXED_WRITES = (torch.ops.aten.scatter_.src, torch.ops.aten.scatter_.value)


class WrittenBytes(TorchDispatchMode):
    """Counts the bytes the operations write (views write none) and the operations that are not views
    (on a GPU, kernel launches), except inside a kernel stand-in."""

    active: list[WrittenBytes] = []

    def __init__(self):
        super().__init__()
        self.bytes, self.operations, self.paused = 0, 0, False

    def __enter__(self):
        WrittenBytes.active.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        WrittenBytes.active.remove(self)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused and not func.is_view and func not in ALIASING_OPERATIONS:
            self.operations += 1
            if func in INDEXED_WRITES:
                self.bytes += args[2].numel() * out.element_size()  # (target, dim, index, src or value)
                return out
            self.bytes += output_bytes(out)
        return out


def output_sizes(out) -> list[int]:
    """Bytes of each tensor an operation returned (one tensor, or a tuple or list of them)."""
    outputs = out if isinstance(out, (tuple, list)) else [out]
    return [x.numel() * x.element_size() for x in outputs if isinstance(x, torch.Tensor)]


def output_bytes(out) -> int:
    """Bytes of the tensors an operation returned, together."""
    return sum(output_sizes(out))


class AllocatedBytes(TorchDispatchMode):
    """Counts the bytes of the new tensors the operations return (views and in-place writes make none)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and not func._schema.is_mutable and func not in ALIASING_OPERATIONS:
            self.bytes += output_bytes(out)
        return out


class LargestTensor(TorchDispatchMode):
    """The bytes of the largest new tensor an operation returns (views and in-place writes make none)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and not func._schema.is_mutable and func not in ALIASING_OPERATIONS:
            self.bytes = max([self.bytes, *output_sizes(out)])
        return out


class DispatchedOperations(TorchDispatchMode):
    """Counts every dispatched operation, views included (on a CPU, about one dispatch each)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def inside_kernel():
    """Pause the written-bytes counts while a stand-in stands for a fused kernel."""
    for counter in WrittenBytes.active:
        counter.paused = True
    try:
        yield
    finally:
        for counter in WrittenBytes.active:
            counter.paused = False


class _Saved:
    """A tensor as autograd keeps it for the backward pass; freed with the node that saved it."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def saved_bytes(function) -> int:
    """Bytes of the distinct storages autograd keeps for the backward pass of `function()`: those of the
    nodes still alive when it returns (a node whose result was detached at once is freed with it)."""
    saved: list[weakref.ref] = []

    def pack(tensor):
        box = _Saved(tensor.detach())  # (the tensor itself would tie a saved output to its own node: a cycle)
        saved.append(weakref.ref(box))
        return box

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.tensor):
        result = function()
    storages = {}
    for box in filter(None, (ref() for ref in saved)):
        storages[box.tensor.untyped_storage().data_ptr()] = box.tensor.untyped_storage().nbytes()
    del result
    return sum(storages.values())


class FlaStandIn(torch.autograd.Function):
    """fla's `chunk_simple_gla` as autograd sees it: the float64 statement's values, and q, k, v, the
    log-decays g (or None) and the initial state kept for the backward pass (fla recomputes the rest
    there)."""

    @staticmethod
    def forward(ctx, q, k, v, initial_state, scale, g):
        ctx.save_for_backward(q, k, v, initial_state, g)
        ctx.scale = scale
        with inside_kernel():
            return chunk_simple_gla_reference(q, k, v, g=g, scale=scale, initial_state=initial_state)

    @staticmethod
    def backward(ctx, d_out, d_final):
        q, k, v, initial_state, g = ctx.saved_tensors
        with inside_kernel(), torch.enable_grad():
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            start = None if initial_state is None else initial_state.detach().requires_grad_()
            decay = None if g is None else g.detach().requires_grad_()
            outputs = chunk_simple_gla_reference(*leaves, g=decay, scale=ctx.scale, initial_state=start)
            wrt = leaves + [x for x in (start, decay) if x is not None]
            grads = list(torch.autograd.grad(outputs, wrt, (d_out, d_final)))
        d_start = None if start is None else grads.pop(3)
        return *grads[:3], d_start, None, None if decay is None else grads[3]

    @staticmethod
    def chunk_function(q, k, v, *, initial_state, scale, g=None, **_):
        """The stand-in with `chunk_simple_gla`'s keywords."""
        return FlaStandIn.apply(q, k, v, initial_state, scale, g)


class FlexStandIn(torch.autograd.Function):
    """`ops.flex_window.flex_window_attention` as autograd sees the compiled kernel: the dense reference's
    (o_w in q's dtype, l_w float32), and q, k, v, o_w and l_w kept for the backward pass."""

    @staticmethod
    def forward(ctx, q, k, v, key_valid, scale, window, sinks, softcap):
        with inside_kernel():
            out, lse = window_attention_reference(q, k, v, key_valid, scale, window, sinks, softcap)
            out, lse = out.to(q.dtype), lse.float()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.arguments = (key_valid, scale, window, sinks, softcap)
        return out, lse

    @staticmethod
    def backward(ctx, d_out, d_lse):
        q, k, v, _, _ = ctx.saved_tensors
        with inside_kernel(), torch.enable_grad():
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            out, lse = window_attention_reference(*leaves, *ctx.arguments)
            grads = torch.autograd.grad((out.to(q.dtype), lse.float()), leaves, (d_out, d_lse))
        return *grads, None, None, None, None, None

    @staticmethod
    def window_function(q, k, v, key_valid, scale, window, sinks=0, compiled=True, softcap=None):
        """The stand-in with `flex_window_attention`'s arguments; records what it reads."""
        FlexStandIn.read.append((q, k, v))
        return FlexStandIn.apply(q, k, v, key_valid, scale, window, sinks, softcap)

    read: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []


def use_stand_ins(monkeypatch, flex: bool = False) -> None:
    """CPU calls take the fused paths with the stand-ins in place of fla's kernel (and of FlexAttention)."""
    monkeypatch.setattr(backends, "FUSED_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(backends, "fla_chunk_function", lambda: FlaStandIn.chunk_function)
    if flex:
        monkeypatch.setattr(backends, "triton_available", lambda: True)
        monkeypatch.setattr(FlexStandIn, "read", [])
        ops_attention = importlib.import_module("hf_softmax_rnn.ops.attention")
        monkeypatch.setattr(ops_attention, "flex_window_attention", FlexStandIn.window_function)
