"""What the softmax_rnn models share: the attention implementation name, the padding mask,
the swap of transformers' attention modules for the softmax_rnn ones, weight initialisation
and Hub export.

The models run under their own attention implementation, `ATTN_IMPLEMENTATION`. Its mask
function (registered with transformers' `AttentionMaskInterface`) hands every attention
layer the 2-D padding mask `[B, past + L]` (or None when nothing is padded) instead of a
4-D causal mask: the ops apply causality themselves and need the padding per position to
keep padded tokens out of recurrent states. This registration is not an Auto-class
registration, so this module may travel with a checkpoint.
"""

from __future__ import annotations

import inspect
import logging

import torch
from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, create_causal_mask
from transformers.modeling_utils import AttentionInterface, PreTrainedModel
from transformers.utils import import_utils
from transformers.utils.import_utils import is_torchdynamo_compiling

from hf_softmax_rnn.hub import RemoteCodeMixin
from hf_softmax_rnn.layers.attention import RNNParams, RNNProjection
from hf_softmax_rnn.layers.cache import RECURRENT_LAYER_TYPE
from hf_softmax_rnn.ops.checks import check_padding_mask

logger = logging.getLogger(__name__)

#: The names under which a forward receives a cache (transformers 5 renames `past_key_values`).
CACHE_ARGUMENTS = ("cache", "past_key_values")

#: `config._attn_implementation` of every softmax_rnn model.
ATTN_IMPLEMENTATION = "softmax_rnn"


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """Mask function of `ATTN_IMPLEMENTATION`: the last `kv_length` columns of the 2-D bool padding
    mask, `[B, kv_length]` (a `StaticRecurrentStateLayer` asks for the new positions only, so that a
    compiled decode step sees one shape), or None without a mask. Outside torch.compile a mask with
    no padded position also gives None (the ops then skip masking: fewer kernels per layer in eager
    decoding); under torch.compile the mask's values are never read here (no graph break). Custom
    mask functions (packed sequences, bidirectional blocks) cannot be expressed as a padding mask
    and raise. Under torch.compile transformers builds its packed-sequence mask function for every
    call without a mask and a cache (it cannot look at the positions while tracing), so there the
    model's own check of `position_ids` (`check_positions`) decides."""
    if mask_function is not causal_mask_function and not is_torchdynamo_compiling():
        raise ValueError(
            "softmax_rnn attention applies causality and a 2-D padding mask only; it got a custom mask function "
            "(packed sequences with restarting position_ids?). Pass an attention_mask, or one sequence per row"
        )
    if attention_mask is None:
        return None
    if not is_torchdynamo_compiling() and bool(attention_mask.all()):
        return None
    return attention_mask[:, -kv_length:]


AttentionMaskInterface.register(ATTN_IMPLEMENTATION, padding_mask)


def _computed_by_softmax_rnn_layers(module: torch.nn.Module, *args, **kwargs):
    """Attention function of `ATTN_IMPLEMENTATION`: never called by the softmax_rnn attention modules
    (they compute their spec themselves). Registered so that transformers' own inner modules (the
    `LlamaModel` a `LlamaForCausalLM.__init__` builds) accept the implementation name."""
    raise ValueError(
        f"attn_implementation={ATTN_IMPLEMENTATION!r} is computed by softmax_rnn attention modules, not by "
        f"{type(module).__name__}; build the model with a softmax_rnn model class"
    )


AttentionInterface.register(ATTN_IMPLEMENTATION, _computed_by_softmax_rnn_layers)


