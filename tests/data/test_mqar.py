import numpy as np
import pytest

from hf_softmax_rnn.data.mqar import IGNORE_INDEX, MQARConfig, generate_mqar, mqar_splits

CONFIGS = {
    "zoology-default": MQARConfig(),
    "small-vocab": MQARConfig(vocab_size=32, seq_len=64, num_kv_pairs=4),
    "tight": MQARConfig(vocab_size=64, seq_len=32, num_kv_pairs=8, power_a=1.0),
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_every_query_answers_its_pairs_value(config):
    data = generate_mqar(200, config, seed=3)
    k, half = config.num_kv_pairs, config.vocab_size // 2
    for input_ids, labels in zip(data["input_ids"], data["labels"], strict=True):
        input_ids, labels = np.array(input_ids), np.array(labels)
        assert len(input_ids) == config.seq_len
        keys, values = input_ids[0 : 2 * k : 2], input_ids[1 : 2 * k : 2]
        assert len(set(keys)) == k and len(set(values)) == k
        assert keys.max() < half and values.min() >= half and values.max() < config.vocab_size
        scored = np.flatnonzero(labels != IGNORE_INDEX)
        assert len(scored) == k and scored.min() > 2 * k
        pair_value = dict(zip(keys.tolist(), values.tolist(), strict=True))
        queried = input_ids[scored - 1]
        assert sorted(queried) == sorted(keys)
        assert [pair_value[key] for key in queried] == labels[scored].tolist() == input_ids[scored].tolist()
        for key in keys:  # the opening pair and the query: no filler copy of a key
            assert (input_ids == key).sum() == 2


def test_single_query_gaps_follow_the_power_law():
    config = MQARConfig(vocab_size=64, seq_len=24, num_kv_pairs=1, power_a=0.3)
    labels = np.array(generate_mqar(8000, config, seed=0)["labels"])
    slots = (np.flatnonzero(labels != IGNORE_INDEX) % config.seq_len - 2 - 1) // 2
    frequencies = np.bincount(slots, minlength=config.num_slots) / len(slots)
    expected = np.arange(1, config.num_slots + 1) ** (config.power_a - 1.0)
    np.testing.assert_allclose(frequencies, expected / expected.sum(), atol=0.02)


def test_seeds_reproduce_and_differ():
    config = CONFIGS["small-vocab"]
    first, again, other = (generate_mqar(50, config, seed=s)["input_ids"] for s in (7, 7, 8))
    assert first == again
    assert first != other


def test_train_and_test_share_no_sequence():
    splits = mqar_splits(2000, 500, MQARConfig(seq_len=32, num_kv_pairs=4), seed=0)
    train = {tuple(row) for row in splits["train"]["input_ids"]}
    test = {tuple(row) for row in splits["test"]["input_ids"]}
    assert len(train) == 2000 and len(test) == 500 and not train & test
    assert mqar_splits(10, 10, seed=1)["test"]["input_ids"] != mqar_splits(10, 10, seed=2)["test"]["input_ids"]


@pytest.mark.parametrize(
    "fields,match",
    [
        (dict(seq_len=30, num_kv_pairs=8), "seq_len=30"),
        (dict(vocab_size=16, num_kv_pairs=8), "vocab_size=16"),
        (dict(num_kv_pairs=0), "num_kv_pairs=0"),
        (dict(power_a=0.0), "power_a=0.0"),
    ],
    ids=["sequence-too-short", "vocab-too-small", "no-pairs", "power-zero"],
)
def test_bad_config_is_rejected(fields, match):
    with pytest.raises(ValueError, match=match):
        MQARConfig(**fields)


def test_more_sequences_than_memory_holds_are_refused_before_any_is_drawn():
    """10**15 sequences of 64 tokens: numpy raised its _ArrayMemoryError (a traceback) allocating them."""
    with pytest.raises(ValueError, match=r"^num_examples=1,000,000,000,000,000 sequences of seq_len=64 tokens are gen"):
        generate_mqar(10**15, MQARConfig())
