"""`GraphedDecodeStep`: what it refuses (on any device), and the property a CUDA graph needs of a decode
step, checked on the CPU: no host synchronisation (no `.item()`, `bool(tensor)` or tensor built from
Python values), whose value a replayed graph would freeze. Replays against eager steps on a GPU are in
tests/gpu/test_graphed_decoding.py."""

import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache, StaticCache
from transformers.utils import import_utils

from hf_softmax_rnn import AttentionSpec
from hf_softmax_rnn.decoding import GraphedDecodeStep

from .models.helpers import FAMILIES, left_padded_batch, tiny_model, tiny_source

SPECS = {
    "linear_elu": "linear_elu",
    "softmax_taylor_2": "softmax_taylor_2",
    "softmax_taylor_2_l2": "softmax_taylor_2_l2",
    "hedgehog_window3": AttentionSpec(kind="linear", feature_map="hedgehog", window=3, chunk_size=4),
    "hedgehog_window2_sinks1_kept2_decay": AttentionSpec(
        kind="linear", feature_map="hedgehog", window=2, sinks=1, kept=2, decay=True, chunk_size=4
    ),
}
#: aten ops that read a tensor's value on the host (a device sync) or copy Python values to the device.
HOST_OPS = (
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.lift_fresh.default,
)


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


class HostOps(TorchDispatchMode):
    """Records where each of `HOST_OPS` is called."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_OPS:
            self.calls.append(f"{func} at " + "".join(traceback.format_stack(limit=4)[:-1]))
        return func(*args, **(kwargs or {}))


def _model(family: str, name: str) -> torch.nn.Module:
    return tiny_source(family) if name == "transformers" else tiny_model(family, SPECS[name])


def _prefilled_static_cache(model, ids, mask=None) -> StaticCache:
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 8)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
    return cache


def test_host_ops_are_seen():
    """The probe itself: a `.item()` and a `bool()` of a tensor are recorded."""
    with HostOps() as probe:
        torch.ones(2).sum().item()
        bool(torch.ones(2).all())
    assert len(probe.calls) == 2


@pytest.mark.parametrize("name", ["transformers", *sorted(SPECS)])
def test_decode_step_reads_nothing_on_the_host(family, name, monkeypatch):
    """What `GraphedDecodeStep` records: one token per row, positions from the cache or given; with
    transformers told that a CUDA stream is capturing, as it is then (it skips its padding warning)."""
    monkeypatch.setattr(import_utils, "is_cuda_stream_capturing", lambda: True)
    model = _model(family, name)
    ids, mask = left_padded_batch(lengths=(6, 6))
    cache = _prefilled_static_cache(model, ids, mask)
    token = torch.ones(2, 1, dtype=torch.long)
    with torch.no_grad(), HostOps() as probe:
        model(input_ids=token, cache=cache, use_cache=True)
        model(input_ids=token, position_ids=torch.full((2, 1), 7), cache=cache, use_cache=True)
    assert probe.calls == []


def test_refuses_a_dynamic_cache_an_empty_cache_and_no_warm_up(family):
    model = tiny_model(family, "linear_elu")
    with pytest.raises(TypeError, match="needs a StaticCache.*got DynamicCache"):
        GraphedDecodeStep(model, DynamicCache(config=model.config))
    with pytest.raises(ValueError, match="needs a prefilled cache"):
        GraphedDecodeStep(model, StaticCache(config=model.config, max_cache_len=8))
    ids, _ = left_padded_batch(lengths=(4,))
    with pytest.raises(ValueError, match="eager_steps=0 is not allowed; expected at least 1"):
        GraphedDecodeStep(model, _prefilled_static_cache(model, ids), eager_steps=0)


def test_refuses_a_padded_prompt_for_kv_layers_and_a_cpu_model(family):
    ids, mask = left_padded_batch(lengths=(6, 3))
    source = tiny_source(family)
    with pytest.raises(ValueError, match=r"layers \[0, 1\] keep a KV cache.*padded prompt"):
        GraphedDecodeStep(source, _prefilled_static_cache(source, ids, mask), prompt_mask=mask)
    model = tiny_model(family, "linear_elu")  # recurrent states kept the padding out: allowed, up to the device
    with pytest.raises(ValueError, match="the model is on cpu, expected a cuda device"):
        GraphedDecodeStep(model, _prefilled_static_cache(model, ids, mask), prompt_mask=mask)
