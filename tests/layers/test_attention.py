"""The attention modules: against transformers' own modules, against the ops, attention transfer."""

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache, GPT2Config, LlamaConfig
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

from hf_softmax_rnn import AttentionSpec, SoftmaxRNNGPT2Config, SoftmaxRNNLlamaConfig
from hf_softmax_rnn.layers import (
    RNNParams,
    SoftmaxRNNGPT2Attention,
    SoftmaxRNNLlamaAttention,
    set_attention_transfer,
    transfer_losses,
)
from hf_softmax_rnn.layers.attention import GATE_BIAS_INIT, SEQLEN_POWER_INIT
from hf_softmax_rnn.ops import attention, softmax_attention_reference

from ..models.helpers import LLAMA_SHAPE

GPT2 = dict(
    n_embd=32, n_layer=2, n_head=4, vocab_size=64, scale_attn_by_inverse_layer_idx=True, attn_pdrop=0.0, resid_pdrop=0.0
)
LAYER = 1


def perturbed(module):
    with torch.no_grad():
        for param in module.rnn_params.parameters():
            param.add_(0.3 * torch.randn_like(param))
    return module


def llama_layer(spec, dtype=torch.float64):
    return perturbed(
        SoftmaxRNNLlamaAttention(SoftmaxRNNLlamaConfig(attention=spec, **LLAMA_SHAPE), LAYER).to(dtype).eval()
    )


def gpt2_layer(spec, dtype=torch.float64):
    return perturbed(SoftmaxRNNGPT2Attention(SoftmaxRNNGPT2Config(attention=spec, **GPT2), LAYER).to(dtype).eval())


def padding_mask(batch=2, length=7, padded=3):
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[1, :padded] = False
    return mask


def rope(length, dtype=torch.float64):
    config = LlamaConfig(**LLAMA_SHAPE)
    hidden = torch.zeros(1, length, 32, dtype=dtype)
    return LlamaRotaryEmbedding(config).to(dtype)(hidden, torch.arange(length)[None])


def gpt2_qkv(layer, hidden):
    shape = (*hidden.shape[:-1], -1, layer.head_dim)
    return [x.view(shape).transpose(1, 2) for x in layer.c_attn(hidden).split(layer.split_size, dim=2)]


def test_llama_layer_with_softmax_matches_transformers_llama_attention():
    stock_config = LlamaConfig(**LLAMA_SHAPE)
    stock_config._attn_implementation = "sdpa"
    stock = LlamaAttention(stock_config, LAYER).double().eval()
    ours = llama_layer("softmax")
    ours.load_state_dict(stock.state_dict(), strict=False)
    hidden = torch.randn(2, 7, 32, dtype=torch.float64)
    expected, _ = stock(hidden, position_embeddings=rope(7), attention_mask=None)
    actual, _ = ours(hidden, position_embeddings=rope(7), attention_mask=None)
    torch.testing.assert_close(actual, expected, atol=1e-12, rtol=0)


def test_gpt2_layer_with_softmax_matches_transformers_gpt2_attention_and_its_layer_scaling():
    stock_config = GPT2Config(**GPT2)
    stock_config._attn_implementation = "sdpa"
    stock = GPT2Attention(stock_config, layer_idx=LAYER).double().eval()
    ours = gpt2_layer("softmax")
    ours.load_state_dict(stock.state_dict(), strict=False)
    assert ours.scaling == pytest.approx(8**-0.5 / (LAYER + 1))
    hidden = torch.randn(2, 7, 32, dtype=torch.float64)
    torch.testing.assert_close(ours(hidden)[0], stock(hidden)[0], atol=1e-12, rtol=0)


GATED_FINITE = AttentionSpec(
    kind="linear", feature_map="elu", normalizer="rms", input_gate=True, output_gate=True, chunk_size=3
)
GATED_EXACT = AttentionSpec(
    kind="recurrent_softmax", score_clamp=5.0, normalizer="seqlen_layer", input_gate=True, output_gate=True
)


