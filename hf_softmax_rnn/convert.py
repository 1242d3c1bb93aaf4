"""Turn a pretrained Llama, GPT-2 or model of a family of Llama's pattern (Mistral, Qwen2, Qwen3,
Qwen3-MoE, Mixtral, Phi-3, OLMo 2, Granite, SmolLM3, Gemma 2, Gemma 3: `LLAMA_LIKE_FAMILIES`) into the
matching softmax_rnn model with the same weights."""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GPT2LMHeadModel,
    LlamaForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
)
from transformers import initialization as init

from hf_softmax_rnn.attention_spec import AttentionSpec
from hf_softmax_rnn.models import (
    LLAMA_LIKE_CONFIGS,
    LLAMA_LIKE_FAMILIES,
    LLAMA_LIKE_MODELS,
    SoftmaxRNNGPT2Config,
    SoftmaxRNNGPT2LMHeadModel,
    SoftmaxRNNLlamaConfig,
    SoftmaxRNNLlamaForCausalLM,
)
from hf_softmax_rnn.models.llama_like import declares, sliding_window_layers
from hf_softmax_rnn.models.modeling_softmax_rnn import SoftmaxRNNPreTrainedMixin

logger = logging.getLogger(__name__)

#: Source class -> (config class, model class) of its softmax_rnn counterpart.
FAMILIES: dict[type[PreTrainedModel], tuple[type, type[PreTrainedModel]]] = {
    LlamaForCausalLM: (SoftmaxRNNLlamaConfig, SoftmaxRNNLlamaForCausalLM),
    GPT2LMHeadModel: (SoftmaxRNNGPT2Config, SoftmaxRNNGPT2LMHeadModel),
    **{
        family.causal_lm: (LLAMA_LIKE_CONFIGS[family.name], LLAMA_LIKE_MODELS[family.name][1])
        for family in LLAMA_LIKE_FAMILIES
    },
}
# Config entries that belong to the source class, not to the converted one (whose layer types follow its specs).
_DROPPED_CONFIG_KEYS = (
    "model_type",
    "architectures",
    "transformers_version",
    "auto_map",
    "_name_or_path",
    "layer_types",
)


def _family(model: PreTrainedModel) -> tuple[type, type[PreTrainedModel]]:
    if isinstance(model, SoftmaxRNNPreTrainedMixin):
        raise TypeError(
            f"{type(model).__name__} is already a softmax_rnn model; convert the original checkpoint, or change "
            "`config.attention` / `config.layer_attention` and load the weights with from_pretrained"
        )
    for source, family in FAMILIES.items():
        if isinstance(model, source):
            return family
    raise TypeError(
        f"convert() got a {type(model).__name__}; expected one of {[cls.__name__ for cls in FAMILIES]} "
        "(or a directory / Hub id holding one)"
    )


def check_convertible(config: PreTrainedConfig) -> None:
    """Refuse, from its config alone (before its weights load), a model `convert` does not take: TypeError
    naming its `model_type` and the types `convert` takes; ValueError for a model of such a type whose
    attention the converted model cannot reproduce (cross-attention, bidirectional attention), naming the
    setting."""
    model_types = {source.config_class.model_type: source.__name__ for source in FAMILIES}
    if config.model_type not in model_types:
        raise TypeError(
            f"convert() takes a model of type {sorted(model_types)} ({', '.join(model_types.values())}); got "
            f"model_type {config.model_type!r} ({', '.join(config.architectures or []) or 'no architectures'})"
        )
    for setting, refused in (
        ("add_cross_attention", True),
        ("is_encoder_decoder", True),
        ("is_causal", False),
        ("use_bidirectional_attention", True),
    ):
        if getattr(config, setting, not refused) == refused:
            raise ValueError(
                f"convert() takes causal self-attention only; this {config.model_type} model has {setting}={refused}"
            )


