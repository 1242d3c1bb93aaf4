import math

import pytest
import torch

from hf_softmax_rnn.analysis import ablate
from hf_softmax_rnn.analysis.ablate import AblationRun, held_out_loss, summary_table, variant_spec
from hf_softmax_rnn.analysis.small_models import small_llama
from hf_softmax_rnn.errors import UserInputError


def test_every_variant_builds_a_model_with_its_spec():
    for name in ablate.VARIANTS:
        model = small_llama(variant_spec(name), vocab_size=32, hidden_size=16, num_heads=2, max_position_embeddings=8)
        assert model.config.attention_spec(0) == variant_spec(name)


def test_held_out_loss_matches_transformers_loss():
    model = small_llama("softmax", vocab_size=50, hidden_size=16, num_heads=2, max_position_embeddings=12)
    blocks = torch.randint(50, (5, 12))
    expected = model(input_ids=blocks, labels=blocks, use_cache=False).loss.item()
    assert held_out_loss(model, blocks, batch_size=2) == pytest.approx(expected, rel=1e-5)


def test_summary_reports_spread_and_divergence():
    runs = [
        AblationRun("softmax", "softmax", 0, 2.0, None, 1.0),
        AblationRun("softmax", "softmax", 1, 2.2, None, 1.0),
        AblationRun("exp_no_norm_no_clamp", "exp without norm or clamp", 0, math.nan, 17, 1.0),
    ]
    rows = summary_table(runs).splitlines()[2:]
    assert "| 2.100 ± 0.141 |" in rows[0] and f"| {2.1 / math.log(2):.3f} |" in rows[0]
    assert "| diverged |" in rows[1] and "seed 0 at step 17" in rows[1]


def test_unknown_variant_lists_the_known_ones():
    with pytest.raises(ValueError, match="'softmax_typo'.*taylor_4_l2"):
        variant_spec("softmax_typo")


BAD_SEEDS = {
    "empty": ((), r"--seeds is empty; expected at least one seed"),
    "repeated": ((3, 1, 3, 1), r"--seeds 3 1 3 1 repeats seed 3, 1; expected distinct seeds"),
    "bool": ((True,), r"--seeds True has seed True, which is not allowed; expected ints from 0 to 2\*\*32 - 1"),
    "float": ((0, 1.0), r"--seeds 0 1\.0 has seed 1\.0, which is not allowed"),
}


@pytest.mark.parametrize("seeds,message", BAD_SEEDS.values(), ids=BAD_SEEDS.keys())
def test_budget_refuses_seeds_that_are_not_distinct_ints_in_range(seeds, message):
    with pytest.raises(UserInputError, match=message):
        ablate.AblationBudget(seeds=seeds)
