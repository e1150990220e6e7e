"""Scalar series (loss, learning rate, gradient norm) logged from the training loop to the running live services.

:func:`log_scalar` is meant for every step of a training loop, so it only takes a lock and
appends to a bounded buffer of each running service (:class:`ScalarLog`, one per
:class:`~fwdtrace.live.sampler.Sampler`). A CUDA tensor is kept as a device copy and read (the
device sync) when a client asks for it, in the server's thread, never in the training loop.
With no service running it checks its arguments and returns: nothing is kept for a service
started later (a buffer nobody reads would only grow stale).

A service with a history on disk also holds each point for its writer (:meth:`ScalarLog.hold`):
the sampler's summariser thread takes them (:meth:`ScalarLog.take_unwritten`) about once a
second and at stop, so the training thread never waits on the disk.
"""

from __future__ import annotations

import numbers
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from ..errors import FwdtraceError, describe

__all__ = ["log_scalar", "ScalarLog"]

_logs: tuple[ScalarLog, ...] = ()  # the running services' logs; replaced whole, so log_scalar reads it without a lock
_logs_lock = threading.Lock()


class ScalarLog:
    """A service's scalar series: per name the last ``points`` points ``(seq, step, value)``, at most ``names`` names.

    >>> log = ScalarLog(step=lambda: 7)
    >>> log.add("loss", 0.5); log.add("loss", torch.tensor(0.25), step=9)
    >>> log.read()["loss"]
    {'steps': [7, 9], 'values': [0.5, 0.25], 'seq': 1}

    Points of names beyond ``names`` are refused and counted (``refused``).
    """

    def __init__(self, step: Callable[[], int], points: int = 4096, names: int = 256) -> None:
        self.step, self.points, self.max_names = step, points, names
        self.lock = threading.Lock()
        self.series: dict[str, deque[tuple[int, int, float | torch.Tensor]]] = {}
        self.seq = 0
        self.refused = 0
        # Points logged since the writer's last pass, (name, step, time, value), when one takes them.
        self.unwritten: list[tuple[str, int, float, float | torch.Tensor]] | None = None
        self.max_unwritten = 0
        self.lost = 0  # points the writer never got: more than max_unwritten waited for it
        self.write_error: str | None = None  # why the writer's last pass failed, if it did

    def hold(self, points: int = 1 << 16) -> None:
        """Hold every point from now on for a writer, at most ``points`` between two of its passes (more are ``lost``).

        >>> log = ScalarLog(step=lambda: 0); log.hold(points=1)
        >>> log.add("loss", 0.5, step=1); log.add("loss", 0.25, step=2)
        >>> [(name, step, value) for name, step, _, value in log.take_unwritten()], log.lost
        ([('loss', 1, 0.5)], 1)
        """
        with self.lock:
            self.unwritten, self.max_unwritten = [], points

    def add(self, name: str, value: float | torch.Tensor, step: int | None = None) -> None:
        """Keep one point (``value`` a float or a 0-d tensor already ours); the one place a point is recorded."""
        if step is None:
            step = self.step()
        now = time.time()
        with self.lock:
            series = self.series.get(name)
            if series is None:
                if len(self.series) >= self.max_names:
                    self.refused += 1
                    return
                series = self.series[name] = deque(maxlen=self.points)
            series.append((self.seq, step, value))
            self.seq += 1
            if self.unwritten is not None:
                if len(self.unwritten) < self.max_unwritten:
                    self.unwritten.append((name, step, now, value))
                else:
                    self.lost += 1

    def take_unwritten(self) -> list[tuple[str, int, float, float]]:
        """The points held since the last call, oldest first, as ``(name, step, time, value)``; called by the writer.

        Device tensors are read here (their sync), in the writer's thread.
        """
        with self.lock:
            if not self.unwritten:
                return []
            points, self.unwritten = self.unwritten, []
        return [(name, step, when, _float(value)) for name, step, when, value in points]

    def read(self, since: int = -1) -> dict[str, dict[str, Any]]:
        """Per name the points with ``seq`` above ``since``: ``{"steps", "values", "seq"}`` (the newest seq)."""
        with self.lock:
            copies = {name: [p for p in series if p[0] > since] for name, series in self.series.items()}
        out = {}
        for name, points in copies.items():
            if points:  # device tensors are read here, in the reader's thread
                out[name] = {"steps": [p[1] for p in points], "values": [_float(p[2]) for p in points],
                             "seq": points[-1][0]}
        return out

    def names(self) -> list[str]:
        with self.lock:
            return sorted(self.series)

    def register(self) -> None:
        global _logs
        with _logs_lock:
            _logs = (*_logs, self)

    def unregister(self) -> None:
        global _logs
        with _logs_lock:
            _logs = tuple(log for log in _logs if log is not self)


def _float(value: float | torch.Tensor) -> float:
    return float(value.item()) if isinstance(value, torch.Tensor) else value


def log_scalar(name: str, value: float | torch.Tensor, step: int | None = None) -> None:
    """Add a point to the scalar curve ``name`` of every running live service (the page plots it).

    >>> import torch, fwdtrace, fwdtrace.live
    >>> with fwdtrace.serve(torch.nn.Linear(2, 2), port=0) as server:
    ...     fwdtrace.live.log_scalar("loss", 0.75, step=3)
    ...     server.sampler.scalars.read()["loss"]["values"]
    [0.75]

    ``value``: a Python number or a one-element tensor. A CPU tensor is read at once; a tensor on
    another device is copied there (no sync) and read when a client asks. ``step`` defaults to
    the service's step (forwards of the model). Thread-safe; with no service running, a no-op.
    """
    if not isinstance(name, str) or not name:
        raise FwdtraceError(f"log_scalar() expected name as a non-empty str, got {describe(name)}")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise FwdtraceError(f"log_scalar() expected step as a non-negative int or None, got {step!r}")
    point: float | torch.Tensor
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            raise FwdtraceError(f"log_scalar() expected value as a number or a one-element real tensor, "
                                f"got a tensor of shape {list(value.shape)} ({value.dtype})")
        if not _logs:
            return
        point = float(value.item()) if value.device.type == "cpu" else value.detach().reshape(()).clone()
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        point = float(value)
    else:
        raise FwdtraceError(f"log_scalar() expected value as a number or a one-element tensor, got {describe(value)}")
    for log in _logs:
        log.add(name, point, step)
