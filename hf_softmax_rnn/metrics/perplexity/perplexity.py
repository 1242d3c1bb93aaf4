"""Perplexity of a causal language model, offline, with a sliding window over the joined texts."""

import math

import datasets
import evaluate
import torch

from hf_softmax_rnn.default_model import resolve_model
from hf_softmax_rnn.evaluation import perplexity, stream_nll, token_stream

_CITATION = """\
@article{mongaras2025expressiveness,
  title={On the Expressiveness of Softmax Attention: A Recurrent Neural Network Perspective},
  author={Mongaras, Gabriel and Larson, Eric C.},
  journal={Transactions on Machine Learning Research},
  year={2025}
}
"""

_DESCRIPTION = """\
Perplexity (exp of the mean negative log-likelihood per token) of a causal language model.
The texts are joined into one token stream (each followed by EOS) and scored with a
sliding window of `max_length` tokens moved by `stride`, so every token after the first is
scored once with up to `max_length - 1` tokens of context. Works offline with any
`AutoModelForCausalLM` checkpoint, including hf_softmax_rnn's converted models, and with
"default" (the package's embedded SmolLM2-135M-Instruct).
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): the texts to score.
    model_id (str): "default", a local model directory, or a Hub id (needs network).
    batch_size (int): windows per forward pass. Defaults to 1.
    max_length (int): window length; None = min(max_position_embeddings, 1024).
    stride (int): start-to-start distance of windows; None = max_length // 2.
    add_eos (bool): follow each text by the EOS token. Defaults to True.
    per_text (bool): also score each text as its own stream. Defaults to False.
    device (str): "cpu", "cuda", ...; None = cuda if available, else cpu.
    dtype (str): "float32", "bfloat16" or "float16". Defaults to "float32".
Returns:
    perplexity (float): over all texts joined into one stream.
    mean_nll (float): mean negative log-likelihood per scored token, in nats.
    num_tokens (int): number of scored tokens.
    perplexities (list of float), mean_perplexity (float): per text, only with per_text=True.
Examples:
    >>> import evaluate, hf_softmax_rnn.metrics
    >>> metric = evaluate.load(hf_softmax_rnn.metrics.path("perplexity"))
    >>> metric.compute(predictions=["Attention is a sum of RNNs."], model_id="default")["perplexity"]  # doctest: +SKIP
"""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Perplexity(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            module_type="metric",
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("string")}),
            reference_urls=["https://huggingface.co/docs/transformers/perplexity", "https://arxiv.org/abs/2507.23632"],
        )

    def compute(self, *, predictions=None, model_id=None, **kwargs):
        """`evaluate.Metric.compute` after checking `predictions` (non-empty texts) and `model_id`, before
        any model is loaded."""
        if not isinstance(predictions, (list, tuple)):
            raise TypeError(f"predictions must be a list of texts; got {type(predictions).__name__}")
        if len(predictions) == 0:
            raise ValueError("predictions is empty; expected at least one text")
        not_text = [index for index, text in enumerate(predictions) if not isinstance(text, str)]
        if not_text:
            raise TypeError(f"predictions {not_text} are not strings; expected a list of texts")
        if not isinstance(model_id, str) or not model_id:
            raise TypeError(f"model_id must be a model folder, a Hub id or 'default'; got {model_id!r}")
        return super().compute(predictions=predictions, model_id=model_id, **kwargs)

    def _compute(
        self,
        predictions,
        model_id,
        batch_size=1,
        max_length=None,
        stride=None,
        add_eos=True,
        per_text=False,
        device=None,
        dtype="float32",
    ):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r} is not allowed; expected one of {list(_DTYPES)}")
        empty = [index for index, text in enumerate(predictions) if not text]
        if empty:
            raise ValueError(f"predictions {empty} are empty strings; every text needs at least one token")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        model, tokenizer = resolve_model(model_id, dtype=_DTYPES[dtype])
        model.to(device)
        window = dict(max_length=max_length, stride=stride, batch_size=batch_size)
        result = perplexity(model, tokenizer, list(predictions), add_eos=add_eos, **window)
        if per_text:
            per_text_nll = [
                stream_nll(model, token_stream(tokenizer, [text], add_eos=add_eos), progress=False, **window)
                for text in predictions
            ]
            result["perplexities"] = [math.exp(nll / count) for nll, count in per_text_nll]
            result["mean_perplexity"] = sum(result["perplexities"]) / len(result["perplexities"])
        return result
