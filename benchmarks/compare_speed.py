"""compare_dumps against reading both files with h5py and comparing with NumPy, at each torch thread setting.

    python benchmarks/compare_speed.py [--batch 2] [--size 128] [--repeats 3] [--threads 1,default] [--load N] [--dir DIR]

Two dumps of a ResNet-50-sized CNN's training step (``bench_models.ResNet50``), the second with
one weight nudged, a few hundred MB each at the defaults. Timed: ``fwdtrace.compare_dumps(a, b)``
against a plain reading of every dataset of both files with h5py (whole, into NumPy) and the
same per-tensor numbers with NumPy (allclose, max abs and relative error, cosine). Runs are
interleaved; medians of wall-clock time over ``--repeats`` (the files are in the page cache
after the first read, for both). Each setting of ``--threads`` (``default``: torch's own, one
per core) is what the caller has set with ``torch.set_num_threads`` when it calls
``compare_dumps``. ``--load N`` runs N busy processes (one spinning Python loop each) while
timing, as other jobs load a shared machine. Target: compare_dumps within 1.5x of the plain
reading at every setting.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from bench_models import ResNet50

import fwdtrace


def _dump(directory: Path, model: torch.nn.Module, x: torch.Tensor) -> Path:
    with fwdtrace.Dumper(directory) as dumper:
        dumper.register(model)
        model(x).logsumexp(1).sum().backward()
    return dumper.paths[0]


def plain_compare(a: Path, b: Path, rtol: float = 1e-5, atol: float = 1e-8) -> int:
    """The reference: every dataset of both files read whole with h5py and compared with NumPy."""
    import h5py
    import numpy as np

    differ = 0
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        for gname, group in fa.items():
            if not isinstance(group, h5py.Group):
                continue
            for dname, ds in group.items():
                x, y = ds[()].astype(np.float64), fb[gname][dname][()].astype(np.float64)
                close = np.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True)
                diff = np.abs(x - y)
                scale = np.maximum(np.abs(x), np.abs(y))
                np.max(diff, initial=0.0)
                np.max(np.divide(diff, scale, out=np.zeros_like(diff), where=scale > 0), initial=0.0)
                float(x.ravel() @ y.ravel()) / max(float(np.linalg.norm(x) * np.linalg.norm(y)), 1e-300)
                differ += not close
    return differ


@contextlib.contextmanager
def busy_processes(n: int) -> Iterator[None]:
    """``n`` processes spinning a Python loop (each keeps one core busy) until the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--size", type=int, default=128, help="image side in pixels")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write the dumps (default: a temporary folder)")
    parser.add_argument("--threads", default="1,default",
                        help="torch thread settings the caller has when it compares, comma-separated ints or 'default'")
    parser.add_argument("--load", type=int, default=0, help="busy processes running while timing (0: none)")
    args = parser.parse_args()
    default_threads = torch.get_num_threads()
    settings = [default_threads if t == "default" else int(t) for t in args.threads.split(",")]
    torch.manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        paths = []
        for name, nudge in (("a", 1.0), ("b", 1.001)):
            torch.manual_seed(0)
            model = ResNet50()
            with torch.no_grad():
                model.fc.weight.mul_(nudge)
            paths.append(_dump(Path(tmp) / name, model, x))
        mb = sum(p.stat().st_size for p in paths) / 1e6
        print(f"two dumps, {mb:.0f} MB in all; {args.load} busy processes on {os.cpu_count()} cores while timing; "
              f"medians of {args.repeats}")
        for threads in settings:
            torch.set_num_threads(threads)
            ours, plain = [], []
            with busy_processes(args.load):
                for r in range(args.repeats):
                    runs = [(lambda: fwdtrace.compare_dumps(*paths), ours), (lambda: plain_compare(*paths), plain)]
                    for fn, times in runs if r % 2 == 0 else runs[::-1]:
                        start = time.perf_counter()
                        fn()
                        times.append(time.perf_counter() - start)
            o, p = statistics.median(ours), statistics.median(plain)
            label = f"{threads} ({'default' if threads == default_threads else 'set'})"
            print(f"  torch threads {label}: compare_dumps {o:.2f} s ({mb / o:.0f} MB/s), h5py + NumPy {p:.2f} s "
                  f"({mb / p:.0f} MB/s): {o / p:.2f}x (target <= 1.5x)")
        torch.set_num_threads(default_threads)


if __name__ == "__main__":
    main()
