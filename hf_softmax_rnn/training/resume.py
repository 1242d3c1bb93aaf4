"""Where a run starts: at step 0 with a new `TrainerState`, or, with `--resume`, at the newest intact checkpoint
of its output folder, whose recorded settings (`resume_policy`), weights and optimizer state must fit the run."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

from accelerate import Accelerator
from torch import nn

from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.training.checkpointing import (
    CHECKPOINTS_DIR,
    MODEL_FILE,
    OPTIMIZER_FILE,
    TRAINER_STATE_FILE,
    TrainerState,
    checkpoint_to_resume,
    model_state_problem,
    optimizer_state_problem,
)
from hf_softmax_rnn.training.config import FinetuneConfig
from hf_softmax_rnn.training.output_dir import PREVIOUS_RUN, check_output_dir
from hf_softmax_rnn.training.stages import Stage

logger = logging.getLogger(__name__)


def resume_point(config: FinetuneConfig, accelerator: Accelerator) -> tuple[Path | None, TrainerState]:
    """(the checkpoint to resume (None: start at step 0), the state of the run there). The output folder is
    checked first (nothing is written), then with --resume the checkpoint's settings against `config`'s. A new
    state records `config` as given (before it is fitted to the model), as every checkpoint of the run does."""
    resume_from = _checkpoint_to_resume(config, accelerator)
    if resume_from is None:
        return None, TrainerState(config=config.to_dict())
    state = TrainerState.load(resume_from / TRAINER_STATE_FILE)
    conflicts = config.resume_conflicts(state.config)
    if conflicts:
        raise UserInputError(f"--resume from {resume_from} with different settings: {'; '.join(conflicts)}")
    return resume_from, state


def _checkpoint_to_resume(config: FinetuneConfig, accelerator: Accelerator) -> Path | None:
    """Check the output folder (nothing written yet); with --resume, its newest intact checkpoint."""
    check_output_dir(config)
    if not config.output.resume:
        return None
    output_dir = Path(config.output_dir)
    path = checkpoint_to_resume(accelerator, output_dir)
    if path is None:
        folder = output_dir / CHECKPOINTS_DIR
        missing = "does not exist" if not folder.is_dir() else "holds no checkpoint"
        previous = [name for name in PREVIOUS_RUN if name != CHECKPOINTS_DIR and (output_dir / name).exists()]
        logger.warning(
            "--resume: %s %s%s; nothing to resume, starting from step 0",
            folder,
            missing,
            f" although the folder holds a previous run's {', '.join(previous)}" if previous else "",
        )
    return path


def check_checkpoint_fits(
    resume_from: Path, state: TrainerState, converted: nn.Module, stages: list[Stage], weight_decay: float
) -> None:
    """The weights and the optimizer state of the checkpoint to resume must fit the module and parameters its
    stage trains now (found on a copy of the converted model, set up as `Finetuner.run` sets it up): a
    checkpoint of a run that trained another model or other parameters is refused, naming its file, before
    the run writes anything."""
    if state.stage_index >= len(stages):
        return
    model = copy.deepcopy(converted)
    for stage in stages[: state.stage_index]:
        model = stage.setup(model)
        stage.teardown(model)
    stage = stages[state.stage_index]
    trainable = stage.setup(model)
    checks = (
        (MODEL_FILE, "the weights of another model", "a run of another model or method",
         model_state_problem, trainable),
        (OPTIMIZER_FILE, "the optimizer state of other parameters", "a run that trained other parameters",
         optimizer_state_problem, stage.parameter_groups(trainable, weight_decay)),
    )  # fmt: skip
    for file, held, saved_by, problem_of, trained in checks:
        problem = problem_of(resume_from, trained)
        if problem is not None:
            raise UserInputError(
                f"--resume: {resume_from / file} holds {held} than the {stage.name} stage trains ({problem}); "
                f"it was saved by {saved_by}: resume that run's --output-dir, or start over with --overwrite"
            )
