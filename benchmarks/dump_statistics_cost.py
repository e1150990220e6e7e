"""What a statistics dump of every call, every step, costs a training step, and how much file it writes.

    python benchmarks/dump_statistics_cost.py [--pairs 12] [--steps 5] [--threads 1] [--width 128] [--dir DIR]

The live-cost model (``live_cost.py``'s encoder: d=128, 4 layers, batch 8 x 64 tokens, 1 torch
thread): training steps (forward, backward, SGD). Each row registers a ``Dumper`` on every step
(``dumper.register(model, step=i)``) and closes its files at the end of each segment, so the
files' writing and closing are inside the segment's clock. Rows: ``values="statistics"``,
``background=True`` with ``calls="all"`` (every module and torch function call: the step's forward
runs inside a trace), then ``calls="modules"``. The rows are timed in ``--pairs`` pairs of
``--steps``-step segments, the plain model then the dumped one or the reverse, so each pair's ratio
sees the same machine load on both sides; reported are the median ratios (wall time, and CPU
time of the whole process: the training thread and the writer threads). "reductions" is the
training thread's CPU inside the statistics' reductions (``fwdtrace.summary.summarize``), per
step, against a plain step's CPU; "per step" is the size of one step's file. ``--width`` changes
the encoder's width (the step's arithmetic grows with its square, the values summarised with it).
``--without-reductions`` stores one small tensor's statistics for every tensor: what the trace, the hooks and
the file cost without the reductions. Target: the ``calls="all"`` row under 5% of a plain step, a few KB per step.

Last, the floor: the tensors one ``calls="all"`` step summarises (copies of them), each read once by
``torch.sum`` in its own dtype, against a plain step (medians of ``--pairs`` alternating repeats): what
any statistics computed from every value cost at the least, by torch's fastest pass on this machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import live_cost
import torch
from bench_models import TransformerEncoder

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's fwdtrace
import fwdtrace  # noqa: E402
import fwdtrace.dump  # noqa: E402


def train(model: torch.nn.Module, x: torch.Tensor, dumper: fwdtrace.Dumper | None, first: int, n: int) -> None:
    """``n`` of live_cost.py's training steps, each dumped by ``dumper`` when given; its files closed after."""
    if dumper is None:
        live_cost.train(model, x, n)
        return

    def next_step(i: int) -> None:
        if i + 1 < n:
            dumper.register(model, step=first + i + 1)

    dumper.register(model, step=first)
    live_cost.train(model, x, n, after=next_step)
    dumper.remove()


class Reductions:
    """The training thread's CPU time inside ``summarize``, wrapped where the dumper calls it; with ``skip``, one
    small tensor's vector for every tensor (what the dump costs besides its reductions)."""

    def __init__(self, skip: bool = False) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.original = fwdtrace.dump.record.summarize
        self.skipped = self.original(torch.arange(8.0)) if skip else None
        fwdtrace.dump.record.summarize = self  # type: ignore[assignment]

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        start = time.thread_time()
        try:
            return self.original(t) if self.skipped is None else self.skipped.clone()
        finally:
            self.seconds += time.thread_time() - start
            self.calls += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--steps", type=int, default=5, help="training steps per segment")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the machine is shared)")
    parser.add_argument("--width", type=int, default=128, help="the encoder's width d (live_cost.py's: 128)")
    parser.add_argument("--dir", default=None, help="where to write the dumps (default: a temporary folder)")
    parser.add_argument("--without-reductions", action="store_true",
                        help="store one small tensor's statistics for every tensor: what the rest of the dump costs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, x = TransformerEncoder(d=args.width, layers=4, heads=8), torch.randn(8, 64, args.width)
    reductions = Reductions(skip=args.without_reductions)
    rows: list[tuple[str, dict[str, Any]]] = [
        ('statistics, calls="all", background=True', {"calls": "all"}),
        ('statistics, calls="modules", background=True', {"calls": "modules"}),
    ]
    print(("WITHOUT the reductions (every tensor stored as one small tensor's statistics); " if args.without_reductions
           else "") + f"encoder d={args.width} x 4 layers, batch 8 x 64, {args.threads} torch thread(s); {args.pairs} pairs of "
          f"{args.steps}-step segments per row; medians of the pair ratios")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        train(model, x, None, 0, 3)  # warm-up
        for label, options in rows:
            dumper = fwdtrace.Dumper(Path(tmp) / options["calls"], values="statistics", background=True,
                                     overwrite=True, **options)
            train(model, x, dumper, 0, 1)  # warm-up: imports, the first file
            wall: list[float] = []
            cpu: list[float] = []
            plain_cpu: list[float] = []
            reduction_seconds = 0.0
            reduction_calls = 0
            for pair in range(args.pairs):
                times = {}
                for dumped in ((False, True) if pair % 2 == 0 else (True, False)):
                    before = reductions.seconds, reductions.calls
                    start_wall, start_cpu = time.perf_counter(), time.process_time()
                    train(model, x, dumper if dumped else None, pair * args.steps, args.steps)
                    times[dumped] = (time.perf_counter() - start_wall, time.process_time() - start_cpu)
                    if dumped:
                        reduction_seconds += reductions.seconds - before[0]
                        reduction_calls += reductions.calls - before[1]
                wall.append(times[True][0] / times[False][0])
                cpu.append(times[True][1] / times[False][1])
                plain_cpu.append(times[False][1] / args.steps)
            sizes = [p.stat().st_size for p in dumper.paths]
            steps = args.pairs * args.steps
            per_step = reduction_seconds / steps
            print(f"  {label}: wall {statistics.median(wall) - 1:+.1%}, CPU {statistics.median(cpu) - 1:+.1%} "
                  f"of a plain step ({statistics.median(plain_cpu) * 1e3:.1f} ms CPU); reductions "
                  f"{per_step * 1e3:.1f} ms ({per_step / statistics.median(plain_cpu):.1%}, "
                  f"{reduction_calls / steps:.0f} tensors summarised per step); "
                  f"{statistics.median(sizes) / 1e3:.0f} KB per step")
        if not args.without_reductions:
            floor(model, x, tmp, args.pairs)


def floor(model: torch.nn.Module, x: torch.Tensor, directory: str, repeats: int) -> None:
    """Print one read pass over a ``calls="all"`` step's summarised tensors against a plain step."""
    taken: list[torch.Tensor] = []
    original = fwdtrace.dump.record.summarize

    def take(t: torch.Tensor) -> torch.Tensor:
        taken.append(t.detach().clone())
        return original(t)

    fwdtrace.dump.record.summarize = take  # type: ignore[assignment]
    try:
        train(model, x, fwdtrace.Dumper(Path(directory) / "floor", values="statistics", calls="all", overwrite=True),
              0, 1)
    finally:
        fwdtrace.dump.record.summarize = original
    flat = [t.reshape(-1) for t in taken]
    step: list[float] = []
    passes: list[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        live_cost.train(model, x, 1)
        step.append(time.perf_counter() - start)
        start = time.perf_counter()
        for t in flat:
            t.sum()
        passes.append(time.perf_counter() - start)
    values = sum(t.numel() for t in flat)
    nbytes = sum(t.numel() * t.element_size() for t in flat)
    print(f"  floor: one torch.sum pass over the {len(flat)} tensors a step summarises ({values / 1e6:.1f} M values, "
          f"{nbytes / 1e6:.0f} MB) takes {statistics.median(passes) * 1e3:.2f} ms, "
          f"{statistics.median(passes) / statistics.median(step):.1%} of a plain step "
          f"({statistics.median(step) * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
