"""scripts/bench_prefill.py in its quick form: a random 2-layer Llama against its default structure and
against a saved converted copy; bad settings refused before anything loads."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_softmax_rnn import convert
from hf_softmax_rnn.training.recipes import DEFAULT_ATTENTION

from ..models.helpers import LLAMA_SHAPE
from .helpers import load_script

LENGTHS = (8, 24)


@pytest.fixture
def original_dir(tmp_path):
    torch.manual_seed(0)
    folder = tmp_path / "original"
    LlamaForCausalLM(LlamaConfig(**LLAMA_SHAPE, max_position_embeddings=64)).save_pretrained(folder)
    return folder


def _run(monkeypatch, argv):
    return load_script("bench_prefill", monkeypatch).main(argv)


def test_the_default_structure_against_the_original(original_dir, tmp_path, monkeypatch, capsys):
    output = tmp_path / "bench"
    argv = ["--model", str(original_dir), "--lengths", *map(str, LENGTHS), "--rounds", "2", "--output", str(output)]
    _run(monkeypatch, argv)
    result = json.loads((output / "bench_prefill.json").read_text())
    cells = {(m["model"], m["length"]): m for m in result["measurements"]}
    assert set(cells) == {(model, length) for model in ("original", "converted") for length in LENGTHS}
    assert all(len(m["rounds"]) == 2 and m["seconds"] == min(m["rounds"]) > 0 for m in cells.values())
    printed = capsys.readouterr().out
    assert f"converted: {DEFAULT_ATTENTION} (untrained)" in printed
    assert "| 24 |" in printed and "commit" in printed
    assert (output / "bench_prefill.png").stat().st_size > 0


def test_the_prefill_segment_is_set_for_the_run_only(original_dir, tmp_path, monkeypatch):
    """`--prefill-segment 8`: a converted model's 24-token calls run in segments of 8; the setting is restored."""
    module = load_script("bench_prefill", monkeypatch)
    forms = module.attention_ops._finite_state
    lengths = []
    monkeypatch.setattr(
        module.attention_ops, "_finite_state", lambda q, *a, **kw: lengths.append(q.shape[-2]) or forms(q, *a, **kw)
    )
    converted_dir = tmp_path / "converted"
    convert(
        LlamaForCausalLM.from_pretrained(original_dir), {"kind": "linear", "feature_map": "elu", "window": 2}
    ).save_pretrained(converted_dir)
    argv = ["--model", str(original_dir), "--converted", str(converted_dir), "--lengths", "24", "--rounds", "1"]
    module.main([*argv, "--prefill-segment", "8", "--output", str(tmp_path / "bench")])
    assert lengths and set(lengths) == {8}
    assert module.attention_ops.PREFILL_SEGMENT == 2048


def test_a_saved_converted_model(original_dir, tmp_path, monkeypatch, capsys):
    converted_dir = tmp_path / "converted"
    convert(LlamaForCausalLM.from_pretrained(original_dir), "hedgehog_window_64").save_pretrained(converted_dir)
    argv = ["--model", str(original_dir), "--converted", str(converted_dir), "--lengths", "8", "--rounds", "1"]
    _run(monkeypatch, [*argv, "--output", str(tmp_path / "bench")])
    assert f"converted: {converted_dir}" in capsys.readouterr().out


def test_the_default_structure_keeps_more_in_layers_spread_over_the_depth(monkeypatch):
    module = load_script("bench_prefill", monkeypatch)
    assert module.spread_layers(30, 6) == [2, 7, 12, 17, 22, 27]
    assert module.spread_layers(2, 6) == [0, 1]


@pytest.mark.parametrize(
    ("flags", "named"),
    [(["--rounds", "0"], "--rounds=0"), (["--lengths", "8", "-3"], "--lengths=-3"),
     (["--threads", "0"], "--threads=0"), (["--converted", "missing"], "--converted='missing'"),
     (["--model", "nowhere"], "--model='nowhere'"), (["--prefill-segment", "-1"], "--prefill-segment=-1")],
    ids=["rounds", "lengths", "threads", "converted", "model", "prefill_segment"],
)  # fmt: skip
def test_bad_settings_are_refused_naming_them(flags, named, tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _run(monkeypatch, [*flags, "--output", str(tmp_path / "bench")])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "bench").exists()


def test_a_converted_model_as_the_original_is_refused(original_dir, tmp_path, monkeypatch):
    converted_dir = tmp_path / "converted"
    convert(LlamaForCausalLM.from_pretrained(original_dir), "linear_elu").save_pretrained(converted_dir)
    with pytest.raises(SystemExit, match="is converted already"):
        _run(monkeypatch, ["--model", str(converted_dir), "--lengths", "8", "--output", str(tmp_path / "bench")])