def check_softcapping(config: PreTrainedConfig, layer_specs: Mapping[int, AttentionSpec]) -> None:
    """Refuse a cap of the attention scores (Gemma 2's `attn_logit_softcapping`) where a layer would have no exact
    softmax scores to cap (`AttentionSpec.softcap_applies`: not exact softmax, not a window hybrid; the cap does not
    factor into a feature map or a finite state): ValueError naming the value, the layers and the choices."""
    cap = getattr(config, "attn_logit_softcapping", None)
    uncapped = [i for i, layer in layer_specs.items() if not layer.softcap_applies]
    if cap is not None and uncapped and getattr(_family_of_config(config)[0], "softcapped_scores", False):
        raise ValueError(
            f"convert() keeps the attention logit soft-capping of this {config.model_type} model "
            f"(attn_logit_softcapping={cap}) in exact softmax scores only, but would convert layers {uncapped} to a "
            "spec without them: the cap does not factor into a feature map or a finite state. Convert them to a "
            "window hybrid (window=W: its window, sinks and kept keys take the cap, its finite state stays "
            "uncapped), keep them exact (layers=[...]), or convert the model without the cap: load it with "
            "attn_logit_softcapping=None"
        )


def converted_model_type(config: PreTrainedConfig) -> str:
    """The `model_type` of what `convert` makes of a model of `config` (TypeError for one it does not take)."""
    check_convertible(config)
    return _family_of_config(config)[0].model_type


def _family_of_config(config: PreTrainedConfig) -> tuple[type, type[PreTrainedModel]]:
    """(config class, model class) of the softmax_rnn counterpart of a model of `config` (a type `convert` takes)."""
    return next(family for source, family in FAMILIES.items() if source.config_class.model_type == config.model_type)


def source_attention_modules(model: PreTrainedModel) -> list[nn.Module]:
    """The attention module of each decoder block of a model `convert` accepts, in layer order."""
    block_class, name, _ = _family(model)[1].attention_slot
    return [getattr(block, name) for block in model.modules() if isinstance(block, block_class)]


def _existing_folder_or_hub_id(path: str | os.PathLike) -> str:
    """`path` itself, unless it looks like a folder (absolute, starting with "." or "~", or with more
    than one "/") that does not exist: then FileNotFoundError says so (transformers would report a
    malformed Hub id)."""
    name = str(path)
    folder = Path(name).expanduser()
    looks_like_a_folder = folder.is_absolute() or name.startswith((".", "~")) or name.count("/") > 1
    if looks_like_a_folder and not folder.is_dir():
        raise FileNotFoundError(f"convert(): the folder {name!r} does not exist (nor is it a Hub id)")
    return name


def _layer_specs(
    config: PreTrainedConfig,
    spec: AttentionSpec,
    layers: Iterable[int] | None,
    specs: Mapping[int, AttentionSpec | dict | str] | None,
) -> dict[int, AttentionSpec]:
    """The spec of each layer of a model of `config`: exact softmax in every layer not listed in `layers`, `specs`
    in the converted layers it names, `spec` in the others; a layer the source limits to its last
    `sliding_window` positions that computes exact softmax keeps its sliding window."""
    num_layers = config.num_hidden_layers
    sliding = dict.fromkeys(sliding_window_layers(config), getattr(config, "sliding_window", None))
    converted = list(range(num_layers)) if layers is None else converted_layers(layers, num_layers)
    specs = {key: AttentionSpec.coerce(value) for key, value in dict(specs or {}).items()}
    outside = [key for key in specs if isinstance(key, bool) or not isinstance(key, int) or key not in converted]
    if outside:
        raise ValueError(
            f"convert(layer_attention=...) names layers {outside}; expected indices of converted layers "
            f"{list(converted)}"
        )
    plain_softmax = AttentionSpec()
    layer_specs = {i: specs.get(i, spec) if i in converted else plain_softmax for i in range(num_layers)}
    for i, window in sliding.items():
        if layer_specs[i] == plain_softmax:
            layer_specs[i] = AttentionSpec(window=window)
        else:
            logger.info(
                "Layer %d attends to the last %d positions in the source model; converted to %s, it reads every "
                "earlier position",
                i,
                window,
                layer_specs[i].describe(),
            )
    return layer_specs


