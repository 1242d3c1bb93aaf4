"""What one decoder layer of a converted model adds to a training step on the GPU path: operations
(each a kernel launch on a GPU) and bytes written beside the fused kernels, forward and backward, at
SmolLM2-135M's attention shape under bfloat16 autocast, called as a training loop calls a model
(`model(input_ids, labels=...)` in training mode, nothing said about a cache). fla and FlexAttention
are the stand-ins of `tests/ops/kernel_stand_ins.py`, which keep what the kernels keep and are not
counted. One layer's share is the difference between a two-layer and a one-layer model."""

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_softmax_rnn import convert

from ..ops.kernel_stand_ins import WrittenBytes, use_stand_ins

#: SmolLM2-135M's shape (9 query heads, 3 KV heads, 64 wide), with a small vocabulary.
CONFIG = Path(__file__).resolve().parents[2] / "scripts" / "smollm2_135m_config"
VOCAB = 256
BATCH, LENGTH = 2, 256


def _step_traffic(name: str, layers: int) -> WrittenBytes:
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


def layer_traffic(name: str) -> tuple[int, float]:
    """(operations, bytes written per token) of one decoder layer of `name` in a training step."""
    one, two = _step_traffic(name, 1), _step_traffic(name, 2)
    return two.operations - one.operations, (two.bytes - one.bytes) / (BATCH * LENGTH)


#: Upper bounds on what one converted layer adds to the original layer's (SDPA; 148 operations and 248,000
#: bytes per token here, weight gradients included): operations, bytes per token. Before a training-mode
#: forward defaulted to no cache, the hybrid built its recurrent state (window buffers, fla's final state)
#: and its window could not run in FlexAttention: 165 operations and 190,000 bytes per token more than
#: the original.
EXTRA_BOUNDS = {
    "linear_elu": (65, 48_000),
    "hedgehog_window_64": (130, 118_000),
}


@pytest.mark.parametrize("name", list(EXTRA_BOUNDS))
def test_a_converted_layer_adds_few_operations_to_a_training_step(name, monkeypatch):
    use_stand_ins(monkeypatch, flex=True)
    original_operations, original_bytes = layer_traffic("transformers")
    operations, written = layer_traffic(name)
    max_operations, max_bytes = EXTRA_BOUNDS[name]
    assert operations - original_operations <= max_operations, (operations, original_operations)
    assert written - original_bytes <= max_bytes, (written, original_bytes)