def ops_reference(layer, hidden, q, k, v, mask):
    """The ops computing the layer's spec on the whole sequence, values gated here."""
    gates = {"output": torch.sigmoid(layer.rnn_params.output_gate(hidden)).transpose(1, 2)}
    v = v * torch.sigmoid(layer.rnn_params.input_gate(hidden)).transpose(1, 2).unsqueeze(-1)
    spec = layer.attention_spec
    params = layer.rnn_params.op_params()
    out, _ = attention(q, k, v, spec, attention_mask=mask, gates=gates, params=params, scale=layer.scaling)
    return out.transpose(1, 2).reshape(*hidden.shape[:2], -1)


@pytest.mark.parametrize("spec", [GATED_FINITE, GATED_EXACT], ids=["recurrent-state", "kv-cache"])
def test_gated_values_in_the_cache_match_the_ops_gates_step_by_step(spec):
    layer = gpt2_layer(spec)
    hidden = torch.randn(2, 7, 32, dtype=torch.float64)
    mask = padding_mask()
    q, k, v = gpt2_qkv(layer, hidden)
    expected = ops_reference(layer, hidden, q, k, v, mask)
    cache = DynamicCache(config=SoftmaxRNNGPT2Config(attention=spec, **GPT2))
    outputs = []
    for positions in [slice(0, 4), slice(4, 5), slice(5, 6), slice(6, 7)]:  # prefill 4, then decode one by one
        q_t, k_t, v_t = (x[..., positions, :] for x in (q, k, v))
        outputs.append(
            layer.softmax_rnn_attention(hidden[:, positions], q_t, k_t, v_t, mask[:, : positions.stop], cache)
        )
    torch.testing.assert_close(torch.cat(outputs, dim=1)[mask], expected[mask], atol=1e-10, rtol=0)
    assert layer.uses_recurrent_state == (spec is GATED_FINITE)


def test_rnn_params_start_open_identity_like_and_documented():
    spec = AttentionSpec(
        kind="linear",
        feature_map="hedgehog",
        hedgehog_dim=6,
        normalizer="seqlen_layer",
        input_gate=True,
        output_gate=True,
    )
    params = RNNParams(spec, num_heads=4, num_kv_heads=2, head_dim=8, hidden_size=32)
    gates = params.gates(torch.randn(2, 5, 32))
    torch.testing.assert_close(
        gates["input"], torch.full((2, 2, 5), torch.sigmoid(torch.tensor(GATE_BIAS_INIT)).item())
    )
    torch.testing.assert_close(
        gates["output"], torch.full((2, 4, 5), torch.sigmoid(torch.tensor(GATE_BIAS_INIT)).item())
    )
    assert torch.equal(params.norm_weight, torch.ones(4, 8)) and torch.equal(params.norm_bias, torch.zeros(4, 8))
    assert torch.equal(params.hedgehog_q, torch.eye(8, 6).expand(4, 8, 6))
    assert torch.equal(params.hedgehog_k, torch.eye(8, 6).expand(2, 8, 6))
    cosine = RNNParams(
        AttentionSpec.from_preset("linear_cosine"), num_heads=4, num_kv_heads=2, head_dim=8, hidden_size=32
    )
    assert torch.equal(cosine.seqlen_power, torch.full((4,), SEQLEN_POWER_INIT))


def test_unknown_attention_mode_raises():
    config = SoftmaxRNNLlamaConfig(attention="linear_elu", **LLAMA_SHAPE)
    config.attention_mode = "recurrent"
    with pytest.raises(ValueError, match="attention_mode='recurrent' is not allowed"):
        SoftmaxRNNLlamaAttention(config, 0)


class TwoLayers(torch.nn.Module):
    """Stands in for a model: one converted layer and one exact-softmax layer."""

    def __init__(self, spec):
        super().__init__()
        self.converted, self.kept = gpt2_layer(spec), gpt2_layer("softmax")


