"""Damaged checkpoints, changed data and half-written logs: a resumed run is exact, or says why not.

(A run SIGKILLed at any moment is covered by test_resume.py.)
"""

import json
import logging
import re
import shutil

import pytest
import torch
from safetensors.torch import save_file

from hf_softmax_rnn.cli import main
from hf_softmax_rnn.data.corpus import load_corpus
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.training import finetune
from hf_softmax_rnn.training.checkpointing import (
    MANIFEST_FILE,
    InexactResumeError,
    checkpoint_dirs,
    checkpoint_problems,
    write_manifest,
)
from hf_softmax_rnn.training.disk import bytes_in
from hf_softmax_rnn.training.metrics import MetricsLogger, read_metrics
from tests.training.helpers import tiny_config, weights

# 4 full fine-tuning steps, checkpoints at global steps 2 and 4 (both kept)
SETTINGS = dict(transfer_steps=0, finetune_steps=4, finetune_method="full", save_every=2, eval_every=2)


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def empty(path):
    path.write_text("")


DAMAGES = {
    "truncated-weights": ("model.safetensors", truncate),
    "flipped-optimizer-byte": ("optimizer.bin", flip_a_byte),
    "empty-trainer-state": ("trainer_state.json", empty),
    "missing-rng-states": ("random_states_0.pkl", lambda path: path.unlink()),
    "missing-manifest": (MANIFEST_FILE, lambda path: path.unlink()),
    "missing-trainer-state": ("trainer_state.json", lambda path: path.unlink()),
}


@pytest.fixture(scope="module")
def finished_run(tiny_models, tmp_path_factory):
    """A finished run (its config and folder); each test damages a copy of the folder."""
    data = tmp_path_factory.mktemp("data") / "texts.txt"
    data.write_text("\n".join(load_corpus()["train"]["text"][:40]))
    out = tmp_path_factory.mktemp("finished") / "out"
    config = tiny_config(tiny_models["llama"], out, dataset=str(data), **SETTINGS)
    finetune(config)
    return config, out


@pytest.fixture
def run_copy(finished_run, tmp_path):
    """(config with --resume, folder): a copy of the finished run to damage and resume."""
    config, out = finished_run
    shutil.copytree(out, tmp_path / "out")
    return config.with_flags(output_dir=str(tmp_path / "out"), resume=True), tmp_path / "out"


def test_every_checkpoint_verifies_against_its_manifest(finished_run):
    _, out = finished_run
    checkpoints = checkpoint_dirs(out)
    assert [path.name for path in checkpoints] == ["checkpoint-0000002", "checkpoint-0000004"]
    for path in checkpoints:
        listed = set(json.loads((path / MANIFEST_FILE).read_text())["files"])
        assert listed == {file.name for file in path.iterdir()} - {MANIFEST_FILE}
        assert checkpoint_problems(path) == []


@pytest.mark.parametrize("name,damage", DAMAGES.values(), ids=DAMAGES.keys())
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(finished_run, run_copy, caplog, name, damage):
    config, out = run_copy
    damage(checkpoint_dirs(out)[-1] / name)
    with caplog.at_level(logging.WARNING, logger="hf_softmax_rnn"):
        finetune(config)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("checkpoint-0000004" in message and name in message for message in warnings), warnings
    reference = weights(finished_run[1])
    resumed = weights(out)
    for tensor_name in reference:
        assert torch.equal(reference[tensor_name], resumed[tensor_name]), tensor_name
    assert read_metrics(out / "metrics.jsonl") == read_metrics(finished_run[1] / "metrics.jsonl")


def test_no_valid_checkpoint_is_a_clear_error(run_copy):
    config, out = run_copy
    for path in checkpoint_dirs(out):
        truncate(path / "model.safetensors")
    with pytest.raises(UserInputError, match=r"--resume: no checkpoint in .* is complete and intact"):
        finetune(config)


