"""Agreement with the original by position against the full logits of two plain forwards, compared
and bucketed by hand."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from hf_softmax_rnn import convert
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.layers import softmax_rnn_attention_modules
from hf_softmax_rnn.long_context.fidelity import position_fidelity, token_divergence
from hf_softmax_rnn.long_context.positions import eval_sequences

from ..models.helpers import perturb_rnn_params
from .helpers import LLAMA_KWARGS, TEXTS, tiny_gpt2, tiny_llama, tokenizer

BUCKETS = ((0, 8), (8, 40), (50, 120))


def _sharpened(model):
    """`model` in float64 with its final norm scaled up, so that its next-token distributions are peaked
    (a tiny random model's are nearly uniform, and any two of them nearly agree)."""
    final_norm = getattr(model.base_model, "norm", None) or model.base_model.ln_f
    with torch.no_grad():
        final_norm.weight.mul_(30.0)
    return model.double()


def _converted_pair(preset: str, original=None):
    original = _sharpened(original or tiny_llama())
    return perturb_rnn_params(convert(copy.deepcopy(original), preset)).eval(), original


def _gpt2_pair():
    return _converted_pair("linear_elu", tiny_gpt2())


def _noised_pair():
    original = _sharpened(tiny_llama())
    noised = copy.deepcopy(original)
    with torch.no_grad():
        for weight in noised.parameters():
            weight.add_(0.004 * torch.randn_like(weight))
    return noised, original


PAIRS = {
    "llama-hedgehog_window_64": lambda: _converted_pair("hedgehog_window_64"),
    "llama-linear_elu": lambda: _converted_pair("linear_elu"),
    "gpt2-linear_elu": _gpt2_pair,
    "llama-noised-copy": _noised_pair,  # top-1 differs at about half the positions
}


@pytest.fixture(scope="module")
def byte_tok():
    return tokenizer()


def _by_hand(model, reference, sequences: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(reference || model) and argmax equality at every position, from each model's whole logits."""
    with torch.no_grad():
        log_q = F.log_softmax(model(input_ids=sequences, use_cache=False).logits[:, :-1].double(), dim=-1)
        log_p = F.log_softmax(reference(input_ids=sequences, use_cache=False).logits[:, :-1].double(), dim=-1)
    kl = F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)
    return kl, log_p.argmax(-1) == log_q.argmax(-1)


@pytest.mark.parametrize("name", PAIRS, ids=PAIRS)
def test_token_divergence_matches_whole_logits(name, byte_tok):
    model, reference = PAIRS[name]()
    ids = eval_sequences(byte_tok, TEXTS, 100, num_sequences=2)
    kl, agree = token_divergence(model, reference, ids, slice_size=7)
    expected_kl, expected_agree = _by_hand(model, reference, ids)
    assert kl.shape == agree.shape == (2, 99)
    torch.testing.assert_close(kl, expected_kl, rtol=1e-9, atol=1e-12)
    assert torch.equal(agree, expected_agree)
    assert kl.max() > 1e-5  # the models really differ


def test_a_window_hybrid_equals_its_original_inside_the_window(byte_tok):
    """Positions whose context fits in the 64-token window are scored by exact softmax: KL 0 there."""
    model, reference = _converted_pair("hedgehog_window_64")
    kl, agree = token_divergence(model, reference, eval_sequences(byte_tok, TEXTS, 100, num_sequences=2))
    assert kl[:, :63].abs().max() < 1e-12 and agree[:, :63].all()
    assert kl[:, 64:].min() > 0


@pytest.mark.parametrize("join", [False, True], ids=["documents", "joined"])
@pytest.mark.parametrize("name", PAIRS, ids=PAIRS)
def test_buckets_match_whole_logits_bucketed_by_hand(name, join, byte_tok):
    model, reference = PAIRS[name]()
    result = position_fidelity(
        model, reference, byte_tok, TEXTS, BUCKETS, num_sequences=2, join=join, slice_size=11, progress=False
    )
    sequences = eval_sequences(byte_tok, TEXTS, 120, num_sequences=2, join=join)
    kl, agree = _by_hand(model, reference, sequences)
    for bucket, (start, end) in zip(result["buckets"], BUCKETS, strict=True):
        cells = [(row, t - 1) for row in range(2) for t in range(max(start, 1), end)]
        values = [kl[cell].item() for cell in cells]
        mean = sum(values) / len(values)
        stderr = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))
        assert (bucket["start"], bucket["end"], bucket["tokens"]) == (start, end, len(cells))
        assert bucket["kl"] == pytest.approx(mean, rel=1e-9)
        assert bucket["kl_stderr"] == pytest.approx(stderr, rel=1e-6)
        assert bucket["top1_agreement"] == sum(agree[cell].item() for cell in cells) / len(cells)
    assert (result["sequences"], result["sequence_length"], result["tokens"]) == (2, 120, 240)
    if name == "llama-noised-copy":
        assert agree.any() and not agree.all()  # agreement is counted, not constant


def test_a_conversion_to_softmax_agrees_everywhere(byte_tok):
    """The `softmax` preset computes the original attention: KL 0 (to round-off) and every top-1 equal."""
    model, reference = _converted_pair("softmax")
    result = position_fidelity(model, reference, byte_tok, TEXTS, BUCKETS, num_sequences=2, progress=False)
    assert [b["top1_agreement"] for b in result["buckets"]] == [1.0] * len(BUCKETS)
    assert max(abs(b["kl"]) for b in result["buckets"]) < 1e-12


def test_modes_are_restored_after_scoring(byte_tok, monkeypatch):
    """Both models are scored in eval mode with the finite-state layers chunked, then put back as they were."""
    model, reference = _converted_pair("linear_elu")
    model.train()
    layers = softmax_rnn_attention_modules(model)
    for layer in layers:  # the reference form, which scoring switches away from and back to
        layer.set_attention_mode("parallel")
    seen = []
    monkeypatch.setattr(
        type(layers[0]), "forward", _recording(type(layers[0]).forward, lambda layer: seen.append(layer.attention_mode))
    )
    position_fidelity(model, reference, byte_tok, TEXTS, ((0, 16),), num_sequences=1, progress=False)
    assert seen and set(seen) == {"chunked"}
    assert model.training and not reference.training
    assert {layer.attention_mode for layer in layers} == {"parallel"}


def _recording(forward, record):
    def recorded(self, *args, **kwargs):
        record(self)
        return forward(self, *args, **kwargs)

    return recorded


@pytest.mark.parametrize(
    ("pair", "message"),
    [
        (
            lambda: (
                tiny_llama(),
                type(tiny_llama())(type(tiny_llama().config)(**{**LLAMA_KWARGS, "vocab_size": 300})),
            ),
            "the model scores 257 tokens and the reference 300",
        ),
        (lambda: (tiny_llama(), tiny_gpt2()), None),
    ],
    ids=["other-vocabulary", "gpt2-reference-too-short"],
)
def test_pairs_that_cannot_be_compared_are_refused_before_scoring(pair, message, byte_tok, monkeypatch):
    model, reference = pair()
    for scored in (model, reference):
        monkeypatch.setattr(type(scored), "forward", lambda *a, **k: pytest.fail("a model ran"))
    if message is None:  # the GPT-2 reference's learned table has 512 rows: 600 positions are refused for it
        message = "bucket end=600 .* a learned table of 512 rows"
        buckets = ((0, 600),)
    else:
        buckets = ((0, 64),)
    with pytest.raises(UserInputError, match=message):
        position_fidelity(
            model, reference, byte_tok, TEXTS, buckets, num_sequences=1, join=True, past_max_positions=True
        )
