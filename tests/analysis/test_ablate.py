import argparse
import csv
import math
import re

import pytest
import torch

from hf_softmax_rnn.analysis import ablate
from hf_softmax_rnn.analysis.ablate import AblationRun, held_out_loss, summary_table, variant_spec
from hf_softmax_rnn.analysis.small_models import small_llama
from hf_softmax_rnn.cli import main
from hf_softmax_rnn.errors import UserInputError

QUICK_VARIANTS = ["softmax", "l2", "exp_no_norm_no_clamp", "linear_elu", "taylor_2_l2"]


@pytest.mark.slow
def test_quick_run_end_to_end(tmp_path, capsys):
    assert (
        main(["ablate", "--quick", "--no-progress", "--output-dir", str(tmp_path), "--variants", *QUICK_VARIANTS]) == 0
    )
    table = (tmp_path / "ablation.md").read_text().splitlines()
    assert [row.split(" | ")[1] for row in table[2:]] == QUICK_VARIANTS
    with (tmp_path / "ablation.csv").open() as handle:
        runs = list(csv.DictReader(handle))
    assert [r["variant"] for r in runs] == QUICK_VARIANTS
    for run in runs:  # an untrained byte model sits near log(257) nats; a diverged run is marked, never a crash
        assert run["diverged_at"] != "" or 3.0 < float(run["final_loss"]) < 7.0
    with (tmp_path / "curves.csv").open() as handle:
        steps = {(r["variant"], int(r["step"])) for r in csv.DictReader(handle)}
    assert {step for _, step in steps} == {2, 4}
    assert (tmp_path / "loss_curves.png").stat().st_size > 0
    assert "ablation.md" in capsys.readouterr().out


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


def test_size_flags_override_the_quick_budget():
    parser = argparse.ArgumentParser()
    ablate.add_arguments(parser)
    budget = ablate.budget_from_args(parser.parse_args(["--quick", "--steps", "7", "--seeds", "3", "4"]))
    assert (budget.steps, budget.seeds, budget.d_model) == (7, (3, 4), ablate.QUICK_BUDGET.d_model)


def test_unknown_variant_lists_the_known_ones():
    with pytest.raises(ValueError, match="'softmax_typo'.*taylor_4_l2"):
        variant_spec("softmax_typo")


BAD_ARGUMENTS = {
    "zero-steps": (["--steps", "0"], r"--steps=0 is not allowed; expected an int >= 1"),
    "zero-eval-blocks": (["--eval-blocks", "0"], r"--eval-blocks=0 is not allowed; expected an int >= 1"),
    "zero-test-blocks": (["--test-blocks", "0"], r"--test-blocks=0 is not allowed; expected an int >= 1"),
    "zero-eval-every": (["--eval-every", "0"], r"--eval-every=0 is not allowed; expected an int >= 1"),
    "short-sequences": (["--seq-len", "1"], r"--seq-len=1 is not allowed; expected an int >= 2"),
    "indivisible-width": (["--d-model", "30", "--num-heads", "4"], r"--d-model=30 is not divisible by --num-heads=4"),
    "negative-weight-decay": (["--weight-decay", "-1"], r"--weight-decay=-1\.0 is not allowed; expected a number >= 0"),
    "zero-threads": (["--threads", "0"], r"--threads=0 is not allowed; expected an int >= 1"),
    "unknown-device": (["--device", "tpu9"], r"--device='tpu9' is not allowed"),
    "repeated-seed": (
        ["--variants", "softmax", "--seeds", "0", "1", "0"],
        r"--seeds 0 1 0 repeats seed 0; expected distinct seeds \(each seed is one independent run\)",
    ),
    "negative-seed": (
        ["--variants", "softmax", "--seeds", "0", "-1"],
        r"--seeds 0 -1 has seed -1, which is not allowed; expected ints from 0 to 2\*\*32 - 1",
    ),
    "seed-past-2**32": (
        ["--variants", "softmax", "--seeds", str(2**32)],
        r"--seeds 4294967296 has seed 4294967296, which is not allowed; expected ints from 0 to 2\*\*32 - 1",
    ),
}


@pytest.mark.parametrize("argv,message", BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS.keys())
def test_cli_rejects_bad_arguments_in_one_line(tmp_path, capsys, argv, message):
    assert main(["ablate", "--quick", *argv, "--output-dir", str(tmp_path / "out"), "--no-progress"]) == 2
    error = capsys.readouterr().err
    assert re.match(r"hf-softmax-rnn ablate: error: " + message, error), error
    assert not (tmp_path / "out").exists()


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


def test_cli_names_an_unreadable_dataset(tmp_path, capsys):
    (tmp_path / "data.txt").write_bytes(b"")
    argv = ["ablate", "--quick", "--dataset", str(tmp_path / "data.txt"), "--output-dir", str(tmp_path / "out")]
    assert main(argv) == 2
    assert re.search(r"hf-softmax-rnn ablate: error: Dataset file '.*data\.txt' is empty", capsys.readouterr().err)


def test_every_flag_has_help():
    parser = argparse.ArgumentParser()
    ablate.add_arguments(parser)
    assert [action.dest for action in parser._actions if not action.help] == []
