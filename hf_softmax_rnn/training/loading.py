"""What a fine-tuning run loads and builds before it trains, one step each (called by `Finetuner` in this
order): the data and the unconverted model (`load_texts_and_model`), the converted model and its stages
(`convert_and_build_stages`), then the held-out and training blocks (`heldout_and_training_blocks`).
Each step reads the `FinetuneConfig` it is given and returns what it built."""

from __future__ import annotations

import logging

import torch
from accelerate import Accelerator
from datasets import Dataset, DatasetDict, IterableDataset
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_softmax_rnn.attention_spec import AttentionSpec
from hf_softmax_rnn.convert import convert
from hf_softmax_rnn.data.corpus import join_corpora, load_corpus
from hf_softmax_rnn.data.generated import GENERATED_CORPUS, GenerationSettings, generated_corpus
from hf_softmax_rnn.data.recall import FactPlanter
from hf_softmax_rnn.default_model import resolve_model
from hf_softmax_rnn.errors import UserInputError, user_input_checks
from hf_softmax_rnn.layers import softmax_rnn_attention_modules
from hf_softmax_rnn.long_context.extend import extend_context
from hf_softmax_rnn.long_context.retrieval import (
    DEFAULT_LENGTH,
    retrieval_layer_attention,
    retrieval_scores,
    writes_digit_tokens,
)
from hf_softmax_rnn.training.config import FinetuneConfig
from hf_softmax_rnn.training.data import ShuffledBlocks, StreamedBlocks, eval_blocks, train_blocks
from hf_softmax_rnn.training.model_checks import fit_state_stage
from hf_softmax_rnn.training.stages import Stage, build_stages, lora_targets

logger = logging.getLogger(__name__)


def load_texts_and_model(
    config: FinetuneConfig, accelerator: Accelerator, *, progress: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, DatasetDict]:
    """(the unconverted model (its positions extended by --extend-context), its tokenizer, the train and test
    texts of every --dataset source): the files and Hub datasets load first, then the model, which writes the
    'generated' source."""
    data = config.data
    corpora = {
        name: load_corpus(
            name,
            config_name=data.dataset_config,
            text_column=data.text_column,
            test_fraction=data.test_fraction,
            seed=config.optim.seed,
            streaming=data.streaming,
        )
        for name in data.dataset_sources
        if name != GENERATED_CORPUS
    }
    model, tokenizer = resolve_model(config.model.original)
    if config.model.extend_context is not None:
        extend_context(model, config.model.extend_context)
    if GENERATED_CORPUS in data.dataset_sources:
        corpora[GENERATED_CORPUS] = _generated_corpus(config, model, tokenizer, accelerator, progress=progress)
    return model, tokenizer, join_corpora([corpora[name] for name in data.dataset_sources])


def _generated_corpus(
    config: FinetuneConfig, model: PreTrainedModel, tokenizer, accelerator: Accelerator, *, progress: bool
) -> DatasetDict:
    """The unconverted model's own texts (`data.generated`), written on the training device by the
    main process first (the others then read its cache)."""
    settings = GenerationSettings(num_texts=config.data.generated_texts, max_new_tokens=config.data.generated_tokens)
    device = model.device
    with accelerator.main_process_first():
        corpus = generated_corpus(model.to(accelerator.device), tokenizer, settings, progress=progress)
    model.to(device)
    return corpus


def convert_and_build_stages(
    config: FinetuneConfig, base_model: PreTrainedModel, tokenizer, train_texts: Dataset | IterableDataset
) -> tuple[PreTrainedModel, list[Stage], FinetuneConfig]:
    """(the converted model, the stages that train it, `config` fitted to it: `fit_state_stage`). The model
    is --model itself where it is converted already, else `base_model` converted (its retrieval layers
    found on `train_texts`); a bad LoRA target, layer, stage module or model type is refused."""
    with user_input_checks(ValueError, TypeError):
        finetune = config.finetune
        targets = (
            lora_targets(base_model, finetune.lora_targets)
            if finetune.finetune_steps and finetune.finetune_method == "lora"
            else None
        )
        if config.model.continues_converted:
            converted = _converted_model(config)
        else:
            converted = convert(
                base_model,
                config.model.attention_spec,
                layers=config.model.layers,
                attention_mode=config.model.attention_mode,
                layer_attention=_retrieval_layer_attention(config, base_model, tokenizer, train_texts),
            )
        config = fit_state_stage(config, converted)
        teacher = base_model.requires_grad_(False) if config.needs_teacher else None
        stages = build_stages(config, converted, lora_target_names=targets, teacher=teacher)
    return converted, stages, config


