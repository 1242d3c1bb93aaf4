"""Teacher-forced attention transfer: each layer passes the exact softmax output on, so the model
computes the original logits, and each layer's loss reaches only its own parameters."""

import pytest
import torch

from hf_softmax_rnn import AttentionSpec, convert
from hf_softmax_rnn.layers import (
    set_attention_transfer,
    softmax_rnn_attention_modules,
    student_outputs,
    transfer_losses,
)
from hf_softmax_rnn.training.stages import heldout_layer_mse

from ..models.helpers import left_padded_batch, perturb_rnn_params, tiny_model, tiny_source

SPEC = AttentionSpec(kind="linear", feature_map="hedgehog", window=2)


def _converted_and_source(family):
    torch.manual_seed(0)
    source = tiny_source(family)
    return perturb_rnn_params(convert(source, SPEC)).eval(), source


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_teacher_forced_model_computes_the_original_logits(family):
    model, source = _converted_and_source(family)
    ids, mask = left_padded_batch()
    set_attention_transfer(model, True)
    forced = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    original = source(input_ids=ids, attention_mask=mask).logits
    rows = mask.bool()
    torch.testing.assert_close(forced[rows], original[rows], atol=1e-5, rtol=1e-5)
    with student_outputs(model):
        student = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    assert (student[rows] - original[rows]).abs().max() > 1e-3
    assert all(module.attention_transfer for module in softmax_rnn_attention_modules(model))


@pytest.mark.parametrize("forcing", [True, False], ids=["teacher-forced", "student-flows-on"])
def test_a_layers_loss_reaches_earlier_layers_only_without_teacher_forcing(forcing):
    model = tiny_model("llama", SPEC)
    set_attention_transfer(model, True, trained=["rnn_params"], teacher_forcing=forcing)
    ids, _ = left_padded_batch()
    model(input_ids=ids, use_cache=False)
    first, second = softmax_rnn_attention_modules(model)
    transfer_losses(model)[1].backward()
    assert second.rnn_params.hedgehog_q.grad.abs().sum() > 0
    reached = first.rnn_params.hedgehog_q.grad
    assert (reached is not None and reached.abs().sum() > 0) == (not forcing)


def test_heldout_layer_mse_matches_the_losses_of_a_forced_forward_and_restores_the_layers():
    model = tiny_model("gpt2", SPEC)
    ids, _ = left_padded_batch(lengths=(10, 10))
    values = heldout_layer_mse(model, ids, batch_size=1)
    set_attention_transfer(model, True)
    per_row = []
    for row in ids:
        model(input_ids=row[None], use_cache=False)
        per_row.append(torch.stack(transfer_losses(model)))
    torch.testing.assert_close(
        torch.tensor(values, dtype=torch.float32), torch.stack(per_row).mean(0), rtol=1e-5, atol=0
    )
    set_attention_transfer(model, False)
    model2 = tiny_model("gpt2", SPEC)
    heldout_layer_mse(model2, ids, batch_size=2)
    assert not any(module.attention_transfer for module in softmax_rnn_attention_modules(model2))
