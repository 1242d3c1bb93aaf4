"""Passkey retrieval: can the model repeat a 5-digit key it read far back in the context?

Each prompt is an instruction, filler text with the sentence "The pass key is 12345. Remember
it. 12345 is the pass key." inserted at a depth (a fraction of the filler), and the question
"What is the pass key? The pass key is". The prompt has `length - max_new_tokens` tokens, so
prompt and answer fit in `length` positions. The model answers greedily with `generate` (its
own cache: the recurrent state for a converted model); the answer is right when its first run
of digits is the key. Keys and filler offsets come from `random.Random(seed)`, so a run with the
same arguments asks the same questions.
"""

from __future__ import annotations

import logging
import random
import re
import time
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.evaluation import check_within_positions
from hf_softmax_rnn.long_context.positions import check_count
from hf_softmax_rnn.utils import check_distinct

logger = logging.getLogger(__name__)

DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)
DEFAULT_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
INSTRUCTION = (
    "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the pass key.\n\n"
)
NEEDLE = "\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n"
QUESTION = "\n\nWhat is the pass key? The pass key is"


def check_passkey_arguments(
    lengths: Sequence[int], depths: Sequence[float], trials: int, max_new_tokens: int, seed: int
) -> None:
    """Refuse what no model can take: lengths that are not ints >= 1, depths outside [0, 1], a count below 1,
    a seed that is not an int >= 0 (`random.Random` would read -1 as 1), and a length or depth named twice."""
    check_count("trials", trials)
    check_count("max_new_tokens", max_new_tokens)
    check_count("seed", seed, minimum=0)
    for name, values in (("lengths", lengths), ("depths", depths)):
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise TypeError(f"{name}={values!r} is not allowed; expected a list")
    for length in lengths:
        check_count("passkey length", length)
    for depth in depths:
        if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0 <= depth <= 1:
            raise UserInputError(f"passkey depth={depth!r} is not allowed; expected a number in [0, 1]")
    for name, values in (("lengths", lengths), ("depths", depths)):
        check_distinct(f"passkey {name}={list(values)!r}", values, "its prompts would be asked and counted twice")


def check_passkey_settings(
    model,
    lengths: Sequence[int],
    depths: Sequence[float],
    trials: int,
    max_new_tokens: int,
    past_max_positions: bool | None = None,
    seed: int = 0,
) -> None:
    """`check_passkey_arguments`, then refuse empty lengths or depths and lengths beyond the model's
    positions (unless `past_max_positions`)."""
    check_passkey_arguments(lengths, depths, trials, max_new_tokens, seed)
    if not lengths or not depths:
        raise UserInputError(f"lengths={tuple(lengths)} and depths={tuple(depths)} must both be non-empty")
    for length in lengths:
        check_within_positions(model, length, "passkey length", past_max_positions=past_max_positions)


def prompt_frame(tokenizer, key: int) -> tuple[list[int], list[int], list[int]]:
    """Token ids of the instruction, the key sentence with `key` and the question of a prompt."""
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    return encode(INSTRUCTION), encode(NEEDLE.format(key=key)), encode(QUESTION)


def passkey_prompt(tokenizer, filler: Sequence[int], prompt_tokens: int, depth: float, key: int) -> list[int]:
    """Token ids of one prompt of exactly `prompt_tokens` tokens: the key at `depth` of the filler."""
    head, needle, question = prompt_frame(tokenizer, key)
    room = prompt_tokens - len(head) - len(needle) - len(question)
    if room < 1:
        raise UserInputError(
            f"a passkey prompt of {prompt_tokens} tokens leaves no room for filler: the instruction, key sentence and "
            f"question take {len(head) + len(needle) + len(question)} tokens; pass a longer passkey length"
        )
    if room > len(filler):
        raise UserInputError(
            f"a passkey prompt of {prompt_tokens} tokens needs {room} filler tokens, more than the {len(filler)} of "
            "the filler texts; pass more filler text or a shorter passkey length"
        )
    cut = round(depth * room)
    return [*head, *filler[:cut], *needle, *filler[cut:room], *question]


def filler_tokens(tokenizer, texts: Sequence[str], needed: int) -> list[int]:
    """The first tokens (at least `needed`, when the texts hold them) of `texts` joined with blank lines."""
    if isinstance(texts, str):
        raise TypeError("filler must be a list of strings, not a single string; wrap it as [text]")
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"]
        if len(ids) >= needed:
            break
    return ids


