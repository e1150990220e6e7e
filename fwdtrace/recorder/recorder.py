"""The training side of the recorder: hooks that hand small copies of tensors to worker processes.

The training step never waits on a worker. A hook cuts its tensor down to what the pictures
need, copies it to CPU numpy (no CUDA tensor crosses a process), and appends it to its file's
bounded queue in this process, dropping that file's oldest item when full (and counting it); a
thread per worker takes the files in turn and sends their items down a socket. A slow worker fills
its pipe, the queues drop old frames, every file keeps its share, and training goes on at full
speed. The same thread watches its worker: one that dies is reported and restarted.
"""

from __future__ import annotations

import atexit
import functools
import glob
import hashlib
import json
import multiprocessing.spawn
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import quote

import torch

from .._tree import tensors_of
from ..errors import FwdtraceError, check_callback, describe
from ..instrument.attach import Attachment
from ..instrument.bins import DEFAULT_BINS, check_bins_spec
from ..instrument.compiled import eager_module, graph_routable
from ..instrument.ingraph import Slot
from ..instrument.keys import Selector, key2module, select_modules
from ..instrument.params import PARAMETER_KINDS, module_parameters, parameter_value
from . import worker as worker_module
from .views import VIEWS, reduce

__all__ = ["Recorder", "file_stem"]

_KINDS = ("forward", "grad", "both", *PARAMETER_KINDS)
# What a frame of each kind shows, in its title: a gradient says which side of the layer it is on.
_LABELS = {"forward": "output", "grad": "grad_output", "weight": "weight", "weight_grad": "weight_grad (.grad)"}
_STEM_MAX = 160  # characters of a file stem: room left for ".partial-xxxxxxxx.mp4" under the usual 255


