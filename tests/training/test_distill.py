"""The sliced distillation loss against KL written out in float64, and what it keeps for the backward."""

import pytest
import torch

from hf_softmax_rnn.training import distill
from hf_softmax_rnn.training.distill import distillation_loss, distillation_loss_reference


def kl_by_hand(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """sum_v p_t(v) (log p_t(v) - log p_s(v)), averaged over positions, in float64."""
    student, teacher = student.double().flatten(0, -2), teacher.double().flatten(0, -2)
    log_p_teacher = teacher - teacher.logsumexp(-1, keepdim=True)
    log_p_student = student - student.logsumexp(-1, keepdim=True)
    return (log_p_teacher.exp() * (log_p_teacher - log_p_student)).sum(-1).mean()


def logits(shape, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(shape, generator=generator, dtype=torch.float64)).to(dtype)


@pytest.fixture(params=[1, 3, 1 << 21], ids=["one-row-slices", "three-row-slices", "one-slice"])
def slice_rows(request, monkeypatch):
    """Rows per slice, set through the slice size so that several slices (and a ragged last one) run."""
    monkeypatch.setattr(distill, "SLICE_ELEMENTS", request.param * 50)
    return request.param


@pytest.mark.parametrize(
    "dtype,tolerance",
    [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 1e-5)],
    ids=["float64", "float32", "bfloat16"],
)
def test_value_and_gradient_match_kl_by_hand(slice_rows, dtype, tolerance):
    student = logits((2, 7, 50), dtype, 0).requires_grad_()
    teacher = logits((2, 7, 50), dtype, 1)
    loss = distillation_loss(student, teacher)
    loss.backward(torch.tensor(2.0, dtype=loss.dtype))

    student64 = student.detach().double().requires_grad_()
    expected = kl_by_hand(student64, teacher)
    (2 * expected).backward()
    assert loss.dtype == torch.promote_types(dtype, torch.float32)
    torch.testing.assert_close(loss.double(), expected, rtol=tolerance, atol=tolerance)
    assert student.grad.dtype == dtype
    gradient_tolerance = 1e-2 if dtype == torch.bfloat16 else tolerance  # the gradient is stored in bf16
    torch.testing.assert_close(student.grad.double(), student64.grad, rtol=gradient_tolerance, atol=tolerance)


def test_matches_the_autograd_reference():
    student = logits((3, 11, 64), torch.float32, 2).requires_grad_()
    reference_student = student.detach().clone().requires_grad_()
    teacher = logits((3, 11, 64), torch.float32, 3)
    loss, reference = distillation_loss(student, teacher), distillation_loss_reference(reference_student, teacher)
    loss.backward()
    reference.backward()
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(student.grad, reference_student.grad)


def test_identical_distributions_give_zero_loss_and_gradient():
    student = logits((4, 30), torch.float32, 4).requires_grad_()
    loss = distillation_loss(student, student.detach() + 5.0)  # a shift does not change the distribution
    loss.backward()
    assert abs(loss.item()) < 1e-5
    assert student.grad.abs().max() < 1e-7


def test_no_gradient_reaches_the_teacher():
    student = logits((5, 20), torch.float32, 5).requires_grad_()
    teacher = logits((5, 20), torch.float32, 6).requires_grad_()
    distillation_loss(student, teacher).backward()
    assert teacher.grad is None
    assert student.grad is not None


def saved_bytes(loss_function, student, teacher) -> int:
    """Bytes of the tensors autograd keeps for the backward, beyond the two logit tensors."""
    kept = []

    def pack(tensor):
        if tensor.data_ptr() not in (student.data_ptr(), teacher.data_ptr()):
            kept.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss_function(student, teacher)
    return sum(kept)


def test_keeps_nothing_but_the_logits_for_the_backward():
    student = logits((2, 16, 256), torch.bfloat16, 7).requires_grad_()
    teacher = logits((2, 16, 256), torch.bfloat16, 8)
    logits_bytes = 2 * 16 * 256 * 4
    assert saved_bytes(distillation_loss_reference, student, teacher) >= 2 * logits_bytes
    assert saved_bytes(distillation_loss, student, teacher) == 0


def test_refuses_logits_of_different_shapes():
    with pytest.raises(ValueError, match=r"student logits \(2, 3, 5\) and teacher logits \(2, 3, 6\)"):
        distillation_loss(torch.zeros(2, 3, 5), torch.zeros(2, 3, 6))
