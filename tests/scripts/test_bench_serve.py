"""scripts/bench_serve.py in its quick form: a random 2-layer Llama and converted copies decoding
batches of one prefilled sequence at two contexts; the batch search; bad settings refused."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, StaticCache

from hf_softmax_rnn import convert

from .helpers import load_script, tiny_config_dir

PRESETS = ["linear_elu", "hedgehog_window_64"]
CONTEXTS = (8, 24)


def _load_script(monkeypatch):
    return load_script("bench_serve", monkeypatch)


def _config_dir(tmp_path) -> Path:
    return tiny_config_dir(tmp_path, max_positions=16)


def test_batched_decoding_of_the_kv_model_and_converted_models(tmp_path, monkeypatch, capsys):
    output = tmp_path / "bench"
    argv = ["--model", str(_config_dir(tmp_path)), "--presets", *PRESETS, "--contexts", *map(str, CONTEXTS)]
    argv += ["--max-batch", "3", "--steps", "2", "--warmup", "1", "--prefill-chunk", "16", "--output", str(output)]
    _load_script(monkeypatch).main(argv)
    result = json.loads((output / "bench_serve.json").read_text())
    cells = {(m["model"], m["context"]): m for m in result["measurements"]}
    assert set(cells) == {(name, c) for name in ["transformers", *PRESETS] for c in CONTEXTS}
    assert all(m["batch"] == 3 and m["tokens_per_s"] > 0 for m in cells.values())  # the cap: nothing runs out on CPU
    for preset in PRESETS:  # a recurrent state does not grow with the context, a KV cache does
        assert cells[preset, CONTEXTS[0]]["cache_bytes"] == cells[preset, CONTEXTS[1]]["cache_bytes"] > 0
    kv = [cells["transformers", c]["cache_bytes"] for c in CONTEXTS]
    assert kv[1] > kv[0]
    printed = capsys.readouterr().out
    assert "| context | transformers batch | transformers tokens/s | transformers peak GiB |" in printed
    assert (output / "bench_serve.png").stat().st_size > 0


def test_cuda_graph_mode_decodes_each_batch_from_a_static_copy_of_the_prefilled_cache(tmp_path, monkeypatch):
    """`--cuda-graph` on a machine without a GPU, the graph step an eager stand-in: every batch is decoded
    from a `StaticCache` of that many copies of the prefilled sequence, with room for the steps, and the
    logits are those of the dynamic cache's eager steps."""
    module = _load_script(monkeypatch)
    monkeypatch.setattr(module, "device_or_exit", lambda script, name: torch.device("cpu"))
    steps = []

    class EagerStep:
        def __init__(self, model, cache):
            assert isinstance(cache, StaticCache) and len(cache.layers) == 2
            self.model, self.cache = model, cache
            steps.append(self)

        def __call__(self, tokens):
            return self.model(input_ids=tokens, cache=self.cache, use_cache=True).logits

    monkeypatch.setattr(module, "GraphedDecodeStep", EagerStep)
    output = tmp_path / "bench"
    argv = ["--model", str(_config_dir(tmp_path)), "--presets", *PRESETS, "--contexts", "8", "--device", "cuda"]
    argv += ["--cuda-graph", "--max-batch", "2", "--steps", "1", "--warmup", "2", "--output", str(output)]
    module.main(argv)
    result = json.loads((output / "bench_serve.json").read_text())
    assert "CUDA graphs over a static cache" in result["title"]
    assert {(m["model"], m["batch"]) for m in result["measurements"]} == {(n, 2) for n in ["transformers", *PRESETS]}
    assert [int(step.cache.get_seq_length()) for step in steps] == [8 + 3] * len(steps)  # prefill + 3 steps each
    server = module.Server("transformers", steps[0].model)
    server.prefill(torch.arange(1, 9), chunk=16)
    cache, eager = server._batch(2, 3)
    server.graphed = True
    _, graphed = server._batch(2, 3)
    tokens = torch.tensor([[3], [5]])
    with torch.no_grad():
        torch.testing.assert_close(graphed(tokens), eager(tokens))