def _converted_sliding_windows(config: PreTrainedConfig, layer_specs: Mapping[int, AttentionSpec]) -> dict[str, int]:
    """`{layer index: W}` of the layers the source limits to their last W positions that are converted to a
    finite-state spec (their attention-transfer teacher keeps the window)."""
    window = getattr(config, "sliding_window", None)
    return {str(i): window for i in sliding_window_layers(config) if layer_specs[i] != AttentionSpec(window=window)}


def converted_layers(layers: Iterable[int], num_layers: int) -> list[int]:
    """`layers` checked: a non-empty list of distinct indices in 0..num_layers - 1."""
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise TypeError(
            f"convert(layers={layers!r}): expected None or a list of layer indices in 0..{num_layers - 1} "
            f"(layers=[{layers!r}] converts that one layer)"
        )
    chosen = list(layers)
    bad = [i for i in chosen if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers]
    if bad or not chosen or len(set(chosen)) < len(chosen):
        raise ValueError(
            f"convert(layers={chosen!r}): expected a non-empty list of distinct layer indices in 0..{num_layers - 1}"
        )
    return chosen


def _check_arguments(model_or_path, layer_attention, from_pretrained_kwargs: dict) -> None:
    """Refuse arguments of the wrong kind before any model loads, naming them."""
    if layer_attention is not None and not isinstance(layer_attention, Mapping):
        raise TypeError(
            "convert(layer_attention=...) must be None or a dict {layer index: spec}; got "
            f"{type(layer_attention).__name__}"
        )
    if from_pretrained_kwargs and not isinstance(model_or_path, (str, os.PathLike)):
        raise TypeError(
            f"convert() got {sorted(from_pretrained_kwargs)}, which go to from_pretrained when loading from a path; "
            f"it was given a {type(model_or_path).__name__}: cast or move the model itself instead"
        )
    for name in ("dtype", "torch_dtype"):
        dtype = from_pretrained_kwargs.get(name)
        named = isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype)
        if dtype is not None and not (isinstance(dtype, torch.dtype) or dtype == "auto" or named):
            raise ValueError(
                f"convert({name}={dtype!r}) is not allowed; expected 'auto', a torch dtype or its name "
                "('float32', 'bfloat16', 'float16', ...)"
            )


