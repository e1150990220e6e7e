"""What the live history on disk costs: time per appended sample (in the summariser thread), bytes per row, reads.

Appends ``--samples`` samples of one layer (an input and an output tensor, ``--bins`` bins:
two rows each) through :meth:`History.append_sample`, as the sampler's sink does, with a
retention of ``--retention`` rows per series; then reads the newest 64 samples before the
middle of what is kept. Reported: median and p99 time per append (each ends with a flush), the file's
bytes per row kept, and the read's time.
Run: ``.venv/bin/python benchmarks/live_history_cost.py [--samples 5000] [--retention 2000] [--bins 60]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from fwdtrace.instrument.bins import DEFAULT_BINS
from fwdtrace.instrument.stats import RunningStats
from fwdtrace.live.history import History


def sample(step: int, bins: int) -> dict:
    tensors = []
    for role in ("input", "output"):
        x = torch.randn(64, 128) * (1 + step / 1000)
        stats = RunningStats(bins, (-4.0, 4.0))
        stats.update(x)
        d = stats.to_dict()
        tensors.append({"role": role, "index": 0, "numeric": True, "numel": x.numel(), **d})
    return {"step": step, "call": step, "time": time.time(), "tensors": tensors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=5000)
    parser.add_argument("--retention", type=int, default=2000)
    parser.add_argument("--bins", type=int, default=DEFAULT_BINS)
    args = parser.parse_args()
    samples = [sample(step, args.bins) for step in range(1, args.samples + 1)]
    with tempfile.TemporaryDirectory() as folder, History(folder, retention=args.retention) as history:
        times = []
        for s in samples:
            t0 = time.perf_counter()
            history.append_sample("body.Linear", "forward", s)
            times.append(time.perf_counter() - t0)
        rows = sum(r["rows"] for r in history.series())
        size = history.path.stat().st_size
        t0 = time.perf_counter()
        middle = args.samples - args.retention // 2
        read = history.samples("body.Linear", "forward", before=middle, limit=64)
        read_ms = (time.perf_counter() - t0) * 1e3
    times.sort()
    print(f"{args.samples} samples (2 rows each, {args.bins} bins), retention {args.retention} rows per series")
    print(f"append: median {statistics.median(times) * 1e3:.2f} ms, p99 {times[int(0.99 * len(times))] * 1e3:.2f} ms")
    print(f"file: {size / 2**20:.2f} MiB for {rows} rows kept, {size / rows:.0f} bytes per row")
    print(f"read of {len(read)} samples before step {middle}: {read_ms:.1f} ms")


if __name__ == "__main__":
    main()
