"""Dump throughput against plain h5py, and what a registered-but-disabled probe costs.

    python benchmarks/dump_throughput.py [--repeats 3] [--batch 2] [--size 128] [--device cpu|cuda] [--dir DIR]

1. Dump: a training step (forward + backward) of a ResNet-50-sized CNN (defined here) with
   ``fwdtrace.Dumper`` registered; its MB/s is the bytes dumped over the time its tensor
   writes took (timed inside the dumper: copy to CPU, numpy, dataset and attributes), which
   other load on the machine disturbs far less than a whole step's time would (the step's
   time with and without the dumper is printed too). The same tensors, collected once by
   plain hooks, are written with plain h5py (one group per call, one dataset per tensor, no
   attributes): MB/s over that write. Target: dumper >= 0.8x plain h5py.
2. Probe: a ``no_grad`` forward with a probe whose replace/stats hooks were registered on
   every module and then disabled (``probe.enabled = False`` takes the torch hooks off),
   against the same forward without a probe. Target: under 2% overhead. For scale it also
   reports two enabled no-op hooks per module.

Runs are interleaved and the medians over ``--repeats`` reported; the defaults fit in
24 GiB RAM and a couple of minutes on two CPU cores. On CPU the clock is the process's CPU
time (``--clock wall`` for wall-clock), which other load on a shared machine disturbs less.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_models import ResNet50
from torch import nn

import fwdtrace
import fwdtrace.dump


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# time.process_time (CPU seconds of this process, all its threads) on a CPU run: a shared
# machine's other load changes it far less than wall-clock time. Set by --clock.
_CLOCK: Callable[[], float] = time.process_time


def _time(fn: Callable[[], object], device: str) -> float:
    _sync(device)
    start = _CLOCK()
    fn()
    _sync(device)
    return _CLOCK() - start


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    model(x).logsumexp(1).sum().backward()


def _collect(model: nn.Module, x: torch.Tensor) -> list[tuple[str, list[tuple[str, torch.Tensor]]]]:
    """Every tensor the dumper writes, by plain hooks, copied to the CPU: (group, [(name, tensor)])."""
    calls: list[tuple[str, list[tuple[str, torch.Tensor]]]] = []
    open_calls: dict[int, list[int]] = {}
    done: dict[int, list[int]] = {}
    handles = []

    def pre(m: nn.Module, args: tuple) -> None:
        open_calls.setdefault(id(m), []).append(len(calls))
        calls.append((f"{len(calls):03d}_{type(m).__name__}", [("input0", args[0].detach().cpu().clone())]))

    def post(m: nn.Module, args: tuple, out: torch.Tensor) -> None:
        i = open_calls[id(m)].pop()
        calls[i][1].append(("output0", out.detach().cpu().clone()))
        done.setdefault(id(m), []).append(i)

    def back(m: nn.Module, grad_input: tuple, grad_output: tuple) -> None:
        i = done[id(m)].pop()
        calls[i][1].extend(
            (f"{prefix}{j}", g.detach().cpu().clone())
            for prefix, grads in (("grad_output", grad_output), ("grad_input", grad_input))
            for j, g in enumerate(grads)
            if g is not None
        )

    for m in model.modules():
        handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post), m.register_full_backward_hook(back)]
    _step(model, x)
    for h in handles:
        h.remove()
    return calls


def _write_plain(path: Path, calls: list[tuple[str, list[tuple[str, torch.Tensor]]]]) -> None:
    import h5py

    with h5py.File(path, "w") as f:
        for group_name, tensors in calls:
            group = f.create_group(group_name)
            for name, t in tensors:
                group.create_dataset(name, data=t.numpy())


class _WriteTimer:
    """Times the Dumper's tensor writes (its ``_Recording._write``) from inside, while patched in."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._original = fwdtrace.dump.record._Recording._write

    def __enter__(self) -> _WriteTimer:
        original = self._original

        def timed(*args: object) -> None:
            start = _CLOCK()
            original(*args)
            self.seconds += _CLOCK() - start

        fwdtrace.dump.record._Recording._write = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        fwdtrace.dump.record._Recording._write = self._original  # type: ignore[method-assign]


