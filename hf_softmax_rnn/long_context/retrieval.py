"""Retrieval heads: which layers of the unconverted model copy a fact from far back.

The unconverted model reads passkey prompts (`passkey.passkey_prompt`) made of calibration text,
with the key appended as the answer. A query head's retrieval score is the attention weight that the
positions predicting the answer put on the key's digits in the prompt (both occurrences), averaged
over the answer positions and the prompts; a KV head scores the largest of its query heads. Few heads
score high (in SmolLM2-135M-Instruct, one KV head in each of layers 18 and 21 above 0.75, two thirds
below 0.05), and those are the ones a converted hybrid needs most exact keys in: `retrieval_layer_attention`
gives the top layers a larger `kept` budget, to pass as `layer_attention` to `from_pretrained` or
`convert`. Calibrate on text of the kind the model will read, not on the evaluation text.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from hf_softmax_rnn.attention_spec import AttentionSpec
from hf_softmax_rnn.convert import source_attention_modules
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.long_context.passkey import (
    DEFAULT_DEPTHS,
    NEEDLE,
    check_passkey_settings,
    passkey_filler,
    passkey_prompt,
)

#: Answer tokens the prompts leave room for (the key is 5 digits).
ANSWER_ROOM = 8
#: Tokens of each calibration prompt, answer included (or the model's positions, when fewer).
DEFAULT_LENGTH = 1024


def retrieval_scores(
    model,
    tokenizer,
    texts: Sequence[str],
    *,
    length: int = DEFAULT_LENGTH,
    depths: Sequence[float] = DEFAULT_DEPTHS,
    trials: int = 2,
    seed: int = 0,
    progress: bool = True,
) -> torch.Tensor:
    """`[num_layers, num_kv_heads]` retrieval score of every KV head of an unconverted (transformers)
    model, from `len(depths) * trials` prompts of `length` tokens cut from `texts`."""
    if hasattr(model.config, "attention_spec"):
        raise UserInputError(
            f"retrieval_scores reads the softmax attention of an unconverted model; got a converted "
            f"{type(model).__name__}: pass the model it was converted from"
        )
    if not writes_digit_tokens(tokenizer):
        raise UserInputError(
            "the tokenizer writes a key with no token that decodes to digits alone, so no attention on the key can "
            "be read; retrieval scores need a tokenizer that writes numbers with digit tokens"
        )
    check_passkey_settings(model, [length], depths, trials, ANSWER_ROOM)
    stream = passkey_filler(tokenizer, texts, [length], ANSWER_ROOM)
    config = model.config
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    group = config.num_attention_heads // kv_heads
    scores = torch.zeros(config.num_hidden_layers, config.num_attention_heads, dtype=torch.float64)
    rng = random.Random(seed)
    cases = [(depth, trial) for depth in depths for trial in range(trials)]
    with _AttentionOnKey(model) as reader, torch.no_grad():
        for depth, _ in tqdm(cases, desc="Retrieval heads", unit="prompt", disable=not progress):
            key = rng.randrange(10000, 100000)
            offset = rng.randrange(0, len(stream) - length + ANSWER_ROOM + 1)
            prompt = passkey_prompt(tokenizer, stream[offset:], length - ANSWER_ROOM, depth, key)
            answer = tokenizer(f" {key}", add_special_tokens=False)["input_ids"]
            reader.queries = torch.arange(len(prompt) - 1, len(prompt) + len(answer) - 1)
            reader.keys = torch.tensor(_key_positions(tokenizer, prompt, key))
            reader.per_layer.clear()
            model(input_ids=torch.tensor([prompt + answer], device=model.device), use_cache=False)
            scores += torch.stack(reader.per_layer).double().cpu()
    scores /= len(cases)
    return scores.view(config.num_hidden_layers, kv_heads, group).amax(-1).float()


def check_retrieval_count(count: int, num_layers: int) -> None:
    """Refuse a number of retrieval layers outside 0..num_layers."""
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= num_layers:
        raise UserInputError(f"retrieval layer count={count!r} is not allowed; expected an int in 0..{num_layers}")


def check_retrieval_budget(spec: AttentionSpec, kept: int) -> None:
    """Refuse a spec without kept positions, or a retrieval budget below the spec's own."""
    if spec.kept is None:
        raise UserInputError(
            f"a larger kept budget for retrieval layers needs a spec with kept positions; {spec.describe()!r} has "
            "none (e.g. 'hedgehog_window_256_sinks_4_kept_256_decay' has 256)"
        )
    if isinstance(kept, bool) or not isinstance(kept, int) or kept < spec.kept:
        raise UserInputError(f"retrieval kept={kept!r} is not allowed; expected an int >= the spec's kept={spec.kept}")


def retrieval_layers(scores: torch.Tensor, count: int) -> list[int]:
    """The `count` layers whose best KV head scores highest (`scores` from `retrieval_scores`), in order."""
    check_retrieval_count(count, scores.shape[0])
    return scores.amax(-1).argsort(descending=True)[:count].tolist()


def retrieval_layer_attention(
    spec: AttentionSpec | dict | str, scores: torch.Tensor, count: int, kept: int
) -> dict[int, AttentionSpec]:
    """`layer_attention` that gives the `count` top retrieval layers `kept` kept positions (the other
    layers keep `spec`); `spec` must already keep positions (a window and `kept`)."""
    spec = AttentionSpec.coerce(spec)
    check_retrieval_budget(spec, kept)
    wider = dataclasses.replace(spec, kept=kept)
    return {layer: wider for layer in retrieval_layers(scores, count)}


def writes_digit_tokens(tokenizer) -> bool:
    """Whether `tokenizer` writes a key with tokens that decode to digits alone (what the scores read)."""
    return bool(_digit_offsets(tokenizer, 12345)[1])


def _digit_offsets(tokenizer, key: int) -> tuple[list[int], list[int]]:
    """(the token ids of the key sentence, the offsets in it of the tokens that decode to digits alone)."""
    needle = tokenizer(NEEDLE.format(key=key), add_special_tokens=False)["input_ids"]
    return needle, [j for j, token in enumerate(needle) if tokenizer.decode([token]).strip().isdigit()]


def _key_positions(tokenizer, prompt: list[int], key: int) -> list[int]:
    """Positions in `prompt` of the digit tokens of the key sentence."""
    needle, offsets = _digit_offsets(tokenizer, key)
    start = next(i for i in range(len(prompt) - len(needle) + 1) if prompt[i : i + len(needle)] == needle)
    return [start + offset for offset in offsets]


class _AttentionOnKey:
    """Context manager: the model computes attention eagerly, and after each forward `per_layer` holds
    every layer's `[H]` weight from `queries` onto `keys` (summed over the keys, mean over the queries);
    the attention implementation is restored after."""

    def __init__(self, model) -> None:
        self.model, self.hooks, self.per_layer = model, [], []
        self.queries = self.keys = torch.zeros(0, dtype=torch.long)

    def _read(self, _module, _inputs, output) -> None:
        weights = output[1][0]  # [H, T, T]: each attention module returns (output, weights)
        self.per_layer.append(weights[:, self.queries][:, :, self.keys].sum(-1).mean(-1))

    def __enter__(self) -> _AttentionOnKey:
        self.previous = self.model.config._attn_implementation
        self.model.set_attn_implementation("eager")
        self.hooks = [module.register_forward_hook(self._read) for module in source_attention_modules(self.model)]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self.hooks:
            hook.remove()
        self.model.set_attn_implementation(self.previous)
