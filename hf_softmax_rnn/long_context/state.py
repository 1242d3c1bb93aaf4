"""What a hybrid's recurrent state adds: its finite-state part switched off, the exact parts left.

A hybrid layer (a spec with a `window`) scores the last W positions, its sinks and its kept positions
with the exact exp(q.k) and every older position through the finite state, weighted by e^{lambda_h}
(`rnn_params.linear_log_scale`, one per query head). `finite_state_off` sets lambda_h to -inf for the
duration of a `with` block: each query then reads only its exact keys, under the same normaliser
(with the softmax normaliser: sparse softmax attention over the window, the sinks and the kept
positions). Scoring a model both ways on the same text tells how much its state carries
(`evaluate --no-finite-state`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.layers.attention import softmax_rnn_attention_modules


def _hybrid_layers(model: nn.Module) -> list:
    """The converted layers of `model` that have a finite state, each checked to have a window."""
    layers = [
        module
        for module in softmax_rnn_attention_modules(model)
        if module.is_converted and module.attention_spec.has_finite_state
    ]
    if not layers:
        raise UserInputError(
            f"{type(model).__name__} has no converted layer with a finite state, so there is none to switch off; "
            "expected a model converted to a hybrid spec (one with a window, such as the finetune default)"
        )
    without_window = [module for module in layers if module.attention_spec.window is None]
    if without_window:
        names = ", ".join(f"{module.layer_idx} ({module.attention_spec.describe()})" for module in without_window)
        raise UserInputError(
            f"layers {names} have a finite state and no window: the state is all they read of the context, so it "
            "cannot be switched off; expected every finite-state layer to be a hybrid (a spec with a window)"
        )
    return layers


@contextlib.contextmanager
def finite_state_off(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, the hybrid layers of `model` read only their exact parts (window, sinks, kept
    positions); their finite-state weights are restored on leaving it, also after an exception.

    Raises UserInputError, a ValueError (before changing anything), when `model` has no converted
    finite-state layer, or a finite-state layer without a window.
    """
    layers = _hybrid_layers(model)
    saved = [module.rnn_params.linear_log_scale.detach().clone() for module in layers]
    try:
        with torch.no_grad():
            for module in layers:
                module.rnn_params.linear_log_scale.fill_(-torch.inf)
        yield model
    finally:
        with torch.no_grad():
            for module, log_scale in zip(layers, saved, strict=True):
                module.rnn_params.linear_log_scale.copy_(log_scale)
