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


def weight_decay_groups(
    model: nn.Module, weight_decay: float, *, own_lr: float | None = None, own_module: str = "rnn_params"
) -> list[dict]:
    """AdamW parameter groups of the trainable parameters of `model`: the weights of `DECAYED_LAYERS`
    with `weight_decay`, every other parameter without; empty groups are left out.

    With `own_lr`, the parameters inside a submodule named `own_module` (the converted attention layers'
    feature maps, decay and gates) form groups of their own with that learning rate (and `"name": own_module`);
    the others take the optimizer's."""
    decayed = {id(module.weight) for module in model.modules() if isinstance(module, DECAYED_LAYERS)}
    groups = {}
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        own = own_lr is not None and own_module in name.split(".")
        groups.setdefault((own, id(parameter) in decayed), []).append(parameter)
    own_settings = {"lr": own_lr, "name": own_module}
    # the optimizer's own groups first, then own_module's; in each, the decayed group before the other
    return [
        {"params": params, "weight_decay": weight_decay if is_decayed else 0.0} | (own_settings if own else {})
        for (own, is_decayed), params in sorted(groups.items(), key=lambda item: (item[0][0], not item[0][1]))
    ]
