"""The console script: bad input is one line and exit status 2, bugs keep their traceback."""

import argparse
import ast
import dataclasses
import logging
import sys
import types
from pathlib import Path

import pytest

import hf_softmax_rnn
from hf_softmax_rnn import cli
from hf_softmax_rnn.errors import CommandError, UserInputError
from hf_softmax_rnn.flags import add_dataclass_arguments, flag_group, option, option_fields

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


def option_classes() -> dict[str, tuple[type, ...]]:
    """The dataclasses whose fields are the flags of each subcommand."""
    from hf_softmax_rnn.analysis.ablate import AblationBudget
    from hf_softmax_rnn.analysis.mqar_train import MQARRun
    from hf_softmax_rnn.commands import ablate, demo, evaluate, mqar, needles, taylor_terms
    from hf_softmax_rnn.training.config import FinetuneConfig

    return {
        "demo": (demo.DemoOptions,),
        "evaluate": (evaluate.EvaluateOptions,),
        "needles": (needles.NeedlesOptions,),
        "finetune": (FinetuneConfig,),
        "mqar": (mqar.MQARSweep, MQARRun),
        "taylor-terms": (taylor_terms.TaylorTermsOptions,),
        "ablate": (ablate.AblateOptions, AblationBudget),
    }


def test_every_flag_has_the_help_of_its_dataclass_field():
    from hf_softmax_rnn.training.config import GROUPS

    # besides its flags: the groups that hold the others, and what the config chose
    not_flags = {"finetune": {*GROUPS, "chosen", "state_left_out"}}
    classes = option_classes()
    assert set(classes) == set(cli.SUBCOMMANDS)
    for name, owners in classes.items():
        parser, _ = cli.subcommand_parser(name)
        fields = {field.name: field for owner in owners for field in option_fields(owner)}
        others = {field.name for owner in owners for field in dataclasses.fields(owner) if "help" not in field.metadata}
        assert others == not_flags.get(name, set()), name
        actions = [action for action in parser._actions if not isinstance(action, argparse._HelpAction)]
        assert sorted(action.dest for action in actions) == sorted(fields), name
        for action in actions:
            assert action.help and action.help.strip(), f"{name} {action.option_strings}: no help"
            assert action.help == fields[action.dest].metadata["help"], f"{name} {action.option_strings}"
        text = parser.format_help()
        assert all(" ".join(action.help.split()[:3]) in " ".join(text.split()) for action in actions), name


@dataclasses.dataclass(frozen=True)
class _Inner:
    rate: float = option(0.5, "a rate", group="inner")
    steps: int | None = option(None, "steps")


@dataclasses.dataclass(frozen=True)
class _Outer:
    name: str = option("x", "a name")
    inner: _Inner = flag_group(_Inner)


def test_the_fields_of_a_flag_group_are_flat_flags_of_the_dataclass_holding_it():
    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, _Outer)
    args = parser.parse_args(["--rate", "0.25", "--steps", "3"])
    assert vars(args) == {"name": "x", "rate": 0.25, "steps": 3}
    assert [field.name for field in option_fields(_Outer)] == ["name", "rate", "steps"]
    assert [group.title for group in parser._action_groups][-1] == "inner"
    assert _Outer().inner == _Inner()


def test_flags_keep_their_names_and_defaults():
    parser, _ = cli.subcommand_parser("finetune")
    args = parser.parse_args(["--output-dir", "out", "--no-transfer-teacher-forcing", "--no-progress"])
    assert (args.transfer_teacher_forcing, args.progress, args.lr, args.block_size) == (False, False, None, None)
    assert parser.parse_args(["--output-dir", "o", "--layers", "0", "2"]).layers == [0, 2]
    parser, _ = cli.subcommand_parser("mqar")
    args = parser.parse_args([])
    assert (args.num_kv_pairs, args.steps, args.weight_decay, args.no_progress) == ([4, 8, 16], 3000, 0.1, False)
    assert args.output_dir == Path("runs/mqar")
    parser, _ = cli.subcommand_parser("ablate")
    args = parser.parse_args(["--seeds", "3", "4"])
    assert (args.seeds, args.steps, args.quick) == ([3, 4], None, False)  # None: the (quick) budget's value
    parser, _ = cli.subcommand_parser("taylor-terms")
    args = parser.parse_args(["my_model", "--truncation-orders"])
    assert (args.model, args.truncation_orders, args.dtype) == ("my_model", [], "float32")


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["finetune", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "teach the state long range) (default: the attention's recipe)" in text
    assert "optimizer steps (0 skips the stage) (default: the attention's recipe)" in text
    parser, _ = cli.subcommand_parser("ablate")
    assert "model width (default: 64; --quick: 32)" in " ".join(parser.format_help().split())


@pytest.mark.parametrize(
    "argv, message",
    [
        (["mqar", "--steps", "x"], "argument --steps: invalid int value: 'x'"),
        (["taylor-terms", "--dtype", "float16"], "argument --dtype: invalid choice: 'float16'"),
        (["finetune", "--attention-mode", "serial"], "argument --attention-mode: invalid choice: 'serial'"),
    ],
)
def test_bad_flag_values_are_one_line_with_status_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]


