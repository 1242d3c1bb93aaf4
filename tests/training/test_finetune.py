"""End-to-end fine-tuning of tiny random Llama and GPT-2 checkpoints, and of the other families."""

import json
import math
import re
import subprocess
import sys

import pytest
import torch
from peft import PeftModel
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GraniteConfig,
    GraniteForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from hf_softmax_rnn import AttentionSpec, convert
from hf_softmax_rnn.cli import main
from hf_softmax_rnn.data.corpus import load_corpus
from hf_softmax_rnn.data.recall import FactPlanter
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.layers.attention import SoftmaxRNNGPT2Attention, SoftmaxRNNLlamaAttention
from hf_softmax_rnn.long_context import extend_context
from hf_softmax_rnn.training import Finetuner, finetune
from hf_softmax_rnn.training.metrics import read_metrics
from hf_softmax_rnn.training.recipes import KEPT_RETRIEVAL_LAYERS
from tests.models.helpers import LLAMA_SHAPE
from tests.training.helpers import MAX_POSITIONS, VOCAB_SIZE, direct_perplexity, tiny_config, weights, word_tokenizer

END_TO_END = {
    "llama-l2norm-lora": ("llama", "gated_softmax_no_gate_L2norm_nodivS_noclamp", "lora"),
    "llama-gated-full": ("llama", "gated_softmax", "full"),
    "gpt2-elu-lora": ("gpt2", "linear_elu", "lora"),
    "gpt2-divSnorm-full": ("gpt2", "softmax_divS_norm", "full"),
}


#: A tiny checkpoint of each family whose attention differs most from Llama's: (causal LM, config, fine-tuning method,
#: the projections that make q and k, which attention transfer trains for linear elu).
FAMILY_SHAPE = LLAMA_SHAPE | dict(
    vocab_size=VOCAB_SIZE, max_position_embeddings=MAX_POSITIONS, bos_token_id=None, eos_token_id=1, pad_token_id=None
)
FAMILY_RUNS = {
    "phi3-fused-qkv-lora": (Phi3ForCausalLM, Phi3Config(**FAMILY_SHAPE), "lora", ["qkv_proj"]),
    "olmo2-full": (Olmo2ForCausalLM, Olmo2Config(**FAMILY_SHAPE), "full", ["q_proj", "k_proj"]),
    "granite-lora": (
        GraniteForCausalLM,
        GraniteConfig(**FAMILY_SHAPE, attention_multiplier=0.2, embedding_multiplier=3.0, logits_scaling=2.0),
        "lora",
        ["q_proj", "k_proj"],
    ),
    "smollm3-nope-full": (
        SmolLM3ForCausalLM,
        SmolLM3Config(**FAMILY_SHAPE, no_rope_layer_interval=2),
        "full",
        ["q_proj", "k_proj"],
    ),
    "gemma2-sliding-layer-lora": (
        Gemma2ForCausalLM,
        Gemma2Config(
            **FAMILY_SHAPE,
            head_dim=8,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=8,
            attn_logit_softcapping=None,
        ),
        "lora",
        ["q_proj", "k_proj"],
    ),
    "gemma3-local-global-full": (
        Gemma3ForCausalLM,
        Gemma3TextConfig(
            **FAMILY_SHAPE, head_dim=8, layer_types=["sliding_attention", "full_attention"], sliding_window=8
        ),
        "full",
        ["q_proj", "k_proj"],
    ),
}


