"""The output folder is checked before anything is written and locked while a run lasts."""

import fcntl
import re
from types import SimpleNamespace

import pytest

from hf_softmax_rnn.cli import main
from hf_softmax_rnn.errors import UserInputError
from hf_softmax_rnn.training import Finetuner, finetune
from hf_softmax_rnn.training.checkpointing import checkpoint_dirs
from hf_softmax_rnn.training.output_dir import LOCK_FILE, check_output_dir, claim_output_dir, read_marker
from tests.training.helpers import tiny_config

SHORT = dict(transfer_steps=2, finetune_steps=0)
MAIN_PROCESS = SimpleNamespace(is_main_process=True, wait_for_everyone=lambda: None)


def test_a_folder_of_other_files_is_refused_unless_overwrite(tiny_models, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(UserInputError, match=r"holds files that are not from a hf-softmax-rnn run \(notes\.txt\)"):
        check_output_dir(tiny_config(tiny_models["llama"], out))
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    config = tiny_config(tiny_models["llama"], out, overwrite=True, **SHORT)
    finetune(config)
    assert (out / "notes.txt").read_text() == "mine" and (out / "model.safetensors").is_file()


def test_a_finished_run_needs_resume_or_overwrite(tiny_models, tmp_path):
    config = tiny_config(tiny_models["llama"], tmp_path / "out", **SHORT)
    finetune(config)
    assert read_marker(tmp_path / "out")["finished"] is True
    refusal = r"already holds checkpoints \(latest checkpoint-0000002; the run finished\)"
    with pytest.raises(UserInputError, match=refusal):
        check_output_dir(config)
    old_checkpoint = checkpoint_dirs(tmp_path / "out")[-1]
    (old_checkpoint / "stale").write_text("from the first run")
    finetune(tiny_config(tiny_models["llama"], tmp_path / "out", overwrite=True, **SHORT))
    assert not (checkpoint_dirs(tmp_path / "out")[-1] / "stale").exists()


@pytest.mark.parametrize("where", ["model", "model/out", "parent"], ids=["same", "inside", "contains"])
def test_the_model_folder_is_refused_unless_overwrite(tmp_path, where):
    model = tmp_path / "parent" / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    out = {"model": model, "model/out": model / "out", "parent": tmp_path / "parent"}[where]
    with pytest.raises(UserInputError, match=r"--model folder"):
        check_output_dir(tiny_config(str(model), out))
    check_output_dir(tiny_config(str(model), out, overwrite=True))


def test_a_second_run_into_a_locked_folder_stops_at_once(tiny_models, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with (out / LOCK_FILE).open("w") as other_run:  # another process's lock, as far as flock can tell
        other_run.write("pid 4242 on elsewhere\n")
        other_run.flush()
        fcntl.flock(other_run, fcntl.LOCK_EX | fcntl.LOCK_NB)
        config = tiny_config(tiny_models["llama"], out)
        with pytest.raises(UserInputError, match=r"is in use by another hf-softmax-rnn run \(pid 4242 on elsewhere\)"):
            check_output_dir(config)
        with pytest.raises(UserInputError, match=r"is in use by another hf-softmax-rnn run"):
            claim_output_dir(config, MAIN_PROCESS)
    claim = claim_output_dir(config, MAIN_PROCESS)
    assert read_marker(out) == {"created_by": "hf_softmax_rnn", "version": "0.1.0", "finished": False}
    claim.finish()
    with (out / LOCK_FILE).open() as handle:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released
    assert read_marker(out)["finished"] is True


def test_cli_refuses_a_foreign_folder_before_writing(tiny_models, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".env").write_text("HF_TOKEN=secret")
    assert main(["finetune", "--output-dir", str(out), "--model", tiny_models["llama"], "--no-progress"]) == 2
    assert re.search(
        r"error: --output-dir '.*out' holds files that are not from a hf-softmax-rnn run \(\.env\)",
        capsys.readouterr().err,
    )
    assert sorted(p.name for p in out.iterdir()) == [".env"]


def _files(folder) -> dict[str, str]:
    """Every file under `folder` (relative path: content)."""
    return {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}


def _folder_of_another_tool(out):
    """What a Lightning-style project folder looks like: a checkpoints/ folder beside the user's notes."""
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "epoch=3.ckpt").write_text("lightning")
    (out / "README.md").write_text("# my notes")
    (out / "results.json").write_text('{"mine": true}')


def test_an_unmarked_folder_with_a_checkpoints_folder_is_not_taken_for_a_run(tiny_models, tmp_path, capsys):
    out = tmp_path / "project"
    _folder_of_another_tool(out)
    before = _files(out)
    argv = ["finetune", "--output-dir", str(out), "--model", tiny_models["llama"], "--no-progress"]
    for extra in ([], ["--resume"]):
        assert main([*argv, *extra]) == 2
        error = capsys.readouterr().err
        assert re.search(
            r"error: --output-dir '.*project' holds files that are not from a hf-softmax-rnn run "
            r"\(README\.md, checkpoints, results\.json\); .* pass --overwrite",
            error,
        ), error
        assert _files(out) == before


def test_overwrite_of_an_unmarked_folder_deletes_none_of_its_files(tiny_models, tmp_path):
    out = tmp_path / "project"
    _folder_of_another_tool(out)
    finetune(tiny_config(tiny_models["llama"], out, overwrite=True, **SHORT))
    assert (out / "checkpoints" / "epoch=3.ckpt").read_text() == "lightning"
    assert (out / "model.safetensors").is_file() and checkpoint_dirs(out)
    assert read_marker(out)["finished"] is True


def test_a_marked_run_folder_resumes_and_is_replaced_by_overwrite(tiny_models, tmp_path):
    out = tmp_path / "out"
    finetune(tiny_config(tiny_models["llama"], out, **SHORT))
    check_output_dir(tiny_config(tiny_models["llama"], out, resume=True, **SHORT))
    (out / "checkpoints" / "stale").write_text("from the first run")
    finetune(tiny_config(tiny_models["llama"], out, overwrite=True, **SHORT))
    assert not (out / "checkpoints" / "stale").exists()


#: Paths of the kind a run does not write where it writes one: (name, is a folder, the flags that get past the
#: other checks of the output folder).
WRONG_KINDS = {
    "checkpoints-file-in-a-run-folder": ("checkpoints", False, dict(resume=True)),
    "checkpoints-file-in-another-folder": ("checkpoints", False, dict(overwrite=True)),
    "metrics-folder-in-a-run-folder": ("metrics.jsonl", True, dict(resume=True)),
    "model-weights-folder-in-another-folder": ("model.safetensors", True, dict(overwrite=True)),
}


@pytest.mark.parametrize("name,is_folder,flags", WRONG_KINDS.values(), ids=WRONG_KINDS.keys())
def test_a_path_of_the_wrong_kind_where_the_run_writes_stops_it_before_training(
    tiny_models, tmp_path, name, is_folder, flags
):
    """A file named `checkpoints` (or a folder where the run writes a file) would stop the run at its first
    checkpoint or at the end, after training: it is refused before anything is written."""
    out = tmp_path / "out"
    out.mkdir()
    if flags.get("resume"):
        (out / ".hf_softmax_rnn_run.json").write_text('{"created_by": "hf_softmax_rnn", "finished": false}\n')
    (out / name).mkdir() if is_folder else (out / name).write_text("not the run's")
    before = sorted(p.name for p in out.iterdir())
    kind = "a folder" if is_folder else "a file"
    with pytest.raises(UserInputError, match=rf"holds {kind} '{re.escape(name)}' where the run writes "):
        Finetuner(tiny_config(tiny_models["llama"], out, **SHORT, **flags))
    assert sorted(p.name for p in out.iterdir()) == before


def test_overwrite_of_a_run_folder_removes_a_previous_runs_checkpoints_file(tiny_models, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".hf_softmax_rnn_run.json").write_text('{"created_by": "hf_softmax_rnn", "finished": false}\n')
    (out / "checkpoints").write_text("not a folder")
    finetune(tiny_config(tiny_models["llama"], out, overwrite=True, **SHORT))
    assert checkpoint_dirs(out)