def check_positions(position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> None:
    """Refuse packed sequences: `position_ids` `[B, L]` must count up by one between neighbouring
    tokens (padding excluded, as `attention_mask`'s last L columns say). A restart or jump means
    several documents in one row, whose attention these layers would let cross; with or without a
    cache, in `generate` too. Under torch.compile the check is an asynchronous assert (no graph break)."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.shape[-1] < 2:
        return
    steps_ok = torch.diff(position_ids, dim=-1) == 1
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        visible = attention_mask[:, -position_ids.shape[-1] :].bool()
        steps_ok = steps_ok | ~(visible[:, 1:] & visible[:, :-1])
    message = (
        "position_ids restart or jump inside a row (packed sequences): softmax_rnn attention would attend across "
        "the documents; pass one sequence per row, padded, with its attention_mask"
    )
    if is_torchdynamo_compiling():
        torch._assert_async(steps_ok.all(), message)
        return
    if position_ids.device.type != "meta" and not bool(steps_ok.all()):
        row, column = (~steps_ok).nonzero()[0].tolist()
        found = position_ids[row, column : column + 2].tolist()
        raise ValueError(f"{message} (row {row}, columns {column}-{column + 1}: positions {found})")


def _check_inputs_hook(model, args, kwargs) -> tuple[tuple, dict] | None:
    """Before each forward: attention weights refused, the padding mask's values (bool or 0/1) and
    the positions (no packed sequences) checked; in training mode `use_cache` defaults to False
    (`training_without_cache`)."""
    inputs = {**dict(zip(model._forward_argument_names, args, strict=False)), **kwargs}
    model._refuse_attention_weights(inputs.get("output_attentions"))
    check_token_shape(inputs, model.config.hidden_size)
    check_token_ids(inputs.get("input_ids"), model.config.vocab_size)
    check_labels(inputs.get("labels"), inputs, model.config.vocab_size)
    attention_mask = inputs.get("attention_mask")
    if attention_mask is not None and not (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4):
        check_padding_mask(attention_mask)
        tokens = inputs.get("input_ids")
        tokens = inputs.get("inputs_embeds") if tokens is None else tokens
        if isinstance(tokens, torch.Tensor) and tokens.dim() >= 2:
            check_mask_shape(attention_mask, tokens.shape[0], tokens.shape[1])
    check_positions(inputs.get("position_ids"), attention_mask)
    return training_without_cache(model, inputs, args, kwargs)


def training_without_cache(model, inputs: dict, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """(args, kwargs with `use_cache=False`) for a forward in training mode whose `inputs` (args and
    kwargs by name) neither ask for a cache nor pass one, else None (inputs unchanged), as transformers'
    recurrent models (Mamba, RWKV) default. With `config.use_cache` the model would otherwise build every
    layer's recurrent state (window buffers, the final state) that a training step throws away, and the
    layers could not take the state-free fused kernels (`hf_softmax_rnn.ops.backends`)."""
    said = ("use_cache", *CACHE_ARGUMENTS)
    if not model.training or any(name in model._forward_argument_names[: len(args)] for name in said):
        return None
    if any(inputs.get(name) is not None for name in said):
        return None
    return args, {**kwargs, "use_cache": False}


def check_token_shape(inputs: dict, hidden_size: int) -> None:
    """`input_ids` are `[B, L]` and `inputs_embeds` `[B, L, hidden_size]`, with L >= 1: another shape raises,
    naming it (the layers would fail reshaping it, deep inside)."""
    for name, shape in (("input_ids", ["B", "L"]), ("inputs_embeds", ["B", "L", hidden_size])):
        tokens = inputs.get(name)
        if not isinstance(tokens, torch.Tensor):
            continue
        if tokens.dim() != len(shape) or (len(shape) == 3 and tokens.shape[-1] != hidden_size):
            expected = ", ".join(map(str, shape))
            raise ValueError(
                f"{name} has shape {list(tokens.shape)}; expected [{expected}], one row per sequence ({name}[None] "
                "for a single one)"
            )
        if tokens.shape[1] == 0:
            raise ValueError(
                f"{name} has shape {list(tokens.shape)}: no token to read; expected at least one position per sequence"
            )


def check_token_ids(
    input_ids: torch.Tensor | None, vocab_size: int, name: str = "input_ids", ignored: int | None = None
) -> None:
    """Token ids are integers in [0, vocab_size) (or `ignored`, the loss's ignore index, for labels): a float
    tensor or an id outside raises, naming it (the embedding or the loss would raise an IndexError from deep
    inside, or fail on the device). Reads the values (their least and largest, then which one is outside only
    when one may be) only outside torch.compile and CUDA-graph capture."""
    if not isinstance(input_ids, torch.Tensor):
        return
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise TypeError(f"{name} has dtype {input_ids.dtype}; expected integer token ids (torch.long)")
    if input_ids.numel() == 0 or input_ids.device.type == "meta" or is_torchdynamo_compiling():
        return
    if import_utils.is_cuda_stream_capturing():  # a CUDA graph cannot read values
        return
    low, high = torch.stack(torch.aminmax(input_ids)).tolist()  # one read of two numbers
    if low >= 0 and high < vocab_size:
        return
    outside = (input_ids < 0) | (input_ids >= vocab_size)
    if ignored is not None:
        outside &= input_ids != ignored
    if bool(outside.any()):
        also = "" if ignored is None else f" or {ignored} (not scored)"
        raise ValueError(
            f"{name} holds {input_ids[outside][0].item()}, outside the vocabulary: expected ids in "
            f"0..{vocab_size - 1}{also} (config.vocab_size={vocab_size})"
        )


#: The label of a position the loss skips (transformers' `ignore_index`).
IGNORED_LABEL = -100


def check_labels(labels: torch.Tensor | None, inputs: dict, vocab_size: int) -> None:
    """`labels` hold a token id in the vocabulary or -100 per input position, in the inputs' shape (the
    model shifts them itself): another shape or an id outside raises, naming it (the loss would raise an
    IndexError on a CPU and a device-side assert on a GPU)."""
    if not isinstance(labels, torch.Tensor):
        return
    tokens = inputs.get("input_ids")
    tokens = inputs.get("inputs_embeds") if tokens is None else tokens
    if isinstance(tokens, torch.Tensor) and tokens.dim() >= 2 and tuple(labels.shape) != tuple(tokens.shape[:2]):
        raise ValueError(
            f"labels has shape {list(labels.shape)} for inputs of {list(tokens.shape[:2])} positions; expected the "
            "same shape (one label per input position: the model shifts them itself)"
        )
    check_token_ids(labels, vocab_size, "labels", IGNORED_LABEL)


def check_mask_shape(attention_mask: torch.Tensor, batch: int, length: int) -> None:
    """A 2-D padding mask has a row per sequence and a column per position up to the last input token
    (the cached ones, then the `length` new ones): at least `length` columns."""
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] < length:
        raise ValueError(
            f"attention_mask has shape {list(attention_mask.shape)} for {batch} sequences of {length} new tokens; "
            f"expected [{batch}, cached + {length}] (one column per position, 1 = token, 0 = padding)"
        )


def check_prompt_padding(attention_mask: torch.Tensor, prompt: torch.Tensor) -> None:
    """`generate` continues each row after its last column, so a prompt's padding must be on the left
    and every row must hold a token; right padding or an empty row raises (transformers only warns)."""
    check_padding_mask(attention_mask)
    check_mask_shape(attention_mask, prompt.shape[0], prompt.shape[-1])
    if attention_mask.shape[1] != prompt.shape[-1]:
        raise ValueError(
            f"attention_mask has {attention_mask.shape[1]} columns for a prompt of {prompt.shape[-1]} tokens; "
            "expected one column per prompt token"
        )
    present = attention_mask.bool()
    empty = (~present.any(dim=1)).nonzero()
    if len(empty):
        raise ValueError(
            f"attention_mask row {empty[0].item()} masks every prompt token; give each row at least one token"
        )
    right_padded = (~present[:, -1]).nonzero()
    if len(right_padded):
        raise ValueError(
            f"attention_mask row {right_padded[0].item()} ends in padding: generate continues every row after its "
            "last column, so pad prompts on the left (tokenizer.padding_side = 'left')"
        )


class SoftmaxRNNPreTrainedMixin(RemoteCodeMixin):
    """Mixin for the softmax_rnn `PreTrainedModel` classes (put it first among the bases)."""

    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = False
    _can_compile_fullgraph = False

    def get_correct_attn_implementation(self, requested_attention: str | None, is_init_check: bool = False) -> str:
        """Always `ATTN_IMPLEMENTATION`: the attention layers compute their spec themselves."""
        if requested_attention not in (None, ATTN_IMPLEMENTATION, "sdpa"):
            logger.warning(
                "%s ignores attn_implementation=%r: its layers compute their AttentionSpec with hf_softmax_rnn.ops",
                type(self).__name__,
                requested_attention,
            )
        return ATTN_IMPLEMENTATION

    def _refuse_attention_weights(self, requested: bool | None) -> None:
        if requested:
            raise ValueError(
                f"{type(self).__name__} does not return attention weights (output_attentions=True): its layers compute "
                "their AttentionSpec without an attention matrix (recurrent layers have none); call it without "
                "output_attentions"
            )

    #: (block class, attribute, softmax_rnn attention class): the attention module that `post_init` swaps.
    attention_slot: tuple[type[torch.nn.Module], str, type[torch.nn.Module]]

    def post_init(self) -> None:
        """transformers' `post_init` after swapping each block's attention module for the softmax_rnn one
        (same parameter names, so state dicts load unchanged), plus a check before each forward (the
        forward keeps its signature, which `generate` reads): `output_attentions=True` raises, a mask
        that is not bool or 0/1 raises, and so do packed sequences (`check_positions`)."""
        block_class, name, attention_class = self.attention_slot
        for block in self.modules():
            attention = getattr(block, name, None) if isinstance(block, block_class) else None
            if attention is not None and not isinstance(attention, attention_class):
                setattr(block, name, attention_class(self.config, attention.layer_idx))
        for module in self.modules():  # the stock base model inside (`LlamaModel`, `GPT2Model`) initialises as we do
            if isinstance(module, PreTrainedModel) and not isinstance(module, SoftmaxRNNPreTrainedMixin):
                module._init_weights = self._init_weights
        super().post_init()
        if not getattr(self, "_refuses_attention_weights", False):
            self._forward_argument_names = tuple(inspect.signature(self.forward).parameters)
            self.register_forward_pre_hook(_check_inputs_hook, with_kwargs=True)
            self._refuses_attention_weights = True

    def generate(self, *args, **kwargs):
        """transformers' `generate`; refuses an empty prompt, a prompt mask that is right-padded, has a
        row without tokens or does not fit the prompt, attention weights and a cache it cannot decode
        from, each with a message instead of an error from deep inside or a wrong continuation.

        `cache_implementation`: None / "dynamic" (any model), or "static" when every layer has a
        recurrent state (a `StaticCache` of `StaticRecurrentStateLayer`s, updated in place, which
        transformers compiles on an accelerator)."""
        self._refuse_attention_weights(kwargs.get("output_attentions"))
        prompt = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(prompt, torch.Tensor) and prompt.shape[-1] == 0:
            raise ValueError("generate got an empty prompt (input_ids with 0 tokens); pass at least one token")
        attention_mask = kwargs.get("attention_mask")
        if isinstance(prompt, torch.Tensor) and prompt.dim() == 2 and isinstance(attention_mask, torch.Tensor):
            check_prompt_padding(attention_mask, prompt)
        config = kwargs.get("generation_config") or self.generation_config
        chunk = kwargs.get("prefill_chunk_size", getattr(config, "prefill_chunk_size", None))
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"prefill_chunk_size={chunk!r} is not allowed; expected None or an int >= 1")
        implementation = kwargs.get("cache_implementation", getattr(config, "cache_implementation", None))
        self._check_cache_implementation(implementation)
        return super().generate(*args, **kwargs)

    def create_masks_for_generate(
        self,
        config,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache,
        position_ids=None,
        **kwargs,
    ) -> torch.Tensor | None:
        """The mask `generate` hands a compileable (static) cache's forward: `padding_mask`'s `[B, L]`
        columns of the new positions, or None (transformers' default returns the growing 2-D mask for
        layer types it does not know, a new shape, and a recompilation, every step)."""
        return create_causal_mask(
            config=config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
        )

    def _check_cache_implementation(self, implementation: str | None) -> None:
        """Of transformers' static caches only "static" works, and only when every layer decodes from a
        recurrent state (a KV layer would attend over the whole preallocated length); the dynamic ones
        are transformers' to check."""
        if implementation not in ALL_STATIC_CACHE_IMPLEMENTATIONS:
            return
        if implementation != "static":
            raise ValueError(
                f"cache_implementation={implementation!r} is not supported by {type(self).__name__}; of the static "
                "caches only 'static' is: expected one of [None, 'dynamic', 'offloaded', 'static']"
            )
        kv_layers = [i for i, kind in enumerate(self.config.layer_types) if kind != RECURRENT_LAYER_TYPE]
        if kv_layers:
            raise ValueError(
                f"cache_implementation='static' needs every layer to decode from a recurrent state "
                f"({RECURRENT_LAYER_TYPE}), but layers {kv_layers} of {type(self).__name__} keep a KV cache (exact "
                "exp); use cache_implementation=None or 'dynamic'"
            )

    @property
    def _is_stateful(self) -> bool:
        """Some layer decodes from a recurrent state, which cannot be rolled back (no assisted decoding)."""
        return RECURRENT_LAYER_TYPE in self.config.layer_types

    def _init_weights(self, module: torch.nn.Module) -> None:
        """transformers' initialisation, except for `RNNParams` and its projections (`RNNProjection`), which
        initialise themselves (the standard init would give a projection normal weights and a zero bias: gates at
        0.5, a decay with a half-life of one position). The base model inside uses this method too (`post_init`)."""
        if isinstance(module, RNNProjection):
            module.reset_parameters()
            return
        super()._init_weights(module)
        if isinstance(module, RNNParams):
            module.reset_parameters()
