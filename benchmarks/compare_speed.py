"""compare_dumps against reading both files with h5py and comparing with NumPy, at each torch thread setting.

    python benchmarks/compare_speed.py [--shapes large,small,statistics] [--batch 2] [--size 128] [--repeats 3]
        [--threads 1,default] [--load N] [--dir DIR]

Three shapes of dump, each two runs' training steps, the second with one weight nudged:
``large``, a ResNet-50-sized CNN (``bench_models.ResNet50``, module calls: a few large tensors,
a few hundred MB each at the defaults); ``small``, a 12-layer encoder
(``bench_models.TransformerEncoder``, ``calls="all"``: hundreds of small calls, tens of MB);
``statistics``, the same encoder's statistics dump (one packed matrix). Timed:
``fwdtrace.compare_dumps(a, b)`` against a plain reading of every dataset of both files with h5py
(whole, into NumPy; a statistics dump's matrix and index) and the same per-tensor numbers with
NumPy (allclose, max abs and relative error, cosine). Runs are
interleaved; medians of wall-clock time over ``--repeats`` (the files are in the page cache
after the first read, for both). Each setting of ``--threads`` (``default``: torch's own, one
per core) is what the caller has set with ``torch.set_num_threads`` when it calls
``compare_dumps``. ``--load N`` runs N busy processes (one spinning Python loop each) while
timing, as other jobs load a shared machine. Target: compare_dumps within 1.5x of the plain
reading at every setting. The plain reading's BLAS (NumPy's OpenBLAS: its dot product and norms)
runs on one thread, set before NumPy loads: compare_dumps computes on one thread (einsum, and
torch on one intra-op thread), and on a busy machine a BLAS pool's woken threads wait for cores,
which would time the machine's load, not the reading.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

os.environ["OPENBLAS_NUM_THREADS"] = "1"  # before NumPy loads OpenBLAS: read once, when it starts its pool

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_models import ResNet50, TransformerEncoder  # noqa: E402

import fwdtrace  # noqa: E402


def _dump(directory: Path, model: torch.nn.Module, x: torch.Tensor, **options: str) -> Path:
    with fwdtrace.Dumper(directory, **options) as dumper:
        dumper.register(model)
        model(x).logsumexp(1).sum().backward()
    return dumper.paths[0]


def _numbers(x: np.ndarray, y: np.ndarray, rtol: float, atol: float) -> bool:
    """The per-tensor numbers compare_dumps reports, with NumPy: whether allclose."""
    close = np.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True)
    diff = np.abs(x - y)
    scale = np.maximum(np.abs(x), np.abs(y))
    np.max(diff, initial=0.0)
    np.max(np.divide(diff, scale, out=np.zeros_like(diff), where=scale > 0), initial=0.0)
    float(x.ravel() @ y.ravel()) / max(float(np.linalg.norm(x) * np.linalg.norm(y)), 1e-300)
    return bool(close)


def plain_compare(a: Path, b: Path, rtol: float = 1e-5, atol: float = 1e-8) -> int:
    """The reference: every dataset of both files read whole with h5py and compared with NumPy."""
    import h5py

    differ = 0
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        if "statistics" in fa:  # a statistics dump: one matrix, a row per tensor, and its JSON index
            rows_a = json.loads(bytes(fa["statistics_index"][()]))["rows"]
            rows_b = {(g, d): i for i, (g, d, *_) in enumerate(json.loads(bytes(fb["statistics_index"][()]))["rows"])}
            ma, mb = fa["statistics"][()], fb["statistics"][()]
            for i, (g, d, *_) in enumerate(rows_a):
                x, y = ma[i], mb[rows_b[g, d]]
                keep = ~(np.isnan(x) & np.isnan(y))
                differ += not _numbers(x[keep], y[keep], rtol, atol)
            return differ
        for gname, group in fa.items():
            if not isinstance(group, h5py.Group):
                continue
            for dname, ds in group.items():
                x, y = ds[()].astype(np.float64), fb[gname][dname][()].astype(np.float64)
                differ += not _numbers(x, y, rtol, atol)
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
    parser.add_argument("--shapes", default="large,small,statistics",
                        help="which dumps to compare, comma-separated: large, small, statistics")
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
    for shape in args.shapes.split(","):
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            paths = _pair(Path(tmp), shape, args.batch, args.size)
            _time(paths, shape, settings, default_threads, args.load, args.repeats)


def _pair(tmp: Path, shape: str, batch: int, size: int) -> list[Path]:
    """Two dumps of ``shape``, the second run's last weight nudged."""
    torch.manual_seed(0)
    if shape == "large":
        x = torch.randn(batch, 3, size, size)
    elif shape in ("small", "statistics"):
        x = torch.randn(batch, 32, 64)
    else:
        raise SystemExit(f"--shapes expected large, small or statistics, got {shape!r}")
    paths = []
    for name, nudge in (("a", 1.0), ("b", 1.001)):
        torch.manual_seed(0)
        model: torch.nn.Module = ResNet50() if shape == "large" else TransformerEncoder(64, 12)
        last = model.fc if shape == "large" else model.norm
        with torch.no_grad():
            last.weight.mul_(nudge)
        options = {} if shape == "large" else {"calls": "all", "values": "tensors" if shape == "small" else shape}
        paths.append(_dump(tmp / name, model, x, **options))
    return paths


def _time(paths: list[Path], shape: str, settings: list[int], default_threads: int, load: int, repeats: int) -> None:
    mb = sum(p.stat().st_size for p in paths) / 1e6
    rows = len(fwdtrace.compare_dumps(*paths).rows)
    print(f"{shape}: two dumps, {rows} tensors, {mb:.1f} MB in all; {load} busy processes on {os.cpu_count()} "
          f"cores while timing; medians of {repeats}")
    for threads in settings:
        torch.set_num_threads(threads)
        ours: list[float] = []
        plain: list[float] = []
        with busy_processes(load):
            for r in range(repeats):
                runs = [(lambda: fwdtrace.compare_dumps(*paths), ours), (lambda: plain_compare(*paths), plain)]
                for fn, times in runs if r % 2 == 0 else runs[::-1]:
                    start = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - start)
        o, p = statistics.median(ours), statistics.median(plain)
        label = f"{threads} ({'default' if threads == default_threads else 'set'})"
        print(f"  torch threads {label}: compare_dumps {o:.3f} s ({mb / o:.0f} MB/s), h5py + NumPy {p:.3f} s "
              f"({mb / p:.0f} MB/s): {o / p:.2f}x (target <= 1.5x)")
    torch.set_num_threads(default_threads)


if __name__ == "__main__":
    main()
