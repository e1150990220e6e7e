"""What tracing costs against a plain forward: time (medians) and peak memory.

    python benchmarks/trace_overhead.py [--repeats 10] [--device cpu|cuda]

For a ResNet-50-sized CNN and a small transformer encoder (both defined here), it times a
plain ``torch.no_grad()`` forward, ``fwdtrace.trace(pin=False)`` and ``trace(pin=True)``
(all under no_grad, interleaved, medians over repeats) and reports the ratios. Peak memory
is what a variant adds over the built model: on CPU the peak of live tensor storage
(counted by a dispatch mode) plus the peak of the Python heap (tracemalloc), on CUDA
``torch.cuda.max_memory_allocated``. Targets: ``pin=False`` at most 2.0x a plain
forward in time and at most 1.1x in peak memory.
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc
from collections.abc import Callable

import torch
from bench_models import ResNet50, TransformerEncoder
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fwdtrace
from fwdtrace.memory import StorageTracker

MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "resnet50": (ResNet50, lambda: torch.randn(1, 3, 224, 224)),
    "transformer": (lambda: TransformerEncoder(d=256, layers=4, heads=8), lambda: torch.randn(8, 128, 256)),
}
VARIANTS: dict[str, Callable[[nn.Module, torch.Tensor], object]] = {
    "plain": lambda m, x: m(x),
    "trace(pin=False)": lambda m, x: fwdtrace.trace(m, x, pin=False),
    "trace(pin=True)": lambda m, x: fwdtrace.trace(m, x, pin=True),
}


def build(name: str, device: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    make_model, make_input = MODELS[name]
    return make_model().eval().to(device), make_input().to(device)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_variants(name: str, device: str, repeats: int) -> dict[str, float]:
    """Median seconds per call of each variant, interleaved so drift hits all alike."""
    model, x = build(name, device)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with torch.no_grad():
        for fn in VARIANTS.values():  # warm-up
            fn(model, x)
        for _ in range(repeats):
            for variant, fn in VARIANTS.items():
                sync(device)
                start = time.perf_counter()
                fn(model, x)
                sync(device)
                times[variant].append(time.perf_counter() - start)
    return {v: statistics.median(t) for v, t in times.items()}


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of tensor storage created while active (a CPU stand-in for CUDA's peak stats).

    Every op's outputs go to fwdtrace's own :class:`~fwdtrace.memory.StorageTracker` (the one
    ``analyze`` uses); storages that existed before (weights, inputs) are not counted.
    """

    def __init__(self, existing: list[torch.Tensor]) -> None:
        super().__init__()
        self.tracker = StorageTracker(existing)
        self.base = self.tracker.live_bytes

    @property
    def peak(self) -> int:
        return self.tracker.peak_bytes - self.base

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self.tracker.add(out)
        return out


def peak_memory(name: str, variant: str, device: str) -> tuple[int, int]:
    """Peak bytes a variant adds over the built model: (tensor storage, Python objects).

    CUDA: ``max_memory_allocated``. CPU: tensor storage counted by :class:`LiveTensorBytes`
    plus the Python heap's peak from ``tracemalloc`` (the graph's own objects), an upper bound.
    """
    model, x = build(name, device)
    with torch.no_grad():
        VARIANTS[variant](model, x)  # first-call work (lazy imports, kernel caches) is not the variant's
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            VARIANTS[variant](model, x)
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - base, 0
        existing = [x, *model.parameters(), *model.buffers()]
        for _ in range(2):  # the first round under the mode and tracemalloc pays their own set-up
            tracemalloc.start()
            with LiveTensorBytes(existing) as tensors:
                VARIANTS[variant](model, x)
            python_peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        return tensors.peak, python_peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    args = parser.parse_args()

    print(f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}, "
          f"median of {args.repeats} repeats")
    print(f"{'model':<12} {'variant':<17} {'median ms':>10} {'x plain':>8} "
          f"{'tensors MiB':>12} {'python MiB':>11} {'peak x plain':>13}")
    for name in args.models:
        medians = time_variants(name, args.device, args.repeats)
        peaks = {v: peak_memory(name, v, args.device) for v in VARIANTS}
        for v in VARIANTS:
            total, plain_total = sum(peaks[v]), sum(peaks["plain"])
            print(f"{name:<12} {v:<17} {medians[v] * 1e3:>10.1f} {medians[v] / medians['plain']:>8.2f} "
                  f"{peaks[v][0] / 2**20:>12.1f} {peaks[v][1] / 2**20:>11.2f} {total / plain_total:>13.2f}")


if __name__ == "__main__":
    main()
