"""`evaluate` modules shipped with the package, loadable offline by path.

    import evaluate, hf_softmax_rnn.metrics
    metric = evaluate.load(hf_softmax_rnn.metrics.path("perplexity"))

The Hub's own `evaluate.load("perplexity")` downloads its script and fails offline.
"""

from __future__ import annotations

from pathlib import Path

_ROOT = Path(__file__).parent
METRICS = ("perplexity", "mqar_accuracy")


def path(name: str) -> str:
    """Directory of the metric module `name`, for `evaluate.load`."""
    if name not in METRICS:
        raise ValueError(f"Unknown metric {name!r}; expected one of {list(METRICS)}")
    return str(_ROOT / name)
