"""Rerun the experiments of docs/reproducing.md and copy their figures to docs/figures/.

    python scripts/reproduce_paper.py                 # taylor-terms, ablate, mqar at the sizes of docs/reproducing.md
    python scripts/reproduce_paper.py --quick         # CI size, to check the pipeline end to end
    python scripts/reproduce_paper.py --only ablate   # one experiment

Each experiment is the `hf-softmax-rnn` subcommand of the same name; pass `--device cuda`
to run them on a GPU.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from hf_softmax_rnn.cli import main as cli

FIGURES = Path(__file__).resolve().parent.parent / "docs" / "figures"

#: experiment -> (full arguments, quick arguments, {produced file: name under docs/figures})
EXPERIMENTS = {
    "taylor-terms": (
        ["taylor-terms", "default"],
        ["taylor-terms", "default", "--num-blocks", "1", "--block-size", "64", "--max-order", "40"],
        {"taylor_terms.png": "taylor_terms_smollm2.png", "taylor_summary.csv": "taylor_summary_smollm2.csv"},
    ),
    "ablate": (
        ["ablate"],
        ["ablate", "--quick"],
        {"loss_curves.png": "ablation_loss_curves.png", "ablation.md": "ablation.md", "ablation.csv": "ablation.csv"},
    ),
    "mqar": (
        [
            "mqar",
            "--attention",
            "softmax",
            "gated_softmax_no_gate_L2norm_nodivS_noclamp",
            "softmax_taylor_2",
            "linear_elu",
            "linear_cosine",
            "--num-kv-pairs",
            "2",
            "4",
            "8",
            "--steps",
            "1000",
        ],
        [
            "mqar",
            "--attention",
            "softmax",
            "linear_elu",
            "--num-kv-pairs",
            "2",
            "--seq-len",
            "16",
            "--vocab-size",
            "32",
            "--d-model",
            "16",
            "--steps",
            "2",
            "--num-train",
            "64",
            "--num-test",
            "16",
            "--batch-size",
            "8",
        ],
        {
            "accuracy_vs_kv_pairs.png": "mqar_accuracy_vs_kv_pairs.png",
            "accuracy_vs_state_size.png": "mqar_accuracy_vs_state_size.png",
            "results.md": "mqar.md",
            "results.csv": "mqar.csv",
        },
    ),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", nargs="+", choices=list(EXPERIMENTS), default=list(EXPERIMENTS), help="experiments to run"
    )
    parser.add_argument("--quick", action="store_true", help="CI size; figures are not copied to docs/figures")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/reproduce"), help="folder of the runs")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    for name in args.only:
        full, quick, figures = EXPERIMENTS[name]
        output = args.output_dir / name
        argv = [*(quick if args.quick else full), "--device", args.device, "--output-dir", str(output)]
        print("hf-softmax-rnn", *argv)
        status = cli(argv)
        if status != 0:
            raise SystemExit(f"hf-softmax-rnn {name} failed with exit status {status}")
        if not args.quick:
            FIGURES.mkdir(parents=True, exist_ok=True)
            for produced, published in figures.items():
                shutil.copyfile(output / produced, FIGURES / published)
                print("Copied", output / produced, "->", FIGURES / published)


if __name__ == "__main__":
    main()
