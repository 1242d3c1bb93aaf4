"""Checkpoints appear only when complete, and old ones go only after a newer one is in place."""

import re

import pytest
import torch
from accelerate import Accelerator

from hf_softmax_rnn.training.checkpointing import (
    CHECKPOINTS_DIR,
    TrainerState,
    checkpoint_dirs,
    latest_checkpoint,
    load_checkpoint,
    optimizer_state_problem,
    remove_incomplete,
    save_checkpoint,
)
from hf_softmax_rnn.training.metrics import MetricsLogger, read_metrics


def _training_objects():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def _step(model, optimizer, scheduler):
    model(torch.randn(4, 3)).pow(2).mean().backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def test_keeps_the_newest_and_restores_everything(tmp_path):
    accelerator = Accelerator(cpu=True)
    model, optimizer, scheduler = _training_objects()
    model, optimizer = accelerator.prepare(model, optimizer)
    for step in (1, 2, 3):
        _step(model, optimizer, scheduler)
        save_checkpoint(
            accelerator, tmp_path, TrainerState(global_step=step, data={"position": step}), scheduler, keep=2
        )
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["checkpoint-0000002", "checkpoint-0000003"]
    expected_weight, expected_lr, expected_draw = model.weight.detach().clone(), scheduler.get_last_lr(), torch.rand(3)
    accelerator.free_memory()

    restored, optimizer, scheduler = _training_objects()
    restored, optimizer = accelerator.prepare(restored, optimizer)
    state = load_checkpoint(accelerator, latest_checkpoint(tmp_path), scheduler)
    assert (state.global_step, state.data) == (3, {"position": 3})
    assert torch.equal(restored.weight, expected_weight)
    assert scheduler.get_last_lr() == expected_lr
    assert torch.equal(torch.rand(3), expected_draw)
    accelerator.free_memory()


def test_half_written_and_half_deleted_folders_are_never_checkpoints(tmp_path):
    root = tmp_path / CHECKPOINTS_DIR
    complete = root / "checkpoint-0000004"
    complete.mkdir(parents=True)
    TrainerState(global_step=4).save(complete / "trainer_state.json")
    (root / ".tmp-checkpoint-0000006").mkdir()
    (root / ".trash-checkpoint-0000002").mkdir()
    (root / "checkpoint-0000005").mkdir()  # renamed folders always hold trainer_state.json; this one does not
    assert latest_checkpoint(tmp_path) == complete
    remove_incomplete(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-0000004", "checkpoint-0000005"]


def test_metrics_of_a_resumed_run_drop_what_followed_the_checkpoint(tmp_path):
    logger = MetricsLogger(tmp_path)
    for step in range(6):
        logger.log(step, "finetune", loss=float(step))
    logger.close()
    MetricsLogger(tmp_path, resume_from_step=3).close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]


def _saved_optimizer(folder, *shapes):
    parameters = [torch.nn.Parameter(torch.ones(shape)) for shape in shapes]
    optimizer = torch.optim.AdamW(parameters)
    sum(p.sum() for p in parameters).backward()
    optimizer.step()
    torch.save(optimizer.state_dict(), folder / "optimizer.bin")


OPTIMIZER_MISMATCHES = {
    "same-parameters": ([(3, 2), (2,)], [(3, 2), (2,)], None),
    "another-count": ([(3, 2)], [(3, 2), (2,)], r"^1 parameter group of 1 tensor in the file, 1 parameter group of 2"),
    "another-shape": ([(3, 2), (2,)], [(4, 2), (2,)], r"^exp_avg of tensor 0 of parameter group 0 has shape \[3, 2\]"),
}


@pytest.mark.parametrize("saved,now,message", OPTIMIZER_MISMATCHES.values(), ids=OPTIMIZER_MISMATCHES.keys())
def test_an_optimizer_state_of_other_parameters_is_told_apart(tmp_path, saved, now, message):
    _saved_optimizer(tmp_path, *saved)
    groups = [{"params": [torch.nn.Parameter(torch.zeros(shape)) for shape in now]}]
    problem = optimizer_state_problem(tmp_path, groups)
    assert problem is None if message is None else re.search(message, problem), problem
