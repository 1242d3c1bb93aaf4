"""scripts/bench_train.py in its quick form: a random 2-layer Llama, the original beside converted
models, training steps at two lengths of the same tokens per step; bad settings refused."""

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from hf_softmax_rnn.ops import backends

from ..models.helpers import LLAMA_SHAPE
from .helpers import load_script, tiny_config_dir

PRESETS = ["linear_elu", "hedgehog_window_64"]
LENGTHS = (16, 32)


def _load_script(monkeypatch):
    return load_script("bench_train", monkeypatch)


def _config_dir(tmp_path) -> Path:
    return tiny_config_dir(tmp_path, max_positions=16)


def test_training_throughput_of_the_original_and_converted_models(tmp_path, monkeypatch, capsys):
    output = tmp_path / "bench"
    argv = ["--model", str(_config_dir(tmp_path)), "--presets", *PRESETS, "--lengths", *map(str, LENGTHS)]
    _load_script(monkeypatch).main(argv + ["--tokens-per-step", "64", "--steps", "2", "--warmup", "1",
                                           "--output", str(output)])  # fmt: skip
    result = json.loads((output / "bench_train.json").read_text())
    cells = {(m["model"], m["length"]): m for m in result["measurements"]}
    assert set(cells) == {(name, n) for name in ["transformers", *PRESETS] for n in LENGTHS}
    assert all(m["tokens_per_s"] > 0 and m["error"] is None for m in cells.values())
    assert [cells["transformers", n]["batch"] for n in LENGTHS] == [64 // n for n in LENGTHS]
    printed = capsys.readouterr().out
    assert "| L | B | transformers tokens/s | linear_elu tokens/s | hedgehog_window_64 tokens/s |" in printed
    assert "hedgehog_window_64 / transformers" in printed
    assert (output / "bench_train.png").stat().st_size > 0


def test_profile_splits_one_step_of_each_model_by_kind(tmp_path, monkeypatch, capsys):
    output = tmp_path / "bench"
    argv = ["--model", str(_config_dir(tmp_path)), "--presets", *PRESETS, "--lengths", *map(str, LENGTHS)]
    _load_script(monkeypatch).main(argv + ["--tokens-per-step", "64", "--steps", "1", "--warmup", "1",
                                           "--profile", "--output", str(output)])  # fmt: skip
    timed = {
        (m["model"], m["length"]): m for m in json.loads((output / "bench_train.json").read_text())["measurements"]
    }
    profiles = json.loads((output / "bench_train_profile.json").read_text())["measurements"]
    assert [(p["model"], p["length"]) for p in profiles] == [
        (name, n) for n in LENGTHS for name in ["transformers", *PRESETS]
    ]
    for profile in profiles:
        assert profile["step_ms"] == timed[profile["model"], profile["length"]]["step_ms"]
        assert profile["launches"] > 0 and profile["kernel_ms"] > 0
        assert sum(profile["ms_by_kind"].values()) == pytest.approx(profile["kernel_ms"])
        assert profile["ms_by_kind"]["matrix products"] > 0
    by_model = {(p["model"], p["length"]): p["launches"] for p in profiles}
    assert all(by_model["hedgehog_window_64", n] > by_model["transformers", n] for n in LENGTHS)
    printed = capsys.readouterr().out
    assert "| L | model | step ms | kernel ms | busy | launches |" in printed
    assert (output / "bench_train_profile.png").stat().st_size > 0


def test_a_profiled_step_that_fails_is_left_out_and_the_others_are_profiled(tmp_path, monkeypatch):
    module = _load_script(monkeypatch)
    step, calls = module.Trainer.step, {}

    def failing_on_its_last_step(self, ids):
        calls[self.name] = calls.get(self.name, 0) + 1
        if self.name == "linear_elu" and calls[self.name] == 3:  # warm-up, timed, profiled
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return step(self, ids)

    monkeypatch.setattr(module.Trainer, "step", failing_on_its_last_step)
    output = tmp_path / "bench"
    argv = ["--model", str(_config_dir(tmp_path)), "--presets", *PRESETS, "--lengths", "16"]
    module.main(argv + ["--tokens-per-step", "32", "--steps", "1", "--warmup", "1", "--profile",
                        "--output", str(output)])  # fmt: skip
    profiles = json.loads((output / "bench_train_profile.json").read_text())["measurements"]
    assert [p["model"] for p in profiles] == ["transformers", "hedgehog_window_64"]
    timed = json.loads((output / "bench_train.json").read_text())["measurements"]
    assert all(m["tokens_per_s"] > 0 for m in timed)


def test_a_model_that_fails_is_reported_and_the_others_are_timed(tmp_path, monkeypatch, capsys):
    module = _load_script(monkeypatch)
    step = module.Trainer.step

    def failing_step(self, ids):
        if self.name == "linear_elu" and ids.shape[-1] == LENGTHS[1]:
            raise RuntimeError("kernel failed")
        return step(self, ids)

    monkeypatch.setattr(module.Trainer, "step", failing_step)
    output = tmp_path / "bench"
    argv = ["--model", str(_config_dir(tmp_path)), "--presets", "linear_elu", "--lengths", *map(str, LENGTHS)]
    module.main(argv + ["--tokens-per-step", "64", "--steps", "1", "--warmup", "1", "--output", str(output)])
    cells = {
        (m["model"], m["length"]): m for m in json.loads((output / "bench_train.json").read_text())["measurements"]
    }
    assert cells["linear_elu", LENGTHS[1]]["error"] == "error: RuntimeError"
    assert cells["linear_elu", LENGTHS[1]]["tokens_per_s"] is None
    assert all(m["tokens_per_s"] > 0 for key, m in cells.items() if key != ("linear_elu", LENGTHS[1]))
    assert "error: RuntimeError" in capsys.readouterr().out


def test_training_steps_change_the_weights_of_every_model(tmp_path, monkeypatch):
    module = _load_script(monkeypatch)
    config = LlamaConfig(**LLAMA_SHAPE)
    from transformers import LlamaForCausalLM

    from hf_softmax_rnn.convert import convert

    base = LlamaForCausalLM(config)
    trainer = module.Trainer(
        "linear_elu", convert(base, "linear_elu", attention_mode="chunked"), module.torch.device("cpu")
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    ids = module.torch.randint(0, config.vocab_size, (2, 8))
    assert trainer.step(ids) > 0
    changed = [not module.torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True)]
    assert all(changed)
    assert all(p.grad is None for p in trainer.model.parameters())


def _count_mlp_calls(monkeypatch) -> list[int]:
    """A list that grows by one at every forward of a Llama decoder layer's MLP."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    forward, calls = LlamaMLP.forward, []

    def counted(self, *args, **kwargs):
        calls.append(1)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(LlamaMLP, "forward", counted)
    return calls


def test_gradient_checkpointing_recomputes_every_model_s_layers(tmp_path, monkeypatch):
    """--gradient-checkpointing: each decoder layer of every model (the original too) runs its forward
    twice per training step, against once without the flag (counted at each layer's MLP)."""
    module = _load_script(monkeypatch)
    calls = _count_mlp_calls(monkeypatch)
    counts = {}
    for flag in ([], ["--gradient-checkpointing"]):
        calls.clear()
        output = tmp_path / f"bench{len(flag)}"
        argv = ["--model", str(_config_dir(tmp_path)), "--presets", "linear_elu", "--lengths", "16", *flag]
        module.main(argv + ["--tokens-per-step", "32", "--steps", "1", "--warmup", "1", "--output", str(output)])
        counts[bool(flag)] = len(calls)
        title = json.loads((output / "bench_train.json").read_text())["title"]
        assert ("activation checkpointing" in title) == bool(flag)
    layers, models, steps = 2, 2, 2  # the config's layers, transformers + linear_elu, warm-up + timed
    assert counts == {False: layers * models * steps, True: 2 * layers * models * steps}


def test_checkpointed_models_recompute_their_layers_beside_the_same_models_keeping_them(tmp_path, monkeypatch, capsys):
    """--checkpointed transformers linear_elu: two more rows whose decoder layers run their forward twice per
    step (counted at each layer's MLP), timed beside the plain ones and set against them in the summary."""
    module = _load_script(monkeypatch)
    calls = _count_mlp_calls(monkeypatch)
    output = tmp_path / "bench"
    argv = ["--model", str(_config_dir(tmp_path)), "--presets", "linear_elu", "--lengths", "16",
            "--checkpointed", "transformers", "linear_elu", "--tokens-per-step", "32", "--steps", "1",
            "--warmup", "1", "--output", str(output)]  # fmt: skip
    module.main(argv)
    result = json.loads((output / "bench_train.json").read_text())
    models = [m["model"] for m in result["measurements"]]
    assert models == ["transformers", "linear_elu", "transformers checkpointed", "linear_elu checkpointed"]
    assert all(m["tokens_per_s"] > 0 for m in result["measurements"])
    layers, steps = 2, 2  # the config's layers, warm-up + timed
    assert len(calls) == layers * steps * (2 + 2 * 2)
    out = capsys.readouterr().out
    for name in ("transformers", "linear_elu"):
        assert re.search(rf"- `{name} checkpointed` at L=16: \d+\.\d\dx the tokens/s of `{name}`", out)


def test_compile_runs_every_model_s_forward_through_torch_compile(tmp_path, monkeypatch):
    """--compile: the original and the converted hybrid (one block of queries: the case inductor's CPU
    backward once crashed on) train through torch.compile; the title says so and every step is timed."""
    module = _load_script(monkeypatch)
    compiled = []
    compile_function = module.torch.compile

    def recorded(model, *args, **kwargs):
        compiled.append(type(model).__name__)
        return compile_function(model, *args, **kwargs)

    monkeypatch.setattr(module.torch, "compile", recorded)
    output = tmp_path / "bench"
    argv = ["--model", str(_config_dir(tmp_path)), "--presets", "hedgehog_window_64", "--lengths", "16", "--compile"]
    module.main(argv + ["--tokens-per-step", "32", "--steps", "1", "--warmup", "1", "--output", str(output)])
    result = json.loads((output / "bench_train.json").read_text())
    assert "torch.compile" in result["title"]
    assert sorted(compiled) == ["LlamaForCausalLM", "SoftmaxRNNLlamaForCausalLM"]
    assert all(m["tokens_per_s"] > 0 and m["error"] is None for m in result["measurements"])


def test_unsegmented_presets_are_timed_with_fla_s_rows_left_whole(tmp_path, monkeypatch, capsys):
    module = _load_script(monkeypatch)
    seen = []  # (model, the state segment length its forward ran under)
    convert = module.convert

    def recording(model, name, **kwargs):
        converted = convert(model, name, **kwargs)
        index = len(seen)
        seen.append([])
        converted.register_forward_pre_hook(lambda *_: seen[index].append(backends.state_segment_length()))
        return converted

    monkeypatch.setattr(module, "convert", recording)
    monkeypatch.delenv(backends.SEGMENT_ENV_VARIABLE, raising=False)
    output = tmp_path / "bench"
    argv = ["--model", str(_config_dir(tmp_path)), "--presets", "linear_elu", "--unsegmented", "linear_elu"]
    module.main(argv + ["--lengths", "16", "--tokens-per-step", "32", "--steps", "1", "--warmup", "1",
                        "--output", str(output)])  # fmt: skip
    assert seen == [[backends.DEFAULT_STATE_SEGMENT] * 2, [0, 0]]  # warm-up and timed step of each
    models = [m["model"] for m in json.loads((output / "bench_train.json").read_text())["measurements"]]
    assert models == ["transformers", "linear_elu", "linear_elu unsegmented"]
    assert "linear_elu unsegmented / transformers" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lengths", "48"], "--lengths=[48] is not allowed; expected increasing lengths that divide"),
        (["--lengths", "32", "16"], "--lengths=[32, 16] is not allowed"),
        (["--tokens-per-step", "0"], "--tokens-per-step=0 is not allowed"),
        (["--steps", "0"], "--steps=0 is not allowed"),
        (["--layers", "0"], "--layers=0 is not allowed"),
        (["--presets", "linear_elu", "nope"], "--presets nope: unknown; expected names from softmax,"),
        (["--device", "cuda"], "--device='cuda' is not available on this machine"),
        (
            ["--presets", "linear_elu", "--unsegmented", "hedgehog_window_64"],
            "--unsegmented hedgehog_window_64: not in --presets; expected names from linear_elu",
        ),
        (
            ["--presets", "linear_elu", "--checkpointed", "hedgehog_window_64"],
            "--checkpointed hedgehog_window_64: not timed; expected names from transformers linear_elu",
        ),
        (
            ["--presets", "linear_elu", "--checkpointed", "linear_elu", "--gradient-checkpointing"],
            "--checkpointed is not allowed with --gradient-checkpointing",
        ),
        (["--model", "/nonexistent"], "--model='/nonexistent' is not allowed; expected a folder with a config.json"),
    ],
    ids=[
        "length_not_dividing",
        "lengths_decreasing",
        "tokens_0",
        "steps_0",
        "layers_0",
        "unknown_preset",
        "cuda_without_gpu",
        "unsegmented_not_timed",
        "checkpointed_not_timed",
        "checkpointed_with_every_model_checkpointed",
        "missing_config",
    ],  # fmt: skip
)
def test_bad_arguments_stop_before_loading_anything(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("transformers.AutoConfig.from_pretrained", _must_not_load)
    base = ["--model", str(_config_dir(tmp_path)), "--tokens-per-step", "64", "--lengths", "16"]
    base += ["--output", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_info:
        _load_script(monkeypatch).main(base + argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1]
    assert not (tmp_path / "out").exists()


def _must_not_load(*args, **kwargs):
    raise AssertionError("a bad argument must stop the script before a model is loaded")
