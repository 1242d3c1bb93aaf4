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
    predictions (list of list of int): predicted token id for each position.
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


def _check_token_ids(name: str, value) -> None:
    if not isinstance(value, (list, tuple, np.ndarray)):
        raise TypeError(f"{name} must be a list of token-id lists (ints); got {type(value).__name__}")
    if len(value) == 0:
        raise ValueError(f"{name} is empty; expected at least one sequence of token ids")
    for index, row in enumerate(value):
        row = np.asarray(row)
        if row.ndim != 1 or not (np.issubdtype(row.dtype, np.integer) or all(_is_int(x) for x in row.tolist())):
            raise TypeError(
                f"{name}[{index}] must be a list of int token ids; got {np.asarray(row).tolist()!r:.80} "
                f"(dtype {row.dtype})"
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

    def compute(self, *, predictions=None, references=None, **kwargs):
        """`evaluate.Metric.compute` after checking that both are non-empty lists of token-id lists (ints)."""
        for name, value in (("predictions", predictions), ("references", references)):
            _check_token_ids(name, value)
        return super().compute(predictions=predictions, references=references, **kwargs)

    def _compute(self, predictions, references, ignore_index=-100):
        correct = scored = sequences_right = 0
        for index, (prediction, reference) in enumerate(zip(predictions, references)):
            prediction, reference = np.asarray(prediction), np.asarray(reference)
            if prediction.shape != reference.shape:
                raise ValueError(
                    f"predictions[{index}] has {prediction.size} tokens but references[{index}] has {reference.size}; "
                    "they must be aligned position by position"
                )
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
