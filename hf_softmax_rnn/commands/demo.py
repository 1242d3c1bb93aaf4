"""`hf-softmax-rnn demo`: convert the default model to the paper's attention variants and compare them.

For each preset the pretrained model is converted (`hf_softmax_rnn.convert`, same weights, no
training) and measured: held-out perplexity, decoding speed and cache size after a prompt of
each context length, and one greedy answer to a chat prompt. Conversions other than
"softmax" are untrained: `finetune`'s default hybrid (the second row) is already close to the original,
the paper's variants are poor until fine-tuned (`hf-softmax-rnn finetune`).
`--trained DIR ...` adds rows for models saved by `finetune` (or any causal LM folder with the
same vocabulary), measured the same way on the same text and prompts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig
from transformers.generation.streamers import BaseStreamer

from hf_softmax_rnn.attention_spec import AttentionSpec
from hf_softmax_rnn.convert import convert
from hf_softmax_rnn.data.corpus import load_corpus
from hf_softmax_rnn.default_model import (
    DEFAULT_MODEL_ALIAS,
    DEFAULT_MODEL_NAME,
    load_causal_lm,
    resolve_config,
    resolve_model,
)
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.evaluation import stream_nll, token_stream
from hf_softmax_rnn.flags import add_dataclass_arguments, option
from hf_softmax_rnn.layers.cache import cache_nbytes
from hf_softmax_rnn.presets import PRESETS
from hf_softmax_rnn.training.recipes import DEFAULT_ATTENTION
from hf_softmax_rnn.utils import check_distinct

logger = logging.getLogger(__name__)

DEFAULT_PRESETS = (
    "softmax",
    DEFAULT_ATTENTION,
    "hedgehog_window_64",
    "gated_softmax_no_gate_L2norm_nodivS_noclamp",
    "softmax_taylor_2",
    "linear_elu",
)
DEFAULT_CONTEXTS = (128, 4096)
DEFAULT_PROMPT = "What is a Python dictionary? Answer in one sentence."
SAMPLE_CHARS = 120
_BYTE_UNITS = ("B", "KB", "MB", "GB")
FINETUNE_HINT = (
    "Of the presets only 'softmax' is the pretrained model unchanged; the others are converted with no training. "
    f"`hf-softmax-rnn finetune` trains them; its default, {DEFAULT_ATTENTION} (the second row, untrained: exact "
    "softmax over the first 4, the last 256 and 256 kept older positions, a decaying learned feature map beyond; "
    "finetune gives 2,048 kept positions to 6 retrieval layers), came back to 1.00x the original perplexity on "
    "1,024-token windows of SmolLM2-135M with its default 20 distillation steps of 2,048 tokens and 10 of its state "
    "alone on 4,096 (14 min on 2 CPU cores; docs/finetuning.md)."
)


@dataclasses.dataclass(frozen=True)
class DemoOptions:
    """The flags of `demo` (each field is the flag of the same name)."""

    model: str = option(DEFAULT_MODEL_ALIAS, "'default' (embedded SmolLM2-135M-Instruct), a local dir or a Hub id")
    dataset: str | None = option(None, "held-out text: 'pydoc' (default, offline), files or a Hub dataset")
    presets: list[str] = option(list(DEFAULT_PRESETS), "attention presets to compare", metavar="PRESET")
    contexts: list[int] = option(list(DEFAULT_CONTEXTS), "prompt lengths (tokens) for the speed columns", metavar="N")
    max_eval_tokens: int = option(2048, "tokens of held-out text scored for perplexity")
    eval_window: int = option(1024, "perplexity windows (non-overlapping): each token sees 0 to N-1 tokens of context")
    prefill_chunk: int = option(512, "prompt tokens per forward pass when prefilling (generate's prefill_chunk_size)")
    new_tokens: int = option(16, "tokens generated per speed measurement and per sample")
    prompt: str = option(DEFAULT_PROMPT, "chat prompt of the generated samples")
    trained: list[Path] = option(
        [], "folders of fine-tuned models (finetune's output) measured beside the presets", metavar="DIR"
    )
    output: Path | None = option(None, "directory to write demo.md and demo.json into")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `DemoOptions`."""
    add_dataclass_arguments(parser, DemoOptions)


