"""Every command checks its output folder (`--output`, `--output-dir`) before any work: a place where no
folder can be created is refused in one line naming the path (exit status 2), and the check leaves
nothing behind."""

import argparse
import importlib
import os
import re
from pathlib import Path

import pytest

from hf_softmax_rnn import cli
from hf_softmax_rnn.commands.arguments import check_output_folders
from hf_softmax_rnn.errors import UserInputError

#: (command, its output flag) for every command that writes into a folder.
OUTPUT_FLAGS = {
    "finetune": "--output-dir",
    "evaluate": "--output",
    "taylor-terms": "--output-dir",
    "ablate": "--output-dir",
    "demo": "--output",
    "mqar": "--output-dir",
}
SYS = Path("/sys")


@pytest.fixture
def read_only(tmp_path, monkeypatch) -> Path:
    """A folder in which no folder can be created (as on a read-only mount: root ignores permission bits,
    `os.access` says yes)."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    mkdir = os.mkdir

    def refuse_inside(path, *args, **kwargs):
        if Path(path).parent == folder:
            raise PermissionError(1, "Operation not permitted", str(path))
        return mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", refuse_inside)
    return folder


@pytest.fixture
def no_work(monkeypatch) -> list[str]:
    """The commands' `run` replaced by a recorder: a command that got past the checks is listed."""
    started = []
    for name, (module_name, _) in cli.SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        monkeypatch.setattr(module, "run", lambda args, name=name: started.append(name))
    return started


@pytest.mark.parametrize("where", ["folder", "new-folder", "new-nested-folder"])
def test_a_place_where_no_folder_can_be_created_is_refused(read_only, where):
    path = {"folder": read_only, "new-folder": read_only / "out", "new-nested-folder": read_only / "a" / "b"}[where]
    with pytest.raises(UserInputError, match=rf"--output-dir={re.escape(str(path))} cannot be written: no folder "
                       rf"can be created in {re.escape(str(read_only))} \(Operation not permitted\)"):  # fmt: skip
        check_output_folders(argparse.Namespace(output_dir=str(path)))


@pytest.mark.parametrize("where", ["existing-folder", "new-folder", "new-nested-folder"])
def test_the_check_leaves_nothing_behind(tmp_path, where):
    (tmp_path / "mine.txt").write_text("mine")
    path = {"existing-folder": tmp_path, "new-folder": tmp_path / "out", "new-nested-folder": tmp_path / "a" / "b"}
    check_output_folders(argparse.Namespace(output=str(path[where])))
    assert [p.name for p in tmp_path.iterdir()] == ["mine.txt"]


@pytest.mark.parametrize("command", OUTPUT_FLAGS, ids=OUTPUT_FLAGS)
def test_every_command_refuses_the_place_before_any_work(command, read_only, no_work, capsys):
    path = read_only / "out"
    assert cli.main([command, OUTPUT_FLAGS[command], str(path)]) == 2
    error = capsys.readouterr().err
    assert re.fullmatch(rf"hf-softmax-rnn {command}: error: .*{re.escape(str(path))} cannot be written.*\n", error)
    assert no_work == [] and not path.exists()


@pytest.mark.skipif(not (SYS / "kernel").is_dir(), reason="needs Linux sysfs")
@pytest.mark.parametrize("command", ["finetune", "evaluate", "taylor-terms", "ablate"])
def test_sysfs_is_refused_before_any_work(command, no_work, capsys):
    path = SYS / "hf-softmax-rnn-test" / "out"
    assert cli.main([command, OUTPUT_FLAGS[command], str(path)]) == 2
    error = capsys.readouterr().err
    assert f"{path} cannot be written: no folder can be created in {SYS}" in error, error
    assert no_work == [] and not path.parent.exists()


@pytest.mark.parametrize("command", OUTPUT_FLAGS, ids=OUTPUT_FLAGS)
def test_every_command_refuses_an_output_path_with_a_nul_byte_before_any_work(command, tmp_path, no_work, capsys):
    path = f"{tmp_path}/out\0put"
    assert cli.main([command, OUTPUT_FLAGS[command], path]) == 2
    error = capsys.readouterr().err
    assert re.fullmatch(
        rf"hf-softmax-rnn {command}: error: {OUTPUT_FLAGS[command]}='.*out\\x00put' holds a NUL byte, which no path "
        r"can hold; expected a folder name.*\n",
        error,
    ), error
    assert no_work == [] and list(tmp_path.iterdir()) == []
