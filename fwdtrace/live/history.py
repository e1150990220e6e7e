"""A live run's history on disk: every summarised sample and scalar, bounded, readable while it grows.

A run directory holds ``history.h5`` (this store), ``graph.json`` (the traced graph) and
``keys.json`` (the module keys with their classes and parameter counts), so a finished run
is reopened without the model (``fwdtrace serve --logdir DIR``).

Inside ``history.h5`` every series, one per ``(key, kind, role)``, is a slot (a row) of
tables made once, when the file is created, and shared by all series: ``series_meta``
(``seq``, ``step``, ``call``, ``index``, ``time`` per kept row) and ``series_values`` (the
statistics named in :data:`STATS`, the histogram's counts, then the edges they were counted
with: bins re-bin, so each row keeps its own). Scalars are slots of ``scalar_meta`` (``seq``,
``step``, ``time``, ``value``). ``catalog`` names each slot (which table, which slot, its
bins, and where its JSON name lies in ``names``: ``[key, kind, role]`` or ``[name]``).
A new series takes the next free slot and appends its name: the tables grow by a batch of
slots at a time, and ``series_values`` widens for more bins, resizes HDF5 makes in
single-writer/multiple-reader mode (SWMR). So the file is opened once, a new series costs
the same few writes however many there are, and no reader ever sees the file closed. Reads
take one slot's ``meta`` row and only the ``values`` rows asked for. Files of the earlier
layout (a group per series) are read, not continued.

Retention: at most ``retention`` rows per series and per scalar (10 000 by default); past it
each slot is a ring, the oldest row overwritten by the newest (``seq`` orders them), in
place, so the file stops growing. A row takes ``8 * (len(STATS) + 2 * bins + 1) + 40`` bytes
(1 088 at 60 bins); chunks are allocated as rows reach them: a series at the default
retention stays under 11 MB; a layer armed forward has two (input and output). Rows are not
compressed: HDF5 writes a rewritten compressed chunk to new space, and the file would outgrow
the retention.

Writes come from one thread (the sampler's summariser: samples as they are summarised, the
scalars logged since its last pass about once a second and at stop; the training thread
only queues them), reads from the HTTP threads of the same process; one lock covers the
file. The file is written in SWMR mode from the first write to ``close()`` and flushed after
every append, so what an append wrote is on disk when it returns and the file stays valid if
the process dies: a hard kill (SIGKILL, a crashed node) loses only the append in flight. A
run whose writer was killed reopens read-only; writing into it again is refused (HDF5 marks
the file as still open for writing). A read-only history (``fwdtrace serve --logdir`` beside
a running run) takes no file lock; it shows the run as it was when opened. A write that
fails (a full disk) leaves the history open: the next write reopens the file and tries
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
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .._files import write_bytes
from .._hdf5 import check_dataset, check_link, check_stored
from ..errors import FwdtraceError, describe, one_line
from ..instrument.bins import DEFAULT_BINS

__all__ = ["History", "STATS", "DEFAULT_RETENTION", "HISTORY_FILE", "GRAPH_FILE", "KEYS_FILE"]

HISTORY_FILE, GRAPH_FILE, KEYS_FILE = "history.h5", "graph.json", "keys.json"
FORMAT_ATTR, FORMAT_VERSION = "fwdtrace_live_history", 2
_GROUPS_VERSION = 1  # the earlier layout, a group per series: read, not continued
DEFAULT_RETENTION = 10_000
_MAX_RUN_FILE = 256 << 20  # graph.json and keys.json: a graph of a million nodes stays below
STATS = ("numel", "mean", "std", "min", "max", "nan", "inf", "zero_fraction", "underflow", "overflow")
_COUNTS = ("numel", "nan", "inf", "underflow", "overflow")  # statistics served as ints
_CHUNK_ROWS = 64  # values rows per HDF5 chunk: a read takes whole chunks, an append rewrites one
_META_CHUNK_ROWS = 256  # meta rows per chunk: a series' meta is read whole, its rows are small
_SLOT_BATCH = 64  # slots a table grows by at once: one resize for the next 64 new series
_MAX_BINS = 1 << 16
_SERIES_META = np.dtype([("seq", "<i8"), ("step", "<i8"), ("call", "<i8"), ("index", "<i8"), ("time", "<f8")])
_SCALAR_META = np.dtype([("seq", "<i8"), ("step", "<i8"), ("time", "<f8"), ("value", "<f8")])
_CATALOG = np.dtype([("table", "u1"), ("slot", "<i8"), ("bins", "<i8"), ("name_start", "<i8"), ("name_length", "<i8")])
_SERIES, _SCALARS, _UNUSED = 0, 1, 255  # catalog tables; a catalog row not yet written reads as _UNUSED
_TABLES = {_SERIES: ("series_meta", "series_values", _SERIES_META), _SCALARS: ("scalar_meta", None, _SCALAR_META)}


def _width(bins: int) -> int:
    """Values per row of a series with ``bins`` bins: the statistics, the counts, the edges."""
    return len(STATS) + 2 * bins + 1


_VALUE_COLUMNS = _width(DEFAULT_BINS)  # values per chunk across: a row of the default bins is one chunk wide


def _h5py() -> Any:
    try:
        import h5py
    except ImportError as e:  # pragma: no cover - h5py is a dependency
        raise FwdtraceError("a live history on disk needs h5py: pip install h5py") from e
    return h5py


class _Table:
    """The datasets one kind of series shares, a slot (first index) per series; ``values`` only for layer series."""

    def __init__(self, meta: Any, values: Any) -> None:
        self.meta, self.values = meta, values
        self.used = 0  # slots handed out


class _Ring:
    """One series or scalar: its slot of a table, and how many rows were ever appended (the ring keeps the newest)."""

    def __init__(self, table: _Table, slot: int, bins: int, order: int, appended: int, stored: int | None = None
                 ) -> None:
        self.table, self.slot, self.bins, self.order, self.appended = table, slot, bins, order, appended
        self.stored = stored  # read-only: the rows of the slot's chunks the file stores, what a read may take

    def span(self) -> dict[str, Any]:
        """Rows kept, rows ever appended, and the first and last step kept (None when empty)."""
        steps = self.logical()[0]["step"]
        return {"rows": len(steps), "appended": self.appended,
                "first_step": int(steps.min()) if len(steps) else None,
                "last_step": int(steps.max()) if len(steps) else None}

    def physical(self) -> np.ndarray:
        """The slot's ``meta`` rows that may hold data (rows ever appended, at most the ring's length)."""
        rows = min(self.appended, self.table.meta.shape[1])
        return self.table.meta[self.slot, :rows if self.stored is None else min(rows, self.stored)]

    def logical(self) -> tuple[np.ndarray, np.ndarray]:
        """Every kept ``meta`` row and its physical row number, oldest first."""
        meta = self.physical()
        # A reader beside a live writer sees rows written after it opened the file: it shows the run as it was.
        where = np.nonzero((meta["seq"] >= 0) & (meta["seq"] < self.appended))[0]
        order = np.argsort(meta["seq"][where], kind="stable")
        return meta[where[order]], where[order]

    def values(self, lo: int, hi: int) -> np.ndarray:
        return self.table.values[self.slot, lo:hi + 1, :_width(self.bins)]


class _GroupRing(_Ring):
    """A series or scalar of the earlier layout, a group of its own (``meta``, and ``values`` for a layer)."""

    def __init__(self, group: Any, bins: int, order: int) -> None:
        self.group, self.bins, self.order = group, bins, order
        meta = group["meta"]
        self.appended = int(meta["seq"].max()) + 1 if meta.shape[0] else 0

    def physical(self) -> np.ndarray:
        return self.group["meta"][:]

    def values(self, lo: int, hi: int) -> np.ndarray:
        return self.group["values"][lo:hi + 1]


def _appended(meta: Any, slot: int, retention: int) -> tuple[int, int]:
    """Rows ever appended to a slot (from the newest ``seq`` in it) and the rows of its chunks that hold any,
    reading its chunks in order up to the first empty one (rows are written from the slot's start): what a
    read allocates stays within what the file stores, whatever ``seq`` it holds."""
    newest, stored = -1, 0
    for start in range(0, retention, _META_CHUNK_ROWS):
        seq = meta[slot, start:min(start + _META_CHUNK_ROWS, retention)]["seq"]
        if not (seq >= 0).any():
            break
        newest, stored = max(newest, int(seq.max())), start + len(seq)
    return newest + 1, stored


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
        self._tables: dict[int, _Table] = {}
        self._closed = False
        self._file: Any = None
        self._values_stored: int | None = None  # a read-only run's stored values bytes: no read allocates more
        h5py = _h5py()
        exists = self.path.exists()
        try:
            if read_only:
                self._file = _open_for_reading(h5py, self.path)
            elif exists:
                self._file = h5py.File(self.path, "a", libver="latest")
            else:
                self._file = h5py.File(self.path, "w-", libver="latest")
                _create_layout(self._file, retention or DEFAULT_RETENTION)
        except OSError as e:
            if _damage(e):
                raise self._damaged(e) from None
            why = ("its writer was killed or is still running (HDF5 marks it open for writing): reopen it read-only "
                   "with `fwdtrace serve --logdir`, and give a new logdir to write" if "already open" in str(e)
                   else str(e))
            raise FwdtraceError(f"{caller} could not open the history {str(self.path)!r}: {why}") from None
        try:
            version = self._file.attrs.get(FORMAT_ATTR)
            if version not in (FORMAT_VERSION, _GROUPS_VERSION):
                raise FwdtraceError(f"{caller} expected {str(self.path)!r} to be a fwdtrace live history "
                                    f"(attribute {FORMAT_ATTR}={FORMAT_VERSION}), got an HDF5 file without it")
            self.retention = int(self._file.attrs["retention"])
            if exists and not read_only and retention is not None and retention != self.retention:
                raise FwdtraceError(f"{caller} expected retention={self.retention} for the run in {str(self.logdir)!r} "
                                    f"(it was written with it), got retention={retention}; give a new logdir to change it")
            if version == _GROUPS_VERSION and not read_only:
                raise FwdtraceError(f"{caller} cannot continue the run in {str(self.logdir)!r}: it was written by an "
                                    "earlier fwdtrace (a group per series), which this one reads but does not extend; "
                                    "reopen it read-only with `fwdtrace serve --logdir`, and give a new logdir to write")
            if not 1 <= self.retention <= 1 << 30:
                raise self._untrusted(f"whose retention {self.retention} is not a positive row count")
            if version == _GROUPS_VERSION:
                self._load_groups(h5py)
            else:
                self._load(h5py)
            if not read_only:
                self._file.swmr_mode = True
        except FwdtraceError:
            self._file.close()
            raise
        except Exception as e:  # a damaged or foreign file: one error naming it
            self._file.close()
            if _damage(e):
                raise self._damaged(e) from None
            raise self._untrusted(f"which cannot be read ({one_line(e)})") from None
        except BaseException:
            self._file.close()
            raise

    def _damaged(self, error: BaseException) -> FwdtraceError:
        """What HDF5's report of a damaged file means for the user: which file, what is lost, what is not."""
        beside = [name for name in (GRAPH_FILE, KEYS_FILE) if (self.logdir / name).is_file()]
        still = (f"; {' and '.join(beside)} beside it {'are separate files' if len(beside) > 1 else 'is a separate file'}"
                 " and still read" if beside else "")
        return FwdtraceError(
            f"{self.caller} could not open the history {str(self.path)!r}: the file is damaged (its HDF5 structure "
            "does not read back as written: bytes changed on disk or in a copy after it was written), so none of the "
            "run's series or scalars can be read from it, as they share that structure; a copy of the run taken "
            f"before the damage reads again{still} (HDF5 said: {_damage(error)})")

    def _untrusted(self, what: str) -> FwdtraceError:
        return FwdtraceError(f"{self.caller} expected a fwdtrace live run, got {str(self.path)!r}, {what}")

    def _load(self, h5py: Any) -> None:
        """Every series and scalar of the file, from its catalog. A run reopened is a file from elsewhere: plain
        datasets inside it, of the layout written, each catalog entry pointing inside them."""
        f, error, retention = self._file, self._untrusted, self.retention
        names: dict[str, tuple[np.dtype, int]] = {"catalog": (_CATALOG, 1), "names": (np.dtype("u1"), 1)}
        for meta_name, values_name, meta_dtype in _TABLES.values():
            names[meta_name] = (meta_dtype, 2)
            if values_name:
                names[values_name] = (np.dtype("<f8"), 3)
        datasets = {}
        for name, (dtype, ndim) in names.items():
            check_link(h5py, f, name, repr(name), error)
            ds = datasets[name] = f[name]
            check_dataset(h5py, ds, repr(name), error)
            if ds.dtype != dtype or len(ds.shape) != ndim or ds.chunks is None:
                raise error(f"where {name!r} is {ds.dtype} {ds.shape}, not the layout written")
        for name in ("catalog", "names"):  # read whole: as stored
            ds = datasets[name]
            check_stored(ds, repr(name), error, slack=int(np.prod(ds.chunks)) * ds.dtype.itemsize)
        self._catalog, self._names = datasets["catalog"], datasets["names"]
        for table, (meta_name, values_name, _) in _TABLES.items():
            meta = datasets[meta_name]
            values = datasets[values_name] if values_name else None
            # Chunks as written, so that reading a slot chunk by chunk allocates no more than the file stores.
            if meta.shape[1] != retention or meta.chunks != (1, min(retention, _META_CHUNK_ROWS)) or (
                    values is not None and (values.shape[:2] != meta.shape or values.shape[2] > _width(_MAX_BINS)
                                            or values.chunks != (1, min(retention, _CHUNK_ROWS), _VALUE_COLUMNS))):
                what = meta.shape if values is None else f"{meta.shape} and {values.shape}"
                raise error(f"where {meta_name!r} is {what} in chunks {meta.chunks}, not the layout written")
            self._tables[table] = _Table(meta, values)
        if self.read_only:
            values = self._tables[_SERIES].values
            self._values_stored = values.id.get_storage_size() + int(np.prod(values.chunks)) * 8
        catalog, text = self._catalog[:], self._names[:].tobytes()
        taken: set[tuple[int, int]] = set()
        for i, entry in enumerate(catalog):
            table, slot, bins = int(entry["table"]), int(entry["slot"]), int(entry["bins"])
            if table == _UNUSED:  # a writer killed between growing the catalog and writing its entry
                continue
            where = f"where catalog entry {i}"
            start, length = int(entry["name_start"]), int(entry["name_length"])
            if table not in self._tables or not 0 <= slot < self._tables[table].meta.shape[0] or (table, slot) in taken:
                raise error(f"{where} points to table {table} slot {slot}, outside the tables or taken twice")
            if table == _SERIES and (not 1 <= bins <= _MAX_BINS or _width(bins) > self._tables[table].values.shape[2]):
                raise error(f"{where} has {bins} bins, more than its table holds")
            if not (0 <= start and 0 <= length and start + length <= len(text)):
                raise error(f"{where} names bytes {start}..{start + length} of {len(text)}")
            try:
                parts: Any = json.loads(text[start:start + length].decode("utf-8"))
            except ValueError:
                parts = None
            shape = "[key, kind, role]" if table == _SERIES else "[name]"
            if not isinstance(parts, list) or len(parts) != shape.count(",") + 1 or not all(isinstance(p, str) for p in parts):
                raise error(f"{where} is not named as {shape} in JSON")
            taken.add((table, slot))
            kept = self._tables[table]
            appended, stored = _appended(kept.meta, slot, retention)
            ring = _Ring(kept, slot, bins, 0, appended, stored if self.read_only else None)
            kept.used = max(kept.used, slot + 1)
            if table == _SERIES:
                self._series[(parts[0], parts[1], parts[2])] = ring
            else:
                self._scalars[parts[0]] = ring
        # Orders as created (a slot number may be skipped by a write that failed): the order of the catalog.
        for rings in (self._series.values(), self._scalars.values()):
            for order, ring in enumerate(rings):
                ring.order = order

    def _load_groups(self, h5py: Any) -> None:
        """A run of the earlier layout, a group per series, checked as a file from elsewhere and read as it is."""
        f, error = self._file, self._untrusted
        for kind, meta_dtype in (("series", _SERIES_META), ("scalars", _SCALAR_META)):
            check_link(h5py, f, kind, repr(kind), error)
            parent = f[kind]
            if not isinstance(parent, h5py.Group):
                raise error(f"where {kind!r} is not a group")
            for order, name in enumerate(sorted(parent, key=lambda n: int(n) if n.isdigit() else -1)):
                where = f"'{kind}/{name}'"
                check_link(h5py, parent, name, where, error)
                group = parent[name]
                if not name.isdigit() or not isinstance(group, h5py.Group):
                    raise error(f"where {where} is not a numbered group")
                attrs = ("key", "kind", "role") if kind == "series" else ("name",)
                if any(not isinstance(group.attrs.get(a), str) for a in attrs):
                    raise error(f"where {where} lacks the text attributes {', '.join(attrs)}")
                datasets: dict[str, tuple[Any, int]] = {"meta": (meta_dtype, 1)}
                bins = 0
                if kind == "series":
                    bins = group.attrs.get("bins")
                    if not isinstance(bins, (int, np.integer)) or not 1 <= int(bins) <= _MAX_BINS:
                        raise error(f"where {where} has no valid 'bins' attribute")
                    datasets["values"] = (np.dtype("<f8"), _width(int(bins)))
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
                ring = _GroupRing(group, int(bins), order)
                if kind == "series":
                    self._series[(group.attrs["key"], group.attrs["kind"], group.attrs["role"])] = ring
                else:
                    self._scalars[group.attrs["name"]] = ring

    # -- writing (one thread) ---------------------------------------------------------------------
    def _new_ring(self, table: int, name: list[str], bins: int) -> _Ring:
        """A new series or scalar: the next free slot of its table, and a catalog entry naming it.

        No object is created (SWMR mode cannot): a table grows by a batch of slots when the last is
        taken, ``series_values`` widens when more bins come, the catalog and the names grow by one entry.
        """
        kept = self._tables[table]
        if kept.used == kept.meta.shape[0]:
            kept.meta.resize(kept.used + _SLOT_BATCH, axis=0)
            if kept.values is not None:
                kept.values.resize(kept.used + _SLOT_BATCH, axis=0)
        if kept.values is not None and _width(bins) > kept.values.shape[2]:
            kept.values.resize(_width(bins), axis=2)
        slot = kept.used
        kept.used += 1  # taken even if what follows fails: a slot is never handed out twice
        text = np.frombuffer(json.dumps(name).encode("utf-8"), np.uint8)
        start = self._names.shape[0]
        self._names.resize((start + len(text),))
        self._names[start:] = text
        entry = self._catalog.shape[0]
        self._catalog.resize((entry + 1,))
        self._catalog[entry] = (table, slot, bins, start, len(text))  # last: the series exists once it is named
        return _Ring(kept, slot, bins, len(self._series) if table == _SERIES else len(self._scalars), 0)

    def _put(self, ring: _Ring, meta: tuple, values: np.ndarray) -> None:
        row = ring.appended % self.retention
        ring.table.values[ring.slot, row, :len(values)] = values
        ring.table.meta[ring.slot, row] = (ring.appended, *meta)  # meta last: a row counts once its seq is written
        ring.appended += 1

    def _writable(self) -> None:
        if self.read_only:
            raise FwdtraceError(f"{self.caller}: the run in {str(self.logdir)!r} is open read-only")
        if self._closed:
            raise FwdtraceError(f"{self.caller}: the history {str(self.path)!r} is closed")

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """One write, under the lock, flushed at the end.

        One that fails (a full disk) leaves the file open: HDF5 keeps what it could not write and
        writes it with the next flush, so writing resumes when space returns.
        """
        with self._lock:
            self._writable()
            try:
                yield
                self._file.flush()
            except FwdtraceError:
                raise
            except Exception as e:  # a full disk: the file stays open, HDF5 keeps what it could not write for later
                raise FwdtraceError(f"{self.caller} could not write to the history {str(self.path)!r}: "
                                    f"{one_line(e)}; the next write tries again") from None

    def append(self, key: str, kind: str, role: str, *, step: int, time: float, stats: dict[str, Any],
               histogram: Iterable[float], bin_edges: Iterable[float], call: int = 0, index: int = 0) -> None:
        """One summarised tensor of series ``(key, kind, role)``: ``stats`` (names of :data:`STATS`; missing ones NaN),
        ``histogram`` counted with ``bin_edges``; on disk when this returns."""
        with self._writing():
            self._append(key, kind, role, step, time, stats, histogram, bin_edges, call, index)

    def _append(self, key: str, kind: str, role: str, step: int, time: float, stats: dict[str, Any],
                histogram: Iterable[float], bin_edges: Iterable[float], call: int, index: int) -> None:
        counts, edges = list(histogram), list(bin_edges)
        if len(edges) != len(counts) + 1:
            raise FwdtraceError(f"{self.caller} expected {len(counts) + 1} bin edges for {len(counts)} bins of "
                                f"{key!r} ({kind}, {role}), got {len(edges)}")
        ring = self._series.get((key, kind, role))
        if ring is None:
            if not 1 <= len(counts) <= _MAX_BINS:
                raise FwdtraceError(f"{self.caller} expected 1 to {_MAX_BINS} histogram bins for {key!r} ({kind}, "
                                    f"{role}), got {len(counts)}")
            ring = self._series[(key, kind, role)] = self._new_ring(_SERIES, [key, kind, role], len(counts))
        if len(counts) != ring.bins:
            raise FwdtraceError(f"{self.caller} expected {ring.bins} histogram bins for {key!r} ({kind}, {role}), "
                                f"as its first row had, got {len(counts)}")
        values = np.array([_number(stats.get(s)) for s in STATS] + counts + edges, dtype=np.float64)
        self._put(ring, (step, call, index, time), values)

    def append_sample(self, key: str, kind: str, sample: dict[str, Any]) -> None:
        """Every numeric tensor of a sampler's sample (the ``sink`` signature of :class:`~fwdtrace.live.sampler.Sampler`)."""
        with self._writing():
            for t in sample["tensors"]:
                if t.get("numeric") and t.get("bin_edges"):
                    self._append(key, kind, t["role"], sample["step"], sample["time"], t, t["histogram"],
                                 t["bin_edges"], sample.get("call", 0), t.get("index", 0))

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
        with self._writing():
            for name, rows in by_name.items():
                ring = self._scalars.get(name)
                if ring is None:
                    ring = self._scalars[name] = self._new_ring(_SCALARS, [name], 0)
                self._put_meta(ring, rows)

    def _put_meta(self, ring: _Ring, rows: list[tuple[int, float, float]]) -> None:
        """Append ``rows`` (``meta`` without ``seq``) to a scalar's ring: at most two slice writes."""
        end = ring.appended + len(rows)
        first = max(ring.appended, end - self.retention)  # of more than the ring holds, only the newest are kept
        meta = ring.table.meta
        block = np.array([(first + i, *r) for i, r in enumerate(rows[first - end:])], dtype=meta.dtype)
        start = first % self.retention
        head = min(len(block), self.retention - start)
        meta[ring.slot, start:start + head] = block[:head]
        if head < len(block):  # the ring wrapped: the rest overwrites its oldest rows
            meta[ring.slot, :len(block) - head] = block[head:]
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
        bins = ring.bins
        if self._values_stored is not None and (hi + 1 - lo) * _width(bins) * 8 > self._values_stored:
            raise self._untrusted(f"whose series {ring.slot} declares more rows than the file stores")
        values = ring.values(lo, hi)
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


def _create_layout(file: Any, retention: int) -> None:
    """The tables every series and scalar will share, empty: a new series only resizes and writes them."""
    file.attrs[FORMAT_ATTR] = FORMAT_VERSION
    file.attrs["retention"] = retention
    file.create_dataset("catalog", shape=(0,), maxshape=(None,), dtype=_CATALOG, chunks=(256,),
                        fillvalue=np.array((_UNUSED, 0, 0, 0, 0), _CATALOG))
    file.create_dataset("names", shape=(0,), maxshape=(None,), dtype="u1", chunks=(4096,))
    for meta_name, values_name, meta_dtype in _TABLES.values():
        unwritten = np.zeros((), meta_dtype)
        unwritten["seq"] = -1  # a row never written: not kept
        file.create_dataset(meta_name, shape=(0, retention), maxshape=(None, retention), dtype=meta_dtype,
                            chunks=(1, min(retention, _META_CHUNK_ROWS)), fillvalue=unwritten)
        if values_name:
            # Not compressed: a compressed chunk rewritten (every append, once the ring wraps) moves to new
            # space in the file and leaves the old behind, so the file would outgrow the retention.
            file.create_dataset(values_name, shape=(0, retention, _VALUE_COLUMNS),
                                maxshape=(None, retention, None), dtype="<f8",
                                chunks=(1, min(retention, _CHUNK_ROWS), _VALUE_COLUMNS))


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


# What HDF5 says when a file's own structure is damaged (a flipped byte, a torn copy), as opposed to a
# file that is not HDF5 at all, or one that another process holds.
_DAMAGE = ("checksum", "bad superblock", "bad byte number", "truncated file", "object header",
           "wrong B-tree signature", "bad local heap signature", "bad global heap")


def _damage(error: BaseException) -> str | None:
    """HDF5's own words when ``error`` reports a damaged file (its innermost parenthesis), else None."""
    text = str(error)
    if not any(phrase in text for phrase in _DAMAGE):
        return None
    inner = text[text.rfind("(") + 1:text.find(")", text.rfind("("))] if "(" in text else text
    return inner.strip() or text


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
