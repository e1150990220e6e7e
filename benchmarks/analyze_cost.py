"""What fwdtrace.analyze() costs beyond the forward passes it runs.

``analyze(model, x, warmup=W, repeats=R)`` runs the model W + 2R times (the first warmup run
counts FLOPs and memory, the others are plain, each repeat is a plain run and a module-timed
one). This script times the whole call against W + 2R plain forward passes under ``torch.no_grad()``,
in alternating rounds, and reports medians; the overhead is the analysis time over the
plain time, minus one. Wall time is what a user waits; the process's CPU time is shown too,
as it moves less when other programs share the cores.
Run: ``.venv/bin/python benchmarks/analyze_cost.py [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

# The models every benchmark shares (this script runs from benchmarks/, which Python puts on sys.path).
from bench_models import ResNet50, TransformerEncoder
from torch import nn

import fwdtrace


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def plain(model: nn.Module, x: torch.Tensor, runs: int) -> None:
    with torch.no_grad():
        for _ in range(runs):
            model(x)


def runs_of(warmup: int, repeats: int) -> int:
    """The forward passes analyze(warmup=..., repeats=...) runs."""
    return max(warmup, 1) + 2 * repeats


def measure(name: str, make: Callable[[], tuple[nn.Module, torch.Tensor]], rounds: int, warmup: int, repeats: int) -> dict:
    torch.manual_seed(0)
    model, x = make()
    plain(model, x, 2)  # first-call costs (allocator, oneDNN primitives) go to neither side
    plain_runs, analysis_runs = [], []
    for _ in range(rounds):  # alternate, so slow phases of a busy machine hit both sides
        plain_runs.append(timed(lambda: plain(model, x, runs_of(warmup, repeats))))
        analysis_runs.append(timed(lambda: fwdtrace.analyze(model, x, warmup=warmup, repeats=repeats)))
    result = fwdtrace.analyze(model, x, warmup=1, repeats=1)
    p, a = (statistics.median(w for w, _ in plain_runs), statistics.median(w for w, _ in analysis_runs))
    p_cpu, a_cpu = (statistics.median(c for _, c in plain_runs), statistics.median(c for _, c in analysis_runs))
    return {
        "model": name,
        "params": result.params,
        "gflops": result.flops / 1e9,
        "forward_ms": 1000 * p / runs_of(warmup, repeats),
        "plain_s": p,
        "analysis_s": a,
        "overhead": a / p - 1,
        "cpu_overhead": a_cpu / p_cpu - 1,
    }


MODELS: dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]] = {
    "ResNet-50, 1x3x224x224": lambda: (ResNet50().eval(), torch.randn(1, 3, 224, 224)),
    "Encoder 12x768, 1x128 tokens": lambda: (TransformerEncoder(d=768, layers=12).eval(), torch.randn(1, 128, 768)),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, warmup={args.warmup}, "
          f"repeats={args.repeats}, medians of {args.rounds} rounds")
    runs = f"plain x{runs_of(args.warmup, args.repeats)}"
    print(f"{'model':<30} {'params':>8} {'GFLOPs':>7} {'forward':>9} {runs:>10} {'analyze':>9} {'overhead':>9} {'(CPU time)':>10}")
    for name, make in MODELS.items():
        r = measure(name, make, args.rounds, args.warmup, args.repeats)
        print(f"{r['model']:<30} {r['params'] / 1e6:>7.1f}M {r['gflops']:>7.2f} {r['forward_ms']:>7.1f}ms "
              f"{r['plain_s']:>9.2f}s {r['analysis_s']:>8.2f}s {100 * r['overhead']:>8.1f}% {100 * r['cpu_overhead']:>9.1f}%")


if __name__ == "__main__":
    main()