@pytest.mark.parametrize("model_class,config,method,query_key", FAMILY_RUNS.values(), ids=FAMILY_RUNS.keys())
def test_the_cli_finetunes_a_checkpoint_of_each_family(tmp_path, model_class, config, method, query_key):
    """`hf-softmax-rnn finetune --model DIR`: attention transfer trains the q/k projections (linear elu has no
    rnn_params), LoRA adapts the family's attention projections, and the saved model is the one evaluated."""
    source, out = tmp_path / "source", tmp_path / "out"
    torch.manual_seed(0)
    model_class(config).save_pretrained(source)
    word_tokenizer().save_pretrained(source)
    arguments = ["--model", str(source), "--output-dir", str(out), "--attention", "linear_elu", "--no-progress"]
    arguments += ["--finetune-method", method, "--block-size", "16", "--batch-size", "2", "--eval-batch-size", "4"]
    arguments += ["--max-eval-blocks", "6", "--transfer-steps", "2", "--finetune-steps", "2", "--eval-every", "2"]
    arguments += ["--transfer-lr", "1e-2", "--lr", "1e-2", "--seed", "0"]
    assert main(["finetune", *arguments]) == 0

    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded).__name__ == f"SoftmaxRNN{model_class.__name__}"
    assert reloaded.config.attention_spec(0) == AttentionSpec.from_preset("linear_elu")
    evaluations = json.loads((out / "results.json").read_text())["evaluations"]
    assert list(evaluations) == ["base", "converted", "transfer", "finetune"]
    assert evaluations["finetune"]["perplexity"] == pytest.approx(direct_perplexity(reloaded, str(source), 16, 6))
    original, trained = weights(source), weights(out)
    changed = {name for name, tensor in original.items() if not torch.equal(trained[name], tensor)}
    attention = {name for name in changed if ".self_attn." in name}
    assert {name.split(".")[-2] for name in attention} >= set(query_key)
    if method == "lora":
        adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
        projections = [*query_key, "v_proj"] if query_key != ["qkv_proj"] else query_key
        assert set(adapter["target_modules"]) == {*projections, "o_proj"}
    else:
        assert changed - attention, "full fine-tuning changed no weight outside the attention"


@pytest.mark.parametrize("family,attention,method", END_TO_END.values(), ids=END_TO_END.keys())
def test_finetune_end_to_end(tiny_models, tmp_path, family, attention, method):
    out = tmp_path / "out"
    config = tiny_config(tiny_models[family], out, attention=attention, finetune_method=method)
    result = finetune(config)

    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert reloaded.config.attention_spec(0) == AttentionSpec.from_preset(attention)
    ids = torch.randint(0, VOCAB_SIZE, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, result.model.eval()(ids).logits)

    assert list(result.evaluations) == ["base", "converted", "transfer", "finetune"]
    expected = direct_perplexity(reloaded, tiny_models[family], config.data.block_size, config.data.max_eval_blocks)
    assert result.evaluations["finetune"]["perplexity"] == pytest.approx(expected, rel=1e-5)
    base = AutoModelForCausalLM.from_pretrained(tiny_models[family])
    expected_base = direct_perplexity(base, tiny_models[family], config.data.block_size, config.data.max_eval_blocks)
    assert result.evaluations["base"]["perplexity"] == pytest.approx(expected_base, rel=1e-5)

    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 7))
    assert [(r["stage"], r["step"]) for r in records if "perplexity" in r] == [
        ("base", 0),
        ("converted", 0),
        ("transfer", 2),
        ("transfer", 3),
        ("finetune", 5),
        ("finetune", 6),
    ]
    assert all(math.isfinite(r["loss"]) for r in records if "loss" in r)
    assert (out / "loss_curves.png").stat().st_size > 10_000
    assert any((out / "runs").iterdir()), "no TensorBoard events"
    assert json.loads((out / "results.json").read_text())["evaluations"] == json.loads(json.dumps(result.evaluations))
    assert (out / "adapter").is_dir() == (method == "lora")


def test_extend_context_trains_the_hybrid_under_the_scaled_positions_of_its_extended_teacher(tiny_models, tmp_path):
    """--extend-context 2: blocks of 96 tokens fit the 64-position model extended to 128; the original (the
    teacher, scored as "base") is the extended one, and the saved hybrid keeps the scaling."""
    out = tmp_path / "out"
    config = tiny_config(tiny_models["llama"], out, attention="linear_elu", extend_context=2.0, block_size=96)
    result = finetune(config)
    base = extend_context(AutoModelForCausalLM.from_pretrained(tiny_models["llama"]), 2)
    blocks = (config.data.heldout_block_size, config.data.max_eval_blocks)
    expected_base = direct_perplexity(base, tiny_models["llama"], *blocks)
    assert result.evaluations["base"]["perplexity"] == pytest.approx(expected_base, rel=1e-5)
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert reloaded.config.max_position_embeddings == 128
    assert reloaded.config.rope_parameters == base.config.rope_parameters
    assert reloaded.config.rope_parameters["original_max_position_embeddings"] == 64
    card = (out / "README.md").read_text()
    assert "scaled by YaRN by a factor of 2.0, from the original's\n64 to 128 positions" in card


