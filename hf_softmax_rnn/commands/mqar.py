"""`hf-softmax-rnn mqar`: train small models on multi-query associative recall (docs/design.md, MQAR).

For every (d_model, K, attention spec) a 2-layer Llama is trained from scratch on MQAR with K key-value
pairs and scored on a held-out set (`hf_softmax_rnn.analysis.mqar_train`). Writes `results.csv`,
`results.md`, `accuracy_vs_kv_pairs.png` and `accuracy_vs_state_size.png` under `--output-dir`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from hf_softmax_rnn.analysis.mqar_train import DEFAULT_SPECS, MQARRun, plot_results, train_mqar, write_csv, write_table
from hf_softmax_rnn.analysis.small_models import check_width
from hf_softmax_rnn.attention_spec import AttentionSpec
from hf_softmax_rnn.data.mqar import MQARConfig, check_examples_fit
from hf_softmax_rnn.errors import user_input_checks
from hf_softmax_rnn.flags import add_dataclass_arguments, option
from hf_softmax_rnn.utils import DEVICE_HELP, THREADS_HELP, check_distinct, resolve_device, set_threads


@dataclass(frozen=True)
class MQARSweep:
    """What `mqar` compares and where it runs (each field is the flag of the same name)."""

    attention: list[str] = option(list(DEFAULT_SPECS), "attention presets to compare")
    d_model: list[int] = option([64], "model widths (state size grows with it)")
    num_kv_pairs: list[int] = option([4, 8, 16], "K values, one model per K")
    seq_len: int = option(64, "tokens per sequence (>= 4 K)")
    vocab_size: int = option(256, "Zoology uses 8192; a small vocab trains faster on CPU")
    power_a: float = option(0.01, "a > 0: query slot i has weight (i+1)^(a-1); small a favours short gaps")
    device: str = option("auto", DEVICE_HELP)
    threads: int | None = option(None, THREADS_HELP)
    output_dir: Path = option(Path("runs/mqar"), "folder for the results and plots")
    no_progress: bool = option(False, "no progress bars")


def add_arguments(parser) -> None:
    """The flags of `MQARSweep` and `MQARRun`."""
    add_dataclass_arguments(parser, MQARSweep)
    add_dataclass_arguments(parser, MQARRun)


def _tasks(args) -> list[MQARConfig]:
    """One task per K, every model width and attention checked first (before anything runs); a value named
    twice in a list would train and report the same run twice."""
    for flag, values in (
        ("--attention", args.attention),
        ("--d-model", args.d_model),
        ("--num-kv-pairs", args.num_kv_pairs),
    ):
        check_distinct(flag, values, "its runs would be trained and reported again")
    for d_model in args.d_model:
        check_width(d_model, args.num_heads)
    with user_input_checks(ValueError, TypeError):
        for name in args.attention:
            AttentionSpec.coerce(name)
        tasks = [
            MQARConfig(vocab_size=args.vocab_size, seq_len=args.seq_len, num_kv_pairs=k, power_a=args.power_a)
            for k in args.num_kv_pairs
        ]
        for flag in ("--num-train", "--num-test"):
            check_examples_fit(getattr(args, flag[2:].replace("-", "_")), tasks[0], flag)
        return tasks


def run(args) -> str:
    set_threads(args.threads)
    budget = MQARRun(**{field.name: getattr(args, field.name) for field in fields(MQARRun)})
    tasks = _tasks(args)
    device = resolve_device(args.device)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for d_model in args.d_model:
        for task in tasks:
            for attention in args.attention:
                results.append(
                    train_mqar(attention, task, d_model, budget, device=device, progress=not args.no_progress)
                )
                write_csv(results, args.output_dir / "results.csv")
    write_table(results, args.output_dir / "results.md")
    plots = plot_results(results, args.output_dir)
    written = (args.output_dir / "results.md", args.output_dir / "results.csv", *plots)
    return (args.output_dir / "results.md").read_text() + "\nWrote " + " ".join(map(str, written))
