"""What a statistics dump of every step costs a training step, against a dump of the full tensors and the floor.

    python benchmarks/dump_statistics_cost.py [--model gpt2|encoder] [--calls modules,all] [--pairs 6] [--steps 3]

Models: ``gpt2``, transformers' GPT-2 with 4 layers of width 256 (batch 4 x 64 tokens), and ``encoder``,
the live-service benchmark's encoder (d=128, 4 layers, batch 8 x 64); 1 torch thread. Training steps
(forward, backward, SGD); each dumped row registers a ``Dumper`` on every step (``dumper.register(model,
step=i)``, which also closes the step before's file) and the last file is closed at the end of each segment, so
writing and closing are inside the clock.

Rows, for each ``calls``:

- ``statistics``: ``Dumper(values="statistics")``, every call's tensors summarised by ``fwdtrace.statistics``;
- ``tensors``: ``Dumper(values="tensors")`` of the same calls: the bar a statistics dump must stay under;
- ``without the reductions``: the statistics dump with each tensor's summary replaced by a stored one: what
  the hooks, the trace (``calls="all"``) and the file cost;
- ``no-op hooks`` (``calls="modules"``): a forward hook on every module that puts a no-op hook on each
  output tensor's gradient: what attaching to every call and gradient costs at the least.

Each row is timed in ``--pairs`` pairs of ``--steps``-step segments, the plain model then the dumped one or
the reverse, so each pair's ratio sees the same machine load on both sides; reported are the medians of the
pair ratios (wall time). Last, the floor: the values one step stores statistics of, each distinct tensor once
(copies of those the dump summarises: a layer's output that is the next layer's input, a gradient two calls
hold, a view are one tensor for several datasets), each read once by ``torch.sum`` in its own dtype, against a
plain step: what any statistic computed from every value costs at the least. The targets: a statistics dump at most a tensor dump; ``calls="modules"`` within the no-op hooks
plus 3 floors, ``calls="all"`` within its row without the reductions plus 3 floors.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's fwdtrace
import fwdtrace  # noqa: E402
import fwdtrace.dump  # noqa: E402


def make(name: str) -> tuple[torch.nn.Module, Callable[[], None]]:
    """The model and one training step of it."""
    torch.manual_seed(0)
    if name == "gpt2":
        import transformers
        from transformers import GPT2Config, GPT2LMHeadModel

        transformers.logging.set_verbosity_error()
        config = GPT2Config(n_embd=256, n_layer=4, n_head=4, vocab_size=1000, n_positions=128,
                            attn_implementation="eager", bos_token_id=0, eos_token_id=0)
        model: torch.nn.Module = GPT2LMHeadModel(config)
        ids = torch.randint(0, 1000, (4, 64))

        def forward() -> torch.Tensor:
            return model(input_ids=ids, labels=ids).loss
    else:
        from bench_models import TransformerEncoder

        model = TransformerEncoder(d=128, layers=4, heads=8)
        x = torch.randn(8, 64, 128)

        def forward() -> torch.Tensor:
            return model(x).pow(2).mean()

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        forward().backward()
        optimizer.step()
        optimizer.zero_grad()

    return model, step


class NoOpHooks:
    """A forward hook on every module that puts a no-op hook on each output tensor's gradient."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.handles: list[Any] = []

    def register(self, model: torch.nn.Module, step: int = 0) -> None:
        if self.handles:
            return

        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            for t in (output if isinstance(output, tuple) else (output,)):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(lambda g: None)

        self.handles = [m.register_forward_hook(hook) for m in model.modules()]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


class Skipped:
    """The dump's summaries replaced by one stored summary, binned already (the CPU's own kind, so the dump takes
    the same path with it): what the rest of a statistics dump costs."""

    def __init__(self) -> None:
        from fwdtrace.statistics.engine import finish, summarize_later

        self.original = fwdtrace.dump.record.summarize_later
        self.stored = summarize_later(torch.arange(8.0))
        finish([self.stored])

    def __enter__(self) -> None:
        fwdtrace.dump.record.summarize_later = lambda t: self.stored  # type: ignore[assignment]

    def __exit__(self, *exc: object) -> None:
        fwdtrace.dump.record.summarize_later = self.original  # type: ignore[assignment]


def segment(model: torch.nn.Module, step: Callable[[], None], tool: Any, first: int, n: int) -> float:
    """Seconds for ``n`` steps, each registered with ``tool`` (None: plain); its files closed after."""
    start = time.perf_counter()
    for i in range(n):
        if tool is not None:
            tool.register(model, step=first + i)
        step()
    if tool is not None:
        tool.remove()
    elapsed = time.perf_counter() - start
    for path in getattr(tool, "paths", None) or []:  # a tensor dump's files are GBs: off the disk (tmpfs: memory)
        path.unlink(missing_ok=True)
    return elapsed


