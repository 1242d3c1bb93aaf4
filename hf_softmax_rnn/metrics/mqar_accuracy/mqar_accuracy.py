"""Accuracy on multi-query associative recall (MQAR): predicted tokens at the scored positions."""

import datasets
import evaluate
import numpy as np

_CITATION = """\
@article{arora2023zoology,
  title={Zoology: Measuring and Improving Recall in Efficient Language Models},
  author={Arora, Simran and Eyuboglu, Sabri and Timalsina, Aman and Johnson, Isys and Poli, Michael
          and Zou, James and Rudra, Atri and R{\\'e}, Christopher},
  journal={arXiv preprint arXiv:2312.04927},
  year={2023}
}
"""

_DESCRIPTION = """\
MQAR accuracy: the share of scored positions (the values that follow each queried key)
where the model's predicted token equals the reference. `references` are the MQAR labels,
`ignore_index` (-100) everywhere except at the value positions; `predictions` are the
predicted token ids aligned with them (prediction i is the model's guess for token i, i.e.
the argmax of the logits at position i - 1). Also reports the share of sequences with every
query right.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of list of int): predicted token id for each position (with those given to
        `add`/`add_batch` before).
    references (list of list of int): MQAR labels, `ignore_index` where not scored.
    ignore_index (int): label of unscored positions. Defaults to -100.
Returns:
    accuracy (float): correct / scored positions.
    sequence_accuracy (float): share of sequences whose scored positions are all correct.
    num_scored (int): number of scored positions.
Examples:
    >>> import evaluate, hf_softmax_rnn.metrics
    >>> metric = evaluate.load(hf_softmax_rnn.metrics.path("mqar_accuracy"))
    >>> metric.compute(predictions=[[0, 7, 0, 9]], references=[[-100, 7, -100, 8]])
    {'accuracy': 0.5, 'sequence_accuracy': 0.0, 'num_scored': 2}
"""


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_row(name: str, row) -> np.ndarray:
    """One sequence of token ids (a list of ints), as an array; `name` is how the message names it."""
    array = np.asarray(row, dtype=object) if isinstance(row, (list, tuple)) else row
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{name} must be a list of int token ids; got {row!r:.80}")
    if array.ndim != 1 or not (np.issubdtype(array.dtype, np.integer) or all(_is_int(x) for x in array.tolist())):
        raise TypeError(f"{name} must be a list of int token ids; got {array.tolist()!r:.80} (dtype {array.dtype})")
    return array


def _check_aligned(prediction_name: str, prediction, reference_name: str, reference) -> None:
    """A prediction for every position of its reference."""
    prediction = _check_row(prediction_name, prediction)
    reference = _check_row(reference_name, reference)
    if prediction.shape != reference.shape:
        raise ValueError(
            f"{prediction_name} has {prediction.size} tokens but {reference_name} has {reference.size}; "
            "they must be aligned position by position"
        )


def _check_token_ids(name: str, value) -> None:
    """A batch: a list of token-id lists."""
    if not isinstance(value, (list, tuple, np.ndarray)):
        raise TypeError(f"{name} must be a list of token-id lists (ints); got {type(value).__name__}")


def _check_batch(predictions, references) -> None:
    """Both lists of token-id lists, one prediction per reference, aligned position by position (what
    `add_batch` and `compute(predictions=..., references=...)` store; `add` checks its one pair alone)."""
    for name, value in (("predictions", predictions), ("references", references)):
        _check_token_ids(name, value)
    if len(predictions) != len(references):
        raise ValueError(
            f"predictions has {len(predictions)} sequences but references has {len(references)}; "
            "expected one prediction per reference"
        )
    for index, (prediction, reference) in enumerate(zip(predictions, references, strict=True)):
        _check_aligned(f"predictions[{index}]", prediction, f"references[{index}]", reference)


def _check_ignore_index(ignore_index) -> None:
    if not _is_int(ignore_index):
        raise TypeError(
            f"ignore_index={ignore_index!r} is not allowed; expected an int (the label of unscored positions)"
        )


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class MQARAccuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            module_type="metric",
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.Sequence(datasets.Value("int64")),
                    "references": datasets.Sequence(datasets.Value("int64")),
                }
            ),
            reference_urls=["https://arxiv.org/abs/2312.04927"],
        )

    def add_batch(self, *, predictions=None, references=None, **kwargs):
        """`evaluate.Metric.add_batch` after checking the batch (lists of int token-id lists, aligned)."""
        _check_batch(predictions, references)
        super().add_batch(predictions=predictions, references=references, **kwargs)

    def add(self, *, prediction=None, reference=None, **kwargs):
        """`evaluate.Metric.add` after checking the example (int token-id lists, aligned)."""
        _check_aligned("prediction", prediction, "reference", reference)
        super().add(prediction=prediction, reference=reference, **kwargs)

    def compute(self, *, predictions=None, references=None, ignore_index=-100, **kwargs):
        """`evaluate.Metric.compute` on `predictions` and `references` plus whatever `add`/`add_batch`
        stored; refuses a non-int `ignore_index`, and no data at all."""
        _check_ignore_index(ignore_index)
        if predictions is None and references is None and self.writer is None:
            raise TypeError(
                "predictions must be a list of token-id lists (ints); got NoneType, and nothing was added "
                "with add() or add_batch()"
            )
        return super().compute(predictions=predictions, references=references, ignore_index=ignore_index, **kwargs)

    def _compute(self, predictions, references, ignore_index=-100):
        if len(references) == 0:
            raise ValueError("predictions is empty; expected at least one sequence of token ids")
        correct = scored = sequences_right = 0
        for prediction, reference in zip(predictions, references, strict=True):
            prediction, reference = np.asarray(prediction), np.asarray(reference)
            mask = reference != ignore_index
            hits = int((prediction[mask] == reference[mask]).sum())
            correct, scored = correct + hits, scored + int(mask.sum())
            sequences_right += int(hits == mask.sum())
        if scored == 0:
            raise ValueError(f"references have no scored position (every label is ignore_index={ignore_index})")
        return {
            "accuracy": correct / scored,
            "sequence_accuracy": sequences_right / len(references),
            "num_scored": scored,
        }
