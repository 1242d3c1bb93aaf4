"""The distillation loss, sliced (`hf_softmax_rnn.training.distill.distillation_loss`) beside the plain
autograd form (`distillation_loss_reference`): time of forward + backward and memory kept for the backward.

For each number of positions (`--positions`, the B x L of a training step) the two forms run on the
same random logits of `--vocab` entries, warmed up once, then timed in interleaved rounds
(`--rounds`; the time is the median). "Kept for backward" is the bytes of the tensors autograd
saves beyond the two logit tensors (read through `torch.autograd.graph.saved_tensors_hooks`, exact);
on CUDA the allocator's peak during the step, logits included, is reported too.

    python scripts/bench_distill_loss.py                       # 1,024 and 2,048 positions, SmolLM2's vocabulary
    python scripts/bench_distill_loss.py --device cuda --dtype bfloat16 --positions 16384
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from hf_softmax_rnn.analysis.bench_report import device_or_exit
from hf_softmax_rnn.training.distill import distillation_loss, distillation_loss_reference
from hf_softmax_rnn.utils import hardware_name

FORMS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "reference": distillation_loss_reference,
    "sliced": distillation_loss,
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, nargs="+", default=[1024, 2048], help="rows of logits (B x L)")
    parser.add_argument("--vocab", type=int, default=49152, help="vocabulary size (SmolLM2's by default)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="dtype of the logits")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timed rounds")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args(argv)
    for name, values in (("positions", args.positions), ("vocab", [args.vocab]), ("rounds", [args.rounds])):
        if min(values) < 1:
            parser.error(f"--{name}={getattr(args, name)!r} is not allowed; expected integers >= 1")
    args.device = device_or_exit(parser.prog, args.device)
    return args


def kept_bytes(form, student: torch.Tensor, teacher: torch.Tensor) -> int:
    """Bytes autograd saves for the backward of `form`, beyond the two logit tensors."""
    own = {student.data_ptr(), teacher.data_ptr()}
    kept = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.data_ptr() not in own:
            kept.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        form(student, teacher)
    return sum(kept)


def timed_step(form, student: torch.Tensor, teacher: torch.Tensor) -> tuple[float, int | None]:
    """(seconds of forward + backward, CUDA peak bytes or None)."""
    cuda = student.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    form(student, teacher).backward()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    student.grad = None
    return seconds, torch.cuda.max_memory_allocated() if cuda else None


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    print(f"Distillation loss, vocabulary {args.vocab}, {args.dtype} logits, {hardware_name(args.device)}")
    print("\n| positions | form | forward + backward, ms | kept for backward, MiB | CUDA peak, MiB |")
    print("|---|---|---|---|---|")
    rows = []
    for positions in args.positions:
        generator = torch.Generator().manual_seed(positions)
        shape = (positions, args.vocab)
        student = torch.randn(shape, generator=generator).to(args.device, DTYPES[args.dtype]).requires_grad_()
        teacher = torch.randn(shape, generator=generator).to(args.device, DTYPES[args.dtype])
        times = {name: [] for name in FORMS}
        peaks = {}
        for round_index in range(args.rounds + 1):  # round 0 warms up
            for name, form in FORMS.items():
                seconds, peaks[name] = timed_step(form, student, teacher)
                if round_index:
                    times[name].append(seconds)
        for name, form in FORMS.items():
            row = dict(
                positions=positions,
                form=name,
                ms=1000 * statistics.median(times[name]),
                kept_mib=kept_bytes(form, student, teacher) / 2**20,
                cuda_peak_mib=None if peaks[name] is None else peaks[name] / 2**20,
            )
            rows.append(row)
            peak = "-" if row["cuda_peak_mib"] is None else f"{row['cuda_peak_mib']:,.0f}"
            print(f"| {positions:,} | {name} | {row['ms']:,.0f} | {row['kept_mib']:,.0f} | {peak} |")
    return rows


if __name__ == "__main__":
    main()
