import evaluate
import numpy as np
import pytest

import hf_softmax_rnn.metrics
from hf_softmax_rnn.data.mqar import IGNORE_INDEX, MQARConfig, generate_mqar


@pytest.fixture(scope="module")
def metric():
    return evaluate.load(hf_softmax_rnn.metrics.path("mqar_accuracy"))


@pytest.mark.parametrize("error_rate", [0.0, 0.3, 1.0], ids=["perfect", "some-wrong", "all-wrong"])
def test_accuracy_matches_direct_count(metric, error_rate):
    config = MQARConfig(vocab_size=64, seq_len=32, num_kv_pairs=4)
    labels = np.array(generate_mqar(40, config, seed=1)["labels"])
    rng = np.random.default_rng(0)
    predictions = np.where(rng.random(labels.shape) < error_rate, (labels + 1) % config.vocab_size, labels)
    predictions[labels == IGNORE_INDEX] = rng.integers(config.vocab_size, size=int((labels == IGNORE_INDEX).sum()))
    result = metric.compute(predictions=predictions.tolist(), references=labels.tolist())
    scored = labels != IGNORE_INDEX
    assert result["num_scored"] == scored.sum() == 40 * 4
    assert result["accuracy"] == pytest.approx((predictions == labels)[scored].mean())
    rows_right = [(p[s] == lab[s]).all() for p, lab, s in zip(predictions, labels, scored, strict=True)]
    assert result["sequence_accuracy"] == pytest.approx(np.mean(rows_right))


def test_misaligned_and_unscored_inputs_are_rejected(metric):
    with pytest.raises(ValueError, match=r"predictions\[0\] has 3 tokens"):
        metric.compute(predictions=[[1, 2, 3]], references=[[-100, 2]])
    with pytest.raises(ValueError, match="no scored position"):
        metric.compute(predictions=[[1, 2]], references=[[-100, -100]])


@pytest.mark.parametrize(
    "predictions,references,error,match",
    [
        ([[0, 7.0, 0, 9]], [[-100, 7, -100, 8]], TypeError, r"predictions\[0\] must be a list of int token ids"),
        ([[0, 7, 0, 9]], [[-100, 7.5, -100, 8]], TypeError, r"references\[0\] must be a list of int token ids"),
        (None, [[-100, 7]], TypeError, "predictions must be a list of token-id lists .*got NoneType"),
        ([[0, 7]], None, TypeError, "references must be a list of token-id lists .*got NoneType"),
        ([], [], ValueError, "predictions is empty"),
        ([[0, [7]]], [[-100, 7]], TypeError, r"predictions\[0\] must be a list of int token ids; got \[0, \[7\]\]"),
    ],
    ids=["float-predictions", "float-references", "none-predictions", "none-references", "empty", "nested-row"],
)
def test_bad_input_names_the_argument(metric, predictions, references, error, match):
    with pytest.raises(error, match=match):
        metric.compute(predictions=predictions, references=references)


PREDICTIONS = [[0, 7, 0, 9], [3, 5, 3, 5], [1, 2]]
REFERENCES = [[-100, 7, -100, 8], [-100, 5, -100, 5], [-100, 2]]


def _add_in_batches(metric):
    metric.add_batch(predictions=PREDICTIONS[:2], references=REFERENCES[:2])
    metric.add_batch(predictions=PREDICTIONS[2:], references=REFERENCES[2:])


def _add_one_by_one(metric):
    for prediction, reference in zip(PREDICTIONS, REFERENCES, strict=True):
        metric.add(prediction=prediction, reference=reference)


@pytest.mark.parametrize("add", [_add_in_batches, _add_one_by_one], ids=["add_batch", "add"])
def test_added_data_is_scored_like_one_compute_call(add):
    metric = evaluate.load(hf_softmax_rnn.metrics.path("mqar_accuracy"))
    add(metric)
    streamed = metric.compute()
    assert streamed == metric.compute(predictions=PREDICTIONS, references=REFERENCES)
    assert streamed == {"accuracy": 4 / 5, "sequence_accuracy": 2 / 3, "num_scored": 5}


def test_compute_with_nothing_added_names_both_ways_to_give_data():
    metric = evaluate.load(hf_softmax_rnn.metrics.path("mqar_accuracy"))
    with pytest.raises(TypeError, match=r"predictions must be .*got NoneType.*add\(\) or add_batch\(\)"):
        metric.compute()


ADDED_BAD_BATCHES = {
    "float-predictions": (
        dict(predictions=[[0, 7.0]], references=[[-100, 7]]),
        TypeError,
        r"predictions\[0\] must be a list of int token ids",
    ),
    "no-references": (dict(predictions=[[0, 7]]), TypeError, "references must be a list of token-id lists .*NoneType"),
    "misaligned": (
        dict(predictions=[[1, 2, 3]], references=[[-100, 2]]),
        ValueError,
        r"predictions\[0\] has 3 tokens but references\[0\] has 2",
    ),
    "fewer-references": (
        dict(predictions=[[1, 2], [1, 2]], references=[[-100, 2]]),
        ValueError,
        "predictions has 2 sequences but references has 1",
    ),
}


@pytest.mark.parametrize("batch,error,match", ADDED_BAD_BATCHES.values(), ids=ADDED_BAD_BATCHES.keys())
def test_bad_data_added_in_a_batch_names_the_argument(batch, error, match):
    metric = evaluate.load(hf_softmax_rnn.metrics.path("mqar_accuracy"))
    with pytest.raises(error, match=match):
        metric.add_batch(**batch)


ADDED_BAD_EXAMPLES = {
    "float-prediction": (
        dict(prediction=[0, 7.5], reference=[-100, 7]),
        TypeError,
        r"prediction must be a list of int token ids",
    ),
    "no-reference": (dict(prediction=[0, 7]), TypeError, "reference must be a list of int token ids; got None"),
    "misaligned": (dict(prediction=[1, 2, 3], reference=[-100, 2]), ValueError, "prediction has 3 tokens but"),
}


@pytest.mark.parametrize("example,error,match", ADDED_BAD_EXAMPLES.values(), ids=ADDED_BAD_EXAMPLES.keys())
def test_bad_data_added_one_by_one_names_the_argument(example, error, match):
    metric = evaluate.load(hf_softmax_rnn.metrics.path("mqar_accuracy"))
    with pytest.raises(error, match=match):
        metric.add(**example)


@pytest.mark.parametrize("ignore_index", ["-100", -100.0, True], ids=["string", "float", "bool"])
def test_ignore_index_must_be_an_int(metric, ignore_index):
    with pytest.raises(TypeError, match=r"ignore_index=.* is not allowed; expected an int"):
        metric.compute(predictions=PREDICTIONS, references=REFERENCES, ignore_index=ignore_index)
