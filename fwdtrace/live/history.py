"""A live run's history on disk: every summarised sample and scalar, bounded, readable while it grows.

A run directory holds ``history.h5`` (this store), ``graph.json`` (the traced graph) and
``keys.json`` (the module keys with their classes and parameter counts), so a finished run
is reopened without the model (``fwdtrace serve --logdir DIR``).

Inside ``history.h5`` each series, one per ``(key, kind, role)``, is a group ``series/N``
(attributes ``key``, ``kind``, ``role``, ``bins``) with two chunked datasets that grow by one
row per summarised tensor: ``meta`` (``seq``, ``step``, ``call``, ``index``, ``time``) and
``values`` (the statistics named in :data:`STATS`, the histogram's counts, then the edges
they were counted with: bins re-bin, so each row keeps its own). Scalars are groups
``scalars/N`` (attribute ``name``) with one dataset ``meta`` (``seq``, ``step``, ``time``,
``value``). Reads take the small ``meta`` dataset whole and only the ``values`` rows asked for.

Retention: at most ``retention`` rows per series and per scalar (10 000 by default); past it
each dataset is a ring, the oldest row overwritten by the newest (``seq`` orders them), in
place, so the file stops growing. A row takes ``8 * (len(STATS) + 2 * bins + 1) + 40`` bytes
(656 at 32 bins): a series at the default retention stays under 7 MB; a layer armed forward
has two (input and output). Rows are not compressed: HDF5 writes a rewritten compressed chunk
to new space, and the file would outgrow the retention.

Writes come from one thread (the sampler's summariser: samples as they are summarised, the
scalars logged since its last pass about once a second and at stop), reads from the HTTP
threads of the same process; one lock covers the file. The file is written in
HDF5's single-writer/multiple-reader mode (SWMR) and flushed after every append, so what
an append wrote is on disk when it returns and the file stays valid if the process dies: a
hard kill (SIGKILL, a crashed node) loses only the append in flight, and the new series
being created at that moment, if one was (series and scalars are created outside SWMR
mode, which cannot create objects). A run whose writer was killed reopens read-only;
writing into it again is refused (HDF5 marks the file as still open for writing). A
read-only history (``fwdtrace serve --logdir`` beside a running run) takes no file lock,
so it never stops the writer adding a series; it shows the run as it was when opened. A
series the writer could not add (a full disk) leaves the history open: the next write tries
again, and when space returns writing resumes (clearing the "open for writing" flags a close
that could not write left on the file, as ``h5clear -s`` would).
h5py is imported here, only when a history is opened.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from .._files import write_bytes
from .._hdf5 import check_dataset, check_link, check_stored
from ..errors import FwdtraceError, describe, one_line

__all__ = ["History", "STATS", "DEFAULT_RETENTION", "HISTORY_FILE", "GRAPH_FILE", "KEYS_FILE"]

HISTORY_FILE, GRAPH_FILE, KEYS_FILE = "history.h5", "graph.json", "keys.json"
FORMAT_ATTR, FORMAT_VERSION = "fwdtrace_live_history", 1
DEFAULT_RETENTION = 10_000
_MAX_RUN_FILE = 256 << 20  # graph.json and keys.json: a graph of a million nodes stays below
STATS = ("numel", "mean", "std", "min", "max", "nan", "inf", "zero_fraction", "underflow", "overflow")
_COUNTS = ("numel", "nan", "inf", "underflow", "overflow")  # statistics served as ints
_CHUNK_ROWS = 64  # rows per HDF5 chunk: a read decompresses whole chunks, an append rewrites one
_SERIES_META = np.dtype([("seq", "<i8"), ("step", "<i8"), ("call", "<i8"), ("index", "<i8"), ("time", "<f8")])
_SCALAR_META = np.dtype([("seq", "<i8"), ("step", "<i8"), ("time", "<f8"), ("value", "<f8")])


def _h5py() -> Any:
    try:
        import h5py
    except ImportError as e:  # pragma: no cover - h5py is a dependency
        raise FwdtraceError("a live history on disk needs h5py: pip install h5py") from e
    return h5py


class _FileState:
    """The history's open file, and how many times it was (re)opened: rings attach to the one open now."""

    def __init__(self) -> None:
        self.file: Any = None
        self.generation = 0


