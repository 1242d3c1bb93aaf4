"""Remote code: checkpoints that load with trust_remote_code where this package is not installed."""

import ast
import json
import os
import re
import subprocess
import sys
import sysconfig
import textwrap

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from hf_softmax_rnn import AttentionSpec, SoftmaxRNNGPT2LMHeadModel, SoftmaxRNNLlamaForCausalLM, convert
from hf_softmax_rnn.hub import flat_names, needed_modules
from hf_softmax_rnn.models import LLAMA_LIKE_MODELS

from .models.helpers import LLAMA_SHAPE

REMOTE_SPEC = AttentionSpec(
    kind="linear",
    feature_map="hedgehog",
    window=3,
    sinks=2,
    kept=2,
    decay=True,
    delta_rule=True,
    additive_mass=True,
    short_conv=2,
    chunk_size=4,
)
SOURCES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**LLAMA_SHAPE, pad_token_id=0)),
    "gpt2": lambda: GPT2LMHeadModel(
        GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, bos_token_id=1, eos_token_id=2)
    ),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**LLAMA_SHAPE, head_dim=8, pad_token_id=0)),
    "mixtral": lambda: MixtralForCausalLM(
        MixtralConfig(**LLAMA_SHAPE, num_local_experts=4, num_experts_per_tok=2, pad_token_id=0)
    ),
    "phi3": lambda: Phi3ForCausalLM(Phi3Config(**LLAMA_SHAPE, partial_rotary_factor=0.5, pad_token_id=0)),
    "olmo2": lambda: Olmo2ForCausalLM(Olmo2Config(**LLAMA_SHAPE, pad_token_id=0)),
    "granite": lambda: GraniteForCausalLM(
        GraniteConfig(
            **LLAMA_SHAPE, attention_multiplier=0.2, embedding_multiplier=3.0, logits_scaling=2.0, pad_token_id=0
        )
    ),
    "gemma2": lambda: Gemma2ForCausalLM(
        Gemma2Config(**LLAMA_SHAPE, head_dim=8, layer_types=["full_attention"] * 2, attn_logit_softcapping=None)
    ),
    "gemma3": lambda: Gemma3ForCausalLM(
        Gemma3TextConfig(
            **LLAMA_SHAPE,
            head_dim=8,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=4,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            },
        )
    ),
    "smollm3": lambda: SmolLM3ForCausalLM(SmolLM3Config(**LLAMA_SHAPE, no_rope_layer_interval=2, pad_token_id=0)),
}
#: The flat modeling and configuration files a family's checkpoint names: `<kind>_softmax_rnn_<stem>.py`.
FLAT_STEMS = {family: "llama_like" for family in SOURCES} | {"llama": "llama", "gpt2": "gpt2"}
SAVED_CLASSES = (
    SoftmaxRNNGPT2LMHeadModel,
    SoftmaxRNNLlamaForCausalLM,
    *(model_class for classes in LLAMA_LIKE_MODELS.values() for model_class in classes),
)


@pytest.fixture(autouse=True)
def _unregister_auto_class():
    """`register_for_auto_class` sets a class attribute; undo it so other tests save plain checkpoints."""
    yield
    for model_class in SAVED_CLASSES:
        model_class._auto_class = None


# Runs in a fresh interpreter without site (so without the editable install of hf_softmax_rnn) and
# outside the repository; only the installed libraries are on sys.path. One interpreter checks
# every checkpoint given (importing torch and transformers is most of the cost).
REMOTE_SCRIPT = """
import importlib.util, json, sys
import torch
from transformers import AutoModelForCausalLM
assert importlib.util.find_spec("hf_softmax_rnn") is None, sys.path
ids = torch.tensor(json.loads(sys.argv[1]))
results = {}
for checkpoint in sys.argv[2:]:
    model = AutoModelForCausalLM.from_pretrained(checkpoint, trust_remote_code=True).eval()
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
    generated = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    results[checkpoint] = {"class": type(model).__module__, "logits": logits.tolist(), "generated": generated.tolist()}
print(json.dumps(results))
"""