def test_extend_context_of_a_model_without_rotary_embeddings_is_refused_before_anything_is_written(
    tiny_models, tmp_path
):
    out = tmp_path / "out"
    with pytest.raises(UserInputError, match="GPT2LMHeadModel has no rotary position embedding"):
        finetune(tiny_config(tiny_models["gpt2"], out, attention="linear_elu", extend_context=2.0))
    assert not out.exists()


def test_lora_adapter_on_its_base_equals_the_merged_model(tiny_models, tmp_path):
    out = tmp_path / "out"
    result = finetune(tiny_config(tiny_models["llama"], out, attention="gated_softmax"))
    base = AutoModelForCausalLM.from_pretrained(out / "adapter_base")
    adapted = PeftModel.from_pretrained(base, out / "adapter").eval()
    ids = torch.randint(0, VOCAB_SIZE, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, result.model.eval()(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_saved_model_loads_without_the_package(tiny_models, tmp_path):
    out = tmp_path / "out"
    result = finetune(tiny_config(tiny_models["gpt2"], out, attention="linear_elu", transfer_steps=1, finetune_steps=1))
    ids = torch.randint(0, VOCAB_SIZE, (1, 10))
    ids_file, logits_file = str(tmp_path / "ids.pt"), str(tmp_path / "logits.pt")
    torch.save(ids, ids_file)
    script = (
        "import sys; sys.modules['hf_softmax_rnn'] = None\n"
        "import torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()\n"
        f"with torch.no_grad(): torch.save(model(torch.load({ids_file!r})).logits, {logits_file!r})\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True)
    with torch.no_grad():
        torch.testing.assert_close(torch.load(logits_file), result.model.eval()(ids).logits)


# (family, attention, stage settings, pattern of every parameter name the run may change)
TRAINED_PARAMETERS = {
    "transfer-rnn_params": ("llama", "softmax_divS_norm", dict(finetune_steps=0), r"\.rnn_params\."),
    "transfer-qk-fallback": ("llama", "linear_elu", dict(finetune_steps=0), r"\.(q_proj|k_proj)\."),
    "transfer-explicit-modules": (
        "gpt2",
        "gated_softmax",
        dict(finetune_steps=0, transfer_modules=["c_attn"]),
        r"\.attn\.c_attn\.",
    ),
    "lora-gpt2": ("gpt2", "gated_softmax", dict(transfer_steps=0), r"\.attn\.(c_attn|c_proj)\.|\.rnn_params\."),
    "rnn-method-llama": (
        "llama",
        dict(kind="linear", feature_map="hedgehog", window=4, sinks=1, kept=2, decay=True),
        dict(transfer_steps=0, finetune_method="rnn"),
        r"\.rnn_params\.",
    ),
    "rnn-method-gpt2": ("gpt2", "gated_softmax", dict(transfer_steps=0, finetune_method="rnn"), r"\.rnn_params\."),
    "lora-llama-custom-targets": (
        "llama",
        "linear_elu",
        dict(transfer_steps=0, lora_targets=["v_proj"]),
        r"\.v_proj\.",
    ),
}


@pytest.mark.parametrize("family,attention,stages,pattern", TRAINED_PARAMETERS.values(), ids=TRAINED_PARAMETERS.keys())
def test_each_stage_trains_only_its_parameters(tiny_models, tmp_path, family, attention, stages, pattern):
    finetune(tiny_config(tiny_models[family], tmp_path / "out", attention=attention, **stages))
    converted = convert(AutoModelForCausalLM.from_pretrained(tiny_models[family]), attention).state_dict()
    trained = weights(tmp_path / "out")
    changed = {name for name, tensor in trained.items() if not torch.equal(tensor, converted[name])}
    assert changed, "the run changed no parameter"
    assert {name for name in changed if not re.search(pattern, name)} == set()


def test_finetune_on_generated_text_trains_on_the_models_own_samples(tiny_models, tmp_path, monkeypatch):
    """'pydoc+generated': the model's samples join the training blocks; the held-out split stays pydoc's."""
    from hf_softmax_rnn.data import generated

    monkeypatch.setattr(generated.hub_constants, "HF_HOME", str(tmp_path / "home"))
    plain = finetune(tiny_config(tiny_models["llama"], tmp_path / "plain", finetune_steps=1, transfer_steps=0))
    mixed = finetune(
        tiny_config(
            tiny_models["llama"],
            tmp_path / "mixed",
            dataset="pydoc+generated",
            generated_texts=6,
            generated_tokens=12,
            finetune_steps=1,
            transfer_steps=0,
        )
    )
    cached = list((tmp_path / "home" / "hf_softmax_rnn" / "generated").glob("*.jsonl"))
    assert len(cached) == 1 and len(cached[0].read_text().splitlines()) == 6
    assert mixed.evaluations["base"] == plain.evaluations["base"]
    saved = json.loads((tmp_path / "mixed" / "results.json").read_text())
    assert saved["config"]["dataset"] == "pydoc+generated"


def test_recall_facts_are_written_into_the_training_blocks_and_not_the_held_out_ones(tiny_models, tmp_path):
    settings = dict(block_size=64, finetune_steps=1, transfer_steps=0)
    plain = Finetuner(tiny_config(tiny_models["llama"], tmp_path / "plain", **settings))
    facts = Finetuner(tiny_config(tiny_models["llama"], tmp_path / "facts", recall_facts=1, **settings))
    assert torch.equal(facts.eval_ids, plain.eval_ids)
    planted, original = facts.train_data[64].next_blocks(2), plain.train_data[64].next_blocks(2)
    planter = FactPlanter(facts.tokenizer, 1, 64, seed=0)
    for position, (row, source) in enumerate(zip(planted, original, strict=True)):
        assert torch.equal(row, planter.plant(source, key=position)[0])
        changed = row != source
        assert changed[:32].any() and changed[32:].any()
    result = finetune(tiny_config(tiny_models["llama"], tmp_path / "run", recall_facts=1, **settings))
    assert math.isfinite(result.evaluations["finetune"]["perplexity"])


@pytest.mark.parametrize("method", ["rnn", "lora"])
def test_the_rnn_method_keeps_the_exact_parts_of_a_hybrid_as_the_original_computes_them(tiny_models, tmp_path, method):
    """--finetune-method rnn trains the state's parameters alone: a position whose every key is scored
    exactly (within the window) keeps the original's logits, while later ones change; LoRA moves both."""
    attention = dict(kind="linear", feature_map="hedgehog", window=4, sinks=1, kept=2, decay=True, chunk_size=4)
    result = finetune(
        tiny_config(
            tiny_models["llama"], tmp_path / "out", attention=attention, transfer_steps=0, finetune_method=method
        )
    )
    original = AutoModelForCausalLM.from_pretrained(tiny_models["llama"]).eval()
    ids = torch.randint(0, VOCAB_SIZE, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained, expected = result.model.eval()(ids).logits, original(ids).logits
    exact = slice(0, 4)  # every key of these positions lies in the window
    assert torch.allclose(trained[:, exact], expected[:, exact], atol=1e-5) == (method == "rnn")
    assert not torch.allclose(trained[:, 8:], expected[:, 8:], atol=1e-3)


def test_lora_finetune_trains_the_decay_projection(tiny_models, tmp_path):
    """rnn_params (decay_proj among them) train in full beside the LoRA adapters."""
    attention = dict(kind="linear", feature_map="elu", window=4, sinks=2, decay=True)
    finetune(tiny_config(tiny_models["llama"], tmp_path / "out", attention=attention, transfer_steps=0))
    converted = convert(AutoModelForCausalLM.from_pretrained(tiny_models["llama"]), AttentionSpec(**attention))
    trained = weights(tmp_path / "out")
    decay = [name for name in trained if ".rnn_params.decay_proj." in name]
    assert len(decay) == 2 * converted.config.num_hidden_layers
    assert all(not torch.equal(trained[name], converted.state_dict()[name]) for name in decay)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_gradient_checkpointing_recomputes_each_layer_and_trains_the_same_weights(
    tiny_models, tmp_path, family, monkeypatch
):
    """--gradient-checkpointing runs every converted layer's training forward twice (once more in the
    backward pass) and ends with the weights of the plain run (kept positions, sinks and decay included)."""
    attention_class = {"llama": SoftmaxRNNLlamaAttention, "gpt2": SoftmaxRNNGPT2Attention}[family]
    forward = attention_class.forward
    calls = []

    def counted(self, *args, **kwargs):
        calls.append(self.training and torch.is_grad_enabled())
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(attention_class, "forward", counted)
    attention = dict(kind="linear", feature_map="hedgehog", window=4, sinks=1, kept=2, decay=True, chunk_size=4)
    runs = {}
    for checkpointing in (False, True):
        calls.clear()
        out = tmp_path / f"checkpointing_{checkpointing}"
        finetune(tiny_config(tiny_models[family], out, attention=attention, gradient_checkpointing=checkpointing))
        runs[checkpointing] = (sum(calls), weights(out))
    (plain_calls, plain), (checkpointed_calls, checkpointed) = runs[False], runs[True]
    assert checkpointed_calls == 2 * plain_calls > 0
    assert checkpointed.keys() == plain.keys()
    for name in plain:  # float32 round-off of the recomputed forward, through 6 Adam steps at lr 1e-2: ~2e-6
        torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-5, rtol=1e-5, msg=name)


def test_retrieval_layers_keep_more_positions_in_the_layers_that_copy_the_key(tmp_path):
    """--retrieval-layers 1: the layer whose heads put the most attention on the key (found on the
    unconverted model) is saved with --retrieval-kept kept positions, the other layer with the spec's."""
    from hf_softmax_rnn.analysis.byte_tokenizer import byte_tokenizer
    from hf_softmax_rnn.long_context.retrieval import retrieval_layers, retrieval_scores
    from tests.long_context.helpers import tiny_llama

    model_dir = tmp_path / "byte_llama"
    torch.manual_seed(0)
    tiny_llama().save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    attention = dict(kind="linear", feature_map="hedgehog", window=4, sinks=1, kept=2, chunk_size=4)
    config = tiny_config(str(model_dir), tmp_path / "out", attention=attention, retrieval_layers=1, retrieval_kept=8)
    finetune(config)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    texts = load_corpus()["train"]["text"]
    expected = retrieval_layers(retrieval_scores(base, byte_tokenizer(), texts, length=512, progress=False), 1)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    kept = [saved.config.attention_spec(i).kept for i in range(saved.config.num_hidden_layers)]
    assert kept == [8 if i in expected else 2 for i in range(len(kept))]


def test_the_recipe_gives_kept_specs_retrieval_layers_within_what_model_and_tokenizer_allow(
    tiny_models, tmp_path, caplog
):
    """Left unset, --retrieval-layers is the recipe's count for a spec with kept positions, capped at the
    model's 2 layers; with a tokenizer that has no digit tokens (the word-level one) the run goes on without,
    saying so."""
    from hf_softmax_rnn.analysis.byte_tokenizer import byte_tokenizer
    from tests.long_context.helpers import tiny_llama

    attention = dict(kind="linear", feature_map="elu", window=4, kept=2, chunk_size=4)
    model_dir = tmp_path / "byte_llama"
    tiny_llama().save_pretrained(model_dir)
    byte_tokenizer().save_pretrained(model_dir)
    config = tiny_config(str(model_dir), tmp_path / "byte", attention=attention, finetune_steps=1, transfer_steps=0)
    assert config.model.retrieval_layers == KEPT_RETRIEVAL_LAYERS
    finetune(config)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "byte")
    assert [saved.config.attention_spec(i).kept for i in range(2)] == [2048, 2048]
    config = tiny_config(
        tiny_models["llama"], tmp_path / "word", attention=attention, finetune_steps=1, transfer_steps=0
    )
    with caplog.at_level("WARNING"):
        finetune(config)
    assert "No retrieval layers: the tokenizer writes numbers with no digit tokens" in caplog.text
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "word")
    assert [saved.config.attention_spec(i).kept for i in range(2)] == [2, 2]
    assert tiny_config(tiny_models["llama"], tmp_path / "x", attention="hedgehog_window_64").model.retrieval_layers == 0


def test_lora_setup_raises_no_deprecation_warning_from_peft(tiny_models, tmp_path):
    """PEFT reads transformers' deprecated `is_gradient_checkpointing` when it wraps the model; a run does
    not pass that FutureWarning on to the user."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        finetune(tiny_config(tiny_models["llama"], tmp_path / "out", transfer_steps=0, finetune_steps=1))
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]


def test_finetune_with_bfloat16_mixed_precision_runs_attention_as_one_autocast_operation(
    tiny_models, tmp_path, monkeypatch, fresh_accelerator_state
):
    """`--mixed-precision bf16` (float32 weights, bfloat16 autocast) on a window hybrid: every training
    step's attention reads and returns bfloat16 from float32 q and k (what the fused kernels read on a
    GPU), the losses stay finite and the trained model is saved."""
    from hf_softmax_rnn.layers import attention as layers

    calls = []
    attention_op = layers.attention

    def recorded(q, k, v, *args, **kwargs):
        out, state = attention_op(q, k, v, *args, **kwargs)
        if torch.is_autocast_enabled("cpu"):
            calls.append((q.dtype, out.dtype))
        return out, state

    monkeypatch.setattr(layers, "attention", recorded)
    out = tmp_path / "out"
    spec = {"kind": "linear", "feature_map": "hedgehog", "window": 4, "chunk_size": 8}
    config = tiny_config(tiny_models["llama"], out, attention=json.dumps(spec), mixed_precision="bf16")
    finetune(config)
    assert calls and {out_dtype for _, out_dtype in calls} == {torch.bfloat16}
    assert torch.float32 in {q_dtype for q_dtype, _ in calls}
    records = read_metrics(out / "metrics.jsonl")
    assert all(math.isfinite(r["loss"]) for r in records if "loss" in r)
    assert (out / "model.safetensors").is_file()


@pytest.mark.parametrize(("kept", "logged"), [(6, True), (5, False)], ids=["block-held-exactly", "block-overflows"])
def test_layers_whose_exact_part_holds_a_training_block_are_named_and_their_state_stays_untrained(
    tiny_models, tmp_path, caplog, kept, logged
):
    """Window 8 + 2 sinks + `kept` against 16-token blocks: with 16 exact positions no key of a block reaches
    the finite state, so the feature maps get no gradient (and the run says so); with 15 they train."""
    attention = dict(kind="linear", feature_map="hedgehog", window=8, sinks=2, kept=kept, chunk_size=4)
    config = tiny_config(
        tiny_models["llama"], tmp_path / "out", attention=attention, finetune_steps=1, transfer_steps=0, lr=1e-2
    )
    with caplog.at_level("INFO", logger="hf_softmax_rnn.training.model_checks"):
        finetuner = Finetuner(config)
        finetuner.run()
    message = (
        "Layers [0, 1] score every key of a 16-token training block exactly (window, sinks and kept positions: 16): "
        "their finite state gets no training; blocks longer than 16 tokens train it"
    )
    assert (message in caplog.text) == logged
    maps = [p for name, p in finetuner.converted.named_parameters() if name.endswith("hedgehog_q")]
    moved = max((p.detach() - torch.eye(p.shape[1], p.shape[2])).abs().max().item() for p in maps)
    assert (moved == 0) == logged


def test_a_model_whose_loss_is_nan_before_training_is_named_not_reported_as_divergence(tiny_models, tmp_path, capsys):
    """A weight of NaN (or a config that makes the logits so) gives a held-out loss of nan before any step: the
    run stops there with exit status 2, naming the model, not at step 1 with advice to lower the learning rate."""
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path / "model"
    shutil.copytree(tiny_models["llama"], model)
    tensors = load_file(model / "model.safetensors")
    tensors["model.norm.weight"][0] = float("nan")
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    arguments = ["finetune", "--output-dir", str(out), "--model", str(model), "--block-size", "16", "--batch-size", "2"]
    arguments += ["--max-eval-blocks", "4", "--transfer-steps", "2", "--finetune-steps", "2", "--no-progress"]
    assert main([*arguments, "--attention", "softmax_divS_norm"]) == 2
    error = capsys.readouterr().err
    assert re.search(
        rf"^hf-softmax-rnn finetune: error: Model '{re.escape(str(model))}' scores the held-out data with a loss of "
        r"nan before any training: its weights hold non-finite values",
        error,
        re.MULTILINE,
    ), error
    assert not (out / "model.safetensors").exists() and not (out / "checkpoints").exists()
