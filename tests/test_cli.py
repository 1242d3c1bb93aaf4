"""The console script: bad input is one line and exit status 2, bugs keep their traceback."""

import ast
import sys
import types
from pathlib import Path

import pytest

import hf_softmax_rnn
from hf_softmax_rnn import cli
from hf_softmax_rnn.errors import CommandError, UserInputError

FAKE_MODULE = "hf_softmax_rnn_fake_command"


@pytest.fixture
def fake_command(monkeypatch):
    """A subcommand `fake` whose run raises the exception handed to it (None: returns a report)."""
    module = types.ModuleType(FAKE_MODULE)
    module.error = None

    def run(args):
        if module.error is not None:
            raise module.error
        return "report"

    module.add_arguments = lambda parser: None
    module.run = run
    monkeypatch.setitem(sys.modules, FAKE_MODULE, module)
    monkeypatch.setitem(cli.SUBCOMMANDS, "fake", (FAKE_MODULE, "a test command"))
    return module


@pytest.mark.parametrize(
    "error, status",
    [
        (UserInputError("--steps=0 is not allowed;\nexpected an int >= 1"), 2),
        (FileNotFoundError("Dataset file 'x.txt' does not exist"), 2),
        (CommandError("the upload failed"), 1),
    ],
    ids=["user-input", "missing-file", "command-error"],
)
def test_expected_errors_are_one_line(fake_command, capsys, error, status):
    fake_command.error = error
    assert cli.main(["fake"]) == status
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"hf-softmax-rnn fake: error: {' '.join(str(error).split())}")


def test_internal_errors_keep_their_traceback(fake_command):
    fake_command.error = ValueError("a bug inside the library")
    with pytest.raises(ValueError, match="a bug inside the library"):
        cli.main(["fake"])


def test_report_is_printed(fake_command, capsys):
    assert cli.main(["fake"]) == 0
    assert capsys.readouterr().out == "report\n"


def test_library_modules_do_not_import_the_cli():
    package = Path(hf_softmax_rnn.__file__).parent
    importers = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "hf_softmax_rnn.cli":
                importers.append(str(path.relative_to(package)))
    assert importers == []
