"""What one tensor's statistics cost in each tool, against one read of its values.

    python benchmarks/statistics_speed.py [--repeats 60] [--threads 1]

For float32 tensors of 4 K to 1 M values (CPU, 1 torch thread), the median time of: the engine's summary
(``fwdtrace.statistics.summarize``, what a statistics dump stores), a Probe's ``RunningStats.update`` (the
summary merged into running statistics) and a live page series' ``Series.add`` (the summary merged into
steady bins and running moments), each against ``torch.sum`` of the same tensor (the floor: one read).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's fwdtrace
from fwdtrace.instrument.stats import RunningStats  # noqa: E402
from fwdtrace.live.sampler import Series  # noqa: E402
from fwdtrace.statistics import summarize  # noqa: E402


def median_us(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| values | torch.sum | summarize | RunningStats.update | Series.add |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for n in (4096, 65536, 262144, 1 << 20):
        x = torch.randn(n, generator=torch.Generator().manual_seed(0))
        stats, series = RunningStats(16), Series(60)
        floor = median_us(lambda x=x: x.sum(), args.repeats)
        cells = [median_us(f, args.repeats) for f in (lambda x=x: summarize(x), lambda x=x, s=stats: s.update(x),
                                                        lambda x=x, s=series: s.add(x))]
        print(f"| {n:,} | {floor:.0f} us | " + " | ".join(f"{c:.0f} us ({c / floor:.0f}x)" for c in cells) + " |")


if __name__ == "__main__":
    main()
