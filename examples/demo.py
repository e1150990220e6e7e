"""`make demo`: trace a small CNN with a residual block and write graph.png and graph.svg.

Run it as ``python examples/demo.py [output-folder]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

import fwdtrace


class Residual(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(y)))


class SmallResNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.block = Residual(16)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(self.block(self.stem(x))).flatten(1))


def main(out_dir: str = ".") -> None:
    torch.manual_seed(0)
    model = SmallResNet().eval()
    graph = fwdtrace.trace(model, torch.randn(1, 3, 32, 32))
    print(graph)
    print()
    out = Path(out_dir)
    for name in ("graph.png", "graph.svg"):
        print("wrote", graph.render(out / name))


if __name__ == "__main__":
    main(*sys.argv[1:])