@dataclasses.dataclass
class GenerationTiming:
    """Greedy generation of `new_tokens` after a `context`-token prompt."""

    context: int
    new_tokens: int
    prefill_s: float
    tokens_per_s: float
    cache_bytes: int


@dataclasses.dataclass
class ModelResult:
    """One row: `name` is a preset name (`kind` "preset", converted here) or a folder ("trained")."""

    name: str
    kind: str
    description: str
    decode_state: str
    perplexity: float
    eval_tokens: int
    timings: list[GenerationTiming]
    sample: str


class _TokenClock(BaseStreamer):
    """Records when `generate` hands over the prompt and then each new token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


@torch.inference_mode()
def time_generation(model, context_ids: torch.Tensor, new_tokens: int, prefill_chunk: int) -> GenerationTiming:
    """Greedy `generate` after `context_ids [1, L]`, prefilled `prefill_chunk` tokens at a time:
    prefill time, decode tokens/s, final cache size."""
    clock = _TokenClock()
    output = model.generate(
        context_ids,
        attention_mask=torch.ones_like(context_ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        streamer=clock,
        prefill_chunk_size=prefill_chunk,
        return_dict_in_generate=True,
    )
    prompt_at, first_at, last_at = clock.times[0], clock.times[1], clock.times[-1]
    decoded = len(clock.times) - 2
    return GenerationTiming(
        context=context_ids.shape[1],
        new_tokens=new_tokens,
        prefill_s=first_at - prompt_at,
        tokens_per_s=decoded / (last_at - first_at) if decoded else math.nan,
        cache_bytes=cache_nbytes(output.cache),
    )


@torch.inference_mode()
def chat_sample(model, tokenizer, prompt: str, new_tokens: int) -> str:
    """Greedy answer to `prompt`, chat-formatted when the tokenizer has a chat template."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    else:
        text = prompt
    ids = tokenizer(text, add_special_tokens=tokenizer.chat_template is None, return_tensors="pt").input_ids
    output = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
    return tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True)


def decode_state(spec: AttentionSpec, head_dim: int) -> str:
    """How the preset decodes: a fixed-size recurrent state or a growing KV cache."""
    if spec.fits_recurrent_state(head_dim):
        return "recurrent state"
    return "KV cache (exact exp)" if spec.kind != "softmax" else "KV cache"


def model_decode_state(config) -> str:
    """How a saved model decodes: the `decode_state` shared by all its layers, else "mixed" (a plain
    transformers model has no attention fields and decodes from a KV cache)."""
    if not hasattr(config, "attention_spec"):
        return "KV cache"
    states = {
        decode_state(config.attention_spec(i), config.attention_head_dim) for i in range(config.num_hidden_layers)
    }
    return states.pop() if len(states) == 1 else "mixed: recurrent state and KV cache"


def evaluate_preset(
    base_model, tokenizer, preset: str, eval_ids: list[int], contexts: list[torch.Tensor], args
) -> ModelResult:
    """Convert `base_model` (a copy; the original is left as it is) to `preset` and measure it."""
    model = convert(base_model, preset).eval()
    description = AttentionSpec.from_preset(preset).describe()
    return measure(model, tokenizer, eval_ids, contexts, args, name=preset, kind="preset", description=description)


