"""Attention modules that compute any `AttentionSpec` inside Llama, GPT-2 and the families of Llama's pattern.

`SoftmaxRNNAttentionMixin` is the shared core: it owns `rnn_params` (every learned
tensor a spec adds: gates, norm weight/bias, hedgehog maps, seqlen power), calls
`hf_softmax_rnn.ops.attention` in the right mode and handles the cache:

- no cache (training, scoring): mode `config.attention_mode` for finite-state specs ("chunked" by
  default, "parallel" for the reference form), parallel for exact exp;
- cache and a finite-state spec that fits (`spec.fits_recurrent_state(head_dim)`):
  prefill "chunked", decode "recurrent", carrying the `RecurrentState` in a
  `RecurrentStateLayer` of a `DynamicCache` or a `StaticRecurrentStateLayer` of a
  `StaticCache` (constant memory; the static one updated in place);
- cache and exact exp (softmax, clamped exp, Taylor orders too large to store): keys and
  values go to the cache's `DynamicLayer` and the queries attend in parallel form (Lq < Lk).

`SoftmaxRNNLlamaAttention` and `SoftmaxRNNGPT2Attention` subclass transformers' modules
and keep their projections and parameter names (q_proj..o_proj, c_attn/c_proj), so
pretrained weights and PEFT targets work unchanged; `llama_like_attention_class` makes the
same subclass of another family's attention module of Llama's pattern (Mistral, Qwen2, ...).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, StaticLayer
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
from transformers.models.llama.modeling_llama import LlamaAttention, apply_rotary_pos_emb
from transformers.pytorch_utils import Conv1D

from hf_softmax_rnn.attention_spec import NO_CACHE_MODES, AttentionSpec
from hf_softmax_rnn.layers.cache import recurrent_state_layer
from hf_softmax_rnn.ops.attention import attention
from hf_softmax_rnn.ops.kernels import AttentionParams
from hf_softmax_rnn.ops.short_conv import short_conv
from hf_softmax_rnn.ops.softmax import softmax_attention
from hf_softmax_rnn.utils import device_memory_bytes

logger = logging.getLogger(__name__)

#: Gate bias at initialisation: sigmoid(5) = 0.993, so a gate starts (almost) open.
GATE_BIAS_INIT = 5.0
#: Half-lives (in positions) of the finite state at initialisation, shortest and longest: KV head j of
#: Hkv starts at the j-th of Hkv half-lives spaced geometrically between them (one head: their geometric
#: mean). Training blocks are 1,024 to 2,048 positions, so what a layer does further back is mostly set
#: here: a spread bounds the state's mass at any length and lets distillation choose between heads.
DECAY_HALF_LIFE_RANGE = (512.0, 16384.0)
#: Bias of the delta rule's write strength at initialisation: sigmoid(0) = 0.5, the mean of DeltaNet's
#: (a random projection): each entering key moves what the state recalls along it half way to its value.
DELTA_BIAS_INIT = 0.0


def decay_half_lives(num_kv_heads: int) -> torch.Tensor:
    """`[Hkv]` initial half-lives, geometric over `DECAY_HALF_LIFE_RANGE`."""
    shortest, longest = (math.log(x) for x in DECAY_HALF_LIFE_RANGE)
    if num_kv_heads == 1:
        return torch.tensor([math.exp((shortest + longest) / 2)])
    return torch.exp(torch.linspace(shortest, longest, num_kv_heads, dtype=torch.float64)).float()


def decay_bias(half_lives: torch.Tensor) -> torch.Tensor:
    """The bias b with sigmoid(b) = a = 2^(-1 / half-life): logit(a) = -log(2^(1/h) - 1)."""
    return -torch.log(torch.expm1(math.log(2.0) / half_lives.double())).float()


class RNNProjection(nn.Linear):
    """A `Linear(hidden, heads)` of `RNNParams` that initialises itself (here, in `convert` and in a model's
    `_init_weights`): weight 0, so that it does not yet depend on the token, and the bias `initial_bias()`."""

    def initial_bias(self) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def reset_parameters(self) -> None:
        init.zeros_(self.weight)
        init.copy_(self.bias, self.initial_bias().to(self.bias))


class GateProjection(RNNProjection):
    """An input or output gate's logits: bias `GATE_BIAS_INIT`."""

    def initial_bias(self) -> torch.Tensor:
        return torch.full((self.out_features,), GATE_BIAS_INIT)