def test_a_checkpoint_folder_holding_no_trainer_state_is_named_in_a_warning(finished_run, run_copy, caplog):
    """A `checkpoint-<step>` folder with neither its trainer state nor its manifest (left by a copy, say) is
    no checkpoint to resume, and a WARNING names the file it lacks."""
    config, out = run_copy
    stray = out / "checkpoints" / "checkpoint-0000009"
    stray.mkdir()
    shutil.copy(checkpoint_dirs(out)[-1] / "model.safetensors", stray)
    with caplog.at_level(logging.WARNING, logger="hf_softmax_rnn"):
        finetune(config)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("checkpoint-0000009" in m and "trainer_state.json is missing" in m for m in warnings), warnings
    assert read_metrics(out / "metrics.jsonl") == read_metrics(finished_run[1] / "metrics.jsonl")


class _NotATensor:
    """What torch's weights-only loader refuses: a pickle that calls a function when it loads."""

    def __reduce__(self):
        return print, ("loaded",)


def _code_in_the_pickle(path):
    torch.save({"state": {}, "param_groups": [], "extra": _NotATensor()}, path)


def _random_bytes(path):
    path.write_bytes(bytes(range(256)) * 4)


def _no_trainer_state(path):
    path.write_text("[1, 2]")


TAMPERED = {
    "optimizer-with-code": (
        "optimizer.bin",
        _code_in_the_pickle,
        r"optimizer\.bin: torch's weights-only loader refuses it, as it holds objects besides tensors "
        r"\(Unsupported global: GLOBAL print",
    ),
    "scheduler-of-random-bytes": ("scheduler.pt", _random_bytes, r"scheduler\.pt: it is truncated or no torch file"),
    "weights-of-random-bytes": (
        "model.safetensors",
        _random_bytes,
        r"model\.safetensors: it is truncated or no safetensors file",
    ),
    "trainer-state-of-another-shape": (
        "trainer_state.json",
        _no_trainer_state,
        r"trainer_state\.json is no trainer state \(TypeError",
    ),
}


@pytest.mark.parametrize("name,tamper,message", TAMPERED.values(), ids=TAMPERED.keys())
def test_a_tampered_checkpoint_that_matches_its_manifest_is_named_and_nothing_is_written(
    run_copy, capsys, name, tamper, message
):
    """A file replaced together with its manifest entry, so that it verifies, but that `--resume` cannot read
    (or that torch's weights-only loader refuses): with no other checkpoint, one line naming checkpoint and
    file, exit status 2, and the run folder as it was."""
    config, out = run_copy
    for checkpoint in checkpoint_dirs(out):
        tamper(checkpoint / name)
        write_manifest(checkpoint)
    before = {path: path.stat().st_mtime_ns for path in out.rglob("*")}
    arguments = ["--output-dir", str(out), "--model", config.model.model, "--dataset", config.data.dataset, "--resume"]
    arguments += [f"--{key.replace('_', '-')}={value}" for key, value in SETTINGS.items()]
    arguments += ["--block-size", "16", "--batch-size", "2", "--max-eval-blocks", "6", "--no-progress"]
    arguments += ["--attention", config.model.attention, "--lr", str(config.finetune.lr), "--seed", "0"]
    capsys.readouterr()
    assert main(["finetune", *arguments]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "Traceback" not in error
    assert re.search(
        r"^hf-softmax-rnn finetune: error: --resume: no checkpoint in .* is complete and intact \(checkpoint-0000004: "
        + message,
        error,
    ), error
    assert {path: path.stat().st_mtime_ns for path in out.rglob("*")} == before


def forget_rng_states(checkpoint):
    """A checkpoint that verifies but has no RNG states (as if written without them)."""
    (checkpoint / "random_states_0.pkl").unlink()
    manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())
    del manifest["files"]["random_states_0.pkl"]
    (checkpoint / MANIFEST_FILE).write_text(json.dumps(manifest))


