"""`finetune(config)`: convert a model, train its stages under Accelerate, save and publish it.

`Finetuner(config)` does everything that can fail on bad input (settings, dataset, model,
block size, LoRA targets, packing, conversion) before any training; `Finetuner.run()` then
evaluates, trains the stages with checkpoints, and writes the outputs (see `outputs.py`).

Held-out perplexity, everywhere in a run, is exp(mean next-token NLL) over the test split
packed into `block_size`-token blocks (each block scored on its own, `block_size - 1`
predictions per block), computed with the blocks shared out over the processes.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import torch
from accelerate import Accelerator, DistributedDataParallelKwargs
from accelerate.utils import set_seed
from datasets import DatasetDict
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerBase, get_scheduler

from hf_softmax_rnn.attention_spec import AttentionSpec
from hf_softmax_rnn.convert import check_convertible, convert, converted_layers, converted_model_type
from hf_softmax_rnn.data.corpus import join_corpora, load_corpus
from hf_softmax_rnn.data.generated import GENERATED_CORPUS, GenerationSettings, generated_corpus
from hf_softmax_rnn.data.recall import FactPlanter
from hf_softmax_rnn.default_model import resolve_config, resolve_model
from hf_softmax_rnn.errors import TrainingDivergedError, UserInputError, user_input_checks
from hf_softmax_rnn.evaluation import next_token_nll
from hf_softmax_rnn.layers import softmax_rnn_attention_modules, student_outputs
from hf_softmax_rnn.long_context.extend import extend_context, extended_max_positions
from hf_softmax_rnn.long_context.retrieval import (
    DEFAULT_LENGTH,
    check_retrieval_count,
    retrieval_layer_attention,
    retrieval_scores,
    writes_digit_tokens,
)
from hf_softmax_rnn.training.checkpointing import (
    CHECKPOINTS_DIR,
    MODEL_FILE,
    OPTIMIZER_FILE,
    TRAINER_STATE_FILE,
    TrainerState,
    check_exact_resume,
    checkpoint_to_resume,
    data_fingerprint,
    latest_checkpoint,
    load_checkpoint,
    model_state_problem,
    optimizer_state_problem,
    save_checkpoint,
)
from hf_softmax_rnn.training.config import FinetuneConfig
from hf_softmax_rnn.training.data import ShuffledBlocks, StreamedBlocks, eval_blocks, split_global_batch, train_blocks
from hf_softmax_rnn.training.long_context_run import ORIGINAL, TRAINED, LongContextRun
from hf_softmax_rnn.training.metrics import AFTER_CONVERSION, BEFORE_CONVERSION, MetricsLogger, peak_memory
from hf_softmax_rnn.training.optim import weight_decay_groups
from hf_softmax_rnn.training.output_dir import PREVIOUS_RUN, check_output_dir, claim_output_dir
from hf_softmax_rnn.training.outputs import RESULTS_FILE, RunSummary, publish, save_outputs
from hf_softmax_rnn.training.stages import (
    RNN_PARAMS,
    Stage,
    build_stages,
    heldout_layer_mse,
    lora_targets,
    set_activation_checkpointing,
)
from hf_softmax_rnn.training.transfer_report import record_layer_mse
from hf_softmax_rnn.utils import hardware_name

logger = logging.getLogger(__name__)

#: Config entries in which a converted --model must equal its --teacher.
_SHAPE_SETTINGS = ("vocab_size", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads")


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


@torch.no_grad()
def heldout_metrics(
    model: nn.Module, blocks: torch.Tensor, accelerator: Accelerator, *, batch_size: int, progress: bool = False
) -> dict:
    """{"eval_loss", "perplexity", "eval_tokens"} of `blocks` `[N, L]`, each block scored on its own.

    Process r scores blocks r, r + P, ...; every process runs the same number of batches
    (short ones padded with a block of weight 0), so a wrapped (DDP/FSDP) model stays in step.
    """
    was_training = model.training
    model.eval()
    world, rank = accelerator.num_processes, accelerator.process_index
    rows = torch.arange(rank, len(blocks), world)
    per_process = math.ceil(len(blocks) / world)
    weights = torch.cat([torch.ones(len(rows)), torch.zeros(per_process - len(rows))]).double()
    rows = torch.cat([rows, rows.new_zeros(per_process - len(rows))])
    totals = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    for start in tqdm(range(0, per_process, batch_size), desc="held-out", leave=False, disable=not progress):
        ids = blocks[rows[start : start + batch_size]].to(accelerator.device)
        weight = weights[start : start + batch_size].to(accelerator.device)
        nll = next_token_nll(model(input_ids=ids, use_cache=False).logits, ids)
        totals += torch.stack([(nll.sum(1) * weight).sum(), weight.sum() * (ids.shape[1] - 1)])
    totals = accelerator.reduce(totals, "sum")
    model.train(was_training)
    loss = (totals[0] / totals[1]).item()
    return {"eval_loss": loss, "perplexity": math.exp(min(loss, 700.0)), "eval_tokens": int(totals[1].item())}


#: How a divergence message names a logged value.
_VALUE_NAMES = {
    "update": "optimizer update",
    "grad_norm": "gradient norm",
    "eval_loss": "held-out loss",
    "lr": "learning rate",
    "rnn_lr": "rnn_params learning rate",
}


def _architecture(config: PreTrainedConfig) -> str:
    """The model class a config names (its first architecture), else the config's class."""
    return (config.architectures or [type(config).__name__])[0]


