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
    rows_right = [(p[s] == lab[s]).all() for p, lab, s in zip(predictions, labels, scored)]
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
    ],
    ids=["float-predictions", "float-references", "none-predictions", "none-references", "empty"],
)
def test_bad_input_names_the_argument(metric, predictions, references, error, match):
    with pytest.raises(error, match=match):
        metric.compute(predictions=predictions, references=references)