def _rank() -> tuple[int, int]:
    """(rank, world size) under torch.distributed, or as torchrun's environment says before it starts."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    except ValueError:
        return 0, 1


def file_stem(text: str) -> str:
    """A file name for ``text`` inside one folder: the same for the same text, distinct for distinct texts.

    >>> file_stem("blocks.0.Linear.forward"), file_stem("/abs/dir/x.Linear.forward"), file_stem(".hidden")
    ('blocks.0.Linear.forward', '%2Fabs%2Fdir%2Fx.Linear.forward', '%2Ehidden')

    Letters, digits and ``._-~`` stay as they are (module keys read as themselves); any other
    character is %-escaped, ``%`` included, so no name holds a ``/`` and no two texts share a
    name; a leading dot is escaped (no hidden files). A stem longer than 160 characters is cut
    and ends with a hash of the whole text.
    """
    stem = quote(text, safe="")
    if stem.startswith("."):
        stem = "%2E" + stem[1:]  # quote() never writes "%2E", so this stays one-to-one
    if len(stem) > _STEM_MAX:
        stem = f"{stem[: _STEM_MAX - 17]}~{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    return stem


@dataclass
class _FileStats:
    """What became of one file's frames: ``recorded`` is ``sent`` + ``dropped`` + what is still queued.

    ``not_drawn``: of those sent, the frames the worker could not draw (``error`` says the first reason).
    """

    key: str
    kind: str
    recorded: int = 0
    sent: int = 0
    dropped: int = 0
    not_drawn: int = 0
    error: str = ""


def _how_it_ended(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class _Channel:
    """Per-file drop-oldest queues in the training process and the thread that feeds them to one worker.

    ``size`` is shared equally between the channel's files (at least one item each), and the
    thread takes the files in turn: a worker that falls behind draws every file at the same rate,
    and each file drops only its own oldest items. (One shared queue dropped the oldest item
    overall; read at the same point of every step, its head was always the same file.) The worker
    hands back a credit per frame drawn and the thread takes an item only once it holds one, so
    at most ``IN_FLIGHT`` items sit in the pipe and the backlog stays here, where dropping is fair.

    The thread also watches its worker (at least every ``WATCH_S`` s): a worker that died is
    reported through ``on_death`` and replaced by ``spawn()``, at most ``RESTARTS`` times; after
    that the channel is failed and its frames are dropped (counted).
    """

    IN_FLIGHT = 2
    WATCH_S = 0.5
    RESTARTS = 2

    def __init__(
        self,
        name: str,
        spawn: Callable[[], tuple[Any, Any, Any]],
        size: int,
        on_death: Callable[[_Channel, int, str, bool], None],
    ) -> None:
        self.name = name
        self.spawn = spawn
        self.size = size
        self.on_death = on_death
        self.conn, self.credits, self.process = spawn()
        self.stats: dict[str, _FileStats] = {}
        self.queues: dict[str, deque[tuple]] = {}
        self.turns: deque[str] = deque()  # the files with queued items, in the order they are served
        self.deaths: list[str] = []  # how each worker of this channel died
        self.reports: list[dict[str, Any]] = []  # what each worker that stopped cleanly did
        self.failed = False
        self.ready = threading.Condition()
        self.closing = False
        self.deadline = float("inf")
        self.thread = threading.Thread(target=self._send_loop, name="fwdtrace-recorder-sender", daemon=True)
        self.thread.start()

    def add(self, stem: str, key: str, kind: str) -> None:
        with self.ready:
            self.stats[stem] = _FileStats(key, kind)
            self.queues[stem] = deque()

    def put(self, stem: str, item: tuple) -> None:
        with self.ready:
            stats = self.stats[stem]
            stats.recorded += 1
            if self.failed:
                stats.dropped += 1
                return
            queue = self.queues[stem]
            if not queue:
                self.turns.append(stem)
            else:
                share = max(1, self.size // len(self.queues))
                while len(queue) >= share:
                    queue.popleft()
                    stats.dropped += 1
            queue.append(item)
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
                if not self.turns and not self.closing:
                    self.ready.wait(self.WATCH_S)
                if self.closing and (not self.turns or self._late()):
                    break
                queued = bool(self.turns)
            if not self.process.is_alive():
                if self._replace_worker():
                    continue
                break
            # Wait for the worker to take a frame; meanwhile the queues keep dropping their oldest.
            if not queued or not self.credits.acquire(timeout=0.1):
                continue
            with self.ready:  # only this thread takes items, so there is still one
                stem = self.turns.popleft()
                queue = self.queues[stem]
                item = queue.popleft()
                if queue:
                    self.turns.append(stem)
            try:
                self.conn.send(item)
            except (OSError, ValueError):  # the worker is gone: the next round sees it
                with self.ready:
                    self.stats[stem].dropped += 1
                self.process.join(self.WATCH_S)
            else:
                self.stats[stem].sent += 1  # only this thread writes sent
        with self.ready:
            for stem, queue in self.queues.items():
                self.stats[stem].dropped += len(queue)
                queue.clear()
            self.turns.clear()
        if not self.failed:
            try:
                self.conn.send(worker_module.STOP)
            except (OSError, ValueError):
                pass
            else:  # its last frames, its files closed, then its report
                report = self.credits.report(self.deadline + self.WATCH_S)
                if report is not None:
                    self.reports.append(report)
                    for stem, count in report.get("not_drawn", {}).items():
                        if stem in self.stats:
                            self.stats[stem].not_drawn += int(count)
                    for stem, why in report.get("errors", {}).items():
                        if stem in self.stats and not self.stats[stem].error:
                            self.stats[stem].error = str(why)
        self.conn.close()  # here, not in stop(): closing under a send in progress breaks the send

    def _replace_worker(self) -> bool:
        """Report the dead worker and start another; False (the channel failed) when that is not possible."""
        pid, how = self.process.pid, _how_it_ended(self.process.exitcode)
        self.deaths.append(how)
        self.conn.close()
        restart = not self.closing and len(self.deaths) <= self.RESTARTS
        if restart:
            try:
                self.conn, self.credits, self.process = self.spawn()
            except Exception as e:  # out of memory or processes: give up on this channel, not on training
                how += f"; starting another failed: {e}"
                restart = False
        if not restart:
            with self.ready:
                self.failed = True
        self.on_death(self, pid, how, restart)
        return restart


class _Credits:
    """The parent's end of a worker's credits: one per frame the worker drew, read from its socket.

    ``acquire`` takes one (waiting at most ``timeout``), as a semaphore's would; :meth:`report`
    reads what the worker says when it stops (frames drawn, seconds drawing).
    """

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.available = _Channel.IN_FLIGHT
        self.last: dict[str, Any] | None = None

    def _read(self, timeout: float) -> bool:
        """Read one message if one comes within ``timeout``; False on none or a closed socket."""
        try:
            if not self.conn.poll(timeout):
                return False
            data = self.conn.recv_bytes()
        except (EOFError, OSError):
            return False
        if data == worker_module.CREDIT:
            self.available += 1
        else:
            self.last = json.loads(data)
        return True

    def acquire(self, timeout: float) -> bool:
        if not self.available:
            self._read(timeout)
        if not self.available:
            return False
        self.available -= 1
        return True

    def report(self, deadline: float) -> dict[str, Any] | None:
        """The worker's report, read until ``deadline`` (None if it came not, as from a killed worker)."""
        while self.last is None and self._read(max(0.0, deadline - time.monotonic())):
            pass
        return self.last


