"""`finite_state_off`: a hybrid reads only its exact parts within the block (its logits no longer depend on
what the finite state holds, in every mode and when decoding), and is unchanged after it."""

import pytest
import torch
from transformers import DynamicCache

from hf_softmax_rnn import convert
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.layers.attention import RNNParams
from hf_softmax_rnn.long_context import finite_state_off
from hf_softmax_rnn.long_context.positions import no_cache_mode

from ..models.helpers import perturb_rnn_params
from .helpers import tiny_gpt2, tiny_llama

SPECS = {
    "window": dict(kind="linear", feature_map="hedgehog", window=8),
    "sinks-kept-decay": dict(kind="linear", feature_map="hedgehog", window=8, sinks=2, kept=4, decay=True),
    "taylor-window": dict(kind="recurrent_softmax", taylor_order=2, window=8),
}
FAMILIES = {"llama": tiny_llama, "gpt2": tiny_gpt2}


def _hybrid(family: str, spec: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return perturb_rnn_params(convert(FAMILIES[family](), SPECS[spec])).eval()


def _redraw_state_parameters(model: torch.nn.Module) -> None:
    """New feature maps and decay: what the finite state holds changes, the exact part does not."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RNNParams):
                for name, param in module.named_parameters():
                    if name.startswith(("hedgehog", "decay_proj")):
                        param.add_(torch.randn_like(param))


def _ids(length: int = 40) -> torch.Tensor:
    return torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("spec", sorted(SPECS))
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_do_not_depend_on_the_state_and_return_after_the_block(family, spec):
    model, ids = _hybrid(family, spec), _ids()
    with torch.no_grad():
        before = model(ids).logits
        with finite_state_off(model):
            off = model(ids).logits
        _redraw_state_parameters(model)
        with finite_state_off(model):
            off_redrawn = model(ids).logits
        redrawn = model(ids).logits
    torch.testing.assert_close(off_redrawn, off, rtol=1e-5, atol=1e-6)
    # the state matters with it on: past the window (8 positions) the logits move with it
    assert (before[:, 12:] - off[:, 12:]).abs().max() > 1e-4
    if spec != "taylor-window":  # Taylor-2 has no learned state parameters to redraw
        assert (redrawn[:, 12:] - before[:, 12:]).abs().max() > 1e-4
    torch.testing.assert_close(before[:, :8], off[:, :8], rtol=1e-5, atol=1e-6)  # all within the window


@pytest.mark.parametrize("spec", sorted(SPECS))
def test_chunked_and_decoding_read_the_same_exact_parts(spec):
    model, ids = _hybrid("llama", spec), _ids(30)
    with torch.no_grad(), finite_state_off(model):
        parallel = model(ids).logits
        with no_cache_mode(model, "chunked"):
            chunked = model(ids).logits
        cache = DynamicCache(config=model.config)
        model(ids[:, :20], cache=cache, use_cache=True)
        steps = [model(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(20, 30)]
    torch.testing.assert_close(chunked, parallel, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.cat(steps, 1), parallel[:, 20:], rtol=1e-4, atol=1e-4)


def test_the_weights_come_back_after_an_exception():
    model = _hybrid("llama", "sinks-kept-decay")
    saved = {name: p.clone() for name, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match="inside"), finite_state_off(model):
        assert all(torch.isinf(p).all() for name, p in model.named_parameters() if "linear_log_scale" in name)
        raise RuntimeError("inside")
    for name, param in model.named_parameters():
        torch.testing.assert_close(param, saved[name], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (tiny_llama, "LlamaForCausalLM has no converted layer with a finite state"),
        (lambda: convert(tiny_llama(), "softmax"), "has no converted layer with a finite state"),
        (
            lambda: convert(tiny_llama(), "hedgehog_window_64", layer_attention={1: "linear_elu"}),
            r"layers 1 \(.*\) have a finite state and no window",
        ),
    ],
    ids=["unconverted", "softmax-preset", "a-layer-without-window"],
)
def test_models_without_a_hybrid_state_are_refused_unchanged(make, message):
    model = make()
    saved = {name: p.clone() for name, p in model.named_parameters()}
    with pytest.raises(UserInputError, match=message), finite_state_off(model):
        pass
    assert all(torch.equal(p, saved[name]) for name, p in model.named_parameters())