def check_trained(folders: list[Path], base_config) -> None:
    """Refuse, before anything is measured, a `--trained` folder that holds no model config or whose
    model reads other token ids than the base model (another vocabulary size); then, each loaded once
    and let go, one whose weights do not make the model its config describes (`load_causal_lm`)."""
    for folder in folders:
        if not folder.is_dir():
            state = "is a file" if folder.exists() else "does not exist"
            raise UserInputError(f"--trained {str(folder)!r} {state}; expected a folder written by finetune")
        if not (folder / "config.json").is_file():
            raise UserInputError(
                f"--trained {str(folder)!r} holds no config.json; expected a folder written by finetune"
            )
        try:
            vocab_size = AutoConfig.from_pretrained(folder).vocab_size
        except (ValueError, TypeError) as error:
            raise UserInputError(f"--trained {str(folder)!r}: its config.json could not be loaded ({error})") from error
        if vocab_size != base_config.vocab_size:
            raise UserInputError(
                f"--trained {str(folder)!r} has vocab_size={vocab_size}, the --model has "
                f"{base_config.vocab_size}; expected a model fine-tuned from the --model (same tokenizer)"
            )
    for folder in folders:
        load_causal_lm(str(folder), folder)


def evaluate_trained(
    folder: Path, base_model, tokenizer, eval_ids: list[int], contexts: list[torch.Tensor], args
) -> ModelResult:
    """Measure the model saved in `folder` as the presets are measured."""
    model = load_causal_lm(str(folder), folder, dtype=base_model.dtype).eval()
    summary = getattr(model.config, "attention_summary", lambda: "unconverted attention")()
    description = f"saved model; {summary}"
    return measure(
        model, tokenizer, eval_ids, contexts, args, name=str(folder), kind="trained", description=description
    )


def measure(
    model, tokenizer, eval_ids: list[int], contexts: list[torch.Tensor], args, *, name: str, kind: str, description: str
) -> ModelResult:
    """Held-out perplexity, decoding after each context and a greedy chat sample of `model`."""
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
    logger.info("%s: %s", name, description)
    total_nll, num_tokens = stream_nll(
        model, eval_ids, max_length=args.eval_window, stride=args.eval_window - 1, progress=True
    )
    mean_nll = total_nll / num_tokens
    timings = []
    for context_ids in contexts:
        timing = time_generation(model, context_ids, args.new_tokens, args.prefill_chunk)
        logger.info(
            "%s at %d tokens of context: prefill %.1f s, %.1f tokens/s, cache %s",
            name,
            timing.context,
            timing.prefill_s,
            timing.tokens_per_s,
            format_bytes(timing.cache_bytes),
        )
        timings.append(timing)
    return ModelResult(
        name=name,
        kind=kind,
        description=description,
        decode_state=model_decode_state(model.config),
        perplexity=math.exp(mean_nll) if mean_nll < math.log(sys.float_info.max) else math.inf,
        eval_tokens=num_tokens,
        timings=timings,
        sample=chat_sample(model, tokenizer, args.prompt, args.new_tokens),
    )


def format_bytes(n: int) -> str:
    """1536 -> "1.5 KB" (binary units)."""
    exponent = min(int(math.log(max(n, 1), 1024)), len(_BYTE_UNITS) - 1)
    return f"{n / 1024**exponent:.1f} {_BYTE_UNITS[exponent]}" if exponent else f"{n} B"


def format_table(results: list[ModelResult], model_name: str, eval_window: int) -> str:
    """The results as a markdown table, with the fine-tuning note underneath."""
    contexts = [t.context for t in results[0].timings]
    header = ["model", "decodes from", "perplexity"]
    for context in contexts:
        header += [f"tok/s @{context}", f"cache @{context}"]
    header.append("sample (greedy)")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    for result in results:
        row = [f"`{result.name}`", result.decode_state, f"{result.perplexity:,.1f}"]
        for timing in result.timings:
            row += [f"{timing.tokens_per_s:.1f}", format_bytes(timing.cache_bytes)]
        sample = " ".join(result.sample.split())
        sample = sample[:SAMPLE_CHARS] + ("..." if len(sample) > SAMPLE_CHARS else "")
        row.append(sample.replace("|", "\\|"))
        lines.append("| " + " | ".join(row) + " |")
    eval_tokens = results[0].eval_tokens
    new_tokens = results[0].timings[0].new_tokens if results[0].timings else 0
    return "\n".join(
        [
            f"Model: {model_name}. Perplexity over {eval_tokens} held-out tokens (windows of {eval_window}); "
            "tok/s = greedy decoding of "
            f"{new_tokens} tokens after a prompt of that many tokens; cache = bytes held after it.",
            "",
            *lines,
            "",
            *(f"- `{r.name}`: {r.description}" for r in results),
            "",
            FINETUNE_HINT,
        ]
    )


