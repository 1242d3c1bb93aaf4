"""The one weight-decay rule of every optimizer in the package (fine-tuning, MQAR, ablations)."""

from __future__ import annotations

from torch import nn
from transformers.pytorch_utils import Conv1D

#: Layers whose `weight` is decayed; LoRA's A and B matrices are `nn.Linear` too.
DECAYED_LAYERS = (nn.Linear, nn.Embedding, Conv1D)
WEIGHT_DECAY_HELP = (
    "AdamW weight decay of the weights of linear and embedding layers (LoRA and gate matrices included; never "
    "biases, norm weights or feature maps)"
)


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW parameter groups of the trainable parameters of `model`: the weights of `DECAYED_LAYERS`
    with `weight_decay`, every other parameter without; empty groups are left out."""
    decayed = {id(module.weight) for module in model.modules() if isinstance(module, DECAYED_LAYERS)}
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in trainable if id(p) in decayed], "weight_decay": weight_decay},
        {"params": [p for p in trainable if id(p) not in decayed], "weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]
