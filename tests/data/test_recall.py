"""`FactPlanter`: facts written into a block's first half and restated in its second, the rest of the block
left as it was, in forms that no evaluation or calibration prompt has."""

import re

import pytest
import torch
from datasets import Dataset, IterableDataset

from hf_softmax_rnn.analysis.byte_tokenizer import byte_tokenizer
from hf_softmax_rnn.data.recall import FACT, KEYS, RESTATED, FactPlanter
from hf_softmax_rnn.long_context import needles
from hf_softmax_rnn.long_context.passkey import passkey_prompt
from hf_softmax_rnn.training.data import ShuffledBlocks, StreamedBlocks

BLOCK = 1024
TOKENIZER = byte_tokenizer()


def _block(seed: int = 0) -> torch.Tensor:
    """A block of byte ids that decode to lowercase letters and spaces (no fact can be read into it)."""
    generator = torch.Generator().manual_seed(seed)
    letters = TOKENIZER(" abcdefghijklmnopqrstuvwxyz", add_special_tokens=False)["input_ids"]
    return torch.tensor(letters)[torch.randint(len(letters), (BLOCK,), generator=generator)]


def _text(ids: torch.Tensor) -> str:
    return TOKENIZER.decode(ids.tolist())


def test_each_fact_is_written_in_the_first_half_and_restated_in_the_second():
    planter = FactPlanter(TOKENIZER, 4, BLOCK, seed=0)
    block = _block()
    planted, spans, values = planter.plant(block, key=7)
    assert planted.shape == block.shape and len(spans) == len(values) == 4
    first, second = _text(planted[: BLOCK // 2]), _text(planted[BLOCK // 2 :])
    written = re.findall(r" Ledger entry: the (\w+) code is ([^.]+)\.", first)
    restated = re.findall(r" Checking the ledger, the (\w+) code is ([^.]+)\.", second)
    assert len(written) == len(restated) == 4
    assert sorted(written) == sorted(restated) and [value for _, value in restated] == values
    assert {key for key, _ in written} <= set(KEYS)
    for (start, end), (key, value) in zip(spans, restated, strict=True):
        assert start >= BLOCK // 2 and _text(planted[start:end]) == RESTATED.format(key=key, value=value)


def test_every_token_outside_the_facts_is_the_blocks_own():
    planter = FactPlanter(TOKENIZER, 3, BLOCK, seed=0)
    block = _block()
    planted, spans, _ = planter.plant(block, key=1)
    changed = (planted != block).nonzero().flatten().tolist()
    fact_bytes = sum(len(match.group(0)) for match in re.finditer(r" Ledger entry: [^.]+\.", _text(planted)))
    restated_bytes = sum(end - start for start, end in spans)
    assert len(changed) <= fact_bytes + restated_bytes
    assert all(any(start <= i < end for start, end in spans) or i < BLOCK // 2 for i in changed)


def test_the_facts_are_a_function_of_the_seed_and_the_blocks_place():
    block = _block()
    planter = FactPlanter(TOKENIZER, 2, BLOCK, seed=0)
    same = FactPlanter(TOKENIZER, 2, BLOCK, seed=0).plant(block, key=5)[0]
    assert torch.equal(planter.plant(block, key=5)[0], same)
    assert not torch.equal(planter.plant(block, key=6)[0], same)
    assert not torch.equal(FactPlanter(TOKENIZER, 2, BLOCK, seed=1).plant(block, key=5)[0], same)


def _rows():
    for seed in range(5):
        yield {"input_ids": _block(seed).tolist()}


READERS = {
    "shuffled": lambda planter: ShuffledBlocks(
        Dataset.from_dict({"input_ids": [_block(seed).tolist() for seed in range(5)]}), seed=3, transform=planter
    ),
    "streamed": lambda planter: StreamedBlocks(
        IterableDataset.from_generator(_rows), seed=3, shuffle_buffer=1, transform=planter
    ),
}


@pytest.mark.parametrize("make_reader", READERS.values(), ids=READERS.keys())
def test_a_stream_with_facts_hands_out_the_same_blocks_after_a_restore(make_reader):
    planter = FactPlanter(TOKENIZER, 2, BLOCK, seed=0)
    reader = make_reader(planter)
    reader.next_blocks(3)
    state = reader.state_dict()
    expected = reader.next_blocks(4)  # crosses into the second epoch
    restored = make_reader(planter)
    restored.load_state_dict(state)
    assert torch.equal(restored.next_blocks(4), expected)
    assert all(" Ledger entry: the " in _text(row) for row in expected)


def test_no_key_or_wording_is_one_that_evaluation_or_calibration_reads():
    assert not set(KEYS) & set(needles._KEY_WORDS)
    evaluation_forms = [text for template in needles.TEMPLATES.values() for text in vars(template).values()]
    filler = TOKENIZER(" filler text." * 200, add_special_tokens=False)["input_ids"]
    passkey = TOKENIZER.decode(passkey_prompt(TOKENIZER, filler, 512, depth=0.5, key=12345))
    assert "12345" in passkey
    for form in (FACT, RESTATED):
        stem = form.split("{key}")[0].strip()
        assert stem and all(stem not in text for text in [*evaluation_forms, passkey])


@pytest.mark.parametrize(
    "count, block_size, message",
    [
        (0, BLOCK, r"--recall-facts 0 is not allowed; expected an int >= 1"),
        (len(KEYS) + 1, 1 << 16, rf"--recall-facts {len(KEYS) + 1} is not allowed; expected at most {len(KEYS)}"),
        (20, 512, r"--recall-facts 20 does not fit blocks of 512 tokens: .* expected at most \d+, or longer blocks"),
    ],
    ids=["zero", "more-than-keys", "too-many-for-the-block"],
)
def test_counts_that_cannot_be_planted_are_refused_naming_the_largest(count, block_size, message):
    with pytest.raises(ValueError, match=message):
        FactPlanter(TOKENIZER, count, block_size, seed=0)
