"""The recurrent-state cache layer inside transformers' Cache."""

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from hf_softmax_rnn import SoftmaxRNNLlamaConfig
from hf_softmax_rnn.layers import RecurrentStateLayer, cache_nbytes
from hf_softmax_rnn.layers.cache import recurrent_state_layer
from hf_softmax_rnn.ops import RecurrentState

from ..models.helpers import LLAMA_SHAPE


def filled_layer(batch=3, seen=5) -> RecurrentStateLayer:
    layer = RecurrentStateLayer()
    state = RecurrentState(packed=torch.randn(batch, 2, 6, 8 + 1), t=torch.arange(batch) + 1)
    layer.update_state(state, seen)
    return layer


def snapshot(layer):
    return [x.clone() for x in (layer.state.packed, layer.state.t)]


@pytest.mark.parametrize(
    ("operation", "select"),
    [
        (lambda layer: layer.reorder_cache(torch.tensor([2, 0, 0])), lambda x: x[[2, 0, 0]]),
        (lambda layer: layer.batch_select_indices(torch.tensor([1, 2])), lambda x: x[[1, 2]]),
        (lambda layer: layer.batch_repeat_interleave(2), lambda x: x[[0, 0, 1, 1, 2, 2]]),
    ],
    ids=["reorder_cache", "batch_select_indices", "batch_repeat_interleave"],
)
def test_batch_operations_act_on_every_state_tensor(operation, select):
    layer = filled_layer()
    before = snapshot(layer)
    operation(layer)
    for expected, actual in zip(before, snapshot(layer), strict=True):
        assert torch.equal(actual, select(expected))
    assert layer.get_seq_length() == 5


def test_lengths_count_every_position_fed():
    layer = filled_layer(seen=5)
    layer.update_state(layer.state, 1)
    assert layer.get_seq_length() == 6
    assert layer.get_mask_sizes(3) == (9, 0)
    assert layer.get_max_length() == -1
    layer.reset()
    assert layer.state is None and layer.get_seq_length() == 0 and layer.nbytes == 0


def test_nbytes_is_the_state_size():
    layer = filled_layer(batch=3)
    assert layer.nbytes == 3 * 2 * 6 * (8 + 1) * 4 + 3 * 8  # S and z in float32, t in int64


def test_key_value_update_and_crop_raise():
    layer = filled_layer()
    with pytest.raises(TypeError, match="holds a recurrent state"):
        layer.update(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))
    layer.crop(0)
    with pytest.raises(ValueError, match="cannot remove 2 tokens"):
        layer.crop(-2)


def test_dynamic_cache_from_config_mixes_recurrent_and_kv_layers():
    config = SoftmaxRNNLlamaConfig(attention="linear_elu", layer_attention={1: "softmax"}, **LLAMA_SHAPE)
    cache = DynamicCache(config=config)
    assert [type(layer) for layer in cache.layers] == [RecurrentStateLayer, DynamicLayer]


def test_lazily_built_cache_gets_a_recurrent_layer_in_place():
    cache = DynamicCache()
    layer = recurrent_state_layer(cache, 1)
    assert isinstance(layer, RecurrentStateLayer) and cache.layers[1] is layer
    assert isinstance(cache.layers[0], DynamicLayer)
    cache.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), 0)
    with pytest.raises(TypeError, match="already holds keys and values"):
        recurrent_state_layer(cache, 0)


def test_cache_nbytes_counts_states_and_keys_values():
    config = SoftmaxRNNLlamaConfig(attention="linear_elu", layer_attention={1: "softmax"}, **LLAMA_SHAPE)
    cache = DynamicCache(config=config)
    cache.layers[0].update_state(filled_layer().state, 5)
    keys = torch.zeros(3, 2, 5, 8)
    cache.update(keys, keys.clone(), 1)
    assert cache_nbytes(cache) == filled_layer().nbytes + 2 * keys.numel() * 4