class DecayProjection(RNNProjection):
    """The decay's logits: one constant half-life per KV head (`decay_half_lives`)."""

    def initial_bias(self) -> torch.Tensor:
        return decay_bias(decay_half_lives(self.out_features))


class DeltaProjection(RNNProjection):
    """The delta rule's write-strength logits: bias `DELTA_BIAS_INIT`."""

    def initial_bias(self) -> torch.Tensor:
        return torch.full((self.out_features,), DELTA_BIAS_INIT)


#: Initial logit p_h of the seqlen_pow normaliser (values divided by t^sigmoid(p_h)).
SEQLEN_POWER_INIT = 0.5

# normaliser -> its learned tensors (name -> shape as a function of heads H and value dim Dv)
_NORMALIZER_PARAMS: dict[str, dict[str, tuple[str, ...]]] = {
    "rms": {"norm_weight": ("H", "Dv")},
    "seqlen_rms": {"norm_weight": ("H", "Dv")},
    "layer": {"norm_weight": ("H", "Dv"), "norm_bias": ("H", "Dv")},
    "seqlen_layer": {"norm_weight": ("H", "Dv"), "norm_bias": ("H", "Dv")},
    "seqlen_pow": {"seqlen_power": ("H",)},
}
_PARAM_INIT_VALUES = {"norm_weight": 1.0, "norm_bias": 0.0, "seqlen_power": SEQLEN_POWER_INIT, "linear_log_scale": 0.0}


def _check_hedgehog_maps_fit(width: int, heads: int, head_dim: int) -> None:
    """The hedgehog maps, `heads` of [head_dim, hedgehog_dim] in the default dtype, fit in the memory of the
    default device, else an error naming hedgehog_dim and the largest that fits (before allocating them)."""
    memory = device_memory_bytes(torch.get_default_device())
    per_width = heads * head_dim * torch.tensor([], dtype=torch.get_default_dtype()).element_size()
    if memory is not None and width * per_width > memory:
        raise ValueError(
            f"AttentionSpec.hedgehog_dim={width} is not allowed here: its maps ({heads} heads of "
            f"[{head_dim}, {width}]) need {width * per_width:,} bytes a layer, more than the "
            f"{memory:,} bytes of {torch.get_default_device()}; expected hedgehog_dim <= {memory // per_width:,}"
        )


