"""scripts/bench_generate.py in its quick form: a random tiny Llama, two short contexts, eager and
compiled (static cache + torch.compile, the default inductor mode on CPU)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from hf_softmax_rnn import AttentionSpec, convert

from ..models.helpers import LLAMA_SHAPE

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_generate.py"
CONTEXTS = (8, 40)


def _llama_config() -> LlamaConfig:
    return LlamaConfig(**LLAMA_SHAPE, max_position_embeddings=128)


def _run(tmp_path, monkeypatch, capsys, *extra) -> tuple[dict, str]:
    config_dir = tmp_path / "config"
    _llama_config().save_pretrained(config_dir)
    output = tmp_path / "bench"
    argv = [str(SCRIPT), "--model", str(config_dir), "--random-weights", "--contexts", *map(str, CONTEXTS)]
    argv += ["--steps", "2", "--rounds", "2", "--warmup", "2", "--prefill-chunk", "16", "--output", str(output)]
    monkeypatch.setattr(sys, "argv", argv + list(extra))
    spec = importlib.util.spec_from_file_location("bench_generate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_generate", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    module.main()
    return json.loads(output.with_suffix(".json").read_text()), capsys.readouterr().out


def _check(result: dict, printed: str, presets: list[str]) -> None:
    """`presets`: the converted models' names (a preset, or the path of a saved model)."""
    cells = {(m["model"], m["context"]): m for m in result["measurements"]}
    assert set(cells) == {(name, c) for name in ["transformers", *presets] for c in CONTEXTS}
    assert all(m["latency_ms"] > 0 for m in cells.values())
    for preset in presets:  # a recurrent state does not grow with the context, a KV cache does
        assert cells[preset, CONTEXTS[0]]["cache_bytes"] == cells[preset, CONTEXTS[1]]["cache_bytes"] > 0
    assert cells["transformers", CONTEXTS[1]]["cache_bytes"] > cells["transformers", CONTEXTS[0]]["cache_bytes"]
    header = "| context | transformers ms/token | " + " | ".join(f"{p} ms/token" for p in presets)
    assert header in printed
    assert all(f"{p} / transformers" in printed for p in presets)
    table = [[cell.strip() for cell in line.strip("| ").split("|")] for line in printed.splitlines() if line[:1] == "|"]
    rows = {int(row[0]): row for row in table[2:]}
    for name in ["transformers", *presets]:  # each model's prefill time, as the JSON has it
        column = table[0].index(f"{name} prefill s")
        for context in CONTEXTS:
            assert float(rows[context][column]) == round(cells[name, context]["prefill_s"], 2)


def test_eager_decoding_of_transformers_and_converted_models(tmp_path, monkeypatch, capsys):
    result, printed = _run(tmp_path, monkeypatch, capsys, "--presets", "linear_elu", "softmax_taylor_2")
    _check(result, printed, ["linear_elu", "softmax_taylor_2"])
    assert "eager, dynamic cache" in printed


def test_cpu_clock_times_each_step_by_the_process_cpu_time(tmp_path, monkeypatch, capsys):
    """With `--clock cpu` a step's time is the difference of two readings of `time.process_time` (here a clock
    that advances 2.5 ms a reading), not of the wall clock."""
    readings = iter(range(10**6))
    monkeypatch.setattr("time.process_time", lambda: 0.0025 * next(readings))
    result, printed = _run(tmp_path, monkeypatch, capsys, "--presets", "linear_elu", "--clock", "cpu", "--threads", "1")
    _check(result, printed, ["linear_elu"])
    assert [m["latency_ms"] for m in result["measurements"]] == pytest.approx([2.5] * len(result["measurements"]))
    assert "1 CPU thread(s), CPU time per token" in printed


@pytest.mark.slow
def test_compiled_static_cache_decoding(tmp_path, monkeypatch, capsys):
    result, printed = _run(tmp_path, monkeypatch, capsys, "--compile", "--presets", "linear_elu")
    _check(result, printed, ["linear_elu"])
    assert "static cache + torch.compile(mode='default')" in printed


def test_saved_models_are_timed_with_the_attention_of_each_layer(tmp_path, monkeypatch, capsys):
    spec = AttentionSpec(kind="linear", feature_map="hedgehog", window=4, sinks=1, kept=4, decay=True, chunk_size=8)
    wider = AttentionSpec.coerce(dict(spec.to_dict(), kept=16))
    saved = {"uniform": None, "retrieval_layer_1": {1: wider}}
    for name, layer_attention in saved.items():
        torch.manual_seed(0)
        model = convert(AutoModelForCausalLM.from_config(_llama_config()), spec, layer_attention=layer_attention)
        model.save_pretrained(tmp_path / name)
    paths = [str(tmp_path / name) for name in saved]
    result, printed = _run(tmp_path, monkeypatch, capsys, "--presets", "--converted", *paths)
    _check(result, printed, paths)
    state = {m["model"]: m["cache_bytes"] for m in result["measurements"] if m["context"] == CONTEXTS[0]}
    # layer 1's 2 KV heads hold 16 kept positions instead of 4
    assert state[paths[1]] - state[paths[0]] == 2 * (wider.state_bytes(head_dim=8) - spec.state_bytes(head_dim=8))


def test_a_saved_model_that_is_not_converted_stops_in_one_line(tmp_path, monkeypatch, capsys):
    plain = tmp_path / "plain"
    _llama_config().save_pretrained(plain)
    with pytest.raises(SystemExit) as exit_info:
        _run(tmp_path, monkeypatch, capsys, "--converted", str(plain))
    assert exit_info.value.code == 2
    assert f"--converted {plain}: model_type 'llama' is not a converted model" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cuda-graph"], "--cuda-graph needs --device cuda (got 'cpu')"),
        (["--cuda-graph", "--compile"], "--compile and --cuda-graph are two ways to decode"),
        (["--device", "cuda"], "--device='cuda' is not available on this machine"),
        (["--device", "tpu9"], "--device='tpu9' is not allowed"),
        (["--presets", "linear_elu", "nope"], "--presets nope: unknown; expected names from softmax,"),
        (["--steps", "0"], "--steps=0 is not allowed"),
        (["--prefill-chunk", "0"], "--prefill-chunk=0 is not allowed"),
        (["--threads", "0"], "--threads=0 is not allowed"),
        (["--converted", "no/such/folder"], "--converted no/such/folder: not a saved model folder (no config.json)"),
        (["--clock", "cpu"], "--clock cpu needs --device cpu (got 'cpu') and --threads 1 (got None)"),
    ],
    ids=[
        "graph_on_cpu",
        "graph_and_compile",
        "cuda_without_gpu",
        "unknown_device",
        "unknown_preset",
        "steps_0",
        "prefill_chunk_0",
        "threads_0",
        "converted_missing",
        "cpu_clock_without_one_thread",
    ],
)
def test_bad_arguments_stop_before_loading_anything(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("transformers.AutoConfig.from_pretrained", _must_not_load)
    with pytest.raises(SystemExit) as exit_info:
        _run(tmp_path, monkeypatch, capsys, *argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def _must_not_load(*args, **kwargs):
    raise AssertionError("a bad argument must stop the script before a model is loaded")
