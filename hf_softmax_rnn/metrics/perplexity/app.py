"""Gradio widget of the `perplexity` metric, for publishing this folder as a Hub space."""

from pathlib import Path

import evaluate
from evaluate.utils import launch_gradio_widget

launch_gradio_widget(evaluate.load(str(Path(__file__).with_name("perplexity.py"))))
