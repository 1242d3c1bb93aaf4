"""scripts/bench_generate.py in its quick form: a random tiny Llama, two short contexts, eager and
compiled (static cache + torch.compile, the default inductor mode on CPU)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from transformers import LlamaConfig

from ..models.helpers import LLAMA_SHAPE

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_generate.py"
CONTEXTS = (8, 40)


def _run(tmp_path, monkeypatch, capsys, *extra) -> tuple[dict, str]:
    config_dir = tmp_path / "config"
    LlamaConfig(**LLAMA_SHAPE, max_position_embeddings=128).save_pretrained(config_dir)
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
    cells = {(m["model"], m["context"]): m for m in result["measurements"]}
    assert set(cells) == {(name, c) for name in ["transformers", *presets] for c in CONTEXTS}
    assert all(m["latency_ms"] > 0 for m in cells.values())
    for preset in presets:  # a recurrent state does not grow with the context, a KV cache does
        assert cells[preset, CONTEXTS[0]]["cache_bytes"] == cells[preset, CONTEXTS[1]]["cache_bytes"] > 0
    assert cells["transformers", CONTEXTS[1]]["cache_bytes"] > cells["transformers", CONTEXTS[0]]["cache_bytes"]
    header = "| context | transformers ms/token | " + " | ".join(f"{p} ms/token" for p in presets)
    assert header in printed
    assert all(f"{p} / transformers" in printed for p in presets)


def test_eager_decoding_of_transformers_and_converted_models(tmp_path, monkeypatch, capsys):
    result, printed = _run(tmp_path, monkeypatch, capsys, "--presets", "linear_elu", "softmax_taylor_2")
    _check(result, printed, ["linear_elu", "softmax_taylor_2"])
    assert "eager, dynamic cache" in printed


@pytest.mark.slow
def test_compiled_static_cache_decoding(tmp_path, monkeypatch, capsys):
    result, printed = _run(tmp_path, monkeypatch, capsys, "--compile", "--presets", "linear_elu")
    _check(result, printed, ["linear_elu"])
    assert "static cache + torch.compile(mode='default')" in printed


def test_cuda_graph_decoding_needs_a_gpu_and_two_warm_up_steps(tmp_path, monkeypatch, capsys):
    with pytest.raises(ValueError, match="--cuda-graph needs --device cuda \\(got 'cpu'\\)"):
        _run(tmp_path, monkeypatch, capsys, "--cuda-graph")
    with pytest.raises(ValueError, match="--compile and --cuda-graph are two ways to decode"):
        _run(tmp_path, monkeypatch, capsys, "--cuda-graph", "--compile")
