"""What adding new series to the live history costs, and what it does to the training thread meanwhile.

A writer thread (as the sampler's summariser) adds ``--series`` new series to a
:class:`~fwdtrace.live.history.History`, one row each: half layer series (``append``, 60 bins),
half scalars (``append_scalars``). Meanwhile the main thread trains a small MLP (forward,
backward, SGD) and records the gap between the ends of consecutive steps. The same loop runs
first without the writer, for the baseline. Reported: the time to add a new series (median of
the first and of the last 10 % of them, the slowest), and the training steps' median and longest
gap without and with the writer: h5py holds the GIL while it works, so what a new series costs
shows up as the training thread's longest gap.
Run: ``.venv/bin/python benchmarks/live_history_series.py [--series 1000]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time

import torch

from fwdtrace.live.history import History

BINS = 60


def train_gaps(model: torch.nn.Module, stop: threading.Event, seconds: float | None) -> list[float]:
    """Train until ``stop`` is set (or for ``seconds``); the gaps between the ends of consecutive steps."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, 256)
    gaps, last = [], time.perf_counter()
    end = None if seconds is None else last + seconds
    while not stop.is_set() and (end is None or last < end):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    return gaps


def add_series(history: History, count: int, costs: list[float], stop: threading.Event) -> None:
    edges = [i / BINS for i in range(BINS + 1)]
    for i in range(count):
        start = time.perf_counter()
        if i % 2:
            history.append_scalars([(f"scalar{i}", 0, 0.0, float(i))])
        else:
            history.append(f"layers.{i}.Linear", "forward", "output", step=0, time=0.0, stats={"mean": 0.0},
                           histogram=[1] * BINS, bin_edges=edges)
        costs.append(time.perf_counter() - start)
    stop.set()


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--series", type=int, default=1000)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU()) for _ in range(4)])
    train_gaps(model, threading.Event(), 1.0)  # warm up
    baseline = train_gaps(model, threading.Event(), 5.0)
    costs: list[float] = []
    stop = threading.Event()
    with tempfile.TemporaryDirectory() as logdir, History(logdir) as history:
        writer = threading.Thread(target=add_series, args=(history, args.series, costs, stop))
        writer.start()
        during = train_gaps(model, stop, None)
        writer.join()
    tenth = max(1, len(costs) // 10)
    print(f"new series: {len(costs)}; first 10 %: median {ms(statistics.median(costs[:tenth]))}, "
          f"last 10 %: median {ms(statistics.median(costs[-tenth:]))}, slowest {ms(max(costs))}, "
          f"all of them {sum(costs):.1f} s")
    print(f"training steps without the writer: {len(baseline)}, median gap {ms(statistics.median(baseline))}, "
          f"longest {ms(max(baseline))}")
    print(f"training steps while it adds them: {len(during)}, median gap {ms(statistics.median(during))}, "
          f"longest {ms(max(during))}")


if __name__ == "__main__":
    main()
