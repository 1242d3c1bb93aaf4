"""The recipes: the stage settings, block sizes and retrieval layers a run takes for its attention where
the user gives none (`recipe_defaults`), measured in docs/results/recovery.md and docs/results/variants.md.
"""

from __future__ import annotations

from typing import Any

from hf_softmax_rnn.attention_spec import AttentionSpec
from hf_softmax_rnn.flags import SHOWN_DEFAULT

#: The attention `finetune` converts to by default: the sliding-window hybrid, the recipe that brings
#: a pretrained model back close to its perplexity (docs/results/recovery.md).
DEFAULT_ATTENTION = "hedgehog_window_256_sinks_4_kept_256_decay"
#: Tokens per training block of most recipes; `HELDOUT_BLOCK_SIZE`: per held-out block of every recipe, so
#: that their in-domain figures are measured on the same blocks.
BLOCK_SIZE = HELDOUT_BLOCK_SIZE = 1024
#: Tokens per training block of the state stage (stage 3): past the exact part of every layer, retrieval
#: layers included, so that each layer's finite state learns positions beyond the other stages' blocks.
STATE_BLOCK_SIZE = 4096
#: The schedule of a run whose stage settings are left unset, for most specs: transfer, then LoRA on the LM loss.
DEFAULT_SCHEDULE = dict(
    transfer_steps=100,
    transfer_lr=1e-3,
    finetune_steps=200,
    lr=2e-4,
    finetune_loss="lm",
    block_size=BLOCK_SIZE,
    state_steps=0,
)
#: The recovery recipe for learned feature maps and sliding-window hybrids (measured in docs/results/variants.md):
#: hybrids go straight to LoRA distilled from the unconverted model (teacher-forced transfer lowered their
#: layer error but not their perplexity); a pure learned map is transferred first.
#: A window of 256 exact positions or more is already close to the original after conversion and
#: reaches its level within 40 steps (80 steps moved every position bucket by less than 1.5 %).
#: With kept positions beside it, 20 steps of 2,048-token blocks (the same tokens): the kept selection and
#: the state then see positions past 1,024, which lifts passkey retrieval at 2,048 tokens
#: (docs/long_context.md; 40 such steps did no better). Then 10 steps of 4,096-token blocks train the state
#: alone, which lifts agreement with the original past 1,024 tokens and leaves every exact score as it was.
_DISTILL = dict(transfer_steps=0, transfer_lr=1e-2, lr=1e-3, finetune_loss="distill", state_steps=0)
RECIPE_SCHEDULES = {
    "default": DEFAULT_SCHEDULE,
    "kept_wide_window": _DISTILL | dict(finetune_steps=20, block_size=2048, state_steps=10),
    "wide_window": _DISTILL | dict(finetune_steps=40, block_size=BLOCK_SIZE),
    "window": _DISTILL | dict(finetune_steps=300, block_size=BLOCK_SIZE),
    "learned_map": _DISTILL | dict(transfer_steps=100, finetune_steps=300, block_size=BLOCK_SIZE),
}
#: The narrowest window that takes the "wide_window" schedules.
WIDE_WINDOW = 256
#: Retrieval layers of a spec with kept positions, each with `RETRIEVAL_KEPT` kept positions (docs/long_context.md).
KEPT_RETRIEVAL_LAYERS = 6
RETRIEVAL_KEPT = 2048
#: The `option` keyword of a flag whose default comes from the attention's recipe, as `--help` shows it.
FROM_RECIPE = {SHOWN_DEFAULT: "the attention's recipe"}


def recipe_schedule(spec: AttentionSpec) -> str:
    """The name of the `RECIPE_SCHEDULES` entry for `spec`."""
    if spec.window is not None and spec.window >= WIDE_WINDOW:
        return "kept_wide_window" if spec.kept is not None else "wide_window"
    if spec.window is not None:
        return "window"
    if spec.feature_map == "hedgehog":
        return "learned_map"
    return "default"


def recipe_defaults(spec: AttentionSpec) -> dict[str, Any]:
    """Stage settings, training block size and retrieval layers for `spec` where the user gave none."""
    retrieval = {"retrieval_layers": KEPT_RETRIEVAL_LAYERS if spec.kept is not None else 0}
    return RECIPE_SCHEDULES[recipe_schedule(spec)] | retrieval