def convert(
    model_or_path: PreTrainedModel | str | os.PathLike,
    spec_or_preset: AttentionSpec | dict | str,
    layers: Iterable[int] | None = None,
    *,
    attention_mode: str = "chunked",
    layer_attention: Mapping[int, AttentionSpec | dict | str] | None = None,
    **from_pretrained_kwargs,
) -> PreTrainedModel:
    """A softmax_rnn copy of a pretrained `LlamaForCausalLM` / `GPT2LMHeadModel` / causal LM of a family of
    Llama's pattern (`MistralForCausalLM`, `Qwen2ForCausalLM`, ...: `LLAMA_LIKE_FAMILIES`).

    Args:
        model_or_path: the model, or a local directory / Hub id that
            `AutoModelForCausalLM.from_pretrained` loads into one of those classes.
        spec_or_preset: the new attention: an `AttentionSpec`, a dict of its fields or a
            preset name (`hf_softmax_rnn.PRESETS`).
        layers: indices of the layers to convert; None converts all, the others keep exact
            softmax (a hybrid).
        attention_mode: forward mode without cache for finite-state layers: "chunked" (the
            default: no L x L matrix) or "parallel" (the masked L x L reference form).
        layer_attention: another spec for some converted layers, by index (for example a larger
            `kept` budget in the retrieval layers, `long_context.retrieval_layer_attention`).
        **from_pretrained_kwargs: passed to `from_pretrained` when loading from a path (dtype, ...).

    Returns:
        `SoftmaxRNNLlamaForCausalLM` / `SoftmaxRNNGPT2LMHeadModel` / `SoftmaxRNN<Family>ForCausalLM`
        (model_type "softmax_rnn_<family>") with the same config (plus
        the attention fields), generation config, dtype, device and train/eval mode, and a
        copy of every weight (loaded strictly: each original parameter must find its place).

    A layer the source limits to its last `sliding_window` positions keeps that window where it stays exact
    softmax (`AttentionSpec(window=W)`); converted, it takes the spec it is given (logged at INFO).
    A soft-capped model (Gemma 2's `attn_logit_softcapping`) keeps the cap in its exact softmax layers and in the
    exact part of its window hybrids (window, sinks, kept keys; the finite state stays uncapped); converting one of
    its layers to a spec without exact softmax scores raises (`check_softcapping`).

    The new parameters start where they change the model least (`RNNParams.reset_parameters`):
    gates open (weight 0, bias 5: sigmoid = 0.993 for every token), norm weight 1 and bias 0,
    seqlen power 0.5, hedgehog maps the identity. The kernel change itself (exp -> a
    Taylor truncation, a feature map, a norm instead of the denominator) is what the
    untrained converted model loses; `convert(..., "softmax")` reproduces the original logits,
    and fine-tuning (attention transfer, then LM loss) recovers the rest.
    """
    spec = AttentionSpec.coerce(spec_or_preset)
    _check_arguments(model_or_path, layer_attention, from_pretrained_kwargs)
    source = model_or_path
    if isinstance(source, (str, os.PathLike)):
        name = _existing_folder_or_hub_id(source)
        source_config = AutoConfig.from_pretrained(name, **from_pretrained_kwargs)
        check_convertible(source_config)
        if getattr(source_config, "attn_logit_softcapping", None) is not None:  # refused before the weights load
            check_softcapping(source_config, _layer_specs(source_config, spec, layers, layer_attention))
        source = AutoModelForCausalLM.from_pretrained(name, **from_pretrained_kwargs)
    config_class, model_class = _family(source)
    check_convertible(source.config)
    layer_specs = _layer_specs(source.config, spec, layers, layer_attention)
    check_softcapping(source.config, layer_specs)
    if any(parameter.is_meta for parameter in source.parameters()):
        raise ValueError(
            f"convert() copies the weights of the model it is given, but this {type(source).__name__} has weights on "
            "the meta device (no values); pass a model with its weights loaded, or its folder"
        )

    fields = {key: value for key, value in source.config.to_dict().items() if key not in _DROPPED_CONFIG_KEYS}
    if "sliding_window" in fields:
        fields["sliding_window"] = None  # the layers' specs hold their windows
        fields["source_sliding_windows"] = _converted_sliding_windows(source.config, layer_specs) or None
    if declares(config_class, "rope_layer_types"):  # one RoPE per layer type (Gemma 3): each layer keeps its own
        fields["rope_layer_types"] = list(source.config.layer_types)
    config = config_class(
        **fields,
        attention=spec,
        layer_attention={str(i): layer for i, layer in layer_specs.items() if layer != spec} or None,
        attention_mode=attention_mode,
    )
    with init.no_init_weights():  # every weight but rnn_params (initialised on construction) is loaded next
        model = model_class._from_config(config, dtype=source.dtype)
    incompatible = model.load_state_dict(source.state_dict(), strict=False)
    missing = [key for key in incompatible.missing_keys if ".rnn_params." not in key]
    if missing or incompatible.unexpected_keys:
        raise RuntimeError(
            f"convert: the weights of {type(source).__name__} do not map onto {model_class.__name__}: "
            f"missing {missing}, unexpected {incompatible.unexpected_keys}"
        )
    model.tie_weights()
    model.generation_config = copy.deepcopy(source.generation_config)
    model.to(source.device).train(source.training)
    logger.info("Converted %s to %s: %s", type(source).__name__, model_class.__name__, config.attention_summary())
    return model
