"""`finetune --long-eval`: the unconverted and the trained model measured as `position_perplexity`
measures them when loaded on their own, the results in results.json, the plot and the report; bad
settings refused before the output folder is touched."""

import itertools
import json

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_softmax_rnn.commands.finetune import summary
from hf_softmax_rnn.data.corpus import load_corpus
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.long_context import position_fidelity, position_perplexity
from hf_softmax_rnn.training import finetune
from hf_softmax_rnn.training.long_context_run import LongContextRun
from hf_softmax_rnn.training.trainer import Finetuner

from .helpers import tiny_config

EDGES = [0, 8, 32, 64]


@pytest.fixture(scope="module")
def books(tmp_path_factory):
    """A folder of 4 .txt documents of pydoc prose (the tiny tokenizer's words), each over 64 tokens."""
    folder = tmp_path_factory.mktemp("books")
    for index, text in enumerate(load_corpus()["test"]["text"][:4]):
        (folder / f"{index}.txt").write_text(text)
    return str(folder)


def test_long_eval_measures_both_models_into_results_and_report(tiny_models, tmp_path, books):
    out = tmp_path / "out"
    config = tiny_config(
        tiny_models["llama"],
        out,
        long_eval=True,
        long_eval_texts=books,
        long_eval_positions=EDGES,
        long_eval_sequences=3,
        long_eval_passkey=[0],
    )
    result = finetune(config)

    record = json.loads((out / "results.json").read_text())["long_context"]
    assert record == json.loads(json.dumps(result.long_context))
    texts = [open(f"{books}/{i}.txt").read().strip() for i in range(4)]
    tokenizer = AutoTokenizer.from_pretrained(out)
    buckets = list(itertools.pairwise(EDGES))
    for label, folder in (("unconverted", tiny_models["llama"]), ("trained", out)):
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        expected = position_perplexity(model, tokenizer, texts, buckets, num_sequences=3, progress=False)
        for got, want in zip(record[label]["positions"]["buckets"], expected["buckets"], strict=True):
            assert got["tokens"] == want["tokens"] == 3 * (want["end"] - max(want["start"], 1))
            assert got["perplexity"] == pytest.approx(want["perplexity"], rel=1e-5)
        assert record[label]["passkey"] is None
    original, trained = (AutoModelForCausalLM.from_pretrained(f).eval() for f in (tiny_models["llama"], out))
    expected = position_fidelity(trained, original, tokenizer, texts, buckets, num_sequences=3, progress=False)
    got = record["trained"]["fidelity"]["buckets"]
    assert [b["kl"] for b in got] == pytest.approx([b["kl"] for b in expected["buckets"]], rel=1e-4, abs=1e-9)
    assert [b["top1_agreement"] for b in got] == [b["top1_agreement"] for b in expected["buckets"]]
    assert "fidelity" not in record["unconverted"]
    assert (out / "long_context.png").stat().st_size > 10_000
    report = summary(result)
    assert "Long-context evaluation on " + books in report and "| trained | " in report
    assert "Agreement with unconverted by position" in report


def test_no_long_eval_fidelity_measures_no_agreement_and_keeps_no_original(tiny_models, tmp_path, books, monkeypatch):
    kept = []
    measure = LongContextRun.measure

    def recording(self, label, model, *, progress):
        measure(self, label, model, progress=progress)
        kept.append(self.original)

    monkeypatch.setattr(LongContextRun, "measure", recording)
    settings = {"long_eval_texts": books, "long_eval_positions": EDGES, "long_eval_passkey": [0]}
    result = finetune(
        tiny_config(tiny_models["llama"], tmp_path / "out", long_eval=True, **settings, long_eval_fidelity=False)
    )
    assert "fidelity" not in result.long_context["trained"] and kept == [None, None]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"long_eval_passkey": [128]}, "passkey length=128 is more than the model's 64 positions"),
        ({"long_eval_positions": [0, 32, 128]}, "bucket end=128 is more than the model's 64 positions"),
        ({"long_eval_positions": [0, 64, 32]}, r"bucket edges \[0, 64, 32\] are not allowed"),
        ({"long_eval_sequences": 9}, "fewer than the 9 asked for"),
        ({"long_eval_passkey": [0, 32]}, "--long-eval-passkey 0 32 mixes 0 \\(no passkey test\\) with lengths"),
        ({"long_eval_positions": [0, 1, 32]}, "bucket \\(0, 1\\) holds no scored position"),
    ],
    ids=[
        "passkey-beyond-positions",
        "bucket-beyond-positions",
        "unsorted-edges",
        "too-little-text",
        "passkey-0-with-lengths",
        "bucket-of-position-0-alone",
    ],
)
def test_bad_long_eval_settings_are_refused_before_the_run_writes(tiny_models, tmp_path, books, overrides, message):
    out = tmp_path / "out"
    settings = {"long_eval_positions": EDGES, "long_eval_passkey": [0], "long_eval_texts": books, **overrides}
    with pytest.raises(UserInputError, match=message):
        Finetuner(tiny_config(tiny_models["llama"], out, long_eval=True, **settings))
    assert not out.exists()