def ratio(model: torch.nn.Module, step: Callable[[], None], tool: Any, pairs: int, steps: int) -> tuple[float, float]:
    """The median ratio of a segment with ``tool`` to one without, and the median plain step in seconds."""
    segment(model, step, tool, 0, 1)  # warm-up: imports, the first file
    ratios, plain = [], []
    for pair in range(pairs):
        times = {}
        for tooled in ((False, True) if pair % 2 == 0 else (True, False)):
            times[tooled] = segment(model, step, tool if tooled else None, pair * steps, steps)
        ratios.append(times[True] / times[False])
        plain.append(times[False] / steps)
    return statistics.median(ratios), statistics.median(plain)


def floor(model: torch.nn.Module, step: Callable[[], None], calls: str, folder: Path, repeats: int) -> float:
    """One ``torch.sum`` over every value a ``calls`` statistics dump stores the statistics of, each distinct
    tensor once (those the dump summarises: several datasets may hold one), as a share of a plain step."""
    taken: list[torch.Tensor] = []
    datasets = 0
    summarize, summary = fwdtrace.dump.record.summarize_later, fwdtrace.dump.record._Recording._summary

    def take(t: torch.Tensor) -> Any:
        taken.append(t.detach().clone().reshape(-1))
        return summarize(t)

    def counted(self: Any, t: torch.Tensor) -> Any:
        nonlocal datasets
        datasets += 1
        return summary(self, t)

    fwdtrace.dump.record.summarize_later = take  # type: ignore[assignment]
    fwdtrace.dump.record._Recording._summary = counted  # type: ignore[method-assign]
    try:
        segment(model, step, fwdtrace.Dumper(folder / "floor", values="statistics", calls=calls, overwrite=True), 0, 1)
    finally:
        fwdtrace.dump.record.summarize_later = summarize  # type: ignore[assignment]
        fwdtrace.dump.record._Recording._summary = summary  # type: ignore[method-assign]
    shares = []
    for _ in range(repeats):
        plain = segment(model, step, None, 0, 1)
        start = time.perf_counter()
        for t in taken:
            t.sum()
        shares.append((time.perf_counter() - start) / plain)
    values = sum(t.numel() for t in taken)
    print(f"    floor: one torch.sum over the {len(taken)} distinct tensors of a step's {datasets} datasets "
          f"({values / 1e6:.1f} M values) "
          f"costs {statistics.median(shares):.3f} of a plain step")
    return statistics.median(shares)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2", choices=("gpt2", "encoder"))
    parser.add_argument("--calls", default="modules,all")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3, help="training steps per segment")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the machine is shared)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, step = make(args.model)
    for _ in range(3):
        step()
    print(f"{args.model}, {args.threads} torch thread(s); {args.pairs} pairs of {args.steps}-step segments per row; "
          "medians of the pair ratios (a dumped step against a plain one)")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for calls in args.calls.split(","):
            print(f'  calls="{calls}":')
            rows: dict[str, float] = {}

            def dumper(values: str, calls: str = calls) -> fwdtrace.Dumper:
                return fwdtrace.Dumper(folder / f"{calls}-{values}", values=values, calls=calls, overwrite=True)

            rows["statistics"], plain = ratio(model, step, dumper("statistics"), args.pairs, args.steps)
            rows["tensors"], _ = ratio(model, step, dumper("tensors"), args.pairs, args.steps)
            with Skipped():
                rows["without the reductions"], _ = ratio(model, step, dumper("statistics"), args.pairs, args.steps)
            if calls == "modules":
                rows["no-op hooks"], _ = ratio(model, step, NoOpHooks(model), args.pairs, args.steps)
            for name, value in rows.items():
                print(f"    {name}: {value:.2f}x a plain step ({plain * 1e3:.1f} ms)")
            share = floor(model, step, calls, folder, args.pairs)
            base = rows["no-op hooks"] if calls == "modules" else rows["without the reductions"]
            bound = base + 3 * share
            print(f"    target: statistics <= tensors ({rows['statistics']:.2f}x against {rows['tensors']:.2f}x: "
                  f"{'met' if rows['statistics'] <= rows['tensors'] else 'not met'}); statistics <= "
                  f"{'no-op hooks' if calls == 'modules' else 'without the reductions'} + 3 floors = {bound:.2f}x "
                  f"({'met' if rows['statistics'] <= bound else 'not met'})")


if __name__ == "__main__":
    main()
