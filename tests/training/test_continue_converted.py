"""`finetune --model <converted folder> --teacher <original>`: a converted model trains on with its own attention."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_softmax_rnn import AttentionSpec, convert
from hf_softmax_rnn.commands.evaluate import original_of
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.training import FinetuneConfig, Finetuner, finetune, loading
from hf_softmax_rnn.training.outputs import portable_path
from tests.training.helpers import direct_perplexity, tiny_config, weights

HYBRID = dict(kind="linear", feature_map="hedgehog", window=4, sinks=1, kept=2, decay=True, chunk_size=4)
#: layer 1 with a budget of its own, as the retrieval layers of `finetune` get one
LAYER_ATTENTION = {1: AttentionSpec(**HYBRID | dict(kept=8))}


@pytest.fixture(scope="module")
def converted_llama(tiny_models, tmp_path_factory) -> str:
    """A folder holding the tiny Llama converted to `HYBRID` (layer 1 with 8 kept positions), untrained."""
    folder = tmp_path_factory.mktemp("converted_llama")
    original = AutoModelForCausalLM.from_pretrained(tiny_models["llama"])
    convert(original, AttentionSpec(**HYBRID), layer_attention=LAYER_ATTENTION).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_models["llama"]).save_pretrained(folder)
    return str(folder)


def continued(converted: str, teacher: str, output_dir, **settings) -> FinetuneConfig:
    return tiny_config(converted, output_dir, teacher=teacher, attention=None, **settings)


@pytest.mark.parametrize("method", ["rnn", "lora"])
def test_a_converted_model_trains_on_with_its_own_attention_distilled_from_its_teacher(
    tiny_models, converted_llama, tmp_path, method
):
    config = continued(
        converted_llama, tiny_models["llama"], tmp_path / "out", transfer_steps=0, finetune_method=method
    )
    assert config.model.attention_spec == AttentionSpec(**HYBRID) and config.model.retrieval_layers == 0
    assert config.data.block_size == 16 and config.finetune.finetune_loss == "distill"  # the model's attention's recipe
    result = finetune(config)

    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    start = AutoModelForCausalLM.from_pretrained(converted_llama)
    layers = range(start.config.num_hidden_layers)
    assert [trained.config.attention_spec(i) for i in layers] == [start.config.attention_spec(i) for i in layers]
    before, after = weights(converted_llama), weights(tmp_path / "out")
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert any(".rnn_params." in name for name in changed)
    assert any(".rnn_params." not in name for name in changed) == (method == "lora")

    # "base" is the teacher and "converted" the model as it came, on the same held-out blocks
    blocks = (config.data.heldout_block_size, config.data.max_eval_blocks)
    teacher = AutoModelForCausalLM.from_pretrained(tiny_models["llama"])
    expected = direct_perplexity(teacher, tiny_models["llama"], *blocks)
    assert result.evaluations["base"]["perplexity"] == pytest.approx(expected, rel=1e-5)
    expected = direct_perplexity(start.eval(), converted_llama, *blocks)
    assert result.evaluations["converted"]["perplexity"] == pytest.approx(expected, rel=1e-5)
    card = (tmp_path / "out" / "README.md").read_text()
    teacher_path = portable_path(tiny_models["llama"], tmp_path / "out")
    assert f"`{teacher_path}` with its attention replaced" in card  # the teacher, not the converted folder
    # `evaluate --model <output>` compares with the teacher (results.json names it relative to the folder)
    assert Path(original_of(str(tmp_path / "out"))).resolve() == Path(tiny_models["llama"]).resolve()


def test_the_run_reads_its_converted_model_with_the_attention_mode_it_is_given(tiny_models, converted_llama, tmp_path):
    config = continued(converted_llama, tiny_models["llama"], tmp_path / "out", attention_mode="parallel")
    finetuner = Finetuner(config)
    modes = {module.attention_mode for module in finetuner.converted.modules() if hasattr(module, "attention_mode")}
    assert modes == {"parallel"} and finetuner.converted.config.attention_mode == "parallel"


CONFLICTS = {
    "no-teacher": (dict(teacher=None), r"--model '.*' is converted already: pass --teacher, the unconverted model"),
    "attention": (dict(attention="linear_elu"), r"--attention 'linear_elu' contradicts --model '.*', which is"),
    "layers": (dict(layers=[0]), r"--layers \[0\] contradicts --model '.*', which is converted already"),
    "retrieval-layers": (dict(retrieval_layers=1), r"--retrieval-layers 1 contradicts --model"),
    "retrieval-kept": (dict(retrieval_kept=64), r"--retrieval-kept 64 contradicts --model"),
    "extend-context": (dict(extend_context=2.0), r"--extend-context 2\.0 contradicts --model"),
}


@pytest.mark.parametrize("settings,message", CONFLICTS.values(), ids=CONFLICTS.keys())
def test_conversion_settings_beside_a_converted_model_are_refused(
    tiny_models, converted_llama, tmp_path, settings, message
):
    settings = dict(teacher=tiny_models["llama"]) | settings
    with pytest.raises(UserInputError, match=message):
        tiny_config(converted_llama, tmp_path / "out", **(dict(attention=None) | settings))


def test_a_teacher_beside_an_unconverted_model_is_refused(tiny_models, tmp_path):
    message = r"--teacher '.*' applies to a --model folder that holds a converted model; --model '.*' is none"
    with pytest.raises(UserInputError, match=message):
        tiny_config(tiny_models["llama"], tmp_path / "out", teacher=tiny_models["gpt2"])


def test_a_teacher_of_another_shape_is_refused_before_anything_is_written(
    tiny_models, converted_llama, tmp_path, monkeypatch
):
    """From the two configs, before either model or the data loads."""

    def loaded(*args, **kwargs):
        raise AssertionError("a model or the data loaded before --teacher was checked against --model")

    monkeypatch.setattr(loading, "resolve_model", loaded)
    monkeypatch.setattr(loading, "load_corpus", loaded)
    config = continued(converted_llama, tiny_models["gpt2"], tmp_path / "out")
    with pytest.raises(UserInputError, match=r"is not a conversion of --teacher '.*' \(GPT2LMHeadModel"):
        Finetuner(config)
    assert not (tmp_path / "out").exists()


def test_an_output_folder_inside_the_teacher_is_refused(tiny_models, converted_llama, tmp_path):
    config = continued(converted_llama, tiny_models["llama"], f"{tiny_models['llama']}/out")
    with pytest.raises(UserInputError, match=r"is inside the --teacher folder"):
        Finetuner(config)
