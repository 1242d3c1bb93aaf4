"""The long-context evaluation on the embedded SmolLM2 and the default texts, at tiny sizes: buckets
against the transformers model's own logits bucketed by hand (original and converted), and the
original answering a short passkey prompt."""

import pytest
import torch

from hf_softmax_rnn import convert
from hf_softmax_rnn.data.eval_texts import load_eval_texts
from hf_softmax_rnn.default_model import default_model_and_tokenizer
from hf_softmax_rnn.long_context import passkey_retrieval, position_perplexity

BUCKETS = ((0, 32), (32, 128))


@pytest.mark.slow
def test_default_model_on_the_default_texts():
    model, tokenizer = default_model_and_tokenizer()
    texts = load_eval_texts()[:2]
    converted = convert(model, "hedgehog_window_64", attention_mode="parallel").eval()
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"][:128] for text in texts])
    for name, scored in (("original", model), ("converted", converted)):
        result = position_perplexity(scored, tokenizer, texts, BUCKETS, num_sequences=2, progress=False)
        with torch.no_grad():
            logits = scored(input_ids=ids, use_cache=False).logits
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2).double(), ids[:, 1:], reduction="none")
        for bucket, (start, end) in zip(result["buckets"], BUCKETS, strict=True):
            expected = nll[:, max(start, 1) - 1 : end - 1]
            assert bucket["tokens"] == expected.numel(), name
            assert bucket["mean_nll"] == pytest.approx(expected.mean().item(), rel=1e-4), name
    passkey = passkey_retrieval(model, tokenizer, texts, lengths=(256,), depths=(0.5,), trials=1, progress=False)
    answer = passkey["answers"][0]
    assert answer["correct"] and str(answer["key"]) in answer["answer"], answer
