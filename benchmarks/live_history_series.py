"""What adding new series to the live history costs, and what it does to the training thread meanwhile.

One run, three phases of the same training loop (a small MLP: forward, backward, SGD) on the
main thread, recording the gap between the ends of consecutive steps:

1. no writer (the baseline);
2. a writer thread (as the sampler's summariser) appends ``--series`` rows to series that
   already exist (0 new series): half layer rows (``append``, 60 bins), half scalars
   (``append_scalars``);
3. the writer adds ``--series`` new series, one row each, half layer series, half scalars.

Reported per phase: the training steps' median and longest gap; for the writer, the time per
append (median of the first and of the last 10 %, the slowest) and the writer thread's CPU time
per append (median, most: what h5py holds the GIL for, free of the waits of a busy machine).
h5py holds the GIL while it works, so what a new series costs shows up as the training
thread's longest gap. The
interpreter's garbage collector is frozen after warm-up (``gc.freeze``): a full collection
of torch's objects pauses every thread for as long as it takes, history or not.
Run: ``.venv/bin/python benchmarks/live_history_series.py [--series 1000]``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import threading
import time

import torch

from fwdtrace.live.history import History

BINS = 60
EDGES = [i / BINS for i in range(BINS + 1)]


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


def write(history: History, count: int, new: bool, costs: list[tuple[float, float]], stop: threading.Event) -> None:
    """``count`` appends: each to a new series (``new``) or to one of two series that exist; their wall and CPU times."""
    for i in range(count):
        name = f"new{i}" if new else i % 2
        start, cpu = time.perf_counter(), time.thread_time()
        if i % 2:
            history.append_scalars([(f"scalar{name}", i, 0.0, float(i))])
        else:
            history.append(f"layers.{name}.Linear", "forward", "output", step=i, time=0.0, stats={"mean": 0.0},
                           histogram=[1] * BINS, bin_edges=EDGES)
        costs.append((time.perf_counter() - start, time.thread_time() - cpu))
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
    gc.collect()
    gc.freeze()
    phases = {"no writer": (train_gaps(model, threading.Event(), 3.0), [])}
    with tempfile.TemporaryDirectory() as logdir, History(logdir) as history:
        write(history, 2, False, [], threading.Event())  # the two series phase 2 appends to
        for label, new in (("0 new series", False), (f"{args.series} new series", True)):
            costs: list[tuple[float, float]] = []
            stop = threading.Event()
            writer = threading.Thread(target=write, args=(history, args.series, new, costs, stop))
            writer.start()
            phases[label] = (train_gaps(model, stop, None), costs)
            writer.join()
        assert len(history.series()) + len(history.scalar_names()) == args.series + 2
    for label, (gaps, costs) in phases.items():
        line = (f"{label:>18}: {len(gaps):5d} training steps, median gap {ms(statistics.median(gaps))}, "
                f"longest {ms(max(gaps))}")
        if costs:
            wall, cpu = ([c[i] for c in costs] for i in (0, 1))
            tenth = max(1, len(costs) // 10)
            line += (f"\n{'':>20}{len(costs)} appends: first 10 % median {ms(statistics.median(wall[:tenth]))}, last 10 % "
                     f"median {ms(statistics.median(wall[-tenth:]))}, slowest {ms(max(wall))}, all {sum(wall):.2f} s; "
                     f"CPU time median {ms(statistics.median(cpu))}, most {ms(max(cpu))}")
        print(line)


if __name__ == "__main__":
    main()
