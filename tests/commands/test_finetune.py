"""`hf-softmax-rnn finetune`'s report, its default attention, and the library's `finetune` function
keeping its name once the command's module is imported."""

import json
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest

from hf_softmax_rnn import AttentionSpec
from hf_softmax_rnn.commands.finetune import summary
from hf_softmax_rnn.training.config import FinetuneConfig


def _summary_of(perplexities: dict[str, float], **measured) -> str:
    evaluations = {p: {"perplexity": v} for p, v in perplexities.items()}
    defaults = dict(output_dir="out", evaluations=evaluations, stage_seconds={}, peak_memory={})
    return summary(SimpleNamespace(**defaults | measured))


@pytest.mark.parametrize(
    ("measured", "line"),
    [
        (
            dict(stage_seconds={"finetune": 583.4, "state": 59.6}, peak_memory={"resident_gib": 10.92}),
            "  training: finetune 9 min 43 s, state 1 min 0 s; peak memory 10.92 GiB resident",
        ),
        (
            dict(peak_memory={"resident_gib": 5.0, "cuda_allocated_gib": 3.2}),
            "  peak memory 5.00 GiB resident, 3.20 GiB CUDA tensors",
        ),
        (dict(stage_seconds={"transfer": 41.2, "state": 61.0}), "  training: transfer 41 s, state 1 min 1 s"),
    ],
    ids=["cpu", "cuda-nothing-trained-here", "no-memory-count"],
)
def test_summary_reports_each_stage_s_time_and_the_peak_memory(measured, line):
    lines = _summary_of({"base": 10.0, "state": 10.5}, **measured).splitlines()
    assert lines[-2] == line
    assert json.loads(lines[-1]) == {"base": 10.0, "state": 10.5}


def test_summary_of_a_run_that_measured_nothing_has_no_time_or_memory_line():
    assert len(_summary_of({"base": 10.0, "state": 10.5}).splitlines()) == 5


@pytest.mark.parametrize(
    ("perplexities", "ratio_line", "warned"),
    [
        ({"base": 10.0, "converted": 500.0, "finetune": 15.0}, "  finetune / base: 1.50x", False),
        ({"base": 10.0, "converted": 500.0, "transfer": 40.0, "finetune": 250.0}, "  finetune / base: 25.00x", True),
        ({"base": 10.0, "converted": math.nan}, "  converted / base: nanx", True),
        ({"base": 10.0}, None, False),
    ],
    ids=["recovered", "not-recovered", "nan", "base-only"],
)
def test_summary_reports_the_ratio_to_the_unconverted_model(perplexities, ratio_line, warned, caplog):
    with caplog.at_level("WARNING", logger="hf_softmax_rnn.commands.finetune"):
        text = _summary_of(perplexities)
    lines = text.splitlines()
    assert lines[0] == "Held-out perplexity (out):"
    assert [line.split()[0] for line in lines[1 : 1 + len(perplexities)]] == list(perplexities)
    assert (ratio_line in lines) if ratio_line else not any(" / base: " in line for line in lines)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert bool(warnings) is warned
    if warned:
        assert "has not recovered" in warnings[0] and "hedgehog_window_256_sinks_4_kept_256_decay" in warnings[0]
    assert json.loads(lines[-1]).keys() == perplexities.keys()


def test_finetune_defaults_to_the_recipe_that_recovers(tmp_path):
    config = FinetuneConfig.from_flags(output_dir=str(tmp_path / "out"))
    assert config.model.attention_spec == AttentionSpec.from_preset("hedgehog_window_256_sinks_4_kept_256_decay")
    assert config.finetune.finetune_loss == "distill" and config.transfer.transfer_steps == 0  # the window recipe
    assert (config.finetune.finetune_steps, config.data.block_size) == (20, 2048)  # window 256 with kept positions


@pytest.mark.parametrize(
    ("attention", "steps"),
    [
        ("hedgehog_window_64", 300),
        ("hedgehog_window_256_sinks_4_decay", 40),
        ("hedgehog_window_256_sinks_4_kept_256_decay", 20),
        ("linear_hedgehog", 300),
    ],
    ids=["window-64", "window-256", "window-256-kept", "learned-map"],
)
def test_recipe_steps_follow_the_window_width_unless_given(tmp_path, attention, steps):
    recipe = FinetuneConfig.from_flags(output_dir=str(tmp_path / "out"), attention=attention)
    assert recipe.finetune.finetune_steps == steps
    given = FinetuneConfig.from_flags(output_dir=str(tmp_path / "out"), attention=attention, finetune_steps=7)
    assert given.finetune.finetune_steps == 7


def test_library_finetune_stays_a_function_after_the_command_runs():
    """The command's module used to be `training.finetune`, and importing it replaced the package's
    `finetune` function by the module."""
    code = (
        "import hf_softmax_rnn.cli as cli, sys\n"
        "cli.subcommand_parser('finetune')\n"
        "from hf_softmax_rnn.training import finetune\n"
        "sys.exit(0 if callable(finetune) else 1)\n"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
