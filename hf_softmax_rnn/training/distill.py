"""The distillation objective: KL(teacher || student) of the next-token distributions.

`distillation_loss` is computed a slice of positions at a time and keeps nothing for the
backward but the two logit tensors it was given (which the caller holds anyway): the gradient
softmax(student) - softmax(teacher) is recomputed slice by slice. The plain autograd form
(`distillation_loss_reference`) keeps the student's and the teacher's float32 log-probabilities
for the backward, two `[B, L, V]` tensors (768 MiB for one 2,048-token block of a 49,152-token
vocabulary; `scripts/bench_distill_loss.py` measures both forms), where this form works on
slices of `SLICE_ELEMENTS` and keeps none.

Shapes: logits `[..., V]` (e.g. `[B, L, V]`); every leading position is one distribution.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Elements per slice of the sliced loss: 2**21 (8 MiB in float32), as many whole vocabulary rows as fit.
SLICE_ELEMENTS = 1 << 21


def distillation_loss_reference(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher || student), in one autograd graph (the reference)."""
    student = F.log_softmax(student_logits.float(), -1).flatten(0, -2)
    teacher = F.log_softmax(teacher_logits.float(), -1).flatten(0, -2)
    return F.kl_div(student, teacher, log_target=True, reduction="batchmean")


def _row_slices(rows: int, vocab: int):
    step = max(1, SLICE_ELEMENTS // vocab)
    return (slice(start, start + step) for start in range(0, rows, step))


class _SlicedKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
        student, teacher = student_logits.flatten(0, -2), teacher_logits.flatten(0, -2)
        dtype = torch.promote_types(student.dtype, torch.float32)
        total = torch.zeros((), dtype=dtype, device=student.device)
        for rows in _row_slices(*student.shape):
            teacher_logp = teacher[rows].to(dtype).log_softmax(-1)
            student_logp = student[rows].to(dtype).log_softmax(-1)
            total += (teacher_logp.exp() * (teacher_logp - student_logp)).sum()
        ctx.save_for_backward(student_logits, teacher_logits)
        return total / student.shape[0]

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        student_logits, teacher_logits = ctx.saved_tensors
        student, teacher = student_logits.flatten(0, -2), teacher_logits.flatten(0, -2)
        dtype = torch.promote_types(student.dtype, torch.float32)
        scale = grad_output.to(dtype) / student.shape[0]
        grad = torch.empty_like(student)
        for rows in _row_slices(*student.shape):
            difference = student[rows].to(dtype).softmax(-1) - teacher[rows].to(dtype).softmax(-1)
            grad[rows] = (difference * scale).to(grad.dtype)
        return grad.view_as(student_logits), None


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher || student) of the next-token distributions `[..., V]`
    (float32 or wider arithmetic whatever the logits' dtype); no gradient flows to the teacher."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits {tuple(teacher_logits.shape)} "
            "must have the same shape"
        )
    return _SlicedKL.apply(student_logits, teacher_logits.detach())
