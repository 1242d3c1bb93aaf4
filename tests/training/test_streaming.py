"""A streamed dataset trains through the same pipeline, reading blocks in order as they come."""

import json

import pytest
from datasets import DatasetDict

from hf_softmax_rnn.data.corpus import load_corpus
from hf_softmax_rnn.training import finetune, loading
from hf_softmax_rnn.training.checkpointing import latest_checkpoint
from tests.training.helpers import tiny_config


def _streamed_corpus(*args, **kwargs) -> DatasetDict:
    corpus = load_corpus()
    return DatasetDict({split: corpus[split].to_iterable_dataset() for split in corpus})


def test_streamed_dataset_trains_and_scores_the_same_held_out_blocks(tiny_models, tmp_path, monkeypatch):
    settings = dict(transfer_steps=2, finetune_steps=2)
    loaded = finetune(tiny_config(tiny_models["llama"], tmp_path / "loaded", **settings))
    monkeypatch.setattr(loading, "load_corpus", _streamed_corpus)
    streamed = finetune(
        tiny_config(tiny_models["llama"], tmp_path / "streamed", streaming=True, shuffle_buffer=1, **settings)
    )

    assert streamed.evaluations["base"] == pytest.approx(loaded.evaluations["base"])
    assert streamed.evaluations["converted"] == pytest.approx(loaded.evaluations["converted"])
    state = json.loads((latest_checkpoint(tmp_path / "streamed") / "trainer_state.json").read_text())
    assert state["data"] == {"epoch": 0, "offset": 4 * 2}