class _Ring:
    """One series or scalar: its datasets and how many rows were ever appended (the ring keeps the newest).

    Its datasets are looked up again, when next used, after the file was reopened (a series being
    added): doing it for every ring at each reopen cost time growing with the number of series.
    """

    def __init__(self, state: _FileState, path: str, order: int) -> None:
        self.path, self.order = path, order  # the group's path: objects of a closed file forget theirs
        self._state, self._generation = state, -1
        n = self.meta.shape[0]
        self.appended = int(self.meta["seq"].max()) + 1 if n else 0

    def _attach(self) -> None:
        if self._generation != self._state.generation:
            self._group = self._state.file[self.path]
            self._meta = self._group["meta"]
            self._values = self._group["values"] if "values" in self._group else None
            self._generation = self._state.generation

    @property
    def group(self) -> Any:
        self._attach()
        return self._group

    @property
    def meta(self) -> Any:
        self._attach()
        return self._meta

    @property
    def values(self) -> Any:
        self._attach()
        return self._values

    def span(self) -> dict[str, Any]:
        """Rows kept, rows ever appended, and the first and last step kept (None when empty)."""
        steps = self.meta["step"] if self.meta.shape[0] else np.zeros(0, np.int64)
        return {"rows": len(steps), "appended": self.appended,
                "first_step": int(steps.min()) if len(steps) else None,
                "last_step": int(steps.max()) if len(steps) else None}

    def logical(self) -> tuple[np.ndarray, np.ndarray]:
        """Every kept ``meta`` row and its physical row number, oldest first."""
        meta = self.meta[:]
        where = np.arange(len(meta))
        order = np.argsort(meta["seq"], kind="stable")
        return meta[order], where[order]


