"""TensorBoard export: what the live sampler and ``Probe.running_stats`` measure, as event files.

A pass over summaries already made (a sample of :class:`~fwdtrace.live.sampler.Sampler`, a
:class:`~fwdtrace.instrument.stats.RunningStats`): no tensor is read again. Each becomes one histogram,
on the bins the summary already has (``SummaryWriter.add_histogram_raw``), and the scalars
``mean``, ``std``, ``nan`` and ``inf``, written through ``torch.utils.tensorboard.SummaryWriter``
(``pip install 'fwdtrace[tensorboard]'``). Tags start with the module key, so TensorBoard groups
them by layer:

- a sampler's sample: ``"{key}/{role}{index}"`` for the histogram (``"blocks.0.c1.Conv2d/output0"``,
  ``"fc.Linear/grad_input0"``, named like a dump's datasets) and ``"{key}/{role}{index}/mean"`` etc.,
  at the sample's step (the root model's forward count);
- running statistics: ``"{key}/{of}"`` and ``"{key}/{of}/mean"`` etc., at the step you pass.

Values outside a histogram's bins (a later step's activations grown past the first sample's
range) go into an extra bucket at each end, bounded by the minimum and maximum, so the counts
add up to every finite value. Only finite values are in a histogram; ``nan`` and ``inf`` count the rest.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .errors import FwdtraceError, describe
from .instrument.stats import RunningStats

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from .live.sampler import Sampler

__all__ = ["add_sample", "add_running_stats", "log_sampler", "SamplerLog", "summary_writer", "SCALARS"]

SCALARS = ("mean", "std", "nan", "inf")


def summary_writer(writer: Any, caller: str) -> tuple[SummaryWriter, bool]:
    """``writer`` itself when it is a ``SummaryWriter``, else one writing to that folder; and whether it was made here."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise FwdtraceError(f"{caller} needs the tensorboard package: pip install 'fwdtrace[tensorboard]' ({e})") from None
    if isinstance(writer, SummaryWriter):
        return writer, False
    if isinstance(writer, (str, os.PathLike)):
        return SummaryWriter(log_dir=os.fspath(writer)), True
    raise FwdtraceError(
        f"{caller} expected a torch.utils.tensorboard.SummaryWriter or a log folder, got {describe(writer)}"
    )


def _add(writer: SummaryWriter, tag: str, step: int, numbers: Mapping[str, Any], finite: int,
         sum_squares: float, walltime: float | None = None) -> None:
    """One summary: its histogram (when it has finite values and bins) and its scalars."""
    edges, counts = list(numbers["bin_edges"]), list(numbers["histogram"])
    if finite and edges:
        limits = edges[1:]
        if numbers["underflow"]:
            limits, counts = [edges[0], *limits], [numbers["underflow"], *counts]
        if numbers["overflow"]:
            limits, counts = [*limits, numbers["max"]], [*counts, numbers["overflow"]]
        writer.add_histogram_raw(
            tag, min=numbers["min"], max=numbers["max"], num=finite, sum=numbers["mean"] * finite,
            sum_squares=sum_squares, bucket_limits=limits, bucket_counts=counts, global_step=step, walltime=walltime,
        )
    for name in SCALARS:
        writer.add_scalar(f"{tag}/{name}", numbers[name], global_step=step, walltime=walltime)


def add_sample(writer: SummaryWriter, key: str, sample: Mapping[str, Any]) -> None:
    """Write one live-sampler sample: per tensor a histogram and its scalars, at the sample's step.

    >>> import tempfile, torch
    >>> from torch.utils.tensorboard import SummaryWriter
    >>> from fwdtrace.live.sampler import Sampler
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 2)); sampler = Sampler(model)
    >>> _ = sampler.arm("0", "forward"); _ = model(torch.ones(3, 4))
    >>> writer = SummaryWriter(tempfile.mkdtemp())
    >>> add_sample(writer, "0.Linear", sampler.samples("0.Linear", "forward")[0]); writer.close(); sampler.close()

    Tags are ``"{key}/{role}{index}"`` (``"0.Linear/output0"``) and that plus ``/mean``,
    ``/std``, ``/nan``, ``/inf``; tensors without numbers (bool, complex, empty) are left out.
    """
    for t in sample["tensors"]:
        if not t.get("numeric"):
            continue
        finite = t["numel"] - t["nan"] - t["inf"]
        mean, std = t["mean"], t["std"]
        # the sampler keeps the population std: sum of squares = n (std^2 + mean^2)
        sum_squares = finite * (std * std + mean * mean) if finite else 0.0
        _add(writer, f"{key}/{t['role']}{t['index']}", int(sample["step"]), t, finite, sum_squares, sample.get("time"))