@pytest.mark.parametrize("name", ["transformers", "hedgehog_window_64"])
def test_static_cache_mode_decodes_eagerly_from_a_static_copy_of_the_prefilled_cache(tmp_path, monkeypatch, name):
    """`--static-cache`: every batch is decoded eagerly from a `StaticCache` of that many copies of the
    prefilled sequence (a KV model's layers written in place, not grown), and the logits are those of the
    dynamic cache's eager steps, for the KV model and a converted one."""
    module = _load_script(monkeypatch)
    output = tmp_path / "bench"
    config_dir = _config_dir(tmp_path)
    argv = ["--model", str(config_dir), "--presets", "hedgehog_window_64", "--contexts", "8", "--static-cache"]
    argv += ["--max-batch", "2", "--steps", "1", "--warmup", "1", "--output", str(output)]
    module.main(argv)
    result = json.loads((output / "bench_serve.json").read_text())
    assert "eager over a static cache" in result["title"]
    served = {(m["model"], m["batch"]) for m in result["measurements"]}
    assert served == {("transformers", 2), ("hedgehog_window_64", 2)}

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir)).eval()
    model = model if name == "transformers" else convert(model, name).eval()
    static, dynamic = module.Server(name, model, static=True), module.Server(name, model)
    caches, steps = [], []
    for server in (static, dynamic):
        server.prefill(torch.arange(1, 9), chunk=16)
        cache, step = server._batch(2, 3)
        caches.append(cache)
        steps.append(step)
    assert isinstance(caches[0], StaticCache) and not isinstance(caches[1], StaticCache)
    with torch.no_grad():
        for tokens in (torch.tensor([[3], [5]]), torch.tensor([[7], [2]])):
            torch.testing.assert_close(steps[0](tokens), steps[1](tokens))


@pytest.mark.parametrize(
    ("fits", "cap", "tried", "found"),
    [
        (100, 512, [1, 2, 4, 8, 16, 32, 64, 128, 96, 112, 104], 96),
        (1000, 512, [1, 2, 4, 8, 16, 32, 64, 128, 256, 512], 512),
        (1000, 48, [1, 2, 4, 8, 16, 32, 48], 48),
        (40, 48, [1, 2, 4, 8, 16, 32, 48, 40, 44], 40),
        (0, 8, [1], None),
    ],
    ids=["bisected", "capped", "cap_not_a_power_of_2", "cap_misses", "nothing_fits"],
)
def test_largest_batch_doubles_then_bisects(monkeypatch, fits, cap, tried, found):
    module = _load_script(monkeypatch)
    attempts = []

    def attempt(batch):
        attempts.append(batch)
        return module.Measurement("m", 8, batch, 1.0, 1.0, 0, None) if batch <= fits else None

    result = module.largest_batch(attempt, cap)
    assert attempts == tried
    assert (result and result.batch) == found


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--contexts", "32", "16"], "--contexts=[32, 16] is not allowed"),
        (["--max-batch", "0"], "--max-batch=0 is not allowed"),
        (["--steps", "0"], "--steps=0 is not allowed"),
        (["--presets", "nope"], "--presets nope: unknown; expected names from softmax,"),
        (["--device", "cuda"], "--device='cuda' is not available on this machine"),
        (["--model", "/nonexistent"], "--model='/nonexistent' is not allowed; expected a folder with a config.json"),
        (["--cuda-graph"], "--cuda-graph needs a GPU; --device='cpu', expected cuda or cuda:N"),
        (["--cuda-graph", "--device", "cuda", "--warmup", "1"], "--warmup=1 is not allowed with --cuda-graph"),
    ],
    ids=[
        "contexts_decreasing",
        "max_batch_0",
        "steps_0",
        "unknown_preset",
        "cuda_without_gpu",
        "missing_config",
        "graph_on_cpu",
        "graph_without_recording_warmup",
    ],
)
def test_bad_arguments_stop_before_loading_anything(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("transformers.AutoConfig.from_pretrained", _must_not_load)
    base = ["--model", str(_config_dir(tmp_path)), "--output", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_info:
        _load_script(monkeypatch).main(base + argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()


def _must_not_load(*args, **kwargs):
    raise AssertionError("a bad argument must stop the script before a model is loaded")
