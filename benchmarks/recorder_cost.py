"""What fwdtrace.Recorder adds to a training step, at its default settings, recording two keys.

Two copies of a model with the same weights train side by side: one plain, one with a Recorder
tracking two keys (every call, ``views=("auto",)``, queue of 64, one worker). They take one step
each in turn, so slow phases of a busy machine hit both; the figures are medians of the steps'
wall times (and of this process's CPU times, which move less when other programs share the
cores), and the overhead is the recorded median over the plain one, minus one.
The worker's drawing runs in its own (niced) process; what the training process pays is the
hooks, the copies to CPU and the queue. Frames drawn and dropped are reported too.

Throughput: the worker's own count of frames and of the seconds it spent drawing and encoding
them (``Recorder.throughput()``), measured while the training runs beside it, gives frames per
second per worker, and ``stop()``'s wait for the workers after the last step (``finish_s``).
From it, the smallest ``every`` at which one worker keeps up with the two keys
(``keys / (fps * step time)``, rounded up); a second run at that ``every`` checks it: no frame dropped.
Run: ``.venv/bin/python benchmarks/recorder_cost.py [--steps 150 --threads 1]``.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

# The models every benchmark shares (this script runs from benchmarks/, which Python puts on sys.path).
from bench_models import TransformerEncoder
from torch import nn

import fwdtrace


def small_cnn() -> tuple[nn.Module, torch.Tensor, list[str]]:
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(64, 64, 3, stride=2, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 10),
    )
    return model, torch.randn(32, 3, 32, 32), ["2.Conv2d", "7.Linear"]


def encoder() -> tuple[nn.Module, torch.Tensor, list[str]]:
    model = TransformerEncoder(d=128, layers=2)
    keys = [k for k in fwdtrace.module_keys(model) if ".ff." in k and k.endswith("Linear")]
    return model, torch.randn(8, 32, 128), [keys[0], keys[-1]]


MODELS: dict[str, Callable[[], tuple[nn.Module, torch.Tensor, list[str]]]] = {
    "CNN 3 convs, 32x3x32x32": small_cnn,
    "encoder 2x128, 8x32 tokens": encoder,
}


def steps(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, n: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, the recorder's sender thread included) of n steps."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(n):
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(name: str, make: Callable[[], tuple[nn.Module, torch.Tensor, list[str]]], n: int, every: int = 1) -> dict:
    torch.manual_seed(0)
    plain_model, x, keys = make()
    recorded_model = copy.deepcopy(plain_model)
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=1e-3)
    recorded_opt = torch.optim.SGD(recorded_model.parameters(), lr=1e-3)
    with tempfile.TemporaryDirectory() as out, fwdtrace.Recorder(out, every=every, timeout=600) as rec:
        rec.track(recorded_model, keys)
        steps(plain_model, plain_opt, x, 3)  # first-call costs go to neither side
        steps(recorded_model, recorded_opt, x, 3)
        time.sleep(5)  # the worker's start-up (imports) is not a training step's cost
        plain, recorded = [], []
        for _ in range(n):  # one step each in turn, so slow phases of a busy machine hit both
            plain.append(steps(plain_model, plain_opt, x, 1))
            recorded.append(steps(recorded_model, recorded_opt, x, 1))
        calls = sum(s["recorded"] for s in rec.stats().values())
        rec.stop()
        dropped = rec.dropped
        [worker] = rec.throughput()
    p, r = statistics.median(w for w, _ in plain), statistics.median(w for w, _ in recorded)
    p_cpu, r_cpu = statistics.median(c for _, c in plain), statistics.median(c for _, c in recorded)
    return {"model": name, "keys": keys, "step_ms": 1000 * p, "overhead": r / p - 1,
            "cpu_overhead": r_cpu / p_cpu - 1, "frames": calls - dropped, "dropped": dropped,
            "fps": worker["fps"], "finish_s": rec.finish_s, "every": every}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: idle worker threads spin, which CPU time would count)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, medians of {args.steps} training steps "
          "of each model, taken in turn")
    print(f"{'model':<28} {'every':>5} {'step':>8} {'overhead':>9} {'(CPU time)':>10} {'frames':>7} {'dropped':>8} "
          f"{'frames/s/worker':>16} {'stop() waited':>14}")
    for name, make in MODELS.items():
        r = measure(name, make, args.steps)
        print(row(r), flush=True)
        # The smallest every at which one worker draws the keys' frames as fast as training makes them.
        every = math.ceil(len(r["keys"]) / (r["fps"] * r["step_ms"] / 1000))
        print(row(measure(name, make, args.steps, every)), flush=True)


def row(r: dict) -> str:
    return (f"{r['model']:<28} {r['every']:>5} {r['step_ms']:>6.1f}ms {100 * r['overhead']:>8.1f}% "
            f"{100 * r['cpu_overhead']:>9.1f}% {r['frames']:>7} {r['dropped']:>8} {r['fps']:>16.1f} {r['finish_s']:>13.1f}s")


if __name__ == "__main__":
    main()
