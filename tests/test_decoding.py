"""`GraphedDecodeStep`: what it refuses (on any device), and the property a CUDA graph needs of a decode
step, checked on the CPU: no host synchronisation (no `.item()`, `bool(tensor)` or tensor built from
Python values), whose value a replayed graph would freeze. Replays against eager steps on a GPU are in
tests/gpu/test_graphed_decoding.py."""

import traceback

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache, StaticCache
from transformers.utils import import_utils

from hf_softmax_rnn import AttentionSpec
from hf_softmax_rnn.decoding import GraphedDecodeStep, static_cache_from

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


@pytest.mark.parametrize("rows", [1, 2], ids=["one_row", "two_rows"])
@pytest.mark.parametrize("name", ["transformers", *sorted(SPECS)])
def test_a_static_copy_of_a_prefilled_cache_decodes_as_the_repeated_dynamic_cache(family, name, rows):
    """`static_cache_from(cache, config, max_len, repeats=3)` decodes three steps with the logits of the
    dynamic cache repeated with `batch_repeat_interleave(3)`; each copy of a row gets its own tokens."""
    model = _model(family, name)
    ids, _ = left_padded_batch(lengths=(6,) * rows)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, cache=cache, use_cache=True)
        static = static_cache_from(cache, model.config, max_cache_len=ids.shape[1] + 3, repeats=3)
        cache.batch_repeat_interleave(3)
        tokens = torch.arange(3 * rows * 3).view(3, 3 * rows, 1) % 50 + 1
        for step_tokens in tokens:
            want = model(input_ids=step_tokens, cache=cache, use_cache=True).logits
            got = model(input_ids=step_tokens, cache=static, use_cache=True).logits
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert int(static.get_seq_length()) == ids.shape[1] + 3


def test_static_cache_from_refuses_what_it_cannot_copy(family):
    model = tiny_model(family, "linear_elu")
    source = tiny_source(family)
    ids, _ = left_padded_batch(lengths=(4,))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, cache=cache, use_cache=True)
        kv_cache = DynamicCache(config=source.config)
        source(input_ids=ids, cache=kv_cache, use_cache=True)
    with pytest.raises(ValueError, match="repeats=0 is not allowed; expected at least 1"):
        static_cache_from(cache, model.config, max_cache_len=8, repeats=0)
    with pytest.raises(TypeError, match="copies a DynamicCache; got StaticCache"):
        static_cache_from(StaticCache(config=model.config, max_cache_len=8), model.config, max_cache_len=8)
    with pytest.raises(TypeError, match="layer 0: a RecurrentStateLayer cannot be copied into a StaticLayer"):
        static_cache_from(cache, source.config, max_cache_len=8)
    with pytest.raises(ValueError, match=r"max_cache_len=4 holds no new token after the 4 cached.*at least 5"):
        static_cache_from(kv_cache, source.config, max_cache_len=4)
    with pytest.raises(ValueError, match="layer 0 of the cache holds no state yet: run the prompt"):
        static_cache_from(DynamicCache(config=model.config), model.config, max_cache_len=8)


#: case id -> (keyword arguments of `static_cache_from` over valid ones, error, message).
_BAD_STATIC_CACHE_ARGUMENTS = {
    "float_max_cache_len": (dict(max_cache_len=16.0), TypeError, "max_cache_len=16.0 has type float; expected an int"),
    "string_max_cache_len": (dict(max_cache_len="16"), TypeError, "max_cache_len='16' has type str; expected an int"),
    "bool_max_cache_len": (dict(max_cache_len=True), TypeError, "max_cache_len=True has type bool; expected an int"),
    "zero_max_cache_len": (dict(max_cache_len=0), ValueError, "max_cache_len=0 is not allowed; expected at least 1"),
    "float_repeats": (dict(repeats=2.5), TypeError, "repeats=2.5 has type float; expected an int >= 1"),
    "string_repeats": (dict(repeats="2"), TypeError, "repeats='2' has type str; expected an int >= 1"),
    "bool_repeats": (dict(repeats=True), TypeError, "repeats=True has type bool; expected an int >= 1"),
    "zero_repeats": (dict(repeats=0), ValueError, "repeats=0 is not allowed; expected at least 1"),
    "no_config": (dict(config=None), TypeError, "config must be the model's PreTrainedConfig.*got NoneType"),
    "dict_config": (dict(config={"num_hidden_layers": 2}), TypeError, "config must be .*PreTrainedConfig.*got dict"),
}


@pytest.mark.parametrize("name", ["transformers", "linear_elu"])
@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [pytest.param(*case, id=case_id) for case_id, case in _BAD_STATIC_CACHE_ARGUMENTS.items()],
)
def test_static_cache_from_refuses_bad_arguments_naming_them(family, name, arguments, error, message):
    """Refused before any copy, for a KV cache and a recurrent one alike (`repeats=True` was taken for 1 by
    the first and failed deep inside the second)."""
    model = _model(family, name)
    ids, _ = left_padded_batch(lengths=(4,))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, cache=cache, use_cache=True)
    call = {"config": model.config, "max_cache_len": 8, "repeats": 2, **arguments}
    with pytest.raises(error, match=f"static_cache_from: {message}"):
        static_cache_from(cache, **call)


@pytest.mark.parametrize("name", ["transformers", "linear_elu"])
def test_static_cache_from_takes_numpy_integers(family, name):
    model = _model(family, name)
    ids, _ = left_padded_batch(lengths=(4,))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, cache=cache, use_cache=True)
        static = static_cache_from(cache, model.config, max_cache_len=np.int64(8), repeats=np.int32(2))
    assert int(static.get_seq_length()) == 4


@pytest.mark.parametrize(
    ("name", "arguments", "allowed"),
    [
        ("transformers", dict(max_cache_len=2**62), r"max_cache_len <= [\d,]+ at repeats=1$"),
        ("transformers", dict(max_cache_len=2**40), r"max_cache_len <= [\d,]+ at repeats=1$"),
        ("transformers", dict(max_cache_len=8, repeats=2**45), r"repeats <= [\d,]+ at max_cache_len=8$"),
        ("linear_elu", dict(max_cache_len=8, repeats=2**45), r"repeats <= [\d,]+ at max_cache_len=8$"),
    ],
    ids=["kv_2_62_positions", "kv_2_40_positions", "kv_2_45_repeats", "recurrent_2_45_repeats"],
)
def test_static_cache_from_refuses_a_cache_bigger_than_the_device(family, name, arguments, allowed):
    """Refused, naming the size asked and what fits, before any allocation (which raised an allocator error or
    an overflow of the storage size)."""
    model = _model(family, name)
    ids, _ = left_padded_batch(lengths=(4,))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, cache=cache, use_cache=True)
    call = {"repeats": 1, **arguments}
    with pytest.raises(ValueError, match=rf"static_cache_from: max_cache_len=.* bytes of cache, more than .*{allowed}"):
        static_cache_from(cache, model.config, **call)


def test_static_cache_from_takes_any_max_cache_len_for_recurrent_layers(family):
    """max_cache_len sizes KV buffers only: a model of recurrent layers holds its state whatever it is."""
    model = _model(family, "linear_elu")
    ids, _ = left_padded_batch(lengths=(4,))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, cache=cache, use_cache=True)
        static = static_cache_from(cache, model.config, max_cache_len=2**62)
    assert int(static.get_seq_length()) == 4