def _check_args(args) -> None:
    unknown = [p for p in args.presets if p not in PRESETS]
    if unknown:
        raise UserInputError(f"Unknown presets {unknown}; expected names from {sorted(PRESETS)}")
    for name in ("max_eval_tokens", "eval_window", "prefill_chunk", "new_tokens"):
        if getattr(args, name) < 2:
            flag = f"--{name.replace('_', '-')}"
            raise UserInputError(f"{flag}={getattr(args, name)} is not allowed; expected an int >= 2")
    if any(c < 1 for c in args.contexts):
        raise UserInputError(f"--contexts={args.contexts} is not allowed; expected positive ints")
    if not args.prompt.strip():
        raise UserInputError(f"--prompt {args.prompt!r} is empty; expected the text of a chat prompt")
    for flag, values in (("--presets", args.presets), ("--contexts", args.contexts), ("--trained", args.trained)):
        check_distinct(flag, [str(value) for value in values], "its row would be measured again")


def _context_prompts(texts: list[str], tokenizer, lengths: list[int]) -> list[torch.Tensor]:
    """Prompts of exactly each length, cut from the joined texts (repeated if they are too short)."""
    stream = token_stream(tokenizer, texts)
    repeats = -(-max(lengths) // len(stream))
    stream = torch.tensor(stream * repeats)
    return [stream[None, :length] for length in lengths]


def run(args) -> str:
    _check_args(args)
    start = time.perf_counter()
    base_config = resolve_config(args.model)  # checked before the model, the data and the measurements
    max_positions = getattr(base_config, "max_position_embeddings", None)
    if max_positions is not None and max(args.contexts) + args.new_tokens > max_positions:
        raise UserInputError(
            f"--contexts up to {max(args.contexts)} plus --new-tokens={args.new_tokens} exceed the model's "
            f"max_position_embeddings={max_positions}; use shorter contexts"
        )
    if max_positions is not None and args.eval_window > max_positions:
        raise UserInputError(
            f"--eval-window={args.eval_window} is more than the model's max_position_embeddings={max_positions}; "
            f"use --eval-window <= {max_positions}"
        )
    check_trained(args.trained, base_config)
    base_model, tokenizer = resolve_model(args.model)
    base_model.eval()
    corpus = load_corpus(args.dataset)
    eval_ids = token_stream(tokenizer, corpus["test"]["text"])[: args.max_eval_tokens]
    contexts = _context_prompts(corpus["train"]["text"], tokenizer, args.contexts)
    results = [
        evaluate_preset(base_model, tokenizer, preset, eval_ids, contexts, args)
        for preset in tqdm(args.presets, desc="Presets", unit="preset")
    ]
    results += [
        evaluate_trained(folder, base_model, tokenizer, eval_ids, contexts, args)
        for folder in tqdm(args.trained, desc="Trained models", unit="model", disable=not args.trained)
    ]
    model_name = DEFAULT_MODEL_NAME if args.model == DEFAULT_MODEL_ALIAS else args.model
    table = format_table(results, model_name, args.eval_window)
    if args.output is not None:
        args.output.mkdir(parents=True, exist_ok=True)
        (args.output / "demo.md").write_text(table + "\n")
        payload = {
            "model": model_name,
            "settings": {k: str(v) for k, v in vars(args).items()},
            "results": [dataclasses.asdict(r) for r in results],
        }
        (args.output / "demo.json").write_text(json.dumps(payload, indent=2) + "\n")
        logger.info("Wrote %s and %s", args.output / "demo.md", args.output / "demo.json")
    logger.info("Demo finished in %.0f s", time.perf_counter() - start)
    return table
