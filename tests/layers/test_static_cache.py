"""The static recurrent-state cache layer: allocated once, updated in place (fixed addresses)."""

import pytest
import torch
from transformers import StaticCache

from hf_softmax_rnn import SoftmaxRNNLlamaConfig
from hf_softmax_rnn.layers.cache import StaticRecurrentStateLayer, cache_nbytes, recurrent_state_layer
from hf_softmax_rnn.ops import RecurrentState

from ..models.helpers import LLAMA_SHAPE


def window_state(batch=3, seed=0) -> RecurrentState:
    generator = torch.Generator().manual_seed(seed)
    return RecurrentState(
        packed=torch.randn(batch, 2, 6, 8 + 1, generator=generator),
        t=torch.arange(batch) + seed,
        window_keys=torch.randn(batch, 2, 4, 8, generator=generator),
        window_values=torch.randn(batch, 2, 4, 8 + 1, generator=generator),
        window_valid=torch.rand(batch, 4, generator=generator) > 0.5,
        sink_keys=torch.randn(batch, 2, 3, 8, generator=generator),
        sink_values=torch.randn(batch, 2, 3, 8 + 1, generator=generator),
    )


def filled_static_layer(batch=3, seen=5) -> StaticRecurrentStateLayer:
    layer = StaticRecurrentStateLayer(max_cache_len=16)
    layer.update_state(window_state(batch), seen)
    return layer


def _config():
    return SoftmaxRNNLlamaConfig(attention="linear_elu", **LLAMA_SHAPE)


def test_static_cache_from_config_builds_static_recurrent_layers():
    cache = StaticCache(config=SoftmaxRNNLlamaConfig(attention="hedgehog_window_64", **LLAMA_SHAPE), max_cache_len=16)
    assert [type(layer) for layer in cache.layers] == [StaticRecurrentStateLayer] * 2
    assert cache.is_compileable
    assert recurrent_state_layer(cache, 1) is cache.layers[1]


def test_updates_copy_into_the_first_buffers():
    layer = filled_static_layer(seen=5)
    addresses = [x.data_ptr() for x in layer.state.tensors()]
    new = window_state(seed=1)
    new.t = torch.arange(12)[::4]  # a strided view, as the ops return it
    layer.update_state(new, 1)
    assert [x.data_ptr() for x in layer.state.tensors()] == addresses
    assert all(torch.equal(a, b) for a, b in zip(layer.state.tensors(), new.tensors(), strict=True))
    assert all(x.is_contiguous() for x in layer.state.tensors())
    assert int(layer.get_seq_length()) == 6 and layer.get_mask_sizes(1) == (1, 0)
    assert layer.nbytes == new.nbytes and cache_nbytes(StaticCache(config=_config(), max_cache_len=4)) == 0


def test_reorder_is_in_place_and_reset_zeroes():
    layer = filled_static_layer()
    before = [x.clone() for x in layer.state.tensors()]
    addresses = [x.data_ptr() for x in layer.state.tensors()]
    layer.reorder_cache(torch.tensor([2, 0, 0]))
    assert all(torch.equal(a, b[[2, 0, 0]]) for a, b in zip(layer.state.tensors(), before, strict=True))
    assert [x.data_ptr() for x in layer.state.tensors()] == addresses
    layer.reset()
    assert all(not x.any() for x in layer.state.tensors()) and int(layer.get_seq_length()) == 0
    assert [x.data_ptr() for x in layer.state.tensors()] == addresses


def test_batch_resizing_keeps_every_row_and_crop_offload_refuse():
    layer = filled_static_layer()
    before = [x.clone() for x in layer.state.tensors()]
    layer.batch_repeat_interleave(2)
    layer.batch_select_indices(torch.tensor([0, 5]))
    assert all(torch.equal(a, b[[0, 2]]) for a, b in zip(layer.state.tensors(), before, strict=True))
    layer.crop(0)
    with pytest.raises(ValueError, match="cannot remove 2 tokens"):
        layer.crop(-2)
    with pytest.raises(TypeError, match="holds a recurrent state"):
        layer.update(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))
    with pytest.raises(ValueError, match="cannot be offloaded"):
        layer.offload()
