"""Reading past the context a rotary model was trained for, without training: YaRN position scaling.

A model with rotary position embeddings sees, between a query and a key, a rotation by their
distance. Past the distances it was trained on, its scores leave the range it knows and its
perplexity climbs steeply, and a model converted from it inherits that limit.
`extend_context(model, factor)` rescales the rotary frequencies by YaRN (transformers'
`rope_type="yarn"`: the slow frequencies interpolated by `factor`, the fast ones kept, cos and sin
scaled by 0.1 ln(factor) + 1), so that `factor` times as many positions stay within the trained
range. A converted model extends as its original does: its exact parts and its feature maps read
the same rotated queries and keys. docs/long_context.md measures what it gains past the original
range and costs within it.
"""

from __future__ import annotations

import logging
import math
import numbers

from hf_softmax_rnn.errors import UserInputError

logger = logging.getLogger(__name__)

#: The most positions an extended model may read: position ids are int64.
MAX_POSITIONS = 2**63 - 1


def _rotary_modules(model) -> list[tuple[object, str, object]]:
    """(parent, attribute name, module) of each rotary embedding of `model` (modules with `inv_freq`)."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if hasattr(child, "inv_freq") and hasattr(child, "rope_type"):
                found.append((parent, name, child))
    return found


def check_factor(factor) -> None:
    """Refuse a context factor that is not a finite real number above 1."""
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not 1 < factor < math.inf:
        raise UserInputError(f"extend_context: factor={factor!r} is not allowed; expected a finite number above 1")


def extended_positions(original: int, factor) -> int:
    """`original * factor` positions as an int, refused above `MAX_POSITIONS` (position ids are int64; a
    larger factor, 1e307 say, gives no finite number of positions at all)."""
    largest = MAX_POSITIONS // original
    if not factor <= largest:
        raise UserInputError(
            f"extend_context: factor={factor!r} is not allowed: max_position_embeddings={original} times it is "
            f"more than {MAX_POSITIONS} positions (the largest int64 position id); expected a factor of at most "
            f"{largest}"
        )
    return min(int(original * factor), MAX_POSITIONS)  # (float rounding may step past it)


def extended_max_positions(config, factor, name: str | None = None) -> int:
    """The `max_position_embeddings` of a model of `config` once `extend_context` extends it by `factor`
    (its own when it is extended by `factor` already), from the config alone: so that settings beyond it
    stop before the weights load. Raises UserInputError as `extend_context` does (`name`, the model's
    class in the messages, defaults to the config's first architecture)."""
    check_factor(factor)
    rope = getattr(config, "rope_parameters", None)
    if not isinstance(rope, dict) or "rope_type" not in rope:
        raise _no_rotary_embedding(name or (config.architectures or [type(config).__name__])[0])
    if _extended_by(rope, factor):
        return config.max_position_embeddings
    if rope["rope_type"] != "default":
        raise UserInputError(
            f"extend_context: the model's rotary embedding is already scaled (rope_type={rope['rope_type']!r}, "
            f"factor={rope.get('factor')!r}); expected rope_type 'default', or 'yarn' by factor {factor!r}"
        )
    return extended_positions(config.max_position_embeddings, factor)


def _extended_by(rope: dict, factor) -> bool:
    return rope["rope_type"] == "yarn" and rope.get("factor") == factor


def _no_rotary_embedding(name: str) -> UserInputError:
    return UserInputError(
        f"extend_context: {name} has no rotary position embedding to rescale (a learned position table, as "
        "GPT-2's, has no rows past its limit); expected a model with rope_parameters"
    )


def extend_context(model, factor: float):
    """`model` (in place, and returned) reading `factor` times its `config.max_position_embeddings`:
    its rotary embeddings rebuilt with YaRN scaling by `factor` (> 1) from the config's own
    frequencies, and `max_position_embeddings` multiplied by `factor`. Saved, the model keeps it; a
    model already extended by `factor` (a saved one, or its original) is returned as it is.

    Raises UserInputError, before the model changes, for a factor that is not a number above 1 or that
    gives more than 2**63 - 1 positions (position ids are int64), a model without rotary position
    embeddings (GPT-2 looks positions up in a learned table), or one whose rotary embedding is scaled
    otherwise (another `rope_type`, or YaRN by another factor).
    """
    config = model.config
    positions = extended_max_positions(config, factor, type(model).__name__)
    modules = _rotary_modules(model)
    if not modules:
        raise _no_rotary_embedding(type(model).__name__)
    rope = config.rope_parameters
    if _extended_by(rope, factor):
        return model
    original = config.max_position_embeddings
    scaled = {
        "rope_parameters": {
            **rope,
            "rope_type": "yarn",
            "factor": float(factor),
            "original_max_position_embeddings": original,
        },
        "max_position_embeddings": positions,
    }
    rebuilt = _rebuilt_rotary_modules(config, scaled, modules)
    for name, value in scaled.items():
        setattr(config, name, value)
    for (parent, name, _), module in zip(modules, rebuilt, strict=True):
        setattr(parent, name, module)
    logger.info(
        "Rotary embeddings scaled by YaRN, factor %s: %d -> %d positions",
        factor,
        original,
        config.max_position_embeddings,
    )
    return model


def _rebuilt_rotary_modules(config, scaled: dict, modules: list[tuple[object, str, object]]) -> list[object]:
    """Each rotary module of `modules` rebuilt from `config` with the fields of `scaled`, on its device;
    `config` is changed only while they are built and restored whatever happens (the caller assigns
    `scaled` for good once every module is built, so that a refused scaling leaves the model as it was)."""
    previous = {name: getattr(config, name) for name in scaled}
    try:
        for name, value in scaled.items():
            setattr(config, name, value)
        return [type(module)(config=config).to(module.inv_freq.device) for _, _, module in modules]
    finally:
        for name, value in previous.items():
            setattr(config, name, value)
