"""The training side of the recorder: hooks that hand small copies of tensors to worker processes.

The training step never waits on a worker. A hook cuts its tensor down to what the pictures
need, copies it to CPU numpy (no CUDA tensor crosses a process), and appends it to a bounded
queue in this process, dropping the oldest item when full (and counting it); a thread per
worker sends the queue down a pipe. A slow worker fills its pipe, its queue drops old frames,
and training goes on at full speed.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import tempfile
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, ClassVar

import torch

from .._tree import tensors_of
from ..errors import FwdtraceError, describe
from ..keys import Selector, key2module, select_modules
from . import worker as worker_module
from .views import VIEWS, reduce

__all__ = ["Recorder"]

_KINDS = ("forward", "grad", "both")


def _rank() -> tuple[int, int]:
    """(rank, world size) under torch.distributed, or as torchrun's environment says before it starts."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    except ValueError:
        return 0, 1


class _Channel:
    """A bounded drop-oldest queue in the training process and the thread that feeds one worker.

    The worker hands back a credit (a semaphore) per frame drawn, so at most ``IN_FLIGHT``
    items sit in its pipe: the backlog stays here, where dropping the oldest is possible.
    """

    IN_FLIGHT = 2

    def __init__(self, conn: Any, credits: Any, process: Any, size: int, on_drop: Callable[[str], None]) -> None:
        self.conn = conn
        self.credits = credits
        self.process = process
        self.size = size
        self.on_drop = on_drop
        self.items: deque[tuple] = deque()
        self.ready = threading.Condition()
        self.closing = False
        self.deadline = float("inf")
        self.thread = threading.Thread(target=self._send_loop, name="fwdtrace-recorder-sender", daemon=True)
        self.thread.start()

    def put(self, item: tuple) -> None:
        with self.ready:
            if len(self.items) >= self.size:
                self.on_drop(self.items.popleft()[0])
            self.items.append(item)
            self.ready.notify()

    def close(self, deadline: float) -> None:
        """Send what is queued until ``deadline`` (the rest counts as dropped), then the stop message."""
        with self.ready:
            self.closing = True
            self.deadline = deadline
            self.ready.notify()

    def _late(self) -> bool:
        return self.closing and time.monotonic() > self.deadline

    def _send_loop(self) -> None:
        while True:
            with self.ready:
                while not self.items and not self.closing:
                    self.ready.wait()
                if not self.items or self._late():
                    break
                item = self.items.popleft()
            # Wait for the worker to take a frame; meanwhile the queue above keeps dropping the oldest.
            while not self.credits.acquire(timeout=0.1):
                if not self.process.is_alive() or self._late():
                    break
            else:
                try:
                    self.conn.send(item)
                    continue
                except (OSError, ValueError):  # the worker is gone
                    pass
            self.on_drop(item[0])
            if not self.process.is_alive():
                with self.ready:
                    self.closing, self.deadline = True, 0.0
        with self.ready:
            while self.items:
                self.on_drop(self.items.popleft()[0])
        try:
            self.conn.send(worker_module.STOP)
        except (OSError, ValueError):
            pass
        self.conn.close()  # here, not in stop(): closing under a send in progress breaks the send


def _on_output(record: Callable[[Any], None]) -> Callable[[torch.nn.Module, Any, Any], None]:
    def hook(module: torch.nn.Module, inputs: Any, output: Any) -> None:
        record(output)

    return hook


def _on_grad_output(record: Callable[[Any], None]) -> Callable[[torch.nn.Module, Any, Any], None]:
    def hook(module: torch.nn.Module, grad_input: Any, grad_output: Any) -> None:
        record(grad_output)

    return hook


