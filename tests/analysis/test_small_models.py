import math

import pytest
import torch

from hf_softmax_rnn.analysis.small_models import (
    batches,
    optimizer_and_schedule,
    scored_loss,
    selected_logits,
    small_llama,
    train_steps,
)


@pytest.fixture
def model():
    return small_llama("softmax", vocab_size=40, hidden_size=16, num_heads=2, max_position_embeddings=10)


def test_scored_loss_matches_transformers_loss_on_labelled_positions(model):
    ids = torch.randint(40, (3, 10))
    labels = torch.full_like(ids, -100)
    labels[:, [3, 7]] = ids[:, [3, 7]]
    expected = model(input_ids=ids, labels=labels, use_cache=False).loss
    torch.testing.assert_close(scored_loss(model, ids, labels), expected, rtol=1e-5, atol=1e-6)


def test_selected_logits_equal_the_full_logits_there(model):
    ids = torch.randint(40, (2, 10))
    positions = torch.rand(2, 10) < 0.4
    full = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(selected_logits(model, ids, positions), full[positions], rtol=1e-5, atol=1e-5)


def test_training_stops_at_the_first_non_finite_loss(model):
    data = batches({"input_ids": torch.randint(40, (8, 10))}, 4, seed=0)
    calls = []

    def loss_fn(batch):
        calls.append(1)
        loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"], use_cache=False).loss
        return loss * (math.inf if len(calls) == 3 else 1.0)

    losses = train_steps(
        model, loss_fn, data, steps=10, lr=1e-3, weight_decay=0.0, warmup_steps=1, device=torch.device("cpu")
    )
    assert len(losses) == 3 and math.isinf(losses[-1]) and all(math.isfinite(x) for x in losses[:2])


def test_training_lowers_the_loss(model):
    ids = torch.randint(40, (4, 10))
    before = model(input_ids=ids, labels=ids, use_cache=False).loss.item()
    train_steps(
        model,
        lambda b: model(input_ids=b["input_ids"], labels=b["input_ids"], use_cache=False).loss,
        batches({"input_ids": ids}, 4, seed=0),
        steps=30,
        lr=1e-2,
        weight_decay=0.0,
        warmup_steps=1,
        device=torch.device("cpu"),
    )
    assert model(input_ids=ids, labels=ids, use_cache=False).loss.item() < before - 0.5


def test_batches_cover_every_row_each_epoch_and_reject_large_batches():
    rows = torch.arange(12)[:, None]
    stream = batches({"x": rows}, 4, seed=1)
    epoch = torch.cat([next(stream)["x"] for _ in range(3)]).flatten()
    assert sorted(epoch.tolist()) == list(range(12))
    with pytest.raises(ValueError, match="batch_size=20"):
        next(batches({"x": rows}, 20, seed=1))


def test_hidden_size_must_split_into_heads():
    with pytest.raises(ValueError, match="hidden_size=30 is not divisible by num_heads=4"):
        small_llama("softmax", vocab_size=10, hidden_size=30, num_heads=4)


def test_weight_decay_only_on_linear_and_embedding_weights():
    model = small_llama("gated_softmax", vocab_size=40, hidden_size=16, num_heads=2, max_position_embeddings=10)
    optimizer, _ = optimizer_and_schedule(model, lr=1e-3, weight_decay=0.1, warmup_steps=1, steps=10)
    decayed = {id(p) for p in optimizer.param_groups[0]["params"]}
    names = {name for name, p in model.named_parameters() if id(p) in decayed}
    assert names == {
        name
        for name, module in model.named_modules()
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding))
        for name in [f"{name}.weight"]
    }
    assert not any("norm" in name or name.endswith("bias") for name in names)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters()))