class History:
    """The on-disk history of a live run: series of summaries per ``(key, kind, role)`` and scalars.

    >>> import tempfile
    >>> from fwdtrace.live.history import History
    >>> with History(tempfile.mkdtemp(), retention=2) as history:
    ...     for step in (1, 2, 3):
    ...         history.append("0.Linear", "forward", "output", step=step, time=0.0,
    ...                        stats={"mean": step / 2}, histogram=[1, 2], bin_edges=[0.0, 1.0, 2.0])
    ...     [(r["step"], r["mean"]) for r in history.rows("0.Linear", "forward", "output")]
    [(2, 1.0), (3, 1.5)]

    ``logdir`` is a new or empty directory (made if missing), or a run written before, which
    is continued (its retention stays, a different one is refused). ``read_only`` opens a
    run as it is, for reading only. ``retention`` rows are kept per series and per scalar
    (default 10 000), the oldest dropped first. ``caller`` starts the error messages.
    """

    def __init__(self, logdir: str | os.PathLike[str], retention: int | None = None, read_only: bool = False,
                 caller: str = "History()") -> None:
        if retention is not None and (not isinstance(retention, int) or isinstance(retention, bool) or retention < 1):
            raise FwdtraceError(f"{caller} expected retention as a positive int (rows kept per series), "
                                f"got {describe(retention)} {retention!r}")
        self.caller, self.read_only = caller, read_only
        self.logdir = _check_logdir(logdir, read_only, caller)
        self.path = self.logdir / HISTORY_FILE
        self._lock = threading.Lock()
        self._series: dict[tuple[str, str, str], _Ring] = {}
        self._scalars: dict[str, _Ring] = {}
        self._closed = False
        self._state = _FileState()
        h5py = _h5py()
        exists = self.path.exists()
        try:
            if read_only:
                self._file = _open_for_reading(h5py, self.path)
            elif exists:
                self._file = h5py.File(self.path, "a", libver="latest")
            else:
                self._file = h5py.File(self.path, "w-", libver="latest")
                self._file.attrs[FORMAT_ATTR] = FORMAT_VERSION
                self._file.attrs["retention"] = retention or DEFAULT_RETENTION
                for name in ("series", "scalars"):
                    self._file.create_group(name)
        except OSError as e:
            why = ("its writer was killed or is still running (HDF5 marks it open for writing): reopen it read-only "
                   "with `fwdtrace serve --logdir`, and give a new logdir to write" if "already open" in str(e)
                   else str(e))
            raise FwdtraceError(f"{caller} could not open the history {str(self.path)!r}: {why}") from None
        try:
            if self._file.attrs.get(FORMAT_ATTR) != FORMAT_VERSION:
                raise FwdtraceError(f"{caller} expected {str(self.path)!r} to be a fwdtrace live history "
                                    f"(attribute {FORMAT_ATTR}={FORMAT_VERSION}), got an HDF5 file without it")
            self.retention = int(self._file.attrs["retention"])
            if exists and not read_only and retention is not None and retention != self.retention:
                raise FwdtraceError(f"{caller} expected retention={self.retention} for the run in {str(self.logdir)!r} "
                                    f"(it was written with it), got retention={retention}; give a new logdir to change it")
            if read_only:
                self._check_untrusted(h5py)
            for order, name in enumerate(sorted(self._file["series"], key=int)):
                g = self._file["series"][name]
                self._series[(g.attrs["key"], g.attrs["kind"], g.attrs["role"])] = _Ring(self._state, g.name, order)
            for order, name in enumerate(sorted(self._file["scalars"], key=int)):
                g = self._file["scalars"][name]
                self._scalars[g.attrs["name"]] = _Ring(self._state, g.name, order)
            if not read_only:
                self._file.swmr_mode = True
        except FwdtraceError:
            self._file.close()
            raise
        except Exception as e:  # a damaged or foreign file: one error naming it
            self._file.close()
            raise self._untrusted(f"which cannot be read ({one_line(e)})") from None
        except BaseException:
            self._file.close()
            raise

    @property
    def _file(self) -> Any:
        return self._state.file

    @_file.setter
    def _file(self, file: Any) -> None:
        self._state.file = file
        self._state.generation += 1  # every ring looks its datasets up again when next used

    def _untrusted(self, what: str) -> FwdtraceError:
        return FwdtraceError(f"{self.caller} expected a fwdtrace live run, got {str(self.path)!r}, {what}")

    def _check_untrusted(self, h5py: Any) -> None:
        """A run reopened is a file from elsewhere: plain objects inside it, of the layout written, sizes as stored."""
        f, error = self._file, self._untrusted
        if not 1 <= self.retention <= 1 << 30:
            raise error(f"whose retention {self.retention} is not a positive row count")
        for kind, meta_dtype in (("series", _SERIES_META), ("scalars", _SCALAR_META)):
            check_link(h5py, f, kind, repr(kind), error)
            parent = f[kind]
            if not isinstance(parent, h5py.Group):
                raise error(f"where {kind!r} is not a group")
            for name in parent:
                where = f"'{kind}/{name}'"
                check_link(h5py, parent, name, where, error)
                group = parent[name]
                if not name.isdigit() or not isinstance(group, h5py.Group):
                    raise error(f"where {where} is not a numbered group")
                attrs = ("key", "kind", "role") if kind == "series" else ("name",)
                if any(not isinstance(group.attrs.get(a), str) for a in attrs):
                    raise error(f"where {where} lacks the text attributes {', '.join(attrs)}")
                datasets: dict[str, tuple[Any, int]] = {"meta": (meta_dtype, 1)}
                if kind == "series":
                    bins = group.attrs.get("bins")
                    if not isinstance(bins, (int, np.integer)) or not 1 <= int(bins) <= 1 << 16:
                        raise error(f"where {where} has no valid 'bins' attribute")
                    datasets["values"] = (np.dtype("<f8"), len(STATS) + 2 * int(bins) + 1)
                rows = None
                for dname, (dtype, width) in datasets.items():
                    check_link(h5py, group, dname, f"{where}/{dname}", error)
                    ds = group[dname]
                    check_dataset(h5py, ds, f"{where}/{dname}", error)
                    shape = (ds.shape[0], width) if dname == "values" else (ds.shape[0],)
                    if ds.dtype != dtype or ds.shape != shape or ds.shape[0] > self.retention:
                        raise error(f"where {where}/{dname} is {ds.dtype} {ds.shape}, not the layout written")
                    if rows is not None and ds.shape[0] != rows:
                        raise error(f"where {where} has {rows} meta rows but {ds.shape[0]} values rows")
                    rows = ds.shape[0]
                    chunk = int(np.prod(ds.chunks)) * ds.dtype.itemsize if ds.chunks else 0
                    check_stored(ds, f"{where}/{dname}", error, slack=chunk)  # a chunk being written when killed

    # -- writing (one thread) ---------------------------------------------------------------------
    def _create(self, kind: str, attrs: dict[str, Any], meta: np.dtype, width: int | None) -> _Ring:
        """A new series or scalar group. SWMR mode cannot create objects: leave it, create, enter it again."""
        self._file.close()
        try:
            self._file = self._reopen()
        except OSError as e:
            raise FwdtraceError(f"{self.caller} could not reopen the history {str(self.path)!r} to add a series: "
                                f"{e}; the next write tries again") from None
        try:
            parent = self._file[kind]
            name = str(len(parent))
            group = parent.create_group(name)
            try:
                group.attrs.update(attrs)
                group.create_dataset("meta", shape=(0,), maxshape=(self.retention,), dtype=meta,
                                     chunks=(min(self.retention, 4 * _CHUNK_ROWS),))
                if width is not None:
                    # Not compressed: a compressed chunk rewritten (every append, once the ring wraps) moves to new
                    # space in the file and leaves the old behind, so the file would outgrow the retention.
                    group.create_dataset("values", shape=(0, width), maxshape=(self.retention, width), dtype="<f8",
                                         chunks=(min(self.retention, _CHUNK_ROWS), width))
            except BaseException:
                with contextlib.suppress(Exception):  # no half-made series left behind
                    del parent[name]
                raise
            path, order = group.name, len(parent) - 1
            self._file.swmr_mode = True
        except Exception as e:  # a full disk: close what is open; the next write reopens the file
            with contextlib.suppress(Exception):
                self._file.close()
            raise FwdtraceError(f"{self.caller} could not add a series to the history {str(self.path)!r}: "
                                f"{one_line(e)}; the next write tries again") from None
        return _Ring(self._state, path, order)

    def _reopen(self) -> Any:
        """The writer's own file again, in plain append mode."""
        h5py = _h5py()
        try:
            return h5py.File(self.path, "a", libver="latest")
        except OSError as e:
            if "already open for write" not in str(e):
                raise
        # Ours, left flagged as open when the disk was full and closing could not write: clear the flags.
        _clear_status_flags(h5py, self.path)
        return h5py.File(self.path, "a", libver="latest")

    def _put(self, ring: _Ring, meta: tuple, values: np.ndarray | None) -> None:
        row = ring.appended % self.retention
        if ring.appended < self.retention:
            ring.meta.resize((row + 1,))
            if ring.values is not None:
                ring.values.resize(row + 1, axis=0)
        if ring.values is not None:
            ring.values[row] = values
        ring.meta[row] = (ring.appended, *meta)  # meta last: a row counts once its seq is written
        ring.appended += 1

    def _writable(self) -> None:
        if self.read_only:
            raise FwdtraceError(f"{self.caller}: the run in {str(self.logdir)!r} is open read-only")
        if self._closed:
            raise FwdtraceError(f"{self.caller}: the history {str(self.path)!r} is closed")
        if not self._file:  # adding a series failed (a full disk): the writer still owns its run, try again
            try:
                self._file = self._reopen()
                self._file.swmr_mode = True
            except Exception as e:
                with contextlib.suppress(Exception):
                    self._file.close()
                raise FwdtraceError(f"{self.caller} could not reopen the history {str(self.path)!r}: {one_line(e)}; "
                                    "the next write tries again") from None

    def append(self, key: str, kind: str, role: str, *, step: int, time: float, stats: dict[str, Any],
               histogram: Iterable[float], bin_edges: Iterable[float], call: int = 0, index: int = 0) -> None:
        """One summarised tensor of series ``(key, kind, role)``: ``stats`` (names of :data:`STATS`; missing ones NaN),
        ``histogram`` counted with ``bin_edges``; on disk when this returns."""
        with self._lock:
            self._writable()
            self._append(key, kind, role, step, time, stats, histogram, bin_edges, call, index)
            self._file.flush()

    def _append(self, key: str, kind: str, role: str, step: int, time: float, stats: dict[str, Any],
                histogram: Iterable[float], bin_edges: Iterable[float], call: int, index: int) -> None:
        counts, edges = list(histogram), list(bin_edges)
        if len(edges) != len(counts) + 1:
            raise FwdtraceError(f"{self.caller} expected {len(counts) + 1} bin edges for {len(counts)} bins of "
                                f"{key!r} ({kind}, {role}), got {len(edges)}")
        ring = self._series.get((key, kind, role))
        if ring is None:
            ring = self._create("series", {"key": key, "kind": kind, "role": role, "bins": len(counts)},
                                _SERIES_META, len(STATS) + 2 * len(counts) + 1)
            self._series[(key, kind, role)] = ring
        bins = int(ring.group.attrs["bins"])
        if len(counts) != bins:
            raise FwdtraceError(f"{self.caller} expected {bins} histogram bins for {key!r} ({kind}, {role}), "
                                f"as its first row had, got {len(counts)}")
        values = np.array([_number(stats.get(s)) for s in STATS] + counts + edges, dtype=np.float64)
        self._put(ring, (step, call, index, time), values)

    def append_sample(self, key: str, kind: str, sample: dict[str, Any]) -> None:
        """Every numeric tensor of a sampler's sample (the ``sink`` signature of :class:`~fwdtrace.live.sampler.Sampler`)."""
        with self._lock:
            self._writable()
            for t in sample["tensors"]:
                if t.get("numeric") and t.get("bin_edges"):
                    self._append(key, kind, t["role"], sample["step"], sample["time"], t, t["histogram"],
                                 t["bin_edges"], sample.get("call", 0), t.get("index", 0))
            self._file.flush()

    def append_scalar(self, name: str, value: float, step: int, time: float) -> None:
        """One value of scalar series ``name``; on disk when this returns."""
        self.append_scalars([(name, step, time, value)])

    def append_scalars(self, points: Iterable[tuple[str, int, float, float]]) -> None:
        """Values of scalar series, ``(name, step, time, value)`` each, in the order logged; on disk when this returns.

        Each series' points are written as one slice (two where its ring wraps), then the file flushed once.
        """
        by_name: dict[str, list[tuple[int, float, float]]] = {}
        for name, step, when, value in points:
            if not isinstance(name, str) or not name:
                raise FwdtraceError(f"{self.caller} expected a scalar's name as a non-empty str, got {describe(name)} {name!r}")
            by_name.setdefault(name, []).append((step, when, _number(value)))
        with self._lock:
            self._writable()
            for name, rows in by_name.items():
                ring = self._scalars.get(name)
                if ring is None:
                    ring = self._scalars[name] = self._create("scalars", {"name": name}, _SCALAR_META, None)
                self._put_meta(ring, rows)
            self._file.flush()

    def _put_meta(self, ring: _Ring, rows: list[tuple[int, float, float]]) -> None:
        """Append ``rows`` (``meta`` without ``seq``) to a ring without ``values``: at most two slice writes."""
        end = ring.appended + len(rows)
        first = max(ring.appended, end - self.retention)  # of more than the ring holds, only the newest are kept
        block = np.array([(first + i, *r) for i, r in enumerate(rows[first - end:])], dtype=ring.meta.dtype)
        if ring.meta.shape[0] < min(end, self.retention):
            ring.meta.resize((min(end, self.retention),))
        start = first % self.retention
        head = min(len(block), self.retention - start)
        ring.meta[start:start + head] = block[:head]
        if head < len(block):  # the ring wrapped: the rest overwrites its oldest rows
            ring.meta[:len(block) - head] = block[head:]
        ring.appended = end

    def write_run(self, graph_json: str | None = None, keys: list[dict[str, Any]] | None = None) -> None:
        """Write the run's graph JSON and key table beside the history (atomically), for reopening without the model."""
        if graph_json is not None:
            write_bytes(self.logdir / GRAPH_FILE, graph_json.encode(), self.caller)
        if keys is not None:
            write_bytes(self.logdir / KEYS_FILE, json.dumps(keys).encode(), self.caller)

    # -- reading (any thread) ---------------------------------------------------------------------
    def graph_json(self) -> str | None:
        """The run's graph as JSON text, None if it was never traced."""
        return self._run_file(GRAPH_FILE)

    def keys(self) -> list[dict[str, Any]]:
        """The run's module keys, as ``/api/keys`` served them (``[]`` if they were never written)."""
        text = self._run_file(KEYS_FILE)
        if text is None:
            return []
        try:
            keys = json.loads(text)
        except ValueError as e:
            raise FwdtraceError(f"{self.caller} could not read {str(self.logdir / KEYS_FILE)!r}: {e}") from None
        if not isinstance(keys, list) or not all(isinstance(k, dict) for k in keys):
            raise FwdtraceError(f"{self.caller} expected {str(self.logdir / KEYS_FILE)!r} to hold a list of keys")
        return keys

    def _run_file(self, name: str) -> str | None:
        """A text file of the run beside the history: a regular file, not a link, of a bounded size; None if missing."""
        path = self.logdir / name
        if not path.exists() and not path.is_symlink():
            return None
        what = ("a symbolic link, not followed" if path.is_symlink() else "not a regular file" if not path.is_file()
                else f"{path.stat().st_size} bytes, over {_MAX_RUN_FILE}" if path.stat().st_size > _MAX_RUN_FILE else None)
        if what is not None:
            raise FwdtraceError(f"{self.caller} expected {str(path)!r} to be the run's {name}, got {what}")
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise FwdtraceError(f"{self.caller} could not read {str(path)!r}: {e}") from None

    def series(self) -> list[dict[str, Any]]:
        """Every series: key, kind, role, rows kept, rows appended, first and last step kept."""
        with self._lock:
            return [{"key": key, "kind": kind, "role": role, **ring.span()}
                    for (key, kind, role), ring in sorted(self._series.items(), key=lambda kv: kv[1].order)]

    def scalar_series(self) -> list[dict[str, Any]]:
        """Every scalar: name, rows kept, rows appended, first and last step kept (the span a page can scroll over)."""
        with self._lock:
            return [{"name": name, **ring.span()}
                    for name, ring in sorted(self._scalars.items(), key=lambda kv: kv[1].order)]

    def scalar_names(self) -> list[str]:
        with self._lock:
            return sorted(self._scalars, key=lambda n: self._scalars[n].order)

    def rows(self, key: str, kind: str, role: str, before: int | None = None, limit: int | None = None
             ) -> list[dict[str, Any]]:
        """The kept rows of one series with step below ``before``, the newest ``limit`` of them, oldest first."""
        with self._lock:
            ring = self._series.get((key, kind, role))
            if ring is None:
                return []
            meta, where = ring.logical()
            chosen = _newest_below(meta, before, limit)
            return self._read(ring, meta[chosen], where[chosen])

    def _read(self, ring: _Ring, meta: np.ndarray, where: np.ndarray) -> list[dict[str, Any]]:
        """The rows at physical positions ``where``, reading only the span of ``values`` they lie in."""
        if not len(where):
            return []
        lo, hi = int(where.min()), int(where.max())
        assert ring.values is not None
        values = ring.values[lo:hi + 1]
        bins = int(ring.group.attrs["bins"])
        out = []
        for m, w in zip(meta, where, strict=True):
            v = values[w - lo]
            row: dict[str, Any] = {"seq": int(m["seq"]), "step": int(m["step"]), "call": int(m["call"]),
                                   "index": int(m["index"]), "time": float(m["time"])}
            for name, x in zip(STATS, v[:len(STATS)], strict=True):
                row[name] = int(x) if name in _COUNTS and math.isfinite(x) else float(x)
            row["histogram"] = [int(c) for c in v[len(STATS):len(STATS) + bins]]
            row["bin_edges"] = [float(e) for e in v[len(STATS) + bins:]]
            out.append(row)
        return out

    def samples(self, key: str, kind: str, before: int | None = None, limit: int = 64) -> list[dict[str, Any]]:
        """The newest ``limit`` samples of ``(key, kind)`` with step below ``before``, oldest first, shaped as the
        sampler's samples (one dict per sampled call, its tensors of every role; no shapes, dtypes or raw values)."""
        with self._lock:
            rings = sorted(((role, ring) for (k, kd, role), ring in self._series.items() if (k, kd) == (key, kind)),
                           key=lambda r: r[1].order)
            metas = []
            for role, ring in rings:
                meta, where = ring.logical()
                keep = meta["step"] < before if before is not None else np.ones(len(meta), bool)
                metas.append((role, ring, meta[keep], where[keep]))
            # The tensors of one sampled call share its submit time and call number; only their rows are read.
            step, time, call = (np.concatenate([meta[f] for _, _, meta, _ in metas] or [np.zeros(0)])
                                for f in ("step", "time", "call"))
            order = np.lexsort((call, time, step))  # plain arrays: sorting a structured one is many times slower
            step, time, call = step[order], time[order], call[order]
            new = np.ones(len(order), bool)
            new[1:] = (step[1:] != step[:-1]) | (time[1:] != time[:-1]) | (call[1:] != call[:-1])
            last = np.nonzero(new)[0][-limit:] if limit else np.zeros(0, np.int64)
            by_call: dict[tuple[float, int], dict[str, Any]] = {
                (t, c): {"step": s, "call": c, "time": t, "tensors": []}
                for s, t, c in zip(step[last].tolist(), time[last].tolist(), call[last].tolist(), strict=True)}
            for role, ring, meta, where in metas:
                near = np.nonzero(np.isin(meta["time"], time[last]))[0]  # then the exact pairs, of these few
                chosen = [i for i in near if (float(meta[i]["time"]), int(meta[i]["call"])) in by_call]
                for r in self._read(ring, meta[chosen], where[chosen]):
                    t = {k: v for k, v in r.items() if k not in ("seq", "step", "call", "time")}
                    by_call[(r["time"], r["call"])]["tensors"].append({"role": role, **t, "numeric": True, "raw": False})
        return list(by_call.values())

    def scalars(self, name: str, before: int | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        """The kept values of scalar ``name`` with step below ``before``, the newest ``limit``, oldest first."""
        with self._lock:
            ring = self._scalars.get(name)
            if ring is None:
                return []
            meta, _ = ring.logical()
        meta = meta[_newest_below(meta, before, limit)]
        return [{"step": int(m["step"]), "time": float(m["time"]), "value": float(m["value"])} for m in meta]

    def close(self) -> None:
        """Flush and close the file; calling it twice is harmless."""
        with self._lock:
            self._closed = True
            if self._file:
                self._file.close()

    def __enter__(self) -> History:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"History({str(self.logdir)!r}, {len(self._series)} series, {len(self._scalars)} scalars)"


def _newest_below(meta: np.ndarray, before: int | None, limit: int | None) -> np.ndarray:
    """The positions in ``meta`` (oldest first) of the newest ``limit`` rows with step below ``before``."""
    chosen = np.nonzero(meta["step"] < before)[0] if before is not None else np.arange(len(meta))
    return chosen[len(chosen) - limit:] if limit is not None and limit < len(chosen) else chosen


def _number(x: Any) -> float:
    return math.nan if x is None else float(x)


def _ignoring_status_flags(h5py: Any) -> Any:
    """File-access properties that open a file flagged "open for writing" (what ``h5clear -s`` uses).

    h5py has no call for it: HDF5's own ``clear_status_flags`` property, set through its C API.
    Opened for reading, the file is left as it is; opened for writing, the flags are cleared.
    """
    import ctypes
    import glob

    libs = glob.glob(os.path.join(os.path.dirname(h5py.__file__), os.pardir, "h5py.libs", "libhdf5-*.so*"))
    lib = ctypes.CDLL(libs[0]) if libs else ctypes.CDLL(h5py.h5.__file__)  # the library h5py itself runs on
    fapl = h5py.h5p.create(h5py.h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5py.h5f.LIBVER_LATEST, h5py.h5f.LIBVER_LATEST)
    fapl.set_file_locking(False, True)
    clear = ctypes.c_bool(True)
    lib.H5Pset.argtypes = [ctypes.c_int64, ctypes.c_char_p, ctypes.c_void_p]
    if lib.H5Pset(fapl.id, b"clear_status_flags", ctypes.byref(clear)) < 0:
        raise OSError("HDF5 has no clear_status_flags property here")
    return fapl


def _clear_status_flags(h5py: Any, path: Path) -> None:
    """Clear the "open for writing" flags a writer whose close failed (a full disk) left (the writer only)."""
    fapl = _ignoring_status_flags(h5py)
    fapl.set_file_locking(True, True)  # a live writer's lock still refuses
    h5py.h5f.open(os.fsencode(path), h5py.h5f.ACC_RDWR, fapl=fapl).close()


def _open_for_reading(h5py: Any, path: Path) -> Any:
    """A run's history for reading, without a file lock (a reader's lock would stop its writer adding a series).

    A finished run opens plainly: a damaged one fails at once, where HDF5's single-writer/multiple-reader
    mode would retry a bad checksum with back-off for hours. Only a file still flagged as open for writing
    (a live writer, or a killed one) is opened in that mode, which alone reads it.
    """
    if path.is_symlink():
        raise OSError(f"{path.name} is a symbolic link, not followed")
    try:
        return h5py.File(path, "r", libver="latest", locking=False)
    except OSError as e:
        if "already open for write" not in str(e):
            raise
    try:
        return h5py.File(path, "r", libver="latest", swmr=True, locking=False)
    except OSError as e:
        if "not already open for SWMR writing" not in str(e):
            raise
    # Flagged open for plain writing: a writer killed while it added a series. Read it as it is.
    return h5py.File(h5py.h5f.open(os.fsencode(path), h5py.h5f.ACC_RDONLY, fapl=_ignoring_status_flags(h5py)))


def _check_logdir(logdir: Any, read_only: bool, caller: str) -> Path:
    """``logdir`` as a Path to a directory fit for a run (made if missing and writing), else a clear error."""
    if not isinstance(logdir, (str, os.PathLike)):
        raise FwdtraceError(f"{caller} expected logdir as a directory path (str or Path), got {describe(logdir)}")
    path = Path(logdir)
    if read_only:
        if not path.is_dir():
            what = "which does not exist" if not path.exists() else "which is not a directory"
            raise FwdtraceError(f"{caller} expected logdir as the directory of a fwdtrace live run, got {str(path)!r}, {what}")
        if not (path / HISTORY_FILE).is_file():
            raise FwdtraceError(f"{caller} expected logdir as the directory of a fwdtrace live run (holding "
                                f"{HISTORY_FILE}), got {str(path)!r}, which has no {HISTORY_FILE}")
        return path
    if path.exists() and not path.is_dir():
        raise FwdtraceError(f"{caller} expected logdir as a directory (new, empty, or a fwdtrace live run), "
                            f"got {str(path)!r}, which is a file")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FwdtraceError(f"{caller} could not make the logdir {str(path)!r}: {e.strerror or e}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise FwdtraceError(f"{caller} expected logdir as a directory it can write, got {str(path)!r}, "
                            "which this process may not write")
    if not (path / HISTORY_FILE).exists():
        others = sorted(p.name for p in path.iterdir())
        if others:
            shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
            raise FwdtraceError(f"{caller} expected logdir as a new or empty directory, or a fwdtrace live run "
                                f"(holding {HISTORY_FILE}), got {str(path)!r}, which holds other files ({shown})")
    return path