def test_missing_rng_states_refuse_an_inexact_resume(run_copy, caplog):
    config, out = run_copy
    for checkpoint in checkpoint_dirs(out):
        forget_rng_states(checkpoint)
    with pytest.raises(InexactResumeError, match=r"random_states_0\.pkl is missing.*--allow-inexact-resume"):
        finetune(config)
    with caplog.at_level(logging.WARNING, logger="hf_softmax_rnn"):
        finetune(config.with_flags(allow_inexact_resume=True))
    assert any("not exact" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_changed_training_data_is_noticed(tiny_models, tmp_path, caplog):
    data = tmp_path / "texts.txt"
    data.write_text("\n".join(load_corpus()["train"]["text"][:40]))
    config = tiny_config(tiny_models["llama"], tmp_path / "out", dataset=str(data), **SETTINGS)
    finetune(config)
    shutil.rmtree(checkpoint_dirs(tmp_path / "out")[-1])  # as if killed after the first checkpoint
    with data.open("a") as handle:
        handle.write("\nA new paragraph of text that was not there when the run started.\n")
    config = config.with_flags(resume=True)
    with pytest.raises(InexactResumeError, match=r"the training data changed.*--allow-inexact-resume"):
        finetune(config)
    with caplog.at_level(logging.WARNING, logger="hf_softmax_rnn"):
        finetune(config.with_flags(allow_inexact_resume=True))
    assert any("training data changed" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    finetune(config)  # the checkpoints written since record the new data: resuming them is exact again


def test_a_half_written_last_metrics_line_is_dropped(tmp_path, caplog):
    logger = MetricsLogger(tmp_path)
    for step in range(4):
        logger.log(step, "finetune", loss=float(step))
    logger.close()
    with (tmp_path / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 4, "stage": "fine')
    with caplog.at_level(logging.WARNING, logger="hf_softmax_rnn"):
        MetricsLogger(tmp_path, resume_from_step=3).close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]
    assert any("metrics.jsonl" in r.getMessage() and "half-written" in r.getMessage() for r in caplog.records)


def test_a_damaged_metrics_line_before_the_last_is_an_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1, "sta\n{"step": 2}\n')
    with pytest.raises(UserInputError, match=r"metrics\.jsonl:2 is not a JSON record"):
        read_metrics(tmp_path / "metrics.jsonl")


def test_a_diverging_run_stops_and_keeps_its_last_good_checkpoint(tiny_models, tmp_path, capsys):
    """A window of 4 positions, so that the finite state reads most of each 16-token block (a block within
    the exact part is computed as the unconverted model would, which lr 1e30 does not always break)."""
    out = tmp_path / "out"
    arguments = ["--output-dir", str(out), "--model", tiny_models["llama"], "--block-size", "16", "--batch-size", "2"]
    arguments += ["--max-eval-blocks", "4", "--transfer-steps", "0", "--finetune-steps", "3", "--state-steps", "0"]
    arguments += ["--attention", '{"kind": "linear", "feature_map": "hedgehog", "window": 4}']
    arguments += ["--finetune-method", "full", "--lr", "1e30", "--save-every", "1", "--no-progress"]
    assert main(["finetune", *arguments]) == 1
    error = capsys.readouterr().err
    match = re.search(r"finetune: error: Stage finetune: training diverged at step (\d) \((.*?)\)", error)
    assert match, error
    assert match.group(2) in ("the loss is nan", "the gradient norm is nan", "a trained parameter is not finite")
    kept = checkpoint_dirs(out)
    assert [path.name for path in kept] == [f"checkpoint-{step:07d}" for step in range(1, int(match.group(1)))]
    assert f"last good checkpoint: {kept[-1].name}" in error
    assert all(torch.isfinite(tensor).all() for tensor in weights(kept[-1]).values())
    for name in ("model.safetensors", "config.json", "results.json", "README.md", "adapter"):
        assert not (out / name).exists(), name


def test_resume_into_a_run_whose_checkpoints_were_deleted_warns_naming_them(run_copy, caplog):
    config, out = run_copy
    shutil.rmtree(out / "checkpoints")
    with caplog.at_level(logging.WARNING, logger="hf_softmax_rnn"):
        finetune(config)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    expected = rf"--resume: {re.escape(str(out / 'checkpoints'))} does not exist although the folder holds a previous "
    assert any(re.match(expected + r"run's .*metrics\.jsonl.*starting from step 0", m) for m in warnings), warnings


def test_a_full_disk_while_saving_is_one_error_naming_path_and_bytes(tiny_models, tmp_path, monkeypatch, capsys):
    """The second checkpoint's weights hit a full disk (as safetensors reports ENOSPC): the run stops with
    one line and exit status 2, and the first checkpoint still verifies."""
    import accelerate.utils.other
    from safetensors import SafetensorError

    real_save, calls = accelerate.utils.other.safe_save_file, []

    def save_until_the_disk_is_full(*args, **kwargs):
        calls.append(args[1])
        if len(calls) > 1:
            raise SafetensorError(
                'Error while serializing: IoError(Os { code: 28, message: "No space left on device" })'
            )
        return real_save(*args, **kwargs)

    monkeypatch.setattr(accelerate.utils.other, "safe_save_file", save_until_the_disk_is_full)
    data = tmp_path / "texts.txt"
    data.write_text("\n".join(load_corpus()["train"]["text"][:40]))
    config = tiny_config(tiny_models["llama"], tmp_path / "out", dataset=str(data), **SETTINGS)
    arguments = [f"--{name.replace('_', '-')}={value}" for name, value in SETTINGS.items()]
    common = ["--block-size", "16", "--batch-size", "2", "--cpu", "--no-progress", "--dataset", str(data)]
    capsys.readouterr()
    arguments = ["--output-dir", config.output_dir, "--model", config.model.model, *common, *arguments]
    assert main(["finetune", *arguments]) == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error
    assert re.search(
        r"^hf-softmax-rnn finetune: error: Could not write checkpoint .*checkpoint-0000004: .*No space left on device.*"
        rf" \(it needs about {bytes_in(checkpoint_dirs(tmp_path / 'out')[0]):,} bytes, [\d,]+ are free on its disk\); "
        r"the checkpoints saved before are intact",
        error,
        re.MULTILINE,
    ), error
    assert [path.name for path in checkpoint_dirs(tmp_path / "out")] == ["checkpoint-0000002"]
    assert checkpoint_problems(checkpoint_dirs(tmp_path / "out")[0]) == []


def _other_optimizer_state(checkpoint):
    other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    other.step()
    torch.save(other.state_dict(), checkpoint / "optimizer.bin")


def _other_weights(checkpoint):
    save_file({"x": torch.zeros(3)}, checkpoint / "model.safetensors")


OTHER_RUNS = {
    "optimizer-state": (
        _other_optimizer_state,
        r"optimizer\.bin holds the optimizer state of other parameters than the finetune stage trains \(1 parameter "
        r"group of 1 tensor in the file, 2 parameter groups of \d+\+\d+ tensors now\)",
    ),
    "weights": (
        _other_weights,
        r"model\.safetensors holds the weights of another model than the finetune stage trains \(\d+ weights missing "
        r"\(model\.embed_tokens\.weight, .*\); 1 weight left over \(x\)\)",
    ),
}


@pytest.mark.parametrize("replace,message", OTHER_RUNS.values(), ids=OTHER_RUNS.keys())
def test_a_checkpoint_of_another_run_is_named_and_nothing_is_written(run_copy, capsys, replace, message):
    """A checkpoint whose weights or optimizer state are of another model or other trainable parameters (another
    run's, whose files verify): one line naming the file, exit status 2, and the run folder as it was."""
    config, out = run_copy
    for checkpoint in checkpoint_dirs(out):
        replace(checkpoint)
        write_manifest(checkpoint)
    before = {path: path.stat().st_mtime_ns for path in out.rglob("*")}
    arguments = ["--output-dir", str(out), "--model", config.model.model, "--dataset", config.data.dataset, "--resume"]
    arguments += [f"--{key.replace('_', '-')}={value}" for key, value in SETTINGS.items()]
    arguments += ["--block-size", "16", "--batch-size", "2", "--eval-batch-size", "4", "--max-eval-blocks", "6"]
    arguments += ["--attention", config.model.attention, "--lr", str(config.finetune.lr)]
    arguments += ["--transfer-lr", str(config.transfer.transfer_lr)]
    capsys.readouterr()
    assert main(["finetune", *arguments, "--seed", "0", "--no-progress"]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(r"^hf-softmax-rnn finetune: error: --resume: .*checkpoint-0000004/" + message, error), error
    assert {path: path.stat().st_mtime_ns for path in out.rglob("*")} == before
