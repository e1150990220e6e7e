"""Cost of the ONNX cross-check: trace, export and compare, on a ResNet-50-sized CNN and a transformer encoder.

    python benchmarks/onnx_check.py [--repeats 3] [--exporter dynamo --exporter torchscript]

Prints one row per (model, exporter) with the median of each step over the repeats, and
the cost of the comparison relative to the export it checks; the comparison must stay
under 10% of the export. Exits 1 if it does not. Writes nothing. Beside ``export_onnx``, the
same export through ``torch.onnx.export`` itself (the peer, in the same run): fwdtrace builds
the dynamo exporter's ATen -> ONNX table once per process, which torch rebuilds at every export.
"""

from __future__ import annotations

import argparse
import io
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from bench_models import ResNet50, TransformerEncoder
from torch import nn

import fwdtrace

BUDGET = 0.10  # compare / export


MODELS: dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]] = {
    "resnet50 1x3x224x224": lambda: (ResNet50().eval(), torch.randn(1, 3, 224, 224)),
    "encoder 6x512 1x128": lambda: (TransformerEncoder(d=512, layers=6, heads=8).eval(), torch.randn(1, 128, 512)),
}


def median_seconds(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def torch_export(model: nn.Module, x: torch.Tensor, exporter: str) -> Any:
    """The same export with torch alone, into memory."""
    if exporter == "dynamo":
        return torch.onnx.export(model, (x,), dynamo=True, verbose=False)
    torch.onnx.export(model, (x,), io.BytesIO(), dynamo=False)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--exporter", action="append", choices=("dynamo", "torchscript"))
    args = parser.parse_args(argv)
    exporters = args.exporter or ["dynamo", "torchscript"]
    warnings.filterwarnings("ignore")
    # torch's own exporter logs a line per torchvision op when torchvision is absent (export_onnx keeps it quiet)
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    torch.manual_seed(0)

    header = (f"{'model':26s} {'exporter':12s} {'trace ms':>9s} {'export ms':>10s} {'torch ms':>9s} {'compare ms':>11s} "
              f"{'compare/export':>15s}")
    print(header)
    print("-" * len(header))
    within = True
    for name, factory in MODELS.items():
        model, x = factory()
        # No torch.no_grad() here: under it nn.MultiheadAttention takes a fused fast path
        # that the TorchScript exporter cannot export.
        model(x)  # warm-up: the first forward pays for kernel selection
        t_trace, graph = median_seconds(lambda m=model, x=x: fwdtrace.trace(m, x), args.repeats)
        for exporter in exporters:
            fwdtrace.export_onnx(model, x, exporter=exporter)  # warm-up: the first export pays imports
            t_export, proto = median_seconds(
                lambda m=model, x=x, e=exporter: fwdtrace.export_onnx(m, x, exporter=e), args.repeats
            )
            t_torch, _ = median_seconds(lambda m=model, x=x, e=exporter: torch_export(m, x, e), args.repeats)
            t_compare, report = median_seconds(lambda g=graph, p=proto: fwdtrace.compare_onnx(g, p), args.repeats)
            ratio = t_compare / t_export
            within &= ratio < BUDGET and report.ok
            flag = "" if report.ok else "  (report not ok!)"
            print(f"{name:26s} {exporter:12s} {1e3 * t_trace:9.1f} {1e3 * t_export:10.1f} {1e3 * t_torch:9.1f} "
                  f"{1e3 * t_compare:11.1f} {100 * ratio:14.1f}%{flag}")
    print(f"compare under {100 * BUDGET:.0f}% of export everywhere: {'yes' if within else 'NO'}")
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