def add_running_stats(writer: SummaryWriter, stats: Any, step: int, of: str | None = None) -> None:
    """Write running statistics as they stand: per key a histogram and its scalars, at ``step``.

    >>> import tempfile, torch, fwdtrace
    >>> from torch.utils.tensorboard import SummaryWriter
    >>> model = torch.nn.Sequential(torch.nn.ReLU()); writer = SummaryWriter(tempfile.mkdtemp())
    >>> with fwdtrace.Probe(model) as probe:
    ...     stats = probe.running_stats("0", of="output"); _ = model(torch.randn(8))
    ...     add_running_stats(writer, stats, step=1)
    >>> writer.close()

    ``stats`` is what :meth:`fwdtrace.Probe.running_stats` returns (its ``of`` names the tags:
    ``"0.ReLU/output"``) or a ``{key: RunningStats}`` dict, tagged ``"{key}/{of}"`` (``of``
    defaults to ``"stats"`` there). Call it every N steps: the histograms show how the
    distribution accumulated so far moves.
    """
    if isinstance(stats, Mapping):
        by_key, name = stats, of or "stats"
    elif isinstance(getattr(stats, "stats", None), Mapping):
        by_key, name = stats.stats, of or stats.of
    else:
        raise FwdtraceError(
            f"add_running_stats() expected what Probe.running_stats() returns or a {{key: RunningStats}} dict, got {describe(stats)}"
        )
    if isinstance(step, bool) or not isinstance(step, int):
        raise FwdtraceError(f"add_running_stats() expected step as an int, got {describe(step)}")
    for key, s in list(by_key.items()):
        if not isinstance(s, RunningStats):
            raise FwdtraceError(f"add_running_stats() expected a RunningStats for {key!r}, got {describe(s)}")
        with s._lock:  # a consistent view while hooks in other threads may update it
            numbers = s.to_dict()
            finite, sum_squares = s.finite, s.l2 * s.l2
        _add(writer, f"{key}/{name}", step, numbers, finite, sum_squares)


class SamplerLog:
    """A sampler's samples going to TensorBoard as they are kept (see :func:`log_sampler`).

    ``close()`` (or leaving ``with``) stops logging, writes what the summariser still holds and
    flushes the writer (closing it when ``log_sampler`` made it from a folder).
    """

    def __init__(self, sampler: Sampler, writer: SummaryWriter, owned: bool) -> None:
        self.sampler, self.writer, self._owned = sampler, writer, owned
        self._lock = threading.Lock()
        self.closed = False

    def __call__(self, key: str, kind: str, sample: dict[str, Any]) -> None:
        with self._lock:
            if not self.closed:
                add_sample(self.writer, key, sample)

    def flush(self) -> None:
        """Write every sample taken so far (waits for the summariser) and flush the event file."""
        self.sampler.drain()
        self.writer.flush()

    def close(self) -> None:
        if self.closed:
            return
        self.sampler.drain()
        with self._lock:
            self.closed = True
        if self in self.sampler.sinks:
            self.sampler.sinks.remove(self)
        (self.writer.close if self._owned else self.writer.flush)()

    def __enter__(self) -> SamplerLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def log_sampler(sampler: Any, writer: Any) -> SamplerLog:
    """Send every sample the live sampler keeps from now on to TensorBoard, as it is summarised.

    >>> import tempfile, torch, fwdtrace
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    >>> with fwdtrace.serve(model, port=0) as server, log_sampler(server.sampler, tempfile.mkdtemp()) as log:
    ...     _ = server.sampler.arm("0.Linear", "forward"); _ = model(torch.ones(3, 4))

    ``sampler`` is a :class:`~fwdtrace.live.sampler.Sampler` (``server.sampler`` of
    :func:`fwdtrace.serve`); ``writer`` a ``SummaryWriter`` or a log folder
    (``tensorboard --logdir`` it). Writing happens in the sampler's summariser thread, never
    in the training step; what is armed, and how often, is the sampler's business (the page
    or ``POST /api/sample``). Tags: see :func:`add_sample`.
    """
    from .live.sampler import Sampler

    if not isinstance(sampler, Sampler):
        raise FwdtraceError(f"log_sampler() expected a fwdtrace live Sampler (server.sampler), got {describe(sampler)}")
    made, owned = summary_writer(writer, "log_sampler()")
    log = SamplerLog(sampler, made, owned)
    sampler.sinks.append(log)
    return log