def run_without_package(script: str, *args: str, cwd) -> subprocess.CompletedProcess:
    env = {
        "PATH": os.environ.get("PATH", ""),
        "PYTHONPATH": sysconfig.get_paths()["purelib"],
        "HF_HUB_OFFLINE": "1",
        "HF_MODULES_CACHE": str(cwd / "modules"),
        "HF_HOME": str(cwd / "hf_home"),
    }
    return subprocess.run(
        [sys.executable, "-S", "-c", script, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def saved_with_remote_code(family, directory):
    """A converted hybrid (layer 0: hedgehog with a gated delta-rule state weighed by an additive mass beyond a
    window of 3 with 2 sinks and 2 kept positions, keys and values through a short convolution; layer 1:
    softmax) with perturbed rnn_params, saved with its code."""
    model = convert(SOURCES[family]().eval(), REMOTE_SPEC, layers=[0])
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".rnn_params." in name:
                param.add_(0.1 * torch.randn_like(param))
    model.register_for_auto_class("AutoModelForCausalLM")
    model.save_pretrained(directory)
    return model


@pytest.mark.slow  # a second interpreter imports torch and transformers
def test_saved_models_load_with_remote_code_where_the_package_is_absent(tmp_path):
    models = {family: saved_with_remote_code(family, tmp_path / family) for family in sorted(SOURCES)}
    for family, model in models.items():
        checkpoint = tmp_path / family
        config = json.loads((checkpoint / "config.json").read_text())
        assert config["auto_map"] == {
            "AutoConfig": f"configuration_softmax_rnn_{FLAT_STEMS[family]}.{type(model.config).__name__}",
            "AutoModelForCausalLM": f"modeling_softmax_rnn_{FLAT_STEMS[family]}.{type(model).__name__}",
        }
        code = {path.name: path.read_text() for path in checkpoint.glob("*.py")}
        assert {
            "ops_attention.py",
            "layers_attention.py",
            "attention_spec.py",
            "cache.py",
            "sinks.py",
            "decay.py",
            "kept.py",
            "delta.py",
            "short_conv.py",
        } <= set(code)
        nodes = [node for text in code.values() for node in ast.walk(ast.parse(text))]
        imports = [node for node in nodes if isinstance(node, (ast.Import, ast.ImportFrom))]
        internal = [node for node in imports if isinstance(node, ast.ImportFrom) and node.level]
        assert internal and all(node.level == 1 and f"{node.module}.py" in code for node in internal)
        assert not any("hf_softmax_rnn" in ast.unparse(node) for node in imports)

    ids = torch.randint(1, 64, (2, 7))
    result = run_without_package(
        REMOTE_SCRIPT, json.dumps(ids.tolist()), *(str(tmp_path / f) for f in models), cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    remote = json.loads(result.stdout.strip().splitlines()[-1])
    for family, model in models.items():
        loaded = remote[str(tmp_path / family)]
        assert loaded["class"].startswith("transformers_modules.")
        with torch.no_grad():
            expected = model(ids, use_cache=False).logits
        torch.testing.assert_close(torch.tensor(loaded["logits"]), expected, atol=1e-5, rtol=0)
        assert loaded["generated"] == model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0).tolist()


def test_plain_save_writes_no_code(tmp_path):
    convert(SOURCES["llama"](), "linear_elu").save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.py"))
    assert "auto_map" not in json.loads((tmp_path / "config.json").read_text())


def test_save_with_push_to_hub_is_refused_for_remote_code(tmp_path):
    model = convert(SOURCES["gpt2"](), "linear_elu")
    model.register_for_auto_class("AutoModelForCausalLM")
    with pytest.raises(ValueError, match="call model.push_to_hub"):
        model.save_pretrained(tmp_path, push_to_hub=True)


@pytest.mark.parametrize("remote_code", [False, True], ids=["plain", "remote_code"])
def test_save_into_a_path_that_is_a_file_raises_and_leaves_the_file(tmp_path, remote_code):
    """transformers logs the error and returns, so the model would be lost without a word."""
    model = convert(SOURCES["llama"](), "linear_elu")
    if remote_code:
        model.register_for_auto_class("AutoModelForCausalLM")
    target = tmp_path / "model.bin"
    target.write_text("kept")
    message = rf"save_pretrained\('{re.escape(str(target))}'\): that path is a file; expected a folder"
    with pytest.raises(NotADirectoryError, match=message):
        model.save_pretrained(target)
    assert target.read_text() == "kept" and list(tmp_path.iterdir()) == [target]


def test_flat_names_qualify_only_different_modules_with_colliding_basenames():
    sources = {
        "pkg.models.modeling_x": "x",
        "pkg.ops.attention": "ops",
        "pkg.layers.attention": "layers",
        "pkg.a.spec": "same file",
        "pkg.b.spec": "same file",
    }
    assert flat_names(sources) == {
        "pkg.models.modeling_x": "modeling_x",
        "pkg.ops.attention": "ops_attention",
        "pkg.layers.attention": "layers_attention",
        "pkg.a.spec": "spec",
        "pkg.b.spec": "spec",
    }


def test_flat_names_that_still_collide_raise():
    with pytest.raises(ValueError, match=r"\['pkg.a.b.c', 'pkg.a_b.c'\] would all be flattened to a_b_c.py"):
        flat_names({"pkg.a_b.c": "one", "pkg.a.b.c": "two"})


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """Writes modules of a throwaway package `fakepkg` and puts it on sys.path."""
    root = tmp_path / "fakepkg"
    root.mkdir()
    (root / "__init__.py").write_text("VALUE = 1\n")

    def write(name: str, source: str) -> str:
        (root / f"{name}.py").write_text(textwrap.dedent(source))
        return f"fakepkg.{name}"

    monkeypatch.syspath_prepend(str(tmp_path))
    yield write
    for name in [name for name in sys.modules if name.startswith("fakepkg")]:
        del sys.modules[name]


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("from fakepkg import VALUE\n", "imports the package root 'fakepkg'"),
        ("import fakepkg.helper\n", "use `from fakepkg.<module> import name`"),
        (
            "from transformers import AutoConfig\nAutoConfig.register('x', object)\n",
            "registers with AutoConfig at import time",
        ),
    ],
    ids=["package-root", "plain-import", "auto-registration"],
)
def test_modules_that_cannot_travel_raise(fake_package, source, message):
    fake_package("helper", "X = 1\n")
    entry = fake_package("modeling_fake", source)
    with pytest.raises(ValueError, match=message):
        needed_modules([entry])