#: Bytes of one logit under each `--mixed-precision`: a forward pass holds at least one per token and vocabulary entry.
_LOGIT_BYTES = {"no": 4, "bf16": 2, "fp16": 2}


def device_memory(device: torch.device) -> int:
    """Bytes of memory of `device`: a GPU's own, else the machine's."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return psutil.virtual_memory().total


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
    """One fine-tuning run. The constructor loads and checks everything; `run()` trains."""

    def __init__(self, config: FinetuneConfig) -> None:
        self.config = config
        self.output_dir = Path(config.output_dir)
        self.metrics: MetricsLogger | None = None
        self.stage_seconds: dict[str, float] = {}
        self._ddp_kwargs = DistributedDataParallelKwargs()
        self.accelerator = Accelerator(
            cpu=config.cpu, mixed_precision=config.mixed_precision, kwargs_handlers=[self._ddp_kwargs]
        )
        check_launched_processes(self.accelerator.num_processes)
        config.check_device(self.accelerator.device.type)
        self.resume_from = self._checkpoint_to_resume()
        self.state = (
            TrainerState.load(self.resume_from / TRAINER_STATE_FILE)
            if self.resume_from
            else TrainerState(config=config.to_dict())
        )
        if self.resume_from is not None:
            conflicts = config.resume_conflicts(self.state.config)
            if conflicts:
                raise UserInputError(
                    f"--resume from {self.resume_from} with different settings: {'; '.join(conflicts)}"
                )
        self._check_model_config(resolve_config(config.teacher or config.model))
        corpora = {
            name: load_corpus(
                name,
                config_name=config.dataset_config,
                text_column=config.text_column,
                test_fraction=config.test_fraction,
                seed=config.seed,
                streaming=config.streaming,
            )
            for name in config.dataset_sources
            if name != GENERATED_CORPUS
        }
        self.base_model, self.tokenizer = resolve_model(config.teacher or config.model)
        if config.extend_context is not None:
            extend_context(self.base_model, config.extend_context)
        if GENERATED_CORPUS in config.dataset_sources:
            corpora[GENERATED_CORPUS] = self._generated_corpus()
        texts = join_corpora([corpora[name] for name in config.dataset_sources])
        self.long_context = (
            LongContextRun(config, self.base_model, self.tokenizer)
            if config.long_eval and self.accelerator.is_main_process
            else None
        )
        with user_input_checks(ValueError, TypeError):  # LoRA targets, layers, stage modules, model type
            self.lora_targets = (
                lora_targets(self.base_model, config.lora_targets)
                if config.finetune_steps and config.finetune_method == "lora"
                else None
            )
            self.converted = (
                self._converted_model()
                if config.continues_converted
                else convert(
                    self.base_model,
                    config.attention_spec,
                    layers=config.layers,
                    attention_mode=config.attention_mode,
                    layer_attention=self._retrieval_layer_attention(texts["train"]),
                )
            )
            self._check_state_block()
            teacher = self.base_model.requires_grad_(False) if config.needs_teacher else None
            self.stages = build_stages(config, self.converted, lora_target_names=self.lora_targets, teacher=teacher)
        with self.accelerator.main_process_first(), user_input_checks():  # too little data for one block
            self.eval_ids = eval_blocks(
                texts["test"], self.tokenizer, config.heldout_block_size, config.max_eval_blocks
            )
            # the training blocks of each stage's length; stages of the same length read one stream in turn
            flags = {}
            for stage in self.stages:
                flags.setdefault(stage.block_size, stage.block_size_flag)
            self.train_data = {
                size: train_blocks(
                    texts["train"],
                    self.tokenizer,
                    size,
                    seed=config.seed,
                    shuffle_buffer=config.shuffle_buffer,
                    flag=flag,
                    transform=FactPlanter(self.tokenizer, config.recall_facts, size, config.seed)
                    if config.recall_facts
                    else None,
                )
                for size, flag in flags.items()
            }
        self.global_batch = config.batch_size * self.accelerator.num_processes * config.grad_accum
        self._check_enough_blocks()
        self._check_checkpoint_fits()
        fingerprint = data_fingerprint(list(self.train_data.values()), self.eval_ids)
        if self.resume_from is not None:
            check_exact_resume(
                self.accelerator, self.resume_from, self.state, fingerprint, allow_inexact=config.allow_inexact_resume
            )
        self.state.data_fingerprint = fingerprint
        self.output_claim = claim_output_dir(config, self.accelerator)  # everything is checked: the run may write
        logger.info(
            "Global batch %d blocks (%d per process x %d processes x %d accumulation) of %s tokens; %d held-out "
            "blocks; distributed: %s",
            self.global_batch,
            config.batch_size,
            self.accelerator.num_processes,
            config.grad_accum,
            ", ".join(f"{stage.block_size} ({stage.name})" for stage in self.stages),
            len(self.eval_ids),
            self.accelerator.distributed_type.value,
        )
        self._log_states_without_training()

    def _generated_corpus(self) -> DatasetDict:
        """The unconverted model's own texts (`data.generated`), written on the training device by the
        main process first (the others then read its cache)."""
        settings = GenerationSettings(
            num_texts=self.config.generated_texts, max_new_tokens=self.config.generated_tokens
        )
        device = self.base_model.device
        with self.accelerator.main_process_first():
            corpus = generated_corpus(
                self.base_model.to(self.accelerator.device),
                self.tokenizer,
                settings,
                progress=self._show_progress,
            )
        self.base_model.to(device)
        return corpus

    # ------------------------------------------------------------------ checks
    def _checkpoint_to_resume(self) -> Path | None:
        """Check the output folder (nothing written yet); with --resume, its newest intact checkpoint."""
        check_output_dir(self.config)
        if not self.config.resume:
            return None
        path = checkpoint_to_resume(self.accelerator, self.output_dir)
        if path is None:
            folder = self.output_dir / CHECKPOINTS_DIR
            missing = "does not exist" if not folder.is_dir() else "holds no checkpoint"
            previous = [name for name in PREVIOUS_RUN if name != CHECKPOINTS_DIR and (self.output_dir / name).exists()]
            logger.warning(
                "--resume: %s %s%s; nothing to resume, starting from step 0",
                folder,
                missing,
                f" although the folder holds a previous run's {', '.join(previous)}" if previous else "",
            )
        return path

    def _converted_model(self) -> PreTrainedModel:
        """--model, converted already (checked against --teacher by `_check_teacher`), with --attention-mode."""
        model, _ = resolve_model(self.config.model)
        model.config.attention_mode = self.config.attention_mode
        for module in softmax_rnn_attention_modules(model):
            module.set_attention_mode(self.config.attention_mode)
        return model

    def _check_model_config(self, model_config: PreTrainedConfig) -> None:
        """Settings that contradict the model's config stop here, before its weights and the data load: a
        model type `convert` does not take, layers or a retrieval-layer count beyond its layers, LoRA targets
        that match none of its modules (built on the meta device, without weights), an `--extend-context`
        it cannot take, blocks longer than its positions (extended, with `--extend-context`), and batches whose
        logits need more than the device's memory."""
        config, num_layers = self.config, model_config.num_hidden_layers
        with user_input_checks(ValueError, TypeError):
            check_convertible(model_config)
            if config.layers is not None:
                converted_layers(config.layers, num_layers)
            if config.finetune_steps and config.finetune_method == "lora":
                with torch.device("meta"):  # the modules without their weights
                    lora_targets(AutoModelForCausalLM.from_config(model_config), config.lora_targets)
        if config.continues_converted:
            self._check_teacher(resolve_config(config.model), model_config)
        if not config.retrieval_layers_from_recipe:
            check_retrieval_count(config.retrieval_layers, num_layers)
        maximum = getattr(model_config, "max_position_embeddings", None)
        if config.extend_context is not None:
            maximum = extended_max_positions(model_config, config.extend_context)
        self._check_block_size(maximum)
        self._check_batch_memory(model_config.vocab_size)

    def _check_batch_memory(self, vocab_size: int) -> None:
        """A batch whose logits alone (blocks x tokens x vocabulary entries) need more than the device's memory
        cannot run: refused from the config, before the weights and the data load."""
        config, memory = self.config, device_memory(self.accelerator.device)
        training_block = max([config.block_size] + ([config.state_block_size] if config.state_steps else []))
        per_logit = _LOGIT_BYTES[config.mixed_precision]
        batches = {"batch_size": training_block, "eval_batch_size": config.heldout_block_size}
        for name, block in batches.items():
            blocks, per_block = getattr(config, name), block * vocab_size * per_logit
            if blocks * per_block > memory:
                raise UserInputError(
                    f"--{name.replace('_', '-')} {blocks} needs at least {blocks * per_block:,} bytes for the logits "
                    f"of one batch ({blocks} blocks x {block} tokens x {vocab_size} vocabulary entries x {per_logit} "
                    f"bytes), more than the {memory:,} bytes of {self.accelerator.device.type}; use "
                    f"--{name.replace('_', '-')} <= {max(memory // per_block, 1)}"
                )

    def _check_enough_blocks(self) -> None:
        """Each step reads a global batch of distinct training blocks: a batch larger than the training data of a
        stage's block length (read whole, not streamed) is refused, before the run writes anything."""
        config = self.config
        for stage in self.stages:
            blocks = self.train_data[stage.block_size]
            if isinstance(blocks, ShuffledBlocks) and len(blocks) < self.global_batch:
                per_process = len(blocks) // (self.accelerator.num_processes * config.grad_accum)
                fewer = f"--batch-size <= {per_process}, " if per_process else ""
                raise UserInputError(
                    f"--batch-size {config.batch_size} x {self.accelerator.num_processes} processes x --grad-accum "
                    f"{config.grad_accum} = {self.global_batch} blocks per step, more than the {len(blocks)} training "
                    f"blocks of {stage.block_size} tokens ({stage.block_size_flag}, stage {stage.name}); use {fewer}"
                    "more data or shorter blocks"
                )

    def _check_checkpoint_fits(self) -> None:
        """The weights and the optimizer state of the checkpoint to resume must fit the module and parameters its
        stage trains now (found on a copy of the converted model, set up as `run` sets it up): a checkpoint of a
        run that trained another model or other parameters is refused, naming its file, before the run writes
        anything."""
        if self.resume_from is None or self.state.stage_index >= len(self.stages):
            return
        model = copy.deepcopy(self.converted)
        for stage in self.stages[: self.state.stage_index]:
            model = stage.setup(model)
            stage.teardown(model)
        stage = self.stages[self.state.stage_index]
        trainable = stage.setup(model)
        checks = (
            (MODEL_FILE, "the weights of another model", "a run of another model or method",
             model_state_problem, trainable),
            (OPTIMIZER_FILE, "the optimizer state of other parameters", "a run that trained other parameters",
             optimizer_state_problem, self._parameter_groups(stage, trainable)),
        )  # fmt: skip
        for file, held, saved_by, problem_of, trained in checks:
            problem = problem_of(self.resume_from, trained)
            if problem is not None:
                raise UserInputError(
                    f"--resume: {self.resume_from / file} holds {held} than the {stage.name} stage trains ({problem}); "
                    f"it was saved by {saved_by}: resume that run's --output-dir, or start over with --overwrite"
                )

    def _parameter_groups(self, stage: Stage, trainable: nn.Module) -> list[dict]:
        """The optimizer's parameter groups of `stage` over `trainable`: weight decay, and the converted
        layers' own learning rate."""
        return weight_decay_groups(
            trainable, self.config.weight_decay, own_lr=stage.rnn_learning_rate, own_module=RNN_PARAMS
        )

    def _check_teacher(self, converted: PreTrainedConfig, teacher: PreTrainedConfig) -> None:
        """A converted --model must be a conversion of a model shaped as --teacher: the same family, layers,
        heads and vocabulary (from the two configs)."""
        shape = {name: getattr(converted, name, None) for name in _SHAPE_SETTINGS}
        expected = {name: getattr(teacher, name, None) for name in _SHAPE_SETTINGS}
        if converted.model_type != converted_model_type(teacher) or shape != expected:
            raise UserInputError(
                f"--model {self.config.model!r} ({_architecture(converted)}, {shape}) is not a conversion of --teacher "
                f"{self.config.teacher!r} ({_architecture(teacher)}, {expected}); pass the model it was converted from"
            )

    def _check_block_size(self, maximum: int | None) -> None:
        """Blocks the recipe chose are cut to the model's `maximum` positions; blocks the user asked for must
        fit them (the state stage's only where it trains)."""
        config = self.config
        names = ("block_size", "eval_block_size") + (("state_block_size",) if config.state_steps else ())
        for name in names:
            value = getattr(config, name)
            if maximum is None or value is None or value <= maximum:
                continue
            if name in config.blocks_from_recipe:
                logger.info("The recipe's %s=%d is cut to the model's %d positions", name, value, maximum)
                setattr(config, name, maximum)
            else:
                raise UserInputError(
                    f"{name}={value} is larger than the model's maximum of {maximum} positions "
                    f"(max_position_embeddings of {config.model!r}); use --{name.replace('_', '-')} <= {maximum}"
                )

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
                batch_size=self.config.eval_batch_size,
                progress=self._show_progress,
            )
        self._log(point, **result)
        logger.info("Held-out perplexity at %s (step %d): %.3f", point, self.state.global_step, result["perplexity"])
        return result

    @property
    def _show_progress(self) -> bool:
        return self.config.progress and self.accelerator.is_local_main_process

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
            publish(self.config, self.output_dir)
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
        config, accelerator = self.config, self.accelerator
        set_seed(config.seed + index)
        set_activation_checkpointing(self.converted, config.gradient_checkpointing or stage.activation_checkpointing)
        trainable = stage.setup(model)
        count = sum(p.numel() for p in trainable.parameters() if p.requires_grad)
        logger.info("Stage %s: %d steps, %s trainable parameters", stage.name, stage.steps, f"{count:,}")
        optimizer = torch.optim.AdamW(self._parameter_groups(stage, trainable), lr=stage.learning_rate)
        scheduler = get_scheduler(
            config.lr_scheduler,
            optimizer,
            num_warmup_steps=config.warmup_steps,
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
            if step % config.eval_every == 0 or last:
                result = self.evaluate(prepared, stage.name)
                self._stop_if_diverged(stage, step, {"eval_loss": result["eval_loss"]})
                progress.set_postfix(loss=f"{values['loss']:.4f}", ppl=f"{result['perplexity']:.2f}")
                if last:
                    tokens = stage.steps * self.global_batch * stage.block_size
                    self.state.evaluations[stage.name] = {**result, "train_tokens": tokens}
                    self.stage_seconds[stage.name] = round(time.perf_counter() - started, 1)
            if step % config.save_every == 0 or last:
                self.state.data = blocks.state_dict()
                save_checkpoint(accelerator, self.output_dir, self.state, scheduler, keep=config.save_total_limit)
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
            name = self.config.teacher or self.config.model
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

    def _exact_positions_of_finite_states(self) -> dict[int, int]:
        """{layer index: positions its exact part scores (window, sinks, kept)} of each converted layer with a
        finite state: a training block must be longer for that state to be read."""
        return {
            module.layer_idx: module.attention_spec.exact_positions
            for module in softmax_rnn_attention_modules(self.converted)
            if module.is_converted and module.attention_spec.has_finite_state
        }

    def _check_state_block(self) -> None:
        """A state stage whose blocks fit in the exact part of every converted layer with a finite state would
        train nothing: the recipe's is left out with a warning, one the user asked for is refused."""
        config = self.config
        exact = self._exact_positions_of_finite_states().values()
        if not (config.state_steps and exact and config.state_block_size <= min(exact)):
            return
        reason = (
            f"a {config.state_block_size}-token block fits in the exact part of every converted layer (window, sinks "
            f"and kept positions: at least {min(exact)}), so no finite state would get any training"
        )
        if not config.state_steps_from_recipe:
            raise UserInputError(
                f"--state-block-size {config.state_block_size} is not allowed: {reason}; use more than {min(exact)} "
                "tokens, or --state-steps 0"
            )
        logger.warning("No state stage: %s", reason)
        config.state_steps = 0
        if not config.stage_names:
            raise UserInputError(
                f"Nothing to train: the recipe's state stage is left out ({reason}) and --transfer-steps and "
                "--finetune-steps are 0; set one of them > 0"
            )

    def _log_states_without_training(self) -> None:
        """Name the converted layers whose exact part holds every key of a training block: their finite state
        stays empty in training, so the parameters that only it uses (feature maps, decay) keep their values."""
        block = max(stage.block_size for stage in self.stages)
        layers = {layer: exact for layer, exact in self._exact_positions_of_finite_states().items() if exact >= block}
        if layers:
            logger.info(
                "Layers %s score every key of a %d-token training block exactly (window, sinks and kept positions: "
                "%s): their finite state gets no training; blocks longer than %d tokens train it",
                sorted(layers),
                block,
                " / ".join(map(str, sorted(set(layers.values())))),
                min(layers.values()),
            )

    def _retrieval_layer_attention(self, train_texts) -> dict[int, AttentionSpec] | None:
        """The wider kept budget of the `--retrieval-layers` layers, found on the unconverted model with
        passkey prompts of the training text (None for none). A count that the recipe chose is capped at
        the model's layers, and dropped with a warning when the tokenizer has no digit tokens."""
        config, layers = self.config, self.base_model.config.num_hidden_layers
        count = min(config.retrieval_layers, layers) if config.retrieval_layers_from_recipe else config.retrieval_layers
        if count and config.retrieval_layers_from_recipe and not writes_digit_tokens(self.tokenizer):
            logger.warning("No retrieval layers: the tokenizer writes numbers with no digit tokens to score them by")
            count = 0
        if not count:
            return None
        length = min(DEFAULT_LENGTH, self.base_model.config.max_position_embeddings)
        texts = (row["text"] for row in train_texts)
        scores = retrieval_scores(self.base_model, self.tokenizer, texts, length=length, progress=config.progress)
        overrides = retrieval_layer_attention(config.attention_spec, scores, count, config.retrieval_kept)
        ranked = ", ".join(f"{layer} ({scores[layer].max():.2f})" for layer in overrides)
        logger.info("Retrieval layers (best KV-head score) %s keep %d positions", ranked, config.retrieval_kept)
        return overrides

    def _record_layer_mse(self, model: nn.Module, point: str) -> None:
        """Held-out per-layer transfer MSE of every held-out block (main process only) into the output folder."""
        if self.accelerator.is_main_process:
            values = heldout_layer_mse(model, self.eval_ids, self.config.eval_batch_size)
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
        config, accelerator = self.config, self.accelerator
        micro_batches = split_global_batch(
            blocks.next_blocks(self.global_batch),
            grad_accum=config.grad_accum,
            num_processes=accelerator.num_processes,
            process_index=accelerator.process_index,
        ).to(accelerator.device)
        model.train()
        totals: dict[str, torch.Tensor] = {}
        for micro, input_ids in enumerate(micro_batches):
            syncing = micro == len(micro_batches) - 1
            with nullcontext() if syncing else accelerator.no_sync(model):
                parts = stage.loss(model, unwrapped, input_ids)
                accelerator.backward(parts["loss"] / config.grad_accum)
            for name, value in parts.items():
                totals[name] = totals.get(name, 0.0) + value.detach().float() / config.grad_accum
        # max_norm inf (no clipping) still measures the norm, which `_stop_if_diverged` checks
        values = {"grad_norm": float(accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm or math.inf))}
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
