"""Stage 3: the converted layers' own parameters alone, distilled on blocks of their own length."""

import json
import re
from collections import Counter

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.layers.attention import SoftmaxRNNLlamaAttention
from hf_softmax_rnn.training import FinetuneConfig, Finetuner, finetune
from hf_softmax_rnn.training.data import ShuffledBlocks
from hf_softmax_rnn.training.metrics import read_metrics
from hf_softmax_rnn.training.recipes import STATE_BLOCK_SIZE
from tests.training.helpers import MAX_POSITIONS, VOCAB_SIZE, direct_perplexity, tiny_config, weights

HYBRID = dict(kind="linear", feature_map="hedgehog", window=4, sinks=1, kept=2, decay=True, chunk_size=4)
#: LoRA on 16-token blocks (3 steps), then the state on 48-token blocks (2 steps)
WITH_STATE = dict(attention=HYBRID, transfer_steps=0, finetune_steps=3, state_steps=2, state_block_size=48)
#: The same run without the state stage (whose settings it then refuses).
NO_STATE_STAGE = dict(state_steps=0, state_block_size=None)


@pytest.fixture(scope="module")
def lora_then_state(tiny_models, tmp_path_factory):
    """(result, output folder, block shapes read in order) of LoRA then the state stage on the tiny Llama."""
    shapes = []
    next_blocks = ShuffledBlocks.next_blocks

    def recording(self, count):
        blocks = next_blocks(self, count)
        shapes.append(tuple(blocks.shape))
        return blocks

    out = tmp_path_factory.mktemp("lora_then_state")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ShuffledBlocks, "next_blocks", recording)
        result = finetune(tiny_config(tiny_models["llama"], out, **WITH_STATE))
    return result, out, shapes


def test_the_default_recipe_ends_with_ten_steps_of_the_state_on_4096_token_blocks(tmp_path):
    config = FinetuneConfig.from_flags(output_dir=str(tmp_path / "out"))
    assert config.stage_names == ["finetune", "state"]
    state = config.state
    assert (state.state_steps, state.state_block_size, state.state_lr) == (10, STATE_BLOCK_SIZE, 1e-2)
    assert config.data.block_size == 2048


@pytest.mark.parametrize(
    "attention", ["hedgehog_window_64", "hedgehog_window_256_sinks_4_decay", "linear_hedgehog", "gated_softmax"]
)
def test_other_recipes_have_no_state_stage_unless_asked(tmp_path, attention):
    assert "state" not in FinetuneConfig.from_flags(output_dir=str(tmp_path / "out"), attention=attention).stage_names
    asked = FinetuneConfig.from_flags(output_dir=str(tmp_path / "out"), attention=attention, state_steps=3)
    assert asked.stage_names[-1] == "state" and asked.state.state_steps == 3


def test_the_state_stage_reads_blocks_of_its_own_length_after_the_other_stages(lora_then_state):
    result, out, shapes = lora_then_state
    assert shapes == [(2, 16)] * 3 + [(2, 48)] * 2
    assert list(result.evaluations) == ["base", "converted", "finetune", "state"]
    saved = json.loads((out / "results.json").read_text())
    assert [(s["name"], s["block_size"], s["tokens"]) for s in saved["stages"]] == [
        ("finetune", 16, 3 * 2 * 16),
        ("state", 48, 2 * 2 * 48),
    ]
    assert saved["evaluations"]["state"]["train_tokens"] == 2 * 2 * 48
    assert (
        "| state | 2 | 0.01 | rnn_params of the converted layers on 48-token blocks" in (out / "README.md").read_text()
    )


def test_the_state_stage_distils_from_the_unconverted_model(lora_then_state):
    _, out, _ = lora_then_state
    records = [r for r in read_metrics(out / "metrics.jsonl") if r["stage"] == "state" and "loss" in r]
    assert [r["step"] for r in records] == [4, 5]
    assert all(r["loss"] == r["distill_kl"] > 0 for r in records)
    assert all(r["lr"] <= 1e-2 for r in records)