OUTPUT_FLAGS = {
    "ablate": "--output-dir",
    "demo": "--output",
    "finetune": "--output-dir",
    "mqar": "--output-dir",
    "taylor-terms": "--output-dir",
}


@pytest.mark.parametrize("place", ["existing_file", "under_a_file"])
@pytest.mark.parametrize("command", sorted(OUTPUT_FLAGS))
def test_an_output_folder_that_cannot_be_written_is_refused_before_any_work(
    monkeypatch, tmp_path, capsys, command, place
):
    """A command must not run for minutes on a model and only then fail on its output path."""
    _, module = cli.subcommand_parser(command)
    monkeypatch.setattr(module, "run", lambda args: pytest.fail("the command started before its output was checked"))
    blocker = tmp_path / "taken"
    blocker.write_text("not a folder")
    target = blocker if place == "existing_file" else blocker / "out"
    assert cli.main([command, OUTPUT_FLAGS[command], str(target)]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"hf-softmax-rnn {command}: error: {OUTPUT_FLAGS[command]}={target}" in error
    assert blocker.read_text() == "not a folder"


@pytest.mark.parametrize("command", sorted(OUTPUT_FLAGS))
def test_a_bad_environment_setting_is_refused_before_any_work(monkeypatch, tmp_path, capsys, command):
    _, module = cli.subcommand_parser(command)
    monkeypatch.setattr(module, "run", lambda args: pytest.fail("the command started with a bad setting"))
    monkeypatch.setenv("HF_SOFTMAX_RNN_STATE_SEGMENT", "2k")
    assert cli.main([command, OUTPUT_FLAGS[command], str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert f"hf-softmax-rnn {command}: error: HF_SOFTMAX_RNN_STATE_SEGMENT='2k' is not allowed; expected 0" in error
    assert not (tmp_path / "out").exists()


@dataclasses.dataclass(frozen=True)
class _Flags:
    steps: int = option(1, "steps")
    lengths: list[int] = option((8,), "lengths", nargs="+")
    progress: bool = option(True, "show progress", flag="--no-progress")


@pytest.fixture
def flagged_command(fake_command):
    """`fake` with the flags of `_Flags`; its run records the arguments it was given."""
    fake_command.add_arguments = lambda parser: add_dataclass_arguments(parser, _Flags)
    fake_command.seen = []
    fake_command.run = lambda args: fake_command.seen.append(args) or "report"
    return fake_command


@pytest.mark.parametrize(
    "argv, flag, steps",
    [
        (["--steps", "2", "--steps", "3"], "--steps", 3),
        (["--steps=2", "--steps", "3"], "--steps", 3),
        (["--steps", "2", "--ste", "3"], "--steps", 3),
        (["--lengths", "8", "16", "--lengths", "32"], "--lengths", 1),
        (["--no-progress", "--no-progress"], "--no-progress", 1),
    ],
    ids=["twice", "with-equals", "abbreviated", "list", "switch"],
)
def test_a_flag_given_twice_is_named_in_a_warning_and_the_last_is_used(flagged_command, caplog, argv, flag, steps):
    with caplog.at_level(logging.WARNING, logger="hf_softmax_rnn.cli"):
        assert cli.main(["fake", *argv]) == 0
    (args,) = flagged_command.seen
    assert args.steps == steps
    assert list(args.lengths) == ([32] if flag == "--lengths" else [8])
    (record,) = caplog.records
    assert record.levelname == "WARNING" and record.getMessage().startswith(f"{flag} is given 2 times (")
    assert all(token.split("=")[0] in record.getMessage() for token in argv if token.startswith("-"))


def test_flags_given_once_run_with_their_values_and_no_warning(flagged_command, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_softmax_rnn.cli"):
        assert cli.main(["fake", "--steps", "-2", "--lengths", "8", "16", "--no-progress"]) == 0
    (args,) = flagged_command.seen
    assert (args.steps, args.lengths, args.progress) == (-2, [8, 16], False)
    assert not caplog.records
