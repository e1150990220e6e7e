"""Cost of the ONNX cross-check: trace, export and compare, on a ResNet-50-sized CNN and a transformer encoder.

    python benchmarks/onnx_check.py [--repeats 3] [--exporter dynamo --exporter torchscript]

Prints one row per (model, exporter) with the median of each step over the repeats, and
the cost of the comparison relative to the export it checks; the comparison must stay
under 10% of the export. Exits 1 if it does not. Writes nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import fwdtrace

BUDGET = 0.10  # compare / export


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.down is None else self.down(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        return self.relu(self.bn3(self.conv3(y)) + identity)


class ResNet50ish(nn.Module):
    """ResNet-50's layout: 7x7 stem, bottleneck stages of 3, 4, 6, 3 blocks, 25.6 M parameters."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        layers: list[nn.Module] = []
        cin = 64
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(blocks):
                layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
                cin = 4 * width
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(x))), 1))


class EncoderLayer(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ff(self.norm2(x))


class Encoder(nn.Module):
    """Six pre-norm layers, d=512, 8 heads: a BERT-small-sized encoder without embeddings."""

    def __init__(self, d: int = 512, heads: int = 8, layers: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


MODELS: dict[str, Callable[[], tuple[nn.Module, torch.Tensor]]] = {
    "resnet50ish 1x3x224x224": lambda: (ResNet50ish().eval(), torch.randn(1, 3, 224, 224)),
    "encoder 6x512 1x128": lambda: (Encoder().eval(), torch.randn(1, 128, 512)),
}


def median_seconds(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--exporter", action="append", choices=("dynamo", "torchscript"))
    args = parser.parse_args(argv)
    exporters = args.exporter or ["dynamo", "torchscript"]
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)

    header = f"{'model':26s} {'exporter':12s} {'trace ms':>9s} {'export ms':>10s} {'compare ms':>11s} {'compare/export':>15s}"
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
            t_compare, report = median_seconds(lambda g=graph, p=proto: fwdtrace.compare_onnx(g, p), args.repeats)
            ratio = t_compare / t_export
            within &= ratio < BUDGET and report.ok
            flag = "" if report.ok else "  (report not ok!)"
            print(f"{name:26s} {exporter:12s} {1e3 * t_trace:9.1f} {1e3 * t_export:10.1f} "
                  f"{1e3 * t_compare:11.1f} {100 * ratio:14.1f}%{flag}")
    print(f"compare under {100 * BUDGET:.0f}% of export everywhere: {'yes' if within else 'NO'}")
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