def _converted_model(config: FinetuneConfig) -> PreTrainedModel:
    """--model, converted already (checked against --teacher by `model_checks`), with --attention-mode."""
    model, _ = resolve_model(config.model.model)
    model.config.attention_mode = config.model.attention_mode
    for module in softmax_rnn_attention_modules(model):
        module.set_attention_mode(config.model.attention_mode)
    return model


def _retrieval_layer_attention(
    config: FinetuneConfig, base_model: PreTrainedModel, tokenizer, train_texts
) -> dict[int, AttentionSpec] | None:
    """The wider kept budget of the `--retrieval-layers` layers, found on the unconverted model with
    passkey prompts of the training text (None for none). A count that the recipe chose is capped at
    the model's layers, and dropped with a warning when the tokenizer has no digit tokens."""
    model, layers = config.model, base_model.config.num_hidden_layers
    from_recipe = "retrieval_layers" in config.chosen
    count = min(model.retrieval_layers, layers) if from_recipe else model.retrieval_layers
    if count and from_recipe and not writes_digit_tokens(tokenizer):
        logger.warning("No retrieval layers: the tokenizer writes numbers with no digit tokens to score them by")
        count = 0
    if not count:
        return None
    length = min(DEFAULT_LENGTH, base_model.config.max_position_embeddings)
    texts = (row["text"] for row in train_texts)
    scores = retrieval_scores(base_model, tokenizer, texts, length=length, progress=config.output.progress)
    overrides = retrieval_layer_attention(model.attention_spec, scores, count, model.retrieval_kept)
    ranked = ", ".join(f"{layer} ({scores[layer].max():.2f})" for layer in overrides)
    logger.info("Retrieval layers (best KV-head score) %s keep %d positions", ranked, model.retrieval_kept)
    return overrides


def heldout_and_training_blocks(
    config: FinetuneConfig, texts: DatasetDict, tokenizer, stages: list[Stage], accelerator: Accelerator
) -> tuple[torch.Tensor, dict[int, ShuffledBlocks | StreamedBlocks]]:
    """(the held-out blocks `[N, heldout_block_size]`, the training blocks of each stage's length: stages of the
    same length read one stream in turn), packed by the main process first; too little data for one block is
    refused."""
    data, seed = config.data, config.optim.seed
    with accelerator.main_process_first(), user_input_checks():
        eval_ids = eval_blocks(texts["test"], tokenizer, data.heldout_block_size, data.max_eval_blocks)
        flags = {}
        for stage in stages:
            flags.setdefault(stage.block_size, stage.block_size_flag)
        train_data = {
            size: train_blocks(
                texts["train"],
                tokenizer,
                size,
                seed=seed,
                shuffle_buffer=data.shuffle_buffer,
                flag=flag,
                transform=FactPlanter(tokenizer, data.recall_facts, size, seed) if data.recall_facts else None,
            )
            for size, flag in flags.items()
        }
    return eval_ids, train_data


def check_enough_blocks(
    config: FinetuneConfig,
    stages: list[Stage],
    train_data: dict[int, ShuffledBlocks | StreamedBlocks],
    *,
    global_batch: int,
    num_processes: int,
) -> None:
    """Each step reads a global batch of distinct training blocks: a batch larger than the training data of a
    stage's block length (read whole, not streamed) is refused, before the run writes anything."""
    batch_size, grad_accum = config.data.batch_size, config.data.grad_accum
    for stage in stages:
        blocks = train_data[stage.block_size]
        if isinstance(blocks, ShuffledBlocks) and len(blocks) < global_batch:
            per_process = len(blocks) // (num_processes * grad_accum)
            fewer = f"--batch-size <= {per_process}, " if per_process else ""
            raise UserInputError(
                f"--batch-size {batch_size} x {num_processes} processes x --grad-accum {grad_accum} = {global_batch} "
                f"blocks per step, more than the {len(blocks)} training blocks of {stage.block_size} tokens "
                f"({stage.block_size_flag}, stage {stage.name}); use {fewer}more data or shorter blocks"
            )