def _worker_env() -> dict[str, str]:
    """The environment of a worker: this one, with the folder this fwdtrace was imported from first on its path."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}


class _WorkerProcess:
    """A worker started with ``subprocess``, answering as a ``multiprocessing.Process`` does."""

    def __init__(self, popen: subprocess.Popen, name: str) -> None:
        self.popen, self.name, self.pid = popen, name, popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()  # negative: killed by that signal, as multiprocessing says

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self.is_alive():
            self.popen.terminate()


def _on_output(record: Callable[[Any], None]) -> Callable[[torch.nn.Module, Any, Any], None]:
    def hook(module: torch.nn.Module, inputs: Any, output: Any) -> None:
        record(output)

    return hook


def _on_copies(record: Callable[[Any], None]) -> Callable[[Any], None]:
    """What a compiled model's forward copies (``(inputs, outputs)``) go to after the graph: the outputs."""
    def taken(payload: tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]) -> None:
        record([t for _, t in payload[1]])

    return taken


def _on_grad_output(record: Callable[[Any], None]) -> Callable[[torch.nn.Module, Any, Any], None]:
    def hook(module: torch.nn.Module, grad_input: Any, grad_output: Any) -> None:
        record(grad_output)

    return hook


def _on_parameter(name2record: dict[str, Callable[[Any], None]]) -> Callable[[str, torch.Tensor], None]:
    def hook(name: str, parameter: torch.Tensor) -> None:
        record = name2record.get(name)
        if record is not None:
            record(parameter)

    return hook