class RNNParams(nn.Module):
    """Every learned tensor an `AttentionSpec` adds to one attention layer.

    - `input_gate`: Linear(hidden, Hkv), sigmoid -> one scalar per position and KV head.
    - `output_gate`: Linear(hidden, H), sigmoid -> one scalar per position and query head.
    - `norm_weight`, `norm_bias` `[H, Dv]`: rms / layer normalisers.
    - `seqlen_power` `[H]`: logit of the exponent of the seqlen_pow normaliser.
    - `hedgehog_q` `[H, D, F]`, `hedgehog_k` `[Hkv, D, F]`: hedgehog feature maps.
    - `linear_log_scale` `[H]`: with a sliding window, the log weight of the finite-state part.
    - `decay_proj`: Linear(hidden, Hkv), logsigmoid -> the log-decay of the finite state per position
      and KV head (`spec.decay`; not named `*gate_proj`, which PEFT would match in the MLP).
    - `delta_proj`: Linear(hidden, Hkv), sigmoid -> the write strength of a delta-rule state per position
      and KV head (`spec.delta_rule`).
    - `short_conv_weight` `[Hkv, D + Dv, K]`: the taps of the short convolution of the keys and values
      (`spec.short_conv` = K), per KV head and channel (`ops.short_conv`).

    Initialisation (`reset_parameters`, also what `convert` gives a pretrained model):
    gate weights 0 and bias `GATE_BIAS_INIT`, so each gate is the constant 0.993 until
    trained (the output is scaled by 0.993, not by a token-dependent factor); norm weight 1
    and bias 0 (the plain normaliser); seqlen power `SEQLEN_POWER_INIT`; hedgehog maps the
    identity `eye(D, F)` per head, so phi(x) = [softmax(x), softmax(-x)] starts as the
    Hedgehog paper's initialisation, to be fitted to softmax by attention transfer; the
    window's linear log weight 0 (the finite-state part weighs as the kernel says); the decay
    weight 0 and the bias of each KV head set by `decay_half_lives`, so each head's state starts with
    a constant half-life between 512 and 16,384 positions; the delta weight 0 and bias `DELTA_BIAS_INIT`;
    the short convolution the identity (last tap 1, the others 0), so keys and values start unchanged.
    """

    def __init__(self, spec: AttentionSpec, num_heads: int, num_kv_heads: int, head_dim: int, hidden_size: int) -> None:
        super().__init__()
        self.input_gate = GateProjection(hidden_size, num_kv_heads) if spec.input_gate else None
        self.output_gate = GateProjection(hidden_size, num_heads) if spec.output_gate else None
        self.decay_proj = DecayProjection(hidden_size, num_kv_heads) if spec.decay else None
        self.delta_proj = DeltaProjection(hidden_size, num_kv_heads) if spec.delta_rule else None
        sizes = {"H": num_heads, "Dv": head_dim}
        self._tensor_names: list[str] = []
        for name, shape in _NORMALIZER_PARAMS.get(spec.normalizer, {}).items():
            self.register_parameter(name, nn.Parameter(torch.empty(*(sizes[dim] for dim in shape))))
            self._tensor_names.append(name)
        if spec.effective_feature_map == "hedgehog":
            width = spec.hedgehog_dim or head_dim
            _check_hedgehog_maps_fit(width, num_heads + num_kv_heads, head_dim)
            self.hedgehog_q = nn.Parameter(torch.empty(num_heads, head_dim, width))
            self.hedgehog_k = nn.Parameter(torch.empty(num_kv_heads, head_dim, width))
            self._tensor_names += ["hedgehog_q", "hedgehog_k"]
        if spec.window is not None and spec.has_finite_state:  # (sliding-window softmax mixes in nothing)
            self.linear_log_scale = nn.Parameter(torch.empty(num_heads))
            self._tensor_names.append("linear_log_scale")
        self.short_conv_weight = None
        if spec.short_conv is not None:
            self.short_conv_weight = nn.Parameter(torch.empty(num_kv_heads, 2 * head_dim, spec.short_conv))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for projection in (self.input_gate, self.output_gate, self.decay_proj, self.delta_proj):
            if projection is not None:
                projection.reset_parameters()
        for name in self._tensor_names:
            tensor = getattr(self, name)
            if name.startswith("hedgehog"):
                identity = torch.eye(tensor.shape[1], tensor.shape[2], device=tensor.device, dtype=tensor.dtype)
                init.copy_(tensor, identity.expand_as(tensor))
            else:
                init.constant_(tensor, _PARAM_INIT_VALUES[name])
        if self.short_conv_weight is not None:
            identity = torch.zeros_like(self.short_conv_weight)
            identity[..., -1] = 1.0
            init.copy_(self.short_conv_weight, identity)

    def convolve(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        tail: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Keys `[B, Hkv, L, D]` and values `[B, Hkv, L, Dv]` through the short convolution (unchanged without
        one), with the last inputs of the previous call `tail` `[B, Hkv, K - 1, D + Dv]` (None: none) and the
        padding mask `[B, L_total]` -> (key, value, the new tail or None)."""
        if self.short_conv_weight is None:
            return key, value, None
        mask = None if attention_mask is None else attention_mask[:, -key.shape[-2] :].bool()
        mixed, tail = short_conv(torch.cat([key, value], dim=-1), self.short_conv_weight, tail, mask)
        key, value = mixed.split([key.shape[-1], value.shape[-1]], dim=-1)
        return key, value, tail

    def gates(self, hidden_states: torch.Tensor) -> dict[str, torch.Tensor]:
        """Gate values from the layer input `[B, L, hidden]`: {"input": `[B, Hkv, L]`, "output": `[B, H, L]`,
        "decay": `[B, Hkv, L]` log-decays, "delta": `[B, Hkv, L]` write strengths}."""
        gates = {}
        for name, gate in (("input", self.input_gate), ("output", self.output_gate)):
            if gate is not None:
                gates[name] = torch.sigmoid(gate(hidden_states)).transpose(1, 2)
        if self.decay_proj is not None:
            logits = self.decay_proj(hidden_states)
            gates["decay"] = F.logsigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32))).transpose(1, 2)
        if self.delta_proj is not None:
            logits = self.delta_proj(hidden_states)
            gates["delta"] = torch.sigmoid(logits.to(torch.promote_types(logits.dtype, torch.float32))).transpose(1, 2)
        return gates

    def op_params(self) -> AttentionParams:
        """The learned tensors as `ops.attention(params=...)` takes them."""
        return AttentionParams(**{name: getattr(self, name) for name in self._tensor_names})


class SoftmaxRNNAttentionMixin:
    """The shared attention core: subclasses compute q `[B, H, L, D]`, k, v `[B, Hkv, L, D]`
    and call `softmax_rnn_attention`, which returns the pre-projection output `[B, L, H * D]`.

    Attributes set by `init_softmax_rnn`: `attention_spec`, `uses_recurrent_state`,
    `attention_mode`, `rnn_params`, and for attention transfer `attention_transfer`,
    `teacher_forcing` and `transfer_loss`. The input gate is applied here (so that cached
    values are gated); the ops get the module's `scaling` as the softmax scale.
    Subclasses name the modules that make q, k and v in `QKV_PROJECTIONS` and compute them in
    `project_qkv`, so that a frozen copy of those weights can feed the transfer teacher.
    Where `SOFTCAPPED_SCORES`, the exact softmax scores (a hybrid's window, sinks and kept keys; not its finite
    state) and the attention-transfer teacher's are capped at `config.attn_logit_softcapping`.
    """

    QKV_PROJECTIONS: tuple[str, ...] = ()
    SOFTCAPPED_SCORES = False

    def init_softmax_rnn(
        self,
        spec: AttentionSpec,
        attention_mode: str,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        hidden_size: int,
    ) -> None:
        self.attention_spec = spec
        self.uses_recurrent_state = spec.fits_recurrent_state(head_dim)
        self.set_attention_mode(attention_mode)
        if spec.short_conv is not None and not self.uses_recurrent_state:
            raise ValueError(
                f"AttentionSpec.short_conv={spec.short_conv} is not allowed with {spec.describe()} at head_dim="
                f"{head_dim}: its state ({spec.state_bytes(head_dim):,} bytes a KV head) is too large to decode from, "
                "and a key/value cache has no place for the convolution's last inputs; expected short_conv=None or "
                "a smaller state"
            )
        if spec.kept is not None and not self.uses_recurrent_state:
            raise ValueError(
                f"AttentionSpec.kept={spec.kept} is not allowed with {spec.describe()} at head_dim={head_dim}: its "
                f"state ({spec.state_bytes(head_dim):,} bytes a KV head) is too large to decode from, and a key/value "
                "cache cannot decode kept positions (a key is ranked by the queries of its window, which a decoding "
                "step does not hold); expected kept=None or a smaller state"
            )
        self.rnn_params = RNNParams(spec, num_heads, num_kv_heads, head_dim, hidden_size)
        self.attention_transfer = False
        self.teacher_forcing = True
        self.transfer_loss: torch.Tensor | None = None
        self.has_frozen_teacher = False

    def set_attention_mode(self, attention_mode: str) -> None:
        """How the layer computes a whole sequence without a cache: `attention_mode` ("parallel" or
        "chunked") for a finite-state spec; exact exp always in parallel form."""
        if attention_mode not in NO_CACHE_MODES:
            raise ValueError(
                f"attention_mode={attention_mode!r} is not allowed; expected one of {list(NO_CACHE_MODES)}"
            )
        self.attention_mode = attention_mode if self.uses_recurrent_state else "parallel"

    def freeze_teacher(self, enabled: bool) -> None:
        """Keep (or drop) a copy of the q/k/v projection weights as non-persistent buffers (moved
        with the module, never saved), so the transfer teacher stays the original softmax while
        those projections train."""
        for name in self.QKV_PROJECTIONS:
            for kind in ("weight", "bias"):
                buffer = f"_teacher_{name}_{kind}"
                if hasattr(self, buffer):
                    delattr(self, buffer)
                tensor = getattr(getattr(self, name), kind, None)
                if enabled and tensor is not None:
                    self.register_buffer(buffer, tensor.detach().clone(), persistent=False)
        self.has_frozen_teacher = enabled

    def projection(self, name: str, x: torch.Tensor, frozen: bool = False) -> torch.Tensor:
        """`getattr(self, name)(x)`, or the same map with the frozen teacher weights."""
        module = getattr(self, name)
        if not frozen:
            return module(x)
        weight, bias = getattr(self, f"_teacher_{name}_weight"), getattr(self, f"_teacher_{name}_bias", None)
        if isinstance(module, Conv1D):
            out = x @ weight
            return out if bias is None else out + bias
        return F.linear(x, weight, bias)

    @property
    def is_converted(self) -> bool:
        """Whether this layer computes something other than exact softmax."""
        return self.attention_spec.kind != "softmax"

    def softmax_rnn_attention(
        self,
        hidden_states: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: Cache | None,
        teacher_qkv: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """Attention of `self.attention_spec`: `[B, L, hidden]`, q `[B, H, L, D]`, k, v `[B, Hkv, L, D]`,
        padding mask `[B, L_total]` or None -> `[B, L, H * D]`. `teacher_qkv` makes q, k, v with the
        frozen projections (called only for attention transfer with a frozen teacher)."""
        batch, _, length, _ = query.shape
        gates = self.rnn_params.gates(hidden_states)
        input_gate = gates.pop("input", None)
        layer = (
            recurrent_state_layer(cache, self.layer_idx) if cache is not None and self.uses_recurrent_state else None
        )
        tail = None if layer is None or layer.state is None else layer.state.conv_tail
        mixed_key, mixed_value, tail = self.rnn_params.convolve(key, value, tail, attention_mask)
        gated_value = mixed_value if input_gate is None else mixed_value * input_gate.unsqueeze(-1).to(value.dtype)
        common = dict(
            attention_mask=attention_mask,
            gates=gates,
            params=self.rnn_params.op_params(),
            scale=self.scaling,
            check_gate_values=False,  # (sigmoid and log-sigmoid: in range)
        )
        softcap = self._softcap()
        if softcap is not None:  # (exact softmax and window hybrids only: the config refuses it elsewhere)
            common["softcap"] = softcap
        spec = self.attention_spec
        if cache is None:
            out, _ = attention(
                query, mixed_key, gated_value, spec, mode=self.attention_mode, return_state=False, **common
            )
            if self.attention_transfer:
                teacher = self._teacher_output(query, key, value, attention_mask, teacher_qkv)
                self.transfer_loss = self._transfer_loss(out, teacher, attention_mask)
                if self.teacher_forcing:
                    out = teacher.to(out.dtype)
        elif self.attention_transfer:
            raise ValueError("attention transfer compares full sequences; call the model with use_cache=False")
        elif self.uses_recurrent_state:
            mode = "recurrent" if length == 1 and layer.state is not None else "chunked"
            in_place = mode == "recurrent" and not torch.is_grad_enabled()  # decoding: the cache owns the state
            out, state = attention(
                query,
                mixed_key,
                gated_value,
                spec,
                mode=mode,
                state=layer.state,
                update_state_in_place=in_place,
                **common,
            )
            layer.update_state(state if tail is None else dataclasses.replace(state, conv_tail=tail), length)
        else:
            if self.layer_idx < len(cache.layers) and isinstance(cache.layers[self.layer_idx], StaticLayer):
                raise ValueError(
                    f"Layer {self.layer_idx} ({spec.describe()}) decodes from a KV cache, which softmax_rnn attention "
                    "reads from a DynamicCache only; use a StaticCache only when every layer has a recurrent state"
                )
            cached_key, gated_value = cache.update(mixed_key, gated_value, self.layer_idx)
            out, _ = attention(query, cached_key, gated_value, spec, mode="parallel", **common)
        return out.transpose(1, 2).reshape(batch, length, -1)

    def _softcap(self) -> float | None:
        """The cap of the scores, `config.attn_logit_softcapping` where `SOFTCAPPED_SCORES`, else None."""
        return getattr(self.config, "attn_logit_softcapping", None) if self.SOFTCAPPED_SCORES else None

    @torch.no_grad()
    def _teacher_output(self, query, key, value, attention_mask, teacher_qkv) -> torch.Tensor:
        """Exact causal softmax `[B, H, L, D]` (scores capped as the source model caps them, over the source's
        sliding window where it had one: `config.source_sliding_windows`) on the layer's q, k, v, or on those
        of the frozen teacher projections when they train."""
        if self.has_frozen_teacher:
            if teacher_qkv is None:
                raise ValueError("attention transfer with a frozen teacher needs `teacher_qkv`")
            query, key, value = teacher_qkv()
        key_mask = None if attention_mask is None else attention_mask[:, -key.shape[-2] :].bool()
        window = (getattr(self.config, "source_sliding_windows", None) or {}).get(str(self.layer_idx))
        return softmax_attention(query, key, value, key_mask, self.scaling, window, self._softcap())

    def _transfer_loss(
        self, student: torch.Tensor, teacher: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """MSE (in float32 or wider) between this layer's output and the teacher's, over non-padded
        query positions. Outputs `[B, H, L, D]`."""
        key_mask = None if attention_mask is None else attention_mask[:, -student.shape[-2] :].bool()
        dtype = torch.promote_types(student.dtype, torch.float32)
        student, teacher = student.to(dtype), teacher.to(dtype)
        if key_mask is None:
            return F.mse_loss(student, teacher)
        weight = key_mask[:, None, :, None].to(dtype)
        squared = (student - teacher).pow(2) * weight
        return squared.sum() / (weight.sum() * student.shape[1] * student.shape[-1]).clamp_min(1.0)

    def extra_repr(self) -> str:
        return f"attention={self.attention_spec.describe()!r}, recurrent_state={self.uses_recurrent_state}"


def _warn_attention_dropout(module: nn.Module, probability: float) -> None:
    if probability > 0:
        logger.info(
            "%s: attention-probability dropout (p=%s) is not applied by softmax_rnn attention layers",
            type(module).__name__,
            probability,
        )


class SoftmaxRNNLlamaLikeAttentionMixin(SoftmaxRNNAttentionMixin):
    """The attention of Llama's pattern computing `config.attention_spec(layer_idx)`: put it first among the
    bases of a transformers attention module with q_proj, k_proj, v_proj (`QKV_PROJECTIONS`; or one fused
    projection of q, then k, then v, as Phi-3's qkv_proj) and o_proj, an optional RMSNorm of the queries and
    keys before RoPE (`q_norm`, `k_norm`: per head as in Qwen3, or over the whole projection as in OLMo 2,
    `QK_NORM`), RoPE applied by `apply_rotary_pos_emb(q, k, cos, sin)` (the function of the module's own
    modeling file) unless the module's `use_rope` is false (SmolLM3's NoPE layers), and q.k scaled by the
    module's `scaling` (Granite's `attention_multiplier`)."""

    QKV_PROJECTIONS = ("q_proj", "k_proj", "v_proj")
    #: Where `q_norm` / `k_norm` normalise: "head" (each head's D features) or "projection" (all H * D).
    QK_NORM = "head"

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.init_softmax_rnn(
            config.attention_spec(layer_idx),
            config.attention_mode,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_size=config.hidden_size,
        )
        #: The widths of q, k and v in the output of a fused projection.
        self.qkv_widths = (
            config.num_attention_heads * self.head_dim,
            config.num_key_value_heads * self.head_dim,
            config.num_key_value_heads * self.head_dim,
        )
        _warn_attention_dropout(self, config.attention_dropout or 0.0)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """`[B, L, hidden]` -> (`[B, L, hidden]`, None); attention_mask is the 2-D padding mask."""
        query, key, value = self.project_qkv(hidden_states, position_embeddings)
        teacher_qkv = functools.partial(self.project_qkv, hidden_states, position_embeddings, frozen=True)
        out = self.softmax_rnn_attention(hidden_states, query, key, value, attention_mask, cache, teacher_qkv)
        return self.o_proj(out), None

    def project_qkv(self, hidden_states: torch.Tensor, position_embeddings, frozen: bool = False):
        """q `[B, H, L, D]`, k, v `[B, Hkv, L, D]` (q/k norms, then RoPE, applied), with the frozen teacher
        weights if `frozen`."""
        if len(self.QKV_PROJECTIONS) == 1:
            fused = self.projection(self.QKV_PROJECTIONS[0], hidden_states, frozen)
            query, key, value = fused.split(self.qkv_widths, dim=-1)
        else:
            query, key, value = (self.projection(name, hidden_states, frozen) for name in self.QKV_PROJECTIONS)
        has_qk_norm = getattr(self, "q_norm", None) is not None
        if has_qk_norm and self.QK_NORM == "projection":
            query, key = self.q_norm(query), self.k_norm(key)
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query, key, value = (x.view(hidden_shape) for x in (query, key, value))
        if has_qk_norm and self.QK_NORM == "head":
            query, key = self.q_norm(query), self.k_norm(key)
        query, key, value = (x.transpose(1, 2) for x in (query, key, value))
        if getattr(self, "use_rope", True):
            if isinstance(position_embeddings, Mapping):  # one RoPE per layer type (Gemma 3)
                position_embeddings = position_embeddings[self.config.rope_layer_types[self.layer_idx]]
            cos, sin = position_embeddings
            query, key = self.apply_rotary_pos_emb(query, key, cos, sin)
        return query, key, value

    apply_rotary_pos_emb = staticmethod(apply_rotary_pos_emb)


class SoftmaxRNNLlamaAttention(SoftmaxRNNLlamaLikeAttentionMixin, LlamaAttention):
    """`LlamaAttention` (same q/k/v/o projections and RoPE) computing `config.attention_spec(layer_idx)`."""


def llama_like_attention_class(
    attention_class: type[nn.Module],
    module: str,
    *,
    qkv_projections: tuple[str, ...] = SoftmaxRNNLlamaLikeAttentionMixin.QKV_PROJECTIONS,
    qk_norm: str = SoftmaxRNNLlamaLikeAttentionMixin.QK_NORM,
    softcapped_scores: bool = False,
) -> type[nn.Module]:
    """`SoftmaxRNN<attention_class>`, defined in `module`: `attention_class` (a module of Llama's pattern, see
    `SoftmaxRNNLlamaLikeAttentionMixin`) computing `config.attention_spec(layer_idx)`, with the RoPE function of
    `attention_class`'s modeling file, its q/k/v projections `qkv_projections` (three names, or one fused),
    its q/k norms over `qk_norm` ("head" or "projection") and its scores capped at the config's
    `attn_logit_softcapping` where `softcapped_scores`."""
    name = f"SoftmaxRNN{attention_class.__name__}"
    rotary = sys.modules[attention_class.__module__].apply_rotary_pos_emb
    namespace = {
        "__module__": module,
        "__qualname__": name,
        "__doc__": f"`{attention_class.__name__}` computing `config.attention_spec(layer_idx)`.",
        "apply_rotary_pos_emb": staticmethod(rotary),
        "QKV_PROJECTIONS": tuple(qkv_projections),
        "QK_NORM": qk_norm,
        "SOFTCAPPED_SCORES": softcapped_scores,
    }
    return type(name, (SoftmaxRNNLlamaLikeAttentionMixin, attention_class), namespace)


class SoftmaxRNNGPT2Attention(SoftmaxRNNAttentionMixin, GPT2Attention):
    """`GPT2Attention` (same Conv1D c_attn/c_proj, GPT-2's scaling incl. `scale_attn_by_inverse_layer_idx`)
    computing `config.attention_spec(layer_idx)`. Self-attention only."""

    QKV_PROJECTIONS = ("c_attn",)

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, is_cross_attention=False, layer_idx=layer_idx)
        self.init_softmax_rnn(
            config.attention_spec(layer_idx),
            config.attention_mode,
            num_heads=self.num_heads,
            num_kv_heads=self.num_heads,
            head_dim=self.head_dim,
            hidden_size=self.embed_dim,
        )
        _warn_attention_dropout(self, config.attn_pdrop)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        output_attentions: bool | None = False,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """`[B, L, hidden]` -> (`[B, L, hidden]`, None); attention_mask is the 2-D padding mask."""
        if encoder_hidden_states is not None:
            raise ValueError(f"{type(self).__name__} is self-attention only; it got encoder_hidden_states")
        query, key, value = self.project_qkv(hidden_states)
        teacher_qkv = functools.partial(self.project_qkv, hidden_states, frozen=True)
        out = self.softmax_rnn_attention(hidden_states, query, key, value, attention_mask, cache, teacher_qkv)
        return self.resid_dropout(self.c_proj(out)), None

    def project_qkv(self, hidden_states: torch.Tensor, frozen: bool = False):
        """q, k, v `[B, H, L, D]` from `c_attn`, with the frozen teacher weights if `frozen`."""
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        fused = self.projection("c_attn", hidden_states, frozen)
        return tuple(x.view(shape).transpose(1, 2) for x in fused.split(self.split_size, dim=2))


def softmax_rnn_attention_modules(model: nn.Module) -> list[SoftmaxRNNAttentionMixin]:
    """All softmax_rnn attention modules of `model` (also inside PEFT or other wrappers), in order."""
    return [module for module in model.modules() if isinstance(module, SoftmaxRNNAttentionMixin)]


def _converted_modules(model: nn.Module) -> list[SoftmaxRNNAttentionMixin]:
    modules = [module for module in softmax_rnn_attention_modules(model) if module.is_converted]
    if not modules:
        raise ValueError(f"{type(model).__name__} has no converted (non-softmax) softmax_rnn attention layers")
    return modules


def set_attention_transfer(
    model: nn.Module, enabled: bool, *, trained: Iterable[str] = (), teacher_forcing: bool = True
) -> None:
    """Turn attention transfer on or off for every converted layer.

    While on, each converted layer also computes exact causal softmax attention (the teacher,
    no grad) and stores `mse(student, teacher)` of the pre-o_proj outputs in
    `module.transfer_loss` (forward with `use_cache=False`). With `teacher_forcing` the layer
    passes the teacher's output on, so every layer sees the original model's hidden states and
    its loss reaches only its own parameters; without, the student's output flows on. `trained` names the layer's
    submodules that will train; if it includes a q/k/v projection (`QKV_PROJECTIONS`), the
    teacher uses a copy of those weights taken now, else it would move with the student (and
    both could collapse to the same trivial attention). Otherwise it shares the layer's q, k, v.
    """
    trained = set(trained)
    for module in _converted_modules(model):
        module.attention_transfer = bool(enabled)
        module.teacher_forcing = bool(teacher_forcing)
        module.transfer_loss = None
        module.freeze_teacher(bool(enabled and trained & set(module.QKV_PROJECTIONS)))


@contextlib.contextmanager
def student_outputs(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block every layer computes and passes on its own output (attention transfer
    paused, e.g. to measure the converted model's perplexity in the middle of a transfer stage)."""
    modules = softmax_rnn_attention_modules(model)
    saved = [module.attention_transfer for module in modules]
    for module in modules:
        module.attention_transfer = False
    try:
        yield model
    finally:
        for module, transfer in zip(modules, saved, strict=True):
            module.attention_transfer = transfer


def transfer_losses(model: nn.Module) -> list[torch.Tensor]:
    """The transfer losses of the last forward, one scalar per converted layer."""
    modules = _converted_modules(model)
    if not all(module.attention_transfer and module.transfer_loss is not None for module in modules):
        raise RuntimeError(
            "No attention-transfer losses stored: call set_attention_transfer(model, True), then run a forward "
            "pass with use_cache=False"
        )
    return [module.transfer_loss for module in modules]