def passkey_filler(tokenizer, texts: Sequence[str], lengths: Sequence[int], max_new_tokens: int) -> list[int]:
    """The filler token stream (the first `2 * max(lengths)` tokens of `texts`), checked to fill a
    prompt of every length, before any prompt is answered."""
    frame = sum(map(len, prompt_frame(tokenizer, 10000)))
    for length in lengths:
        if length - max_new_tokens - frame < 1:
            raise UserInputError(
                f"passkey length={length} is too short: the instruction, key sentence and question take {frame} tokens "
                f"and the answer {max_new_tokens}; expected a length of at least {frame + max_new_tokens + 1}"
            )
    stream = filler_tokens(tokenizer, texts, 2 * max(lengths))
    if len(stream) < max(lengths):
        raise UserInputError(
            f"the filler texts hold {len(stream)} tokens, fewer than the longest passkey length {max(lengths)}; "
            "pass more filler text or shorter lengths"
        )
    for length in lengths:
        passkey_prompt(tokenizer, stream, length - max_new_tokens, 0.0, 10000)
    return stream


@torch.inference_mode()
def passkey_retrieval(
    model,
    tokenizer,
    filler: Sequence[str],
    *,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    depths: Sequence[float] = DEFAULT_DEPTHS,
    trials: int = 2,
    seed: int = 0,
    max_new_tokens: int = 8,
    progress: bool = True,
    past_max_positions: bool = False,
) -> dict:
    """Accuracy of greedy passkey answers per length (and per depth); see the module docstring.

    Args:
        filler: texts to hide the key in; each prompt takes its filler from a random offset of
            their first `2 * max(lengths)` tokens.
        trials: prompts per (length, depth), each with its own key and filler offset.
        past_max_positions: allow lengths past the model's `max_position_embeddings`.

    Returns {"lengths": {length: {"accuracy", "correct", "trials", "tokens" (prompt tokens read),
    "seconds", "depths": {depth: accuracy}}}, "answers": [{"length", "depth", "key", "answer",
    "correct"}]}; the keys of "lengths" and "depths" are strings (JSON).
    """
    check_passkey_settings(model, lengths, depths, trials, max_new_tokens, past_max_positions, seed)
    stream = passkey_filler(tokenizer, filler, lengths, max_new_tokens)
    rng = random.Random(seed)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    results, answers = {}, []
    # (made as they are asked, not listed, nor given to itertools.product, which lists range(trials): trials=10**12
    # would not fit)
    cases = ((length, depth, trial) for length in lengths for depth in depths for trial in range(trials))
    total = len(lengths) * len(depths) * trials
    start = {length: None for length in lengths}
    try:
        for length, depth, _ in tqdm(cases, desc="Passkey", unit="prompt", total=total, disable=not progress):
            start[length] = start[length] or time.perf_counter()
            key = rng.randrange(10000, 100000)
            prompt_tokens = length - max_new_tokens
            offset = rng.randrange(0, len(stream) - prompt_tokens + 1)
            ids = passkey_prompt(tokenizer, stream[offset:], prompt_tokens, depth, key)
            answer = greedy_answer(model, tokenizer, ids, max_new_tokens, device)
            digits = re.search(r"\d+", answer)
            correct = bool(digits and digits.group() == str(key))
            answers.append({"length": length, "depth": depth, "key": key, "answer": answer, "correct": correct})
            record = results.setdefault(str(length), {"correct": 0, "trials": 0, "tokens": 0, "depths": {}})
            record["correct"] += answers[-1]["correct"]
            record["trials"] += 1
            record["tokens"] += len(ids)
            record["seconds"] = round(time.perf_counter() - start[length], 1)
    finally:
        model.train(was_training)
    for length, record in results.items():
        record["accuracy"] = record["correct"] / record["trials"]
        for depth in depths:
            hits = [a["correct"] for a in answers if str(a["length"]) == length and a["depth"] == depth]
            record["depths"][str(depth)] = sum(hits) / len(hits)
    return {"lengths": results, "answers": answers}


def greedy_answer(model, tokenizer, ids: list[int], max_new_tokens: int, device) -> str:
    """The greedy continuation of the prompt `ids` through `generate` (the model's own cache), decoded."""
    input_ids = torch.tensor([ids], device=device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad,
    )
    return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True).strip()