@pytest.mark.parametrize("with_padding", [False, True], ids=["no-padding", "left-padding"])
def test_transfer_loss_is_the_mse_to_float64_softmax_on_visible_positions(with_padding):
    model = TwoLayers("gated_softmax_no_gate_L2norm_nodivS_noclamp")
    set_attention_transfer(model, True)
    hidden = torch.randn(2, 7, 32, dtype=torch.float64)
    mask = padding_mask() if with_padding else None
    model.converted(hidden, attention_mask=mask)
    (loss,) = transfer_losses(model)

    layer = model.converted
    q, k, v = gpt2_qkv(layer, hidden)
    student, _ = attention(q, k, v, layer.attention_spec, attention_mask=mask, scale=layer.scaling)
    teacher = softmax_attention_reference(q, k, v, mask, 8**-0.5 / (LAYER + 1))
    rows = torch.ones(2, 7, dtype=torch.bool) if mask is None else mask
    expected = F.mse_loss(student.transpose(1, 2)[rows], teacher.transpose(1, 2)[rows])
    torch.testing.assert_close(loss, expected, atol=1e-12, rtol=0)
    assert loss.requires_grad


def test_transfer_loss_gradient_treats_the_teacher_as_a_constant():
    layer = gpt2_layer("linear_elu")
    hidden = torch.randn(1, 5, 32, dtype=torch.float64)
    q, k, v = gpt2_qkv(layer, hidden)
    student, _ = attention(q, k, v, layer.attention_spec, scale=layer.scaling)
    teacher = softmax_attention_reference(q, k, v, None, layer.scaling).detach()
    F.mse_loss(student, teacher).backward()
    expected = layer.c_attn.weight.grad.clone()
    layer.zero_grad()

    set_attention_transfer(layer, True)
    layer(hidden)
    layer.transfer_loss.backward()
    torch.testing.assert_close(layer.c_attn.weight.grad, expected, atol=1e-12, rtol=0)


def test_transfer_switches_off_and_reports_misuse():
    model = TwoLayers("linear_elu")
    with pytest.raises(RuntimeError, match="No attention-transfer losses stored"):
        transfer_losses(model)
    set_attention_transfer(model, True)
    with pytest.raises(ValueError, match="use_cache=False"):
        model.converted(torch.randn(1, 3, 32, dtype=torch.float64), cache=DynamicCache())
    set_attention_transfer(model, False)
    model.converted(torch.randn(1, 3, 32, dtype=torch.float64))
    assert model.converted.transfer_loss is None
    with pytest.raises(ValueError, match="no converted"):
        set_attention_transfer(gpt2_layer("softmax"), True)


#: Exact exp with the softmax denominator, as a converted layer: its output is softmax's.
EXACT_EXP = dict(kind="recurrent_softmax", normalizer="softmax")


def _layer_call(family, layer, hidden):
    if family == "llama":
        return layer(hidden, position_embeddings=rope(hidden.shape[1]))
    return layer(hidden)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_frozen_teacher_stays_the_original_softmax_while_projections_train(family):
    make_layer = llama_layer if family == "llama" else gpt2_layer
    layer = make_layer(EXACT_EXP)
    projection = layer.QKV_PROJECTIONS[0]
    hidden = torch.randn(2, 6, 32, dtype=torch.float64)
    keys_before = set(layer.state_dict())

    for frozen, loss_after_change in [(True, "positive"), (False, "zero")]:
        original = {name: p.detach().clone() for name, p in layer.named_parameters()}
        set_attention_transfer(layer, True, trained=[projection] if frozen else [])
        assert set(layer.state_dict()) == keys_before  # the frozen copy is never saved
        _layer_call(family, layer, hidden)
        assert layer.transfer_loss.item() < 1e-20  # student == teacher before any change
        with torch.no_grad():
            getattr(layer, projection).weight.add_(0.5 * torch.randn_like(getattr(layer, projection).weight))
        _layer_call(family, layer, hidden)
        # a frozen teacher keeps the original q/k/v, so the student's change shows; an unfrozen one moves with it
        assert (
            (layer.transfer_loss.item() > 1e-4)
            if loss_after_change == "positive"
            else (layer.transfer_loss.item() < 1e-20)
        )
        set_attention_transfer(layer, False)
        assert not any(name.startswith("_teacher_") for name, _ in layer.named_buffers())
        with torch.no_grad():
            for name, p in layer.named_parameters():
                p.copy_(original[name])
