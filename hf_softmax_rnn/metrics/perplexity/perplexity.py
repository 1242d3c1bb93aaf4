"""Perplexity of a causal language model, offline, with a sliding window over the joined texts."""

import math

import datasets
import evaluate
import torch

from hf_softmax_rnn.default_model import resolve_model
from hf_softmax_rnn.evaluation import check_window, perplexity, stream_nll, token_stream
from hf_softmax_rnn.utils import resolve_device

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
    predictions (list of str): the texts to score (with those given to `add`/`add_batch` before).
    model_id (str): "default", a local model directory, or a Hub id (needs network).
    batch_size (int): windows per forward pass. Defaults to 1.
    max_length (int): window length (>= 2); None = min(max_position_embeddings, 1024).
    stride (int): start-to-start distance of windows (1 to max_length - 1); None = max_length // 2.
    add_eos (bool): follow each text by the EOS token. Defaults to True.
    per_text (bool): also score each text as its own stream. Defaults to False.
    device (str): "auto", "cpu", "cuda", "cuda:N" or "mps", available here; None = cuda if available, else cpu.
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
#: The options of `compute` besides the texts and `model_id`, with their defaults.
_OPTIONS = dict(batch_size=1, max_length=None, stride=None, add_eos=True, per_text=False, device=None, dtype="float32")


def _check_texts(texts) -> None:
    """A batch of texts: a list of non-empty strings (an empty one has no token to score)."""
    if not isinstance(texts, (list, tuple)):
        raise TypeError(f"predictions must be a list of texts; got {type(texts).__name__}")
    not_text = [index for index, text in enumerate(texts) if not isinstance(text, str)]
    if not_text:
        raise TypeError(f"predictions {not_text} are not strings; expected a list of texts")
    empty = [index for index, text in enumerate(texts) if not text]
    if empty:
        raise ValueError(f"predictions {empty} are empty strings; every text needs at least one token")


def _check_text(text) -> None:
    """One text added alone: a non-empty string."""
    if not isinstance(text, str):
        raise TypeError(f"prediction must be a text; got {text!r:.80}")
    if not text:
        raise ValueError("prediction is an empty string; every text needs at least one token")


def _checked_options(model_id, options: dict) -> dict:
    """Every option of `compute` (defaults filled in, the device resolved), each refused with a message
    naming it and what is allowed; nothing here loads a model."""
    unknown = [name for name in options if name not in _OPTIONS]
    if unknown:
        raise TypeError(f"{unknown[0]} is not an argument of compute; expected one of {['model_id', *_OPTIONS]}")
    if not isinstance(model_id, str) or not model_id:
        raise TypeError(f"model_id must be a model folder, a Hub id or 'default'; got {model_id!r}")
    options = {**_OPTIONS, **options}
    check_window(max_length=options["max_length"], stride=options["stride"], batch_size=options["batch_size"])
    for name in ("add_eos", "per_text"):
        if not isinstance(options[name], bool):
            raise TypeError(f"{name}={options[name]!r} is not allowed; expected True or False")
    if options["dtype"] not in _DTYPES:
        raise ValueError(f"dtype={options['dtype']!r} is not allowed; expected one of {list(_DTYPES)}")
    options["device"] = _device(options["device"])
    return options


def _device(device) -> torch.device:
    """`device` if this machine has it (checked by `resolve_device`); None: cuda if available, else cpu."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return resolve_device(device, name="device")


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

    def add_batch(self, *, predictions=None, **kwargs):
        """`evaluate.Metric.add_batch` after checking the texts (a list of non-empty strings)."""
        _check_texts(predictions)
        super().add_batch(predictions=predictions, **kwargs)

    def add(self, *, prediction=None, **kwargs):
        """`evaluate.Metric.add` after checking the text (a non-empty string)."""
        _check_text(prediction)
        super().add(prediction=prediction, **kwargs)

    def compute(self, *, predictions=None, model_id=None, **options):
        """`evaluate.Metric.compute` on `predictions` plus the texts `add`/`add_batch` stored, after checking
        `model_id` and every option, before any model is loaded (a refused option keeps the added texts)."""
        options = _checked_options(model_id, options)
        if predictions is None and self.writer is None:
            raise TypeError(
                "predictions must be a list of texts; got NoneType, and nothing was added with add() or add_batch()"
            )
        return super().compute(predictions=predictions, model_id=model_id, **options)

    def _compute(self, predictions, model_id, batch_size, max_length, stride, add_eos, per_text, device, dtype):
        if len(predictions) == 0:
            raise ValueError("predictions is empty; expected at least one text")
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