class Recorder:
    """Pictures of layer activations and gradients over training, one video per key, drawn in worker processes.

    >>> import torch, fwdtrace, tempfile
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> with fwdtrace.Recorder(tempfile.mkdtemp(), timeout=10) as rec:
    ...     rec.track(model, "0.Linear")
    ...     for _ in range(3):
    ...         _ = model(torch.randn(16, 4))
    ['0.Linear']
    >>> sorted(p.name for p in rec.stop())
    ['0.Linear.forward.mp4', '0.Linear.forward.png']

    ``every`` records every Nth call of each module; ``views`` picks among ``"heatmap"`` (2D
    and ``[1, H, W]``; the first 2D slice of larger tensors), ``"histogram"``, ``"pca"`` (a 2D
    scatter of rows, or of pixels for ``[N, C, H, W]``, at most 512 sampled) and ``"auto"``
    (a heatmap for 2D and ``[1, H, W]``, else a histogram), one panel each. ``transform``
    runs on each tensor in the training process before the recorder detaches it, copies it
    to CPU and cuts it down to what the views draw. ``queue_size`` items wait per worker; when
    full the oldest is dropped (``rec.dropped`` counts them, ``rec.dropped_by`` per file).
    ``workers`` processes start on the first :meth:`track` (``rec.processes``) and draw the
    files between them. Workers exit within ``timeout`` seconds of a parent that died, and ``stop()`` waits at most
    that long for queued frames. Under torch.distributed every rank writes its own files,
    ``{key}.{kind}.rank{r}.mp4``, or only the ranks in ``ranks``.
    Scripts that make a Recorder need ``if __name__ == "__main__":``, as for DataLoader workers:
    workers are spawned, and a spawned process imports the main script.
    """

    _live: ClassVar[list[Recorder]] = []

    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        *,
        every: int = 1,
        workers: int = 1,
        views: Iterable[str] = ("auto",),
        fps: float = 10,
        queue_size: int = 64,
        timeout: float = 30.0,
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        ranks: Iterable[int] | None = None,
        _worker_delay: float = 0.0,
    ) -> None:
        for name, count in (("every", every), ("workers", workers), ("queue_size", queue_size)):
            if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
                raise FwdtraceError(f"Recorder expected {name} as a positive int, got {count!r}")
        for name, number in (("fps", fps), ("timeout", timeout)):
            if isinstance(number, bool) or not isinstance(number, (int, float)) or not number > 0:
                raise FwdtraceError(f"Recorder expected {name} as a positive number, got {number!r}")
        views = (views,) if isinstance(views, str) else tuple(views)
        unknown = [v for v in views if v not in VIEWS]
        if not views or unknown:
            raise FwdtraceError(f"Recorder expected views among {', '.join(VIEWS)}, got {list(views)!r}")
        if transform is not None and not callable(transform):
            raise FwdtraceError(f"Recorder expected transform as a callable or None, got {describe(transform)}")
        rank, world = _rank()
        if ranks is not None:
            ranks = list(ranks)
            if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks):
                raise FwdtraceError(f"Recorder expected ranks as non-negative ints, got {ranks!r}")
        self.out_dir = Path(out_dir)
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=self.out_dir):
                pass
        except OSError as e:
            raise FwdtraceError(f"Recorder expected a writable out_dir, got {str(out_dir)!r} ({e.strerror or e})") from e
        try:
            import imageio  # noqa: F401
            import matplotlib  # noqa: F401
        except ImportError as e:
            raise FwdtraceError(
                f"Recorder needs matplotlib, imageio and imageio-ffmpeg: pip install 'fwdtrace[recorder]' ({e})"
            ) from e
        self.every = every
        self.views = views
        self.fps = fps
        self.timeout = float(timeout)
        self.transform = transform
        self.rank = rank
        self.world_size = world
        self.active = ranks is None or rank in ranks
        self.suffix = worker_module.video_suffix()
        self.dropped_by: dict[str, int] = {}
        self.processes: list[Any] = []
        self._channels: list[_Channel] = []
        self._handles: list[Any] = []
        self._stem2key: dict[str, tuple[str, int]] = {}  # stem -> (key, id of the module)
        self._drop_lock = threading.Lock()
        self._stopped = False
        self._paths: list[Path] = []
        self._queue_size = queue_size
        self._workers = workers
        self._worker_delay = _worker_delay
        Recorder._live.append(self)

    # -- what is recorded -------------------------------------------------------------------------
    def track(
        self,
        model: torch.nn.Module,
        keys: Selector | None = None,
        kind: str = "forward",
        name: str | None = None,
    ) -> list[str]:
        """Record the outputs (``"forward"``), output gradients (``"grad"``) or both of the selected modules.

        >>> import torch, fwdtrace, tempfile
        >>> rec = fwdtrace.Recorder(tempfile.mkdtemp(), timeout=10)
        >>> rec.track(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()), torch.nn.ReLU, kind="both")
        ['1.ReLU']
        >>> _ = rec.stop()

        ``keys`` takes what :class:`~fwdtrace.Probe` selectors take: a module key, a glob,
        a class or a list of them; ``None`` is every leaf module. ``name`` prefixes the file
        names (for two models with the same keys). Returns the keys tracked.
        """
        if self._stopped:
            raise FwdtraceError("Recorder.track() expected a running recorder, got one already stopped")
        if not isinstance(model, torch.nn.Module):
            raise FwdtraceError(f"Recorder.track() expected a torch.nn.Module as model, got {describe(model)}")
        if kind not in _KINDS:
            raise FwdtraceError(f"Recorder.track() expected kind as one of {', '.join(_KINDS)}, got {kind!r}")
        if name is not None and (not isinstance(name, str) or not name or "/" in name):
            raise FwdtraceError(f"Recorder.track() expected name as a non-empty str without '/', or None, got {name!r}")
        k2m = key2module(model)
        if keys is None:
            selected = {k: m for k, m in k2m.items() if next(m.children(), None) is None}
        else:
            selected = select_modules(k2m, keys, "Recorder.track()", type(model).__name__)
        kinds = ("forward", "grad") if kind == "both" else (kind,)
        plan = []
        for key, module in selected.items():
            for k in kinds:
                stem = f"{name + '.' if name else ''}{key}.{k}" + (f".rank{self.rank}" if self.world_size > 1 else "")
                seen = self._stem2key.get(stem)
                if seen is not None and seen[1] != id(module):
                    raise FwdtraceError(
                        f"Recorder.track() expected keys not yet recorded from another model, got {key!r} "
                        f"again for {k}; pass name= to tell the models apart"
                    )
                if seen is None:  # tracking a module twice records it once
                    plan.append((stem, key, k, module))
        for stem, key, _, module in plan:
            self._stem2key[stem] = (key, id(module))
        if not self.active or not plan:
            return list(selected)
        if not self.processes:
            self._start_workers()
        for i, (stem, key, k, module) in enumerate(plan, len(self._handles)):
            channel = self._channels[i % len(self._channels)]
            self.dropped_by.setdefault(stem, 0)
            record = self._recorder_of(stem, key, k, channel)
            if k == "forward":
                self._handles.append(module.register_forward_hook(_on_output(record)))
            else:
                self._handles.append(module.register_full_backward_hook(_on_grad_output(record)))
        return list(selected)

    def _start_workers(self) -> None:
        """Spawn the workers, on the first track() (a recorder that tracks nothing costs nothing)."""
        ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds torch state
        for i in range(self._workers):
            reader, writer = ctx.Pipe(duplex=False)
            credits = ctx.Semaphore(_Channel.IN_FLIGHT)
            process = ctx.Process(
                target=worker_module.run,
                args=(reader, credits, os.getpid(), str(self.out_dir), self.suffix, self.fps, self.timeout, self._worker_delay),
                name=f"fwdtrace-recorder-{i}",
            )
            process.start()
            reader.close()  # only the worker holds the read end: it sees EOF if we die
            self.processes.append(process)
            self._channels.append(_Channel(writer, credits, process, self._queue_size, self._count_drop))
        atexit.register(self.stop)  # an uncaught KeyboardInterrupt outside a `with` still finalises

    def _recorder_of(self, stem: str, key: str, kind: str, channel: _Channel) -> Callable[[Any], None]:
        """The function a hook calls with the module's output (or output gradient) on every call."""
        calls = 0
        rank = f"  rank {self.rank}" if self.world_size > 1 else ""

        def record(value: Any) -> None:
            nonlocal calls
            step, calls = calls, calls + 1
            if step % self.every:
                return
            tensors = tensors_of(value)
            if not tensors or tensors[0] is None:
                return
            tensor = tensors[0]
            if self.transform is not None:
                tensor = self.transform(tensor)
            payload = reduce(tensor, self.views)
            channel.put((stem, f"{key}  {kind}  step {step}{rank}", payload, self.views))

        return record

    def _count_drop(self, stem: str) -> None:
        with self._drop_lock:
            self.dropped_by[stem] = self.dropped_by.get(stem, 0) + 1

    @property
    def dropped(self) -> int:
        """How many items were dropped, all files together (per file: ``dropped_by``)."""
        return sum(self.dropped_by.values())

    # -- lifetime ---------------------------------------------------------------------------------
    @classmethod
    def current(cls) -> Recorder:
        """The most recently made recorder not yet stopped, for code far from where it was made.

        >>> import fwdtrace, tempfile
        >>> rec = fwdtrace.Recorder(tempfile.mkdtemp(), timeout=10)
        >>> fwdtrace.Recorder.current() is rec
        True
        >>> _ = rec.stop()
        """
        if not cls._live:
            raise FwdtraceError("Recorder.current() expected a live Recorder, got none (none made, or all stopped)")
        return cls._live[-1]

    def stop(self) -> list[Path]:
        """Remove the hooks, send what is queued (for at most ``timeout`` s), finalise every file, join the workers.

        Returns the videos and last-frame PNGs written, sorted; a second call returns the same.
        """
        if self._stopped:
            return self._paths
        self._stopped = True
        if self in Recorder._live:
            Recorder._live.remove(self)
        atexit.unregister(self.stop)
        while self._handles:
            self._handles.pop().remove()
        deadline = time.monotonic() + self.timeout
        for channel in self._channels:
            channel.close(deadline)
        for channel in self._channels:
            channel.thread.join(max(0.0, deadline - time.monotonic()))
        late = []
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()) + self.timeout)  # its last frame, then closing
            if process.is_alive():
                late.append(process)
                process.terminate()
                process.join(5)
        if late:
            warnings.warn(
                f"Recorder: {len(late)} worker(s) did not finish within timeout={self.timeout}s and were "
                "terminated; their last videos may be unplayable",
                RuntimeWarning,
                stacklevel=2,
            )
        self._paths = sorted(
            path
            for stem in self._stem2key
            for path in (self.out_dir / f"{stem}{self.suffix}", self.out_dir / f"{stem}.png")
            if path.exists()
        )
        return self._paths

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else ("inactive on this rank" if not self.active else "running")
        return f"Recorder({str(self.out_dir)!r}, {len(self._stem2key)} files, {state}, dropped={self.dropped})"
