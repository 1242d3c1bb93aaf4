"""What one decoder layer of a converted model adds to a training step and to a decoding step on the
GPU path: operations (each a kernel launch on a GPU) and bytes written beside the fused kernels, at
SmolLM2-135M's attention shape. Training: bfloat16 autocast, forward and backward, called as a training
loop calls a model (`model(input_ids, labels=...)` in training mode, nothing said about a cache), with
fla and FlexAttention the stand-ins of `tests/ops/kernel_stand_ins.py`, which keep what the kernels keep
and are not counted. Decoding: a bfloat16 model, one token for each of 64 sequences after a prefill.
One layer's share is the difference between a two-layer and a one-layer model."""

from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from hf_softmax_rnn import convert

from ..ops.kernel_stand_ins import WrittenBytes, use_stand_ins

#: SmolLM2-135M's shape (9 query heads, 3 KV heads, 64 wide), with a small vocabulary.
CONFIG = Path(__file__).resolve().parents[2] / "scripts" / "smollm2_135m_config"
VOCAB = 256
BATCH, LENGTH = 2, 256


def _training_traffic(name: str, layers: int) -> WrittenBytes:
    torch.manual_seed(0)
    config = LlamaConfig.from_pretrained(CONFIG, num_hidden_layers=layers, vocab_size=VOCAB)
    model = LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    if name != "transformers":
        model = convert(model, name, attention_mode="chunked")
    model.train()
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=torch.Generator().manual_seed(0))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    step()  # (first calls: lazily built buffers)
    with WrittenBytes() as counter:
        step()
    return counter


def training_layer_traffic(name: str) -> tuple[int, float]:
    """(operations, bytes written per token) of one decoder layer of `name` in a training step."""
    one, two = _training_traffic(name, 1), _training_traffic(name, 2)
    return two.operations - one.operations, (two.bytes - one.bytes) / (BATCH * LENGTH)


#: Upper bounds on what one converted layer adds to the original layer's (SDPA; 148 operations and 248,000
#: bytes per token here, weight gradients included): operations, bytes per token. Before a training-mode
#: forward defaulted to no cache, the hybrid built its recurrent state (window buffers, fla's final state)
#: and its window could not run in FlexAttention: 165 operations and 190,000 bytes per token more than
#: the original; while a call whose state is discarded still copied out the window buffers and had fla
#: write its final state: 61 and 44,346 (linear_elu), 124 and 111,878 (hedgehog_window_64; commit e6d94a4).
#: linear_elu's map takes two operations and three passes over the float32 features of its 9 + 3 heads of 64
#: (9,216 bytes a token) more than F.elu(x) + 1, which lost e^x below about -17 in float32
#: (`ops.feature_maps.elu_plus_one`: e^min(x, 0) and its max with x + 1, then min(y, 1) in the backward),
#: and its row shift of the queries three operations and a pass over their float32 features (2,376 bytes a token;
#: `ops.feature_maps.row_shifted_elu_plus_one`: 61 and 53,163 without it).
EXTRA_BOUNDS = {
    "linear_elu": (65, 55_900),
    "hedgehog_window_64": (121, 111_000),
}


@pytest.mark.parametrize("name", list(EXTRA_BOUNDS))
def test_a_converted_layer_adds_few_operations_to_a_training_step(name, monkeypatch):
    use_stand_ins(monkeypatch, flex=True)
    original_operations, original_bytes = training_layer_traffic("transformers")
    operations, written = training_layer_traffic(name)
    max_operations, max_bytes = EXTRA_BOUNDS[name]
    assert operations - original_operations <= max_operations, (operations, original_operations)
    assert written - original_bytes <= max_bytes, (written, original_bytes)


#: Upper bounds on what one layer takes in a decoding step: operations, and bytes written per sequence (64
#: sequences, 300 tokens of context; the original's KV layer takes 40 and writes 277,000 here, its cache
#: growing by a copy every step). When the hedgehog map's product was broadcast over the batch (a copy of
#: its weights per sequence) and the state took a product and an addition (two writes) instead of one
#: product-and-add: 165,379 bytes (linear_elu) and 599,979 (commit 3512eaf); while each step shifted the
#: window's W rows into new buffers instead of writing one row of a ring: 311,076 (hedgehog_window_64,
#: commit bc5a43b); while a one-position call stacked its output (a copy) and the window's mix weight
#: converted its log-scale in a pass of its own: 63 and 94 operations (commit 444f1cc). linear_elu's map writes
#: two passes more over the float32 features of its 9 + 3 heads of 64 than F.elu(x) + 1 (6,144 bytes), which
#: lost e^x below about -17 in float32, and three operations and 2,376 bytes for the row shift of its queries (60
#: and 119,206 without it).
DECODE_BOUNDS = {"linear_elu": (65, 122_600), "hedgehog_window_64": (92, 214_000)}
SEQUENCES = 64


def _decode_traffic(name: str, layers: int) -> WrittenBytes:
    torch.manual_seed(0)
    config = LlamaConfig.from_pretrained(CONFIG, num_hidden_layers=layers, vocab_size=VOCAB)
    model = convert(LlamaForCausalLM._from_config(config, dtype=torch.bfloat16), name).eval()
    ids = torch.randint(0, VOCAB, (SEQUENCES, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        token = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        model(input_ids=token, cache=cache, use_cache=True)
        with WrittenBytes() as counter:
            model(input_ids=token, cache=cache, use_cache=True)
    return counter


@pytest.mark.parametrize("name", list(DECODE_BOUNDS))
def test_a_converted_layer_takes_few_operations_and_writes_little_per_sequence_in_a_decoding_step(name):
    two, one = _decode_traffic(name, 2), _decode_traffic(name, 1)
    operations, written = two.operations - one.operations, (two.bytes - one.bytes) / SEQUENCES
    max_operations, max_bytes = DECODE_BOUNDS[name]
    assert operations <= max_operations and written <= max_bytes, (operations, written)
