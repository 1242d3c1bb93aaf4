"""FSDP2 on two CPU processes (gloo): a converted model sharded with `fully_shard` (each decoder layer,
then the whole model) trains to the same losses and weights as the unsharded model in one process
on the same global batch."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_softmax_rnn import AttentionSpec
from hf_softmax_rnn.convert import convert
from tests.models.helpers import LLAMA_SHAPE

ROOT = Path(__file__).resolve().parents[2]
PRESET, STEPS, BATCH, LENGTH = "hedgehog_window_64", 3, 4, 24

RANK_SCRIPT = """
import json, sys
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, sys.argv[1])
from tests.training.test_fsdp import BATCH, STEPS, batches, converted_model, train

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model = converted_model()
mesh = init_device_mesh("cpu", (world,))
for layer in model.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
share = BATCH // world
local = [ids[rank * share : (rank + 1) * share] for ids in batches()]
losses = train(model, local)
for i, loss in enumerate(losses):  # the global batch's loss: the mean of the equal shares' means
    total = torch.tensor(loss)
    dist.all_reduce(total)
    losses[i] = total.item() / world
weights = {name: p.full_tensor().tolist() for name, p in model.named_parameters()}
if rank == 0:
    with open(sys.argv[2], "w") as f:
        json.dump({"losses": losses, "weights": weights}, f)
dist.destroy_process_group()
"""


def converted_model():
    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA_SHAPE, max_position_embeddings=64, tie_word_embeddings=False)
    spec = AttentionSpec.from_preset(PRESET, window=8, chunk_size=8)
    return convert(LlamaForCausalLM(config), spec, attention_mode="chunked")


def batches() -> list[torch.Tensor]:
    """The same random batch for every step (so that the loss falls)."""
    ids = torch.randint(0, LLAMA_SHAPE["vocab_size"], (BATCH, LENGTH), generator=torch.Generator().manual_seed(1))
    return [ids] * STEPS


def train(model, inputs: list[torch.Tensor]) -> list[float]:
    """AdamW steps on the language-model loss of each batch of `inputs`; the losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for ids in inputs:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow  # two processes start torch and transformers: about 30 s
def test_fsdp2_on_two_cpu_processes_trains_like_one_process(tmp_path):
    script, result = tmp_path / "rank.py", tmp_path / "result.json"
    script.write_text(RANK_SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(_free_port()), str(script), str(ROOT), str(result)]  # fmt: skip
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    launched = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
    assert launched.returncode == 0, launched.stderr[-3000:]
    sharded = json.loads(result.read_text())

    model = converted_model()
    assert sharded["losses"] == pytest.approx(train(model, batches()), rel=1e-5)
    assert sharded["losses"][-1] < sharded["losses"][0]
    for name, tensor in model.named_parameters():
        torch.testing.assert_close(torch.tensor(sharded["weights"][name]), tensor.detach(), rtol=1e-4, atol=1e-5)