class Recorder:
    """Pictures of layer activations and gradients over training, one video per key, drawn in worker processes.

    >>> import torch, fwdtrace, tempfile
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> with fwdtrace.Recorder(tempfile.mkdtemp()) as rec:
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
    to CPU and cuts it down to what the views draw. ``queue_size`` items wait per worker,
    shared equally by the files it draws (at least one each); a file whose share is full drops
    its oldest item, and the worker takes the files in turn (``rec.dropped`` counts the drops,
    ``rec.dropped_by`` per file, :meth:`stats` says what became of every frame).
    ``workers`` processes start on the first :meth:`track` (``rec.processes``) and draw the
    files between them; a worker that dies is reported (a ``RuntimeWarning`` naming its files)
    and restarted, twice at most, after which its files are marked failed. Workers exit within
    ``timeout`` seconds of a parent that died, and ``stop()`` waits at most that long for queued
    frames. Files are named ``{key}.{kind}.mp4`` (:func:`file_stem` escapes characters such as
    ``/``: every file stays inside ``out_dir``) and appear only when finished; under
    torch.distributed every rank writes its own files, ``{key}.{kind}.rank{r}.mp4``, or only the
    ranks in ``ranks``.
    Workers run ``python -m fwdtrace.recorder``, never the user's script: no
    ``if __name__ == "__main__":`` is needed (POSIX: a worker inherits its socket). ``bins``: the
    histograms' bins, a count (edges from a running range that grows by doubling when a value
    leaves it, so the axes hold still and a video shows drift) or the edges themselves.
    :meth:`throughput` and ``finish_s`` say how fast the workers drew.
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
        bins: int | Sequence[float] = DEFAULT_BINS,
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
        spec = check_bins_spec(bins, "Recorder")
        if transform is not None:
            check_callback(transform, "Recorder", "(tensor)", name="transform")
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
        self.bins = spec
        self.views = views
        self.fps = fps
        self.timeout = float(timeout)
        self.transform = transform
        self.rank = rank
        self.world_size = world
        self.active = ranks is None or rank in ranks
        self.suffix = worker_module.video_suffix()
        self._channels: list[_Channel] = []
        self._handles: list[Any] = []
        self._stem2key: dict[str, tuple[str, int]] = {}  # stem -> (key, id of the module)
        self._stopped = False
        self._paths: list[Path] = []
        self._queue_size = queue_size
        self._workers = workers
        self.finish_s: float | None = None  # how long stop() waited for the workers
        Recorder._live.append(self)

    # -- what is recorded -------------------------------------------------------------------------
    def track(
        self,
        model: torch.nn.Module,
        keys: Selector | None = None,
        kind: str | Iterable[str] = "forward",
        name: str | None = None,
    ) -> list[str]:
        """Record the outputs, output gradients, parameters or parameter gradients of the selected modules.

        >>> import torch, fwdtrace, tempfile
        >>> rec = fwdtrace.Recorder(tempfile.mkdtemp())
        >>> rec.track(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()), torch.nn.ReLU, kind="both")
        ['1.ReLU']
        >>> _ = rec.stop()

        ``keys`` takes what :class:`~fwdtrace.Probe` selectors take: a module key, a glob,
        a class or a list of them; ``None`` is every leaf module. ``kind`` is one of, or a list of:
        ``"forward"`` (the module's output; its first tensor when it returns several, the title
        says which), ``"grad"`` (the gradient of the loss with respect to that output, the
        ``grad_output`` of a full backward hook), ``"both"`` (those two), ``"weight"`` and
        ``"weight_grad"`` (each parameter under the module and its ``.grad``, taken once per backward,
        after the gradient is accumulated and before the optimizer steps: one file per
        parameter, ``{key}.{parameter}.{kind}``, e.g. ``0.Linear.bias.weight_grad``). ``name``
        prefixes the file names (for two models with the same keys). Returns the keys tracked.
        """
        if self._stopped:
            raise FwdtraceError("Recorder.track() expected a running recorder, got one already stopped")
        if not isinstance(model, torch.nn.Module):
            raise FwdtraceError(f"Recorder.track() expected a torch.nn.Module as model, got {describe(model)}")
        asked = [kind] if isinstance(kind, str) else list(kind) if isinstance(kind, Iterable) else [kind]
        if not asked or any(not isinstance(k, str) or k not in _KINDS for k in asked):
            raise FwdtraceError(
                f"Recorder.track() expected kind as one of {', '.join(_KINDS)} (or a list of them), got {kind!r}"
            )
        if name is not None and (not isinstance(name, str) or not name or "/" in name):
            raise FwdtraceError(f"Recorder.track() expected name as a non-empty str without '/', or None, got {name!r}")
        k2m = key2module(model)
        if keys is None:
            selected = {k: m for k, m in k2m.items() if next(m.children(), None) is None}
        else:
            selected = select_modules(k2m, keys, "Recorder.track()", type(eager_module(model)).__name__)
        kinds = list(dict.fromkeys(k for a in asked for k in (("forward", "grad") if a == "both" else (a,))))
        plan = []  # (stem, key, kind, module, parameter name or None)
        rank = f".rank{self.rank}" if self.world_size > 1 else ""
        for key, module in selected.items():
            for k in kinds:
                # Parameter kinds: one file per parameter, the parameter's name after the module key.
                params = [p for p, _ in module_parameters(module)] if k in PARAMETER_KINDS else [None]
                for param in params:
                    what = f"{key}.{param}" if param else key
                    stem = file_stem(f"{name + '.' if name else ''}{what}.{k}{rank}")
                    seen = self._stem2key.get(stem)
                    if seen is not None and seen[1] != id(module):
                        raise FwdtraceError(
                            f"Recorder.track() expected keys not yet recorded from another model, got {key!r} "
                            f"again for {k}; pass name= to tell the models apart"
                        )
                    if seen is None:  # tracking a module twice records it once
                        plan.append((stem, key, k, module, param))
                        self._stem2key[stem] = (key, id(module))
        if not self.active or not plan:
            return list(selected)
        if not self.processes:
            self._start_workers()
        # Outputs of a torch.compile wrapper's layers are copied inside a compiled copy of it and recorded
        # after its graph; other module hooks run only outside compiled code: the model's compiled parts
        # then run eagerly while recorded.
        in_graph = graph_routable(model)
        eager = any(k == "grad" or (k == "forward" and not in_graph) for _, _, k, _, _ in plan)
        on = self._attach(Attachment(model, "Recorder.track()", "eager" if eager else "none"))
        on_graph = self._attach(Attachment(model, "Recorder.track()", "graph")) if in_graph else None
        name2record: dict[tuple[torch.nn.Module, str], dict[str, Callable[[Any], None]]] = {}
        for i, (stem, key, k, module, param) in enumerate(plan, sum(len(c.stats) for c in self._channels)):
            channel = self._channels[i % len(self._channels)]
            channel.add(stem, key, k)
            record = self._recorder_of(stem, f"{key}.{param}" if param else key, k, channel)
            if k == "forward" and on_graph is not None:
                on_graph.copies(module, Slot(_on_copies(record), key, reuse=("copies", id(module), False)), inputs=False)
            elif k == "forward":
                on.forward(module, _on_output(record))
            elif k == "grad":
                on.grads(module, _on_grad_output(record))
            elif param is not None:
                name2record.setdefault((module, k), {})[param] = record
        for (module, _), records in name2record.items():
            named = [(n, p) for n, p in module_parameters(module) if n in records]
            on.after_backward(named, _on_parameter(records))
        return list(selected)

    def _attach(self, attachment: Attachment) -> Attachment:
        self._handles.append(attachment)  # removed with the recorder's other handles when it stops
        return attachment

    def _start_workers(self) -> None:
        """Spawn the workers, on the first track() (a recorder that tracks nothing costs nothing)."""
        for i in range(self._workers):
            spawn = functools.partial(self._spawn, i)
            self._channels.append(_Channel(f"fwdtrace-recorder-{i}", spawn, self._queue_size, self._worker_died))
        atexit.register(self.stop)  # an uncaught KeyboardInterrupt outside a `with` still finalises

    def _spawn(self, index: int) -> tuple[Any, Any, Any]:
        """A new worker process: (our end of its socket, its credits, the process).

        ``python -m fwdtrace.recorder``, a fresh interpreter (no fork of a process that holds
        torch state) that imports only fwdtrace: multiprocessing's spawn re-imports the main
        script, which then needs ``if __name__ == "__main__":``. The interpreter is
        multiprocessing's (``multiprocessing.set_executable`` applies). Its own session: a
        Ctrl-C at the terminal reaches training, whose ``stop()`` ends the workers in order.
        """
        from multiprocessing.connection import Connection

        ours, theirs = socket.socketpair()
        config = {"parent_pid": os.getpid(), "out_dir": str(self.out_dir), "suffix": self.suffix,
                  "fps": self.fps, "timeout": self.timeout, "bins": self.bins}
        try:
            popen = subprocess.Popen(
                [multiprocessing.spawn.get_executable(), "-m", "fwdtrace.recorder", str(theirs.fileno()),
                 json.dumps(config)],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                env=_worker_env(),
                start_new_session=True,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()  # only the worker holds its end: it sees EOF if we die
        conn = Connection(ours.detach())
        return conn, _Credits(conn), _WorkerProcess(popen, f"fwdtrace-recorder-{index}")

    def _worker_died(self, channel: _Channel, pid: int, how: str, restarted: bool) -> None:
        """Called from the channel's thread, once per death: warn, naming the files that lose frames."""
        then = "restarted it" if restarted else "its files are marked failed and get no more frames"
        message = (
            f"Recorder: worker {channel.name} (pid {pid}) died ({how}); {then}. Files affected: "
            f"{', '.join(channel.stats)} (frames it had not drawn are lost)"
        )
        try:
            warnings.warn(message, RuntimeWarning, stacklevel=1)
        except Exception:  # warnings turned into errors must not end the thread: say it plainly
            print(message, file=sys.stderr)

    def _recorder_of(self, stem: str, key: str, kind: str, channel: _Channel) -> Callable[[Any], None]:
        """The function a hook calls on every call: with the module's output, its output gradient, or a parameter.

        The frame's title says what it shows (``_LABELS``): ``grad_output`` for a gradient, and
        which output tensor of several (``output 0 of 3``; the first is recorded).
        """
        calls = 0
        rank = f"  rank {self.rank}" if self.world_size > 1 else ""
        label = _LABELS[kind]

        def record(value: Any) -> None:
            nonlocal calls
            step, calls = calls, calls + 1
            if step % self.every:
                return
            tensors = [parameter_value(value, kind)] if kind in PARAMETER_KINDS else tensors_of(value)
            if not tensors or tensors[0] is None:
                return
            tensor = tensors[0]
            if self.transform is not None:
                tensor = self.transform(tensor)
            payload = reduce(tensor, self.views, self.bins)
            which = f"{label} 0 of {len(tensors)}" if len(tensors) > 1 else label
            channel.put(stem, (stem, f"{key}  {which}  step {step}{rank}", payload, self.views))

        return record

    @property
    def processes(self) -> list[Any]:
        """The worker processes now running (a restarted worker replaces the one that died)."""
        return [channel.process for channel in self._channels]

    @property
    def dropped_by(self) -> dict[str, int]:
        """How many items each file dropped, by file stem (``"0.Linear.forward"``)."""
        return {stem: stats.dropped for channel in self._channels for stem, stats in channel.stats.items()}

    @property
    def dropped(self) -> int:
        """How many items were dropped, all files together (per file: ``dropped_by``)."""
        return sum(self.dropped_by.values())

    def stats(self) -> dict[str, dict[str, Any]]:
        """What became of each file's frames, by file stem.

        >>> import torch, fwdtrace, tempfile
        >>> model = torch.nn.Linear(2, 2)
        >>> with fwdtrace.Recorder(tempfile.mkdtemp()) as rec:
        ...     _ = rec.track(model, "Linear")
        ...     _ = model(torch.randn(1, 2))
        >>> rec.stats()
        {'Linear.forward': {'key': 'Linear', 'kind': 'forward', 'recorded': 1, 'sent': 1, 'dropped': 0, 'not_drawn': 0, 'error': '', 'worker_deaths': 0, 'failed': False}}

        ``recorded`` is ``sent`` (to a worker) + ``dropped`` + what is still queued (nothing after
        :meth:`stop`). ``not_drawn``: frames sent that the worker could not draw, ``error`` the
        first reason (known after :meth:`stop`; :meth:`stop` warns). ``worker_deaths`` counts the deaths of the worker that draws the file;
        frames sent to a worker that then died are lost. ``failed``: no worker draws it any more.
        """
        return {
            stem: {**asdict(stats), "worker_deaths": len(channel.deaths), "failed": channel.failed}
            for channel in self._channels
            for stem, stats in channel.stats.items()
        }

    # -- lifetime ---------------------------------------------------------------------------------
    @classmethod
    def current(cls) -> Recorder:
        """The most recently made recorder not yet stopped, for code far from where it was made.

        >>> import fwdtrace, tempfile
        >>> rec = fwdtrace.Recorder(tempfile.mkdtemp())
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
        Warns (``RuntimeWarning``) when a worker had to be terminated, and names the files that
        lost frames to a worker that died during the run (:meth:`stats` has the counts); the
        unfinished videos such a worker left under their temporary names are removed.
        How long it waited for the workers after training is ``finish_s``; :meth:`throughput`
        has each worker's frames per second, and ``repr()`` says both.
        """
        if self._stopped:
            return self._paths
        self._stopped = True
        if self in Recorder._live:
            Recorder._live.remove(self)
        atexit.unregister(self.stop)
        while self._handles:
            self._handles.pop().remove()
        started = time.monotonic()
        deadline = started + self.timeout
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
        if self._channels:
            self.finish_s = time.monotonic() - started
        if late:
            warnings.warn(
                f"Recorder: {len(late)} worker(s) did not finish within timeout={self.timeout}s and were "
                "terminated; their last videos may be unplayable",
                RuntimeWarning,
                stacklevel=2,
            )
        lost = [f"{stem} ({s['worker_deaths']} worker death(s){', failed' if s['failed'] else ''})"
                for stem, s in self.stats().items() if s["worker_deaths"]]
        for stem in (stem for stem, s in self.stats().items() if s["worker_deaths"]):
            self._remove_partials(stem)
        if lost:
            warnings.warn(f"Recorder.stop(): files that lost frames to a dead worker: {', '.join(lost)}",
                          RuntimeWarning, stacklevel=2)
        undrawn = [f"{stem} ({s['not_drawn']} not drawn: {s['error']})" if s["not_drawn"] else f"{stem} ({s['error']})"
                   for stem, s in self.stats().items() if s["not_drawn"] or s["error"]]
        if undrawn:
            warnings.warn(f"Recorder.stop(): files whose frames could not all be drawn: {'; '.join(undrawn)}",
                          RuntimeWarning, stacklevel=2)
        self._paths = sorted(
            path
            for stem, stats in self.stats().items()
            if stats["sent"]
            for path in (self.out_dir / f"{stem}{self.suffix}", self.out_dir / f"{stem}.png")
            if path.is_file() and not path.is_symlink()
        )
        return self._paths

    def _remove_partials(self, stem: str) -> None:
        """The unfinished videos a killed worker left under their temporary names: unplayable, and nobody finishes them."""
        for path in self.out_dir.glob(f"{glob.escape(stem)}.partial-*{self.suffix}"):
            if path.is_file() and not path.is_symlink():
                try:
                    path.unlink()
                except OSError:  # another process took it meanwhile: nothing to clean
                    pass

    def throughput(self) -> list[dict[str, Any]]:
        """What each worker did, from the reports of those that stopped cleanly (after :meth:`stop`).

        >>> import torch, fwdtrace, tempfile
        >>> model = torch.nn.Linear(2, 2)
        >>> with fwdtrace.Recorder(tempfile.mkdtemp()) as rec:
        ...     _ = rec.track(model, "Linear")
        ...     _ = model(torch.randn(1, 2))
        >>> [(w["worker"], w["frames"]) for w in rec.throughput()]
        [('fwdtrace-recorder-0', 1)]

        One entry per worker: ``frames`` drawn, ``draw_s`` seconds spent drawing and encoding
        them (closing the files included), ``fps`` their ratio: how many frames per second one
        worker keeps up with, whatever the training did meanwhile.
        """
        out = []
        for channel in self._channels:
            frames = sum(r["frames"] for r in channel.reports)
            draw_s = sum(r["draw_s"] for r in channel.reports)
            out.append({"worker": channel.name, "frames": frames, "draw_s": draw_s,
                        "fps": frames / draw_s if draw_s > 0 else float("nan")})
        return out

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else ("inactive on this rank" if not self.active else "running")
        deaths = sum(len(channel.deaths) for channel in self._channels)
        if deaths:
            state += f", {deaths} worker death(s)"
        failed = [stem for stem, stats in self.stats().items() if stats["failed"]]
        if failed:
            state += f", failed: {', '.join(failed)}"
        if self.finish_s is not None:
            rates = ", ".join(f"{w['fps']:.1f}" for w in self.throughput())
            state += f", workers finished {self.finish_s:.1f} s after training ({rates} frames/s per worker)"
        return f"Recorder({str(self.out_dir)!r}, {len(self._stem2key)} files, {state}, dropped={self.dropped})"