def test_the_state_stage_changes_only_rnn_params_of_the_lora_run(tiny_models, lora_then_state, tmp_path):
    """The same run without stage 3 ends with the weights of stage 2: the state stage's run differs from it
    in rnn_params alone, every one of which it moved."""
    _, out, _ = lora_then_state
    finetune(tiny_config(tiny_models["llama"], tmp_path / "lora", **WITH_STATE | NO_STATE_STAGE))
    before, after = weights(tmp_path / "lora"), weights(out)
    changed = {name for name in after if not torch.equal(after[name], before[name])}
    assert {name for name in changed if ".rnn_params." not in name} == set()
    assert changed == {name for name in after if ".rnn_params." in name}


def test_the_adapter_holds_the_state_stage_rnn_params(lora_then_state):
    result, out, _ = lora_then_state
    base = AutoModelForCausalLM.from_pretrained(out / "adapter_base")
    adapted = PeftModel.from_pretrained(base, out / "adapter").eval()
    ids = torch.randint(0, VOCAB_SIZE, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, result.model.eval()(ids).logits)


def test_the_state_stage_perplexity_is_the_saved_models(tiny_models, lora_then_state):
    result, out, _ = lora_then_state
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    expected = direct_perplexity(reloaded, tiny_models["llama"], 16, 6)
    assert result.evaluations["state"]["perplexity"] == pytest.approx(expected, rel=1e-5)


def test_the_state_stage_alone_continues_a_full_fine_tuning(tiny_models, tmp_path):
    """After full fine-tuning (no PEFT wrapper) the stage trains the layers' own rnn_params."""
    settings = WITH_STATE | dict(finetune_method="full", finetune_steps=1)
    finetune(tiny_config(tiny_models["llama"], tmp_path / "full", **settings | NO_STATE_STAGE))
    finetune(tiny_config(tiny_models["llama"], tmp_path / "state", **settings))
    before, after = weights(tmp_path / "full"), weights(tmp_path / "state")
    changed = {name for name in after if not torch.equal(after[name], before[name])}
    assert changed and all(".rnn_params." in name for name in changed)


def test_the_state_stage_alone_recomputes_each_layer_and_trains_the_weights_of_a_run_that_keeps_them(
    tiny_models, tmp_path, monkeypatch
):
    """By default only stage 3 (48-token blocks) runs each converted layer's training forward twice (once more in
    the backward pass); --no-state-gradient-checkpointing keeps its activations, --gradient-checkpointing recomputes
    in every stage, and the three runs end with the same weights."""
    forward = SoftmaxRNNLlamaAttention.forward
    calls = Counter()  # training forwards of a converted layer, by block length

    def counted(self, hidden_states, *args, **kwargs):
        if self.training and torch.is_grad_enabled():
            calls[hidden_states.shape[1]] += 1
        return forward(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(SoftmaxRNNLlamaAttention, "forward", counted)
    runs = {}
    for name, settings in {
        "default": {},
        "kept": dict(state_gradient_checkpointing=False),
        "every stage": dict(gradient_checkpointing=True),
    }.items():
        calls.clear()
        finetune(tiny_config(tiny_models["llama"], tmp_path / name, **WITH_STATE | settings))
        runs[name] = (dict(calls), weights(tmp_path / name))
    kept = runs["kept"][0]
    assert kept[16] > 0 and kept[48] > 0
    assert runs["default"][0] == {16: kept[16], 48: 2 * kept[48]}
    assert runs["every stage"][0] == {16: 2 * kept[16], 48: 2 * kept[48]}
    for name in ("default", "every stage"):
        assert runs[name][1].keys() == runs["kept"][1].keys()
        for weight, value in runs["kept"][1].items():
            torch.testing.assert_close(runs[name][1][weight], value, atol=1e-6, rtol=1e-5, msg=f"{name}: {weight}")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            dict(attention="linear_elu", state_steps=2, finetune_steps=1),
            r"--state-steps 2 trains the converted layers' own parameters \(rnn_params\), and this attention has none",
        ),
        (dict(attention=HYBRID, state_steps=1, state_block_size=MAX_POSITIONS + 1), r"state_block_size=65 is larger"),
    ],
    ids=["attention-without-parameters", "longer-than-the-model"],
)
def test_a_state_stage_that_cannot_train_is_refused_before_anything_is_written(
    tiny_models, tmp_path, settings, message
):
    config = tiny_config(tiny_models["llama"], tmp_path / "out", **dict(transfer_steps=0) | settings)
    with pytest.raises(UserInputError, match=message):
        Finetuner(config)
    assert not (tmp_path / "out").exists()