def test_needed_modules_follow_imports_transitively_including_inside_functions(fake_package):
    fake_package("leaf", "X = 1\n")
    fake_package("middle", "def f():\n    from fakepkg.leaf import X\n    return X\n")
    entry = fake_package("modeling_fake", "import torch\nfrom .middle import f\n")
    assert sorted(needed_modules([entry])) == ["fakepkg.leaf", "fakepkg.middle", "fakepkg.modeling_fake"]


def resaved(directory, target):
    """Load a remote-code checkpoint with the package (no class registered, as in a fresh process) and save it again."""
    for model_class in SAVED_CLASSES:
        model_class._auto_class = None
    AutoModelForCausalLM.from_pretrained(directory).save_pretrained(target)
    return target


def test_resaving_a_loaded_remote_code_model_writes_its_code(tmp_path):
    saved_with_remote_code("llama", tmp_path / "first")
    second = resaved(tmp_path / "first", tmp_path / "second")
    config = json.loads((second / "config.json").read_text())
    assert config["auto_map"] == json.loads((tmp_path / "first" / "config.json").read_text())["auto_map"]
    assert {path.name for path in second.glob("*.py")} == {path.name for path in (tmp_path / "first").glob("*.py")}


@pytest.mark.slow  # a second interpreter imports torch and transformers
def test_a_resaved_model_loads_where_the_package_is_absent(tmp_path):
    model = saved_with_remote_code("gpt2", tmp_path / "first")
    second = resaved(tmp_path / "first", tmp_path / "second")
    ids = torch.randint(1, 64, (2, 7))
    result = run_without_package(REMOTE_SCRIPT, json.dumps(ids.tolist()), str(second), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    remote = json.loads(result.stdout.strip().splitlines()[-1])[str(second)]
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
    torch.testing.assert_close(torch.tensor(remote["logits"]), expected, atol=1e-5, rtol=0)