def bench_dump(model: nn.Module, x: torch.Tensor, repeats: int, device: str, directory: Path) -> dict[str, float]:
    _step(model, x)  # warm up
    calls = _collect(model, x)
    nbytes = sum(t.numel() * t.element_size() for _, tensors in calls for _, t in tensors)
    plain_step, dumped_step, dump_writes, h5py_write = [], [], [], []
    for r in range(repeats):
        plain_step.append(_time(lambda: _step(model, x), device))
        dumper = fwdtrace.Dumper(directory)
        timer = _WriteTimer()

        def dumped(dumper: fwdtrace.Dumper = dumper, r: int = r, timer: _WriteTimer = timer) -> None:
            with timer:
                dumper.register(model, epoch=0, step=r)
                _step(model, x)
                dumper.remove()

        def plain(r: int = r) -> None:
            _write_plain(directory / f"plain_{r}.hdf5", calls)

        # alternate which writes first, so neither always meets the other's dirty pages
        for fn, times, dev in sorted([(dumped, dumped_step, device), (plain, h5py_write, "cpu")],
                                     key=lambda item: (item[0] is plain) == (r % 2 == 0)):
            times.append(_time(fn, dev))
        dump_writes.append(timer.seconds)
        for p in directory.iterdir():  # keep the disk use to one repeat's files
            p.unlink()
    mb = nbytes / 1e6
    return {
        "calls": len(calls),
        "mb": mb,
        "step_s": statistics.median(plain_step),
        "dumped_step_s": statistics.median(dumped_step),
        "dumper_mb_s": mb / statistics.median(dump_writes),
        "h5py_mb_s": mb / statistics.median(h5py_write),
    }


def _probe(model: nn.Module) -> fwdtrace.Probe:
    probe = fwdtrace.Probe(model)
    probe.replace_input("*", lambda m, i, o: None)
    probe.replace_output("*", lambda m, i, o: None)
    probe.running_stats("*", of="output")
    return probe


def bench_probe(model: nn.Module, x: torch.Tensor, repeats: int, device: str) -> dict[str, float]:
    """A forward without hooks, with a disabled probe, and (for scale) with no-op hooks enabled."""
    model.eval()
    plain, disabled, noop = [], [], []
    with torch.no_grad():
        for _ in range(2):  # warm up
            model(x)
        for _ in range(repeats):
            plain.append(_time(lambda: model(x), device))
            probe = _probe(model)
            probe.enabled = False
            disabled.append(_time(lambda: model(x), device))
            probe.remove()
            probe = fwdtrace.Probe(model)
            probe.replace_input("*", lambda m, i, o: None)
            probe.replace_output("*", lambda m, i, o: None)
            noop.append(_time(lambda: model(x), device))
            probe.remove()
    model.train()
    p, q, r = statistics.median(plain), statistics.median(disabled), statistics.median(noop)
    return {
        "hooked_modules": len(probe.keys),
        "forward_s": p,
        "disabled_s": q,
        "overhead_pct": 100 * (q - p) / p,
        "noop_overhead_pct": 100 * (r - p) / p,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--probe-repeats", type=int, default=15)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--size", type=int, default=128, help="image side in pixels")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dir", default=None, help="where to write the dumps (default: a temporary folder)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: idle worker threads spin, which CPU time would count)")
    parser.add_argument("--clock", choices=["cpu", "wall"], default=None,
                        help="cpu: process CPU time (default on CPU), wall: wall-clock (default on CUDA)")
    args = parser.parse_args()
    global _CLOCK
    if (args.clock or ("wall" if args.device == "cuda" else "cpu")) == "wall":
        _CLOCK = time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    model = ResNet50().to(args.device)
    x = torch.randn(args.batch, 3, args.size, args.size, device=args.device)
    print(f"ResNet-50-sized CNN, {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, "
          f"input {list(x.shape)}, device {args.device}, torch threads {torch.get_num_threads()}, "
          f"clock {'wall' if _CLOCK is time.perf_counter else 'process CPU time'}")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        d = bench_dump(model, x, args.repeats, args.device, Path(tmp))
    print(f"dump: {d['calls']} module calls, {d['mb']:.0f} MB per step; step {d['step_s']:.2f} s, "
          f"with dumper {d['dumped_step_s']:.2f} s")
    print(f"  dumper {d['dumper_mb_s']:.0f} MB/s, plain h5py {d['h5py_mb_s']:.0f} MB/s: "
          f"{d['dumper_mb_s'] / d['h5py_mb_s']:.2f}x (target >= 0.8x)")
    p = bench_probe(model, x, args.probe_repeats, args.device)
    print(f"disabled probe: {p['hooked_modules']} modules with 3 hooks each; forward {p['forward_s'] * 1e3:.1f} ms, "
          f"with the probe disabled {p['disabled_s'] * 1e3:.1f} ms: {p['overhead_pct']:+.2f}% (target < 2%)")
    print(f"  for scale, two enabled no-op hooks per module: {p['noop_overhead_pct']:+.1f}%")


if __name__ == "__main__":
    main()