def test_too_little_data_for_one_state_block_names_its_flag(tiny_models, tmp_path):
    """8 texts of 10 words: two 16-token blocks to train on, none of 48."""
    texts = tmp_path / "texts.jsonl"
    texts.write_text(
        "".join(json.dumps({"text": "the value of a list is a sequence of items"}) + "\n" for _ in range(8))
    )
    config = tiny_config(
        tiny_models["llama"], tmp_path / "out", **WITH_STATE | dict(dataset=str(texts), test_fraction=0.5)
    )
    with pytest.raises(UserInputError, match=re.escape("use a smaller --state-block-size or more data")):
        Finetuner(config)
    assert not (tmp_path / "out").exists()


def test_the_recipe_state_block_is_cut_to_the_models_positions(tiny_models, tmp_path, caplog):
    config = tiny_config(tiny_models["llama"], tmp_path / "out", attention=HYBRID, transfer_steps=0, state_steps=1)
    assert config.state.state_block_size == STATE_BLOCK_SIZE
    with caplog.at_level("INFO", logger="hf_softmax_rnn.training.config"):
        finetuner = Finetuner(config)
    assert finetuner.stages[-1].block_size == MAX_POSITIONS
    assert f"state_block_size={STATE_BLOCK_SIZE} is cut to the model's {MAX_POSITIONS} positions" in caplog.text


def test_a_state_block_within_every_exact_part_is_refused(tiny_models, tmp_path):
    """Window 4 + 1 sink + 2 kept: a query of a 7-token block reads every key exactly."""
    config = tiny_config(tiny_models["llama"], tmp_path / "out", **WITH_STATE | dict(state_block_size=7))
    with pytest.raises(UserInputError, match=r"--state-block-size 7 is not allowed: a 7-token block fits in the exact"):
        Finetuner(config)
    assert not (tmp_path / "out").exists()


#: A wide window with kept positions (the recipe gives it a state stage) and 512 exact positions: more than the
#: tiny model's 64, to which the recipe's 4,096-token state blocks are cut
WIDE = dict(kind="linear", feature_map="elu", window=256, kept=256, chunk_size=4)


def test_the_recipe_state_stage_is_left_out_where_the_model_is_too_short_to_train_the_state(
    tiny_models, tmp_path, caplog
):
    config = tiny_config(tiny_models["llama"], tmp_path / "out", attention=WIDE, transfer_steps=0, finetune_steps=1)
    assert config.state.state_steps == 10
    with caplog.at_level("WARNING", logger="hf_softmax_rnn.training.model_checks"):
        finetuner = Finetuner(config)
    assert [stage.name for stage in finetuner.stages] == ["finetune"]
    assert "No state stage: a 64-token block fits in the exact part of every converted layer" in caplog.text


def test_a_run_left_with_nothing_to_train_without_the_recipe_state_stage_is_refused(tiny_models, tmp_path):
    config = tiny_config(tiny_models["llama"], tmp_path / "out", attention=WIDE, transfer_steps=0, finetune_steps=0)
    with pytest.raises(UserInputError, match=r"Nothing to train: the recipe's state stage is left out"):
        Finetuner(config)
    assert not (tmp_path / "out").exists()


def test_the_state_stage_of_one_run_equals_a_second_run_on_its_saved_model(tiny_models, tmp_path):
    """Stages 2 and 3 in one run end where stage 2, saved, then stage 3 alone on the saved model (`--model
    <folder> --teacher <original> --finetune-steps 0`) end."""
    settings = WITH_STATE | dict(finetune_method="full", finetune_steps=2)
    finetune(tiny_config(tiny_models["llama"], tmp_path / "one", **settings))
    finetune(tiny_config(tiny_models["llama"], tmp_path / "stage_2", **settings | NO_STATE_STAGE))
    finetune(
        tiny_config(
            str(tmp_path / "stage_2"),
            tmp_path / "stage_3",
            **{**settings, "attention": None, "finetune_steps": 0, "teacher": tiny_models["llama"]},
        )
    )
    one, two = weights(tmp_path / "one"), weights(tmp_path / "stage_3")
    assert one.keys() == two.keys()
    stage_2 = weights(tmp_path / "stage_2")
    assert any(not torch.equal(two[name], stage_2[name]) for name in two)
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=0, atol=1e-6, msg=name)
