"""`finetune(config)`: convert a model, train its stages under Accelerate, save and publish it.

`Finetuner(config)` does everything that can fail on bad input before any training, in steps that
each return what they build: where the run starts (`resume`), the settings fitted to the model's
config (`model_checks`), the data and the models, the stages and the blocks (`loading`); it never
changes the config it is given. `Finetuner.run()` then evaluates (`heldout`), trains the stages
with checkpoints, and writes the outputs (see `outputs.py`).
"""

from __future__ import annotations

import logging
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator, DistributedDataParallelKwargs
from accelerate.utils import set_seed
from torch import nn
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase, get_scheduler

from hf_softmax_rnn.default_model import resolve_config
from hf_softmax_rnn.errors import TrainingDivergedError, UserInputError
from hf_softmax_rnn.layers import student_outputs
from hf_softmax_rnn.training.checkpointing import (
    check_exact_resume,
    data_fingerprint,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from hf_softmax_rnn.training.config import FinetuneConfig
from hf_softmax_rnn.training.data import ShuffledBlocks, StreamedBlocks, split_global_batch
from hf_softmax_rnn.training.heldout import heldout_metrics
from hf_softmax_rnn.training.loading import (
    check_enough_blocks,
    convert_and_build_stages,
    heldout_and_training_blocks,
    load_texts_and_model,
)
from hf_softmax_rnn.training.long_context_run import ORIGINAL, TRAINED, LongContextRun
from hf_softmax_rnn.training.metrics import AFTER_CONVERSION, BEFORE_CONVERSION, MetricsLogger, peak_memory
from hf_softmax_rnn.training.model_checks import fit_to_model_config, log_untrained_states
from hf_softmax_rnn.training.output_dir import claim_output_dir
from hf_softmax_rnn.training.outputs import RESULTS_FILE, RunSummary, publish, save_outputs
from hf_softmax_rnn.training.resume import check_checkpoint_fits, resume_point
from hf_softmax_rnn.training.stages import RNN_PARAMS, Stage, heldout_layer_mse, set_activation_checkpointing
from hf_softmax_rnn.training.transfer_report import record_layer_mse
from hf_softmax_rnn.utils import hardware_name

logger = logging.getLogger(__name__)


@dataclass
class FinetuneResult:
    """What a run produced: the trained model (LoRA merged), its tokenizer, the held-out
    metrics per point of the run ("base", "converted", then each stage; a stage's entry also holds
    its `train_tokens`), the output folder, the wall time of each stage trained by this process
    (seconds; a resumed stage counts only its part after the resume) and the process's peak memory
    by the end of training (`peak_memory`)."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    evaluations: dict[str, dict]
    output_dir: Path
    stage_seconds: dict[str, float] = field(default_factory=dict)
    long_context: dict | None = None
    peak_memory: dict[str, float] = field(default_factory=dict)


#: How a divergence message names a logged value.
_VALUE_NAMES = {
    "update": "optimizer update",
    "grad_norm": "gradient norm",
    "eval_loss": "held-out loss",
    "lr": "learning rate",
    "rnn_lr": "rnn_params learning rate",
}


def _parameters_finite(model: nn.Module, accelerator: Accelerator) -> bool:
    """Whether every trainable parameter of `model` is finite on every process (one reduction)."""
    flags = [torch.isfinite(p).all() for p in model.parameters() if p.requires_grad]
    non_finite = (~torch.stack(flags)).sum().float() if flags else torch.zeros((), device=accelerator.device)
    return accelerator.reduce(non_finite, "sum").item() == 0


def check_launched_processes(num_processes: int) -> None:
    """Raise `UserInputError` where the launcher started several processes (WORLD_SIZE) but Accelerate
    set up fewer: each would run the whole fine-tuning on its own. Accelerate does so on a machine
    without a GPU unless told to use the CPU (FSDP and DeepSpeed need GPUs)."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > num_processes:
        raise UserInputError(
            f"the launcher started WORLD_SIZE={launched} processes but Accelerate set up {num_processes}, so each "
            "would run the whole fine-tuning alone; without a GPU pass --cpu (gloo: `ACCELERATE_USE_CPU=1 "
            "accelerate launch --multi_gpu --num_processes N ...`; FSDP and DeepSpeed need GPUs)"
        )


class Finetuner:
    """One fine-tuning run. The constructor loads and checks everything; `run()` trains. `config` is the run's
    settings fitted to its model (`model_checks`): the recipe's blocks cut to its positions, the recipe's state
    stage left out where it would train nothing."""

    def __init__(self, config: FinetuneConfig) -> None:
        self.output_dir = Path(config.output_dir)
        self.metrics: MetricsLogger | None = None
        self.stage_seconds: dict[str, float] = {}
        self._ddp_kwargs = DistributedDataParallelKwargs()
        self.accelerator = Accelerator(
            cpu=config.optim.cpu, mixed_precision=config.optim.mixed_precision, kwargs_handlers=[self._ddp_kwargs]
        )
        check_launched_processes(self.accelerator.num_processes)
        config.optim.check_device(self.accelerator.device.type)
        self._show_progress = config.output.progress and self.accelerator.is_local_main_process
        self.resume_from, self.state = resume_point(config, self.accelerator)
        config = fit_to_model_config(config, resolve_config(config.model.original), self.accelerator.device)
        self.base_model, self.tokenizer, texts = load_texts_and_model(
            config, self.accelerator, progress=self._show_progress
        )
        self.long_context = (
            LongContextRun(config.evaluation, self.base_model, self.tokenizer)
            if config.evaluation.long_eval and self.accelerator.is_main_process
            else None
        )
        self.converted, self.stages, config = convert_and_build_stages(
            config, self.base_model, self.tokenizer, texts["train"]
        )
        self.config = config
        self.eval_ids, self.train_data = heldout_and_training_blocks(
            config, texts, self.tokenizer, self.stages, self.accelerator
        )
        self.global_batch = config.data.batch_size * self.accelerator.num_processes * config.data.grad_accum
        self._check_before_writing()
        self.output_claim = claim_output_dir(config, self.accelerator)  # everything is checked: the run may write
        self._log_setup()

    def _check_before_writing(self) -> None:
        """The checks of what was loaded: enough training blocks for a step, a checkpoint to resume that fits the
        model and reads the same data (`check_exact_resume`)."""
        check_enough_blocks(
            self.config,
            self.stages,
            self.train_data,
            global_batch=self.global_batch,
            num_processes=self.accelerator.num_processes,
        )
        if self.resume_from is not None:
            check_checkpoint_fits(
                self.resume_from, self.state, self.converted, self.stages, self.config.optim.weight_decay
            )
        fingerprint = data_fingerprint(list(self.train_data.values()), self.eval_ids)
        if self.resume_from is not None:
            allow_inexact = self.config.output.allow_inexact_resume
            check_exact_resume(self.accelerator, self.resume_from, self.state, fingerprint, allow_inexact=allow_inexact)
        self.state.data_fingerprint = fingerprint

    def _log_setup(self) -> None:
        """The batch, the blocks and the layers whose finite state gets no training, in the log."""
        data = self.config.data
        logger.info(
            "Global batch %d blocks (%d per process x %d processes x %d accumulation) of %s tokens; %d held-out "
            "blocks; distributed: %s",
            self.global_batch,
            data.batch_size,
            self.accelerator.num_processes,
            data.grad_accum,
            ", ".join(f"{stage.block_size} ({stage.name})" for stage in self.stages),
            len(self.eval_ids),
            self.accelerator.distributed_type.value,
        )
        log_untrained_states(self.converted, max(stage.block_size for stage in self.stages))

    # ------------------------------------------------------------------ evaluation and logging
    def _log(self, stage: str, **values: float) -> None:
        if self.metrics is not None:
            self.metrics.log(self.state.global_step, stage, **values)

    def evaluate(self, model: nn.Module, point: str) -> dict:
        """Held-out metrics of `model`, logged under `point` at the current global step."""
        with student_outputs(model):
            result = heldout_metrics(
                model,
                self.eval_ids,
                self.accelerator,
                batch_size=self.config.data.eval_batch_size,
                progress=self._show_progress,
            )
        self._log(point, **result)
        logger.info("Held-out perplexity at %s (step %d): %.3f", point, self.state.global_step, result["perplexity"])
        return result

    # ------------------------------------------------------------------ training
    def run(self) -> FinetuneResult:
        start = time.perf_counter()
        resume_step = self.state.global_step if self.resume_from else None
        self.metrics = (
            MetricsLogger(self.output_dir, resume_from_step=resume_step) if self.accelerator.is_main_process else None
        )
        if BEFORE_CONVERSION not in self.state.evaluations:
            self.state.evaluations[BEFORE_CONVERSION] = self.evaluate(
                self.base_model.to(self.accelerator.device), BEFORE_CONVERSION
            )
            self._check_base_loss(self.state.evaluations[BEFORE_CONVERSION]["eval_loss"])
        if self.long_context is not None:
            self.long_context.measure(
                ORIGINAL, self.base_model.to(self.accelerator.device), progress=self._show_progress
            )
        del self.base_model
        model = self.converted.to(self.accelerator.device)
        if AFTER_CONVERSION not in self.state.evaluations:
            self.state.evaluations[AFTER_CONVERSION] = self.evaluate(model, AFTER_CONVERSION)
        for index, stage in enumerate(self.stages):
            if index < self.state.stage_index:  # trained before the resume: only the wrapper it leaves (LoRA)
                model = stage.setup(model)
                stage.teardown(model)
            else:
                model = self._train_stage(index, stage, model)
        if self.metrics is not None:
            self.metrics.close()
        summary = self.summary(seconds=time.perf_counter() - start)
        model = save_outputs(summary, model, is_main=self.accelerator.is_main_process)
        long_context = None
        if self.long_context is not None:
            self.long_context.measure(TRAINED, model, progress=self._show_progress)
            long_context = self.long_context.save(self.output_dir, RESULTS_FILE)
        self.accelerator.wait_for_everyone()
        self.output_claim.finish()
        if self.accelerator.is_main_process:
            publish(self.config.hub, self.output_dir)
        return FinetuneResult(
            model,
            self.tokenizer,
            dict(self.state.evaluations),
            self.output_dir,
            dict(self.stage_seconds),
            long_context,
            summary.peak_memory,
        )

    def summary(self, *, seconds: float) -> RunSummary:
        """What the output folder records of this run, after training."""
        stages = [
            {
                "name": stage.name,
                "steps": stage.steps,
                "learning_rate": stage.learning_rate,
                "trains": stage.trains,
                "trainable_parameters": self.state.trainable_parameters.get(stage.name),
                "block_size": stage.block_size,
                "tokens": stage.steps * self.global_batch * stage.block_size,
                "seconds_this_process": self.stage_seconds.get(stage.name),
            }
            for stage in self.stages
        ]
        return RunSummary(
            config=self.config,
            output_dir=self.output_dir,
            tokenizer=self.tokenizer,
            evaluations=dict(self.state.evaluations),
            stages=stages,
            global_step=self.state.global_step,
            global_batch=self.global_batch,
            num_processes=self.accelerator.num_processes,
            seconds=seconds,
            peak_memory=peak_memory(self.accelerator.device),
            hardware=hardware_name(self.accelerator.device),
        )

    def _train_stage(self, index: int, stage: Stage, model: nn.Module) -> nn.Module:
        optim, output, accelerator = self.config.optim, self.config.output, self.accelerator
        set_seed(optim.seed + index)
        set_activation_checkpointing(self.converted, optim.gradient_checkpointing or stage.activation_checkpointing)
        trainable = stage.setup(model)
        count = sum(p.numel() for p in trainable.parameters() if p.requires_grad)
        logger.info("Stage %s: %d steps, %s trainable parameters", stage.name, stage.steps, f"{count:,}")
        groups = stage.parameter_groups(trainable, self.config.optim.weight_decay)
        optimizer = torch.optim.AdamW(groups, lr=stage.learning_rate)
        scheduler = get_scheduler(
            optim.lr_scheduler,
            optimizer,
            num_warmup_steps=optim.warmup_steps,
            num_training_steps=stage.steps,
        )
        self._ddp_kwargs.find_unused_parameters = stage.may_leave_parameters_unused
        prepared, optimizer = accelerator.prepare(trainable, optimizer)
        blocks = self.train_data[stage.block_size]
        if self.resume_from is not None and index == self.state.stage_index:
            fingerprint = self.state.data_fingerprint  # of the data read now (differs with --allow-inexact-resume)
            self.state = load_checkpoint(accelerator, self.resume_from, scheduler)
            self.state.data_fingerprint = fingerprint
            blocks.load_state_dict(self.state.data)
        else:
            self.state.stage_index, self.state.stage_step = index, 0
        self.state.trainable_parameters[stage.name] = count
        unwrapped = accelerator.unwrap_model(prepared)
        if stage.name == "transfer" and self.state.stage_step == 0:
            self._record_layer_mse(unwrapped, "before")
        started = time.perf_counter()
        progress = tqdm(
            total=stage.steps, initial=self.state.stage_step, desc=stage.name, disable=not self._show_progress
        )
        for step in range(self.state.stage_step + 1, stage.steps + 1):
            values = self._train_step(stage, blocks, prepared, unwrapped, optimizer, scheduler)
            self.state.global_step += 1
            self.state.stage_step = step
            self._log(stage.name, **values)
            self._stop_if_diverged(stage, step, values, prepared)
            progress.update()
            progress.set_postfix(loss=f"{values['loss']:.4f}")
            last = step == stage.steps
            if step % output.eval_every == 0 or last:
                result = self.evaluate(prepared, stage.name)
                self._stop_if_diverged(stage, step, {"eval_loss": result["eval_loss"]})
                progress.set_postfix(loss=f"{values['loss']:.4f}", ppl=f"{result['perplexity']:.2f}")
                if last:
                    tokens = stage.steps * self.global_batch * stage.block_size
                    self.state.evaluations[stage.name] = {**result, "train_tokens": tokens}
                    self.stage_seconds[stage.name] = round(time.perf_counter() - started, 1)
            if step % output.save_every == 0 or last:
                self.state.data = blocks.state_dict()
                save_checkpoint(accelerator, self.output_dir, self.state, scheduler, keep=output.save_total_limit)
        progress.close()
        if stage.name == "transfer":
            self._record_layer_mse(unwrapped, "after")
        stage.teardown(unwrapped)
        accelerator.free_memory()
        return unwrapped

    def _check_base_loss(self, loss: float) -> None:
        """The model before conversion scores the held-out blocks with a finite loss; NaN or inf there comes
        from its weights or its config (a negative rope_theta), not from training, which would report it as a
        divergence at step 1 and advise a lower learning rate."""
        if not math.isfinite(loss):
            name = self.config.model.original
            raise UserInputError(
                f"Model {name!r} scores the held-out data with a loss of {loss} before any training: its weights "
                "hold non-finite values or its config.json settings make its outputs so (rope_theta, norm eps, ...); "
                "expected a model whose logits are finite (nothing was trained, no model was written)"
            )

    def _stop_if_diverged(
        self, stage: Stage, step: int, values: dict[str, float], model: nn.Module | None = None
    ) -> None:
        """Raise `TrainingDivergedError` when one of `values` or a trainable parameter of `model` is not finite,
        before this step is checkpointed or any output written; the checkpoints saved so far stay."""
        name = next((name for name, value in values.items() if not math.isfinite(value)), None)
        problem = None if name is None else f"the {_VALUE_NAMES.get(name, name)} is {values[name]}"
        if problem is None and model is not None and not _parameters_finite(model, self.accelerator):
            problem = "a trained parameter is not finite"
        if problem is None:
            return
        latest = latest_checkpoint(self.output_dir)
        kept = f"last good checkpoint: {latest.name}" if latest else "no checkpoint was saved"
        raise TrainingDivergedError(
            f"Stage {stage.name}: training diverged at step {step} ({problem}); lower the {stage.learning_rates()} "
            f"or --max-grad-norm and start a new run with --overwrite ({kept}; no model was written)"
        )

    def _record_layer_mse(self, model: nn.Module, point: str) -> None:
        """Held-out per-layer transfer MSE of every held-out block (main process only) into the output folder."""
        if self.accelerator.is_main_process:
            values = heldout_layer_mse(model, self.eval_ids, self.config.data.eval_batch_size)
            record_layer_mse(self.output_dir, point, values)

    def _train_step(
        self,
        stage: Stage,
        blocks: ShuffledBlocks | StreamedBlocks,
        model: nn.Module,
        unwrapped: nn.Module,
        optimizer,
        scheduler,
    ) -> dict[str, float]:
        """One optimizer step over this process's share of the next global batch of `blocks`; returns the
        loss parts averaged over micro-batches and processes, the gradient norm and learning rate."""
        grad_accum, accelerator = self.config.data.grad_accum, self.accelerator
        micro_batches = split_global_batch(
            blocks.next_blocks(self.global_batch),
            grad_accum=grad_accum,
            num_processes=accelerator.num_processes,
            process_index=accelerator.process_index,
        ).to(accelerator.device)
        model.train()
        totals: dict[str, torch.Tensor] = {}
        for micro, input_ids in enumerate(micro_batches):
            syncing = micro == len(micro_batches) - 1
            with nullcontext() if syncing else accelerator.no_sync(model):
                parts = stage.loss(model, unwrapped, input_ids)
                accelerator.backward(parts["loss"] / grad_accum)
            for name, value in parts.items():
                totals[name] = totals.get(name, 0.0) + value.detach().float() / grad_accum
        # max_norm inf (no clipping) still measures the norm, which `_stop_if_diverged` checks
        max_norm = self.config.optim.max_grad_norm or math.inf
        values = {"grad_norm": float(accelerator.clip_grad_norm_(model.parameters(), max_norm))}
        values["lr"] = scheduler.get_last_lr()[0]
        if stage.rnn_learning_rate is not None:
            values["rnn_lr"] = next(g["lr"] for g in optimizer.param_groups if g.get("name") == RNN_PARAMS)
        try:
            optimizer.step()
        except RuntimeError as error:  # a step beyond the parameters' dtype: reported as divergence, as a NaN is
            if "overflow" not in str(error):
                raise
            values["update"] = math.inf
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        names = sorted(totals)
        means = accelerator.reduce(torch.stack([totals[name] for name in names]), "mean")
        return {**dict(zip(names, means.tolist(), strict=True)), **values}


def finetune(config: FinetuneConfig) -> FinetuneResult:
    """Run `config` end to end (see `Finetuner`)."""
    return Finetuner(config).run()
