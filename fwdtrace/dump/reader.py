"""Reading a dump as an untrusted file: ``read_dump`` and the checked reader under every comparison."""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .._files import not_a_regular_file
from .._hdf5 import check_dataset, check_link
from .._host import to_numpy
from ..errors import FwdtraceError, describe, one_line
from ..graph import Graph
from ..statistics import BINS, FIELDS, SAMPLES, as_dict, summarize_blocks
from .layout import (
    _BITS_AS,
    _GROUP_RE,
    _HDF5_SIGNATURE,
    _STR2DTYPE,
    COMPARE_BLOCK_ELEMENTS,
    FORMAT_ATTR,
    GRAPH_DATASET,
    MATH_PREFIX,
    MAX_CHUNK_BYTES,
    MAX_TENSOR_BYTES,
    ORDER_DATASET,
    STATISTICS_DATASET,
    STATISTICS_INDEX,
    WRITING,
    _h5py,
)
from .packed import _STR_ATTRS, _bad_call_attrs, _bad_index, _PackedGroup, _PackedTensor

# A text (the index, the graph) or the packed matrix, deflated, declares at most this many times the bytes the
# file stores for it, plus _INFLATE_SLACK: fwdtrace's own deflate to about a tenth, while a crafted dataset of
# zeros deflates a thousandfold (80 KiB of file declaring 1 GiB of JSON to parse).
_INFLATE_RATIO = 256
_INFLATE_SLACK = 1 << 20


class _Reader:
    """An open dump, checked as a file from elsewhere: plain groups and datasets inside it only.

    External links, soft links, external storage and virtual datasets are refused (reading
    them would open other files); each tensor's size is checked against the cap and against
    what the file really stores before anything is allocated.
    """

    def __init__(self, path: Any, caller: str, max_bytes: int) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise FwdtraceError(f"{caller} expected a dump file path (str or os.PathLike), got {describe(path)}")
        h5py = self.h5py = _h5py()
        self.path = Path(path)
        self.caller = caller
        self.max_bytes = max_bytes
        p = self.path
        what = not_a_regular_file(p)
        if what is not None:
            raise FwdtraceError(f"{caller} expected an HDF5 dump file, got {str(p)!r}, {what}")
        try:
            self.file = h5py.File(p, "r")
        except OSError as e:
            raise FwdtraceError(
                f"{caller} expected an HDF5 dump file, got {str(p)!r}, which HDF5 cannot open{self._cut_short()}: {e}"
            ) from e
        try:
            self._check()
        except BaseException:
            self.file.close()
            raise

    def _cut_short(self) -> str:
        """Why an HDF5 file (by its signature) does not open: written by a process that did not finish."""
        try:
            with open(self.path, "rb") as f:
                head = f.read(len(_HDF5_SIGNATURE))
        except OSError:
            return ""
        if head != _HDF5_SIGNATURE and ".partial-" not in self.path.name:
            return ""
        return " (incomplete: it was cut short while being written, by a killed process or a full disk)"

    def error(self, what: str) -> FwdtraceError:
        return FwdtraceError(f"{self.caller} expected a self-contained fwdtrace dump, got {str(self.path)!r}, {what}")

    def _link(self, parent: Any, name: str, where: str) -> None:
        check_link(self.h5py, parent, name, where, self.error)

    def _dataset(self, ds: Any, where: str) -> None:
        check_dataset(self.h5py, ds, where, self.error)

    def _plain_datasets(self, gname: str, group: Any) -> list[tuple[str, Any]] | None:
        """The call's datasets, each checked as :func:`fwdtrace._hdf5.check_dataset` checks one, where all its
        members are hard links to datasets whose data lies in this file; None where one is not (the checks one by
        one then name it).

        A dump of many small calls is read at disk speed only when each of its objects costs little: its links'
        kinds come from one listing per group, not one lookup per name, and each dataset is opened by its id and
        read through it (:class:`_PlainDataset`), not through h5py's ``group[name]`` (which makes a ``File``
        object for every lookup) and ``Dataset`` (property lists and a reader made for each object)."""
        h5py = self.h5py
        hard = _hard_links(h5py, group)
        out = []
        for raw in group.id:
            dname = raw.decode() if isinstance(raw, bytes) and raw.isascii() else None
            if dname is None or dname not in hard:
                return None
            oid = h5py.h5o.open(group.id, raw)
            if not isinstance(oid, h5py.h5d.DatasetID):
                return None
            plist = oid.get_create_plist()
            layout = plist.get_layout()
            shape = oid.shape
            if layout == h5py.h5d.VIRTUAL or plist.get_external_count() > 0 or shape is None:
                return None
            chunks = plist.get_chunk() if layout == h5py.h5d.CHUNKED else None
            out.append((dname, _PlainDataset(h5py, oid, oid.dtype, shape, chunks)))
        return out

    def _check(self) -> None:
        f = self.file
        try:
            names = list(f)
            if not any(_GROUP_RE.match(name) for name in names) and FORMAT_ATTR not in f.attrs:
                raise FwdtraceError(
                    f"{self.caller} expected a dump with groups named NNN_ClassName, got {str(self.path)!r}, an HDF5 file "
                    "in another layout"
                )
            self.groups: list[tuple[str, Any]] = []
            # Each HDF5 object looked up and each attribute read costs tens of microseconds, more than comparing
            # a small tensor: a dump of many small calls is read at disk speed only when each is looked up once.
            self._datasets: dict[tuple[str, str], Any] = {}
            self._group_attrs: dict[str, dict[str, Any]] = {}
            self._shapes: dict[tuple[str, str], list[int]] = {}
            self._dtypes: dict[tuple[str, str], str] = {}
            self._marked: dict[str, str] = {}  # where -> the torch dtype a dataset is marked with ("" for none)
            self._checked_ok: set[tuple[str, str]] = set()
            hard = _hard_links(self.h5py, f)
            for name in names:
                if name not in hard:
                    self._link(f, name, repr(name))
                if name in (ORDER_DATASET, GRAPH_DATASET, STATISTICS_DATASET, STATISTICS_INDEX):
                    self._dataset(f[name], repr(name))
                if not _GROUP_RE.match(name):
                    continue
                group = f[name]
                if not isinstance(group, self.h5py.Group):
                    raise self.error(f"where {name!r} is a {type(group).__name__}, not a group")
                datasets = self._plain_datasets(name, group)
                if datasets is None:  # something other than datasets linked plainly: the checks one by one say what
                    datasets = []
                    for dname in group:
                        self._link(group, dname, f"'{name}/{dname}'")
                        ds = group[dname]
                        self._dataset(ds, f"'{name}/{dname}'")
                        datasets.append((dname, ds))
                for dname, ds in datasets:
                    self._datasets[name, dname] = ds
                # read once, here: group_attrs() serves them from now on
                attrs = self._group_attrs[name] = {k: _attr(v) for k, v in group.attrs.items()}
                typed = _bad_call_attrs({k: attrs[k] for k in (*_STR_ATTRS, "call_index") if k in attrs})
                if typed is not None:
                    raise self.error(f"where the call {name!r} {typed}")
                self.groups.append((name, group))
            self.packed: list[tuple[str, str]] | None = None  # a packed statistics dump's rows
            version = _attr(f.attrs.get(FORMAT_ATTR, 1))
            self.version = version if isinstance(version, int) and not isinstance(version, bool) else 1
            if STATISTICS_INDEX in names or STATISTICS_DATASET in names:
                self._read_index()
            # call order is the numeric prefix; the name alone sorts wrong past 999
            self.groups.sort(key=lambda item: int(item[0].split("_", 1)[0]))
            self.name2group = dict(self.groups)
            self.attrs = {k: _attr(v) for k, v in f.attrs.items()}
            math_record = {k.removeprefix(MATH_PREFIX): v for k, v in self.attrs.items() if k.startswith(MATH_PREFIX)}
            self._math = math_record or None  # asked for on every row
            self.status = self._status()
        except FwdtraceError:
            raise
        except Exception as e:
            raise self.damaged(e) from e

    def _read_index(self) -> None:
        """A packed statistics dump's calls and rows, from its index, each checked, as groups of tensors."""
        for name in (STATISTICS_INDEX, STATISTICS_DATASET):
            if name not in self.file:
                raise self.error(f"with {(STATISTICS_INDEX if name == STATISTICS_DATASET else STATISTICS_DATASET)!r} "
                                 f"but no {name!r}")
        try:
            index = json.loads(self.text(STATISTICS_INDEX))
        except ValueError as e:
            raise self.error(f"whose {STATISTICS_INDEX!r} is not JSON: {one_line(e)}") from e
        matrix = self.file[STATISTICS_DATASET]
        bad = _bad_index(index)
        if bad is not None:
            raise self.error(f"whose {STATISTICS_INDEX!r} {bad}")
        if matrix.dtype.kind != "f" or matrix.ndim != 2 or matrix.shape[0] != len(index["rows"]) \
                or matrix.shape[1] < _vector_width(self.version):
            raise self.error(f"whose {STATISTICS_DATASET!r} is a {matrix.dtype} array of shape {matrix.shape}, not "
                             f"{len(index['rows'])} rows of statistics")
        groups = {name: _PackedGroup(attrs) for name, attrs in index["calls"]}
        self.packed = []
        for i, (gname, dname, shape, dtype) in enumerate(index["rows"]):
            group = groups.get(gname)
            if group is None or dname in group.datasets:
                raise self.error(f"whose {STATISTICS_INDEX!r} puts '{gname}/{dname}' in no call or twice")
            group.datasets[dname] = _PackedTensor(i, shape, dtype)
            self.packed.append((gname, dname))
        self.groups += list(groups.items())
        self.matrix: torch.Tensor | None = None

    def damaged(self, e: BaseException) -> FwdtraceError:
        return FwdtraceError(
            f"{self.caller} could not read {str(self.path)!r}{self._cut_short()}: {one_line(e)}"
        )

    def _status(self) -> str:
        """``"complete"``, or ``"incomplete: stopped after NNN_Class (reason)"``."""
        attrs = self.attrs
        if "complete" in attrs:
            if attrs["complete"] is True or attrs["complete"] == 1:
                return "complete"
            reason = str(attrs.get("status", "")) or "the file does not say why"
            if reason == WRITING:
                reason = "the file was never closed: the writing process was killed or failed"
        elif ORDER_DATASET in self.file:
            return "complete"  # a version-1 dump: closed, nothing more recorded
        else:
            reason = "the file was never closed: the writing process was killed or failed"
        if not self.groups:
            return f"incomplete: no module call recorded ({reason})"
        return f"incomplete: stopped after {self.groups[-1][0]} ({reason})"

    def order(self) -> list[tuple[str, str]]:
        """(group, dataset) of every tensor in the order the run wrote them."""
        if self.packed is not None:
            return list(self.packed)
        group_names = {name for name, _ in self.groups}
        if ORDER_DATASET not in self.file:
            return [(gname, dname) for gname, group in self.groups for dname in group]
        ds = self.file[ORDER_DATASET]
        if ds.dtype.kind not in "OS" or ds.ndim != 1 or ds.shape[0] > sum(len(g) for _, g in self.groups):
            raise self.error(f"whose {ORDER_DATASET!r} is a {ds.dtype} array of shape {ds.shape}, not one name per tensor")
        out = []
        try:
            entries = ds[()]
        except Exception as e:
            raise self.damaged(e) from e
        for entry in entries:
            text = entry.decode(errors="replace") if isinstance(entry, bytes) else str(entry)
            gname, _, dname = text.partition("/")
            if gname not in group_names or (gname, dname) not in self._datasets:
                raise self.error(f"whose {ORDER_DATASET!r} names {text!r}, which is not in the file")
            out.append((gname, dname))
        return out

    @property
    def statistics(self) -> bool:
        """Whether the dump holds each tensor's statistics (``Dumper(values="statistics")``), not the tensor."""
        return self.attrs.get("values") == "statistics"

    def graph(self) -> Graph | None:
        """The step's trace, stored by a dump that records function calls; None in one without it."""
        if GRAPH_DATASET not in self.file:
            return None
        text = self.text(GRAPH_DATASET)
        try:
            return Graph.from_json(text, source=str(self.path))
        except FwdtraceError:
            raise
        except Exception as e:
            raise self.damaged(e) from e

    def text(self, name: str) -> str:
        """A text the dump stores: as UTF-8 bytes (deflated), or as one HDF5 string (dumps written before)."""
        ds = self.file[name]
        if ds.dtype.kind == "u" and ds.dtype.itemsize == 1 and ds.ndim == 1:
            data: Any = bytes(to_numpy(self.read(self._inflating(self._checked(ds, repr(name)), repr(name)), repr(name))))
        elif ds.dtype.kind in "OS" and ds.shape == ():
            try:
                data = ds[()]
            except Exception as e:
                raise self.damaged(e) from e
        else:
            raise self.error(f"whose {name!r} is a {ds.dtype} array of shape {ds.shape}, not one text")
        return data.decode(errors="replace") if isinstance(data, bytes) else str(data)

    def dataset(self, gname: str, dname: str) -> Any:
        """The dataset (or a packed statistics dump's tensor) ``gname/dname``, looked up once."""
        ds = self._datasets.get((gname, dname))
        if ds is None:
            ds = self._datasets[gname, dname] = self.name2group[gname][dname]
        return ds

    def group_attrs(self, gname: str) -> dict[str, Any]:
        """A call's attributes (``module_key``, ``call_index``, ...), read once."""
        attrs = self._group_attrs.get(gname)
        if attrs is None:
            attrs = self._group_attrs[gname] = {k: _attr(v) for k, v in self.name2group[gname].attrs.items()}
        return attrs

    def shape(self, gname: str, dname: str) -> list[int]:
        shape = self._shapes.get((gname, dname))
        if shape is None:
            ds = self.dataset(gname, dname)
            if self.statistics:
                shape = [int(n) for n in _attr(ds.attrs.get("tensor_shape", []))]
            else:
                shape = list(ds.shape)
            self._shapes[gname, dname] = shape
        return list(shape)

    def dtype(self, gname: str, dname: str) -> str:
        dtype = self._dtypes.get((gname, dname))
        if dtype is None:
            ds = self.dataset(gname, dname)
            if self.statistics:
                dtype = str(_attr(ds.attrs.get("tensor_dtype", "")))
            else:
                dtype = self._marked_dtype(ds, f"'{gname}/{dname}'") or str(ds.dtype)
            self._dtypes[gname, dname] = dtype
        return dtype

    def summary(self, gname: str, dname: str) -> torch.Tensor:
        """The tensor's statistics vector (:mod:`fwdtrace.statistics`): stored in a statistics dump, computed
        block by block from a full one."""
        tensor = self.dataset(gname, dname)
        if isinstance(tensor, _PackedTensor):
            return _upgraded(self._packed_matrix()[tensor.row, :_vector_width(self.version)], self.version)
        if self.statistics:
            vector = self.load(gname, dname).to(torch.float64).reshape(-1)
            if vector.numel() < _vector_width(self.version) - SAMPLES:
                raise self.error(f"where '{gname}/{dname}' holds {vector.numel()} numbers, not a statistics vector")
            return _upgraded(vector, self.version)
        count = math.prod(self.shape(gname, dname)) * (2 if self.dtype(gname, dname).startswith("complex") else 1)
        return summarize_blocks(lambda: self.blocks(gname, dname), count)

    def _packed_matrix(self) -> torch.Tensor:
        """A packed statistics dump's matrix, float64, read once (on the first vector asked for)."""
        if self.matrix is None:
            where = repr(STATISTICS_DATASET)
            matrix = self._inflating(self._checked(self.file[STATISTICS_DATASET], where), where)
            self.matrix = self.read(matrix, where).to(torch.float64)
        return self.matrix

    def statistics_matrix(self) -> Any:
        """A packed statistics dump's vectors in today's layout, a row each (see :meth:`packed_row`), as one
        float64 NumPy array; None for any other dump (one of tensors, or of a vector per dataset), or one written
        before today's layout (each of its vectors is read through :meth:`summary`)."""
        if not self.packs_statistics:
            return None
        return to_numpy(self._packed_matrix()[:, :_vector_width(self.version)])

    @property
    def packs_statistics(self) -> bool:
        """Whether :meth:`statistics_matrix` holds the dump's vectors (without reading it)."""
        return self.packed is not None and self.version >= 5

    def packed_row(self, gname: str, dname: str) -> int:
        """The row of :meth:`statistics_matrix` that holds ``gname/dname``'s vector."""
        return int(self.dataset(gname, dname).row)

    @property
    def math(self) -> dict[str, Any] | None:
        """The run's math record (see :func:`fwdtrace.precision.math_record`); None in a dump written without one."""
        return self._math

    def checked(self, gname: str, dname: str) -> Any:
        """The dataset, once its size is within the cap and backed by what the file really stores (checked once)."""
        ds = self.dataset(gname, dname)
        if (gname, dname) not in self._checked_ok:
            self._checked(ds, f"'{gname}/{dname}'")
            self._checked_ok.add((gname, dname))
        return ds

    def _checked(self, ds: Any, where: str) -> Any:
        import numpy as np

        dtype, shape = ds.dtype, ds.shape  # h5py makes each anew when asked
        if dtype.kind not in "biufc":
            raise self.error(f"where {where} holds {dtype}, not numbers")
        nbytes = math.prod(shape) * dtype.itemsize  # Python ints: no overflow
        if nbytes > self.max_bytes:
            raise self.error(f"where {where} holds {nbytes} bytes, over the cap of {self.max_bytes} (max_bytes=)")
        if not nbytes:
            return ds
        try:
            if ds.chunks is None:  # contiguous (never compressed): every byte is in the file
                stored = ds.id.get_storage_size()
                if stored < nbytes:
                    raise self.error(f"where {where} declares {nbytes} bytes but stores {stored} in the file")
                return ds
            # Chunked, maybe compressed: a chunk never written reads as fill values, from nothing
            # (a few kB of file declaring GiBs), so every chunk of the grid must be in the file.
            # fwdtrace writes contiguous datasets; this is a file from elsewhere (h5repack, crafted).
            chunk_bytes = int(np.prod(ds.chunks, dtype=object)) * dtype.itemsize
            if chunk_bytes > MAX_CHUNK_BYTES:
                raise self.error(f"where {where} has chunks of {chunk_bytes} bytes, over the {MAX_CHUNK_BYTES} read at once")
            grid = 1
            for size, chunk in zip(shape, ds.chunks, strict=True):
                grid *= -(-size // chunk)
            written = ds.id.get_num_chunks()
        except FwdtraceError:
            raise
        except Exception as e:
            raise self.damaged(e) from e
        if written < grid:
            raise self.error(
                f"where {where} declares {nbytes} bytes in {grid} chunks but stores {written} of them: "
                "a crafted or incomplete file"
            )
        return ds

    def _inflating(self, ds: Any, where: str) -> Any:
        """``ds``, read whole, once what it declares is within ``_INFLATE_RATIO`` times what the file stores."""
        try:
            declared, stored = ds.size * ds.dtype.itemsize, ds.id.get_storage_size()
        except Exception as e:
            raise self.damaged(e) from e
        if declared > _INFLATE_RATIO * stored + _INFLATE_SLACK:
            raise self.error(f"where {where} declares {declared} bytes but stores {stored} in the file, over "
                             f"{_INFLATE_RATIO} times as many: a crafted file")
        return ds

    def read(self, ds: Any, where: str, index: tuple = (), numpy: bool = False) -> Any:
        """``ds[index]`` as a tensor, in the dtype the dump recorded (bfloat16 from its bits); with ``numpy``, as
        the NumPy array h5py read where the dump recorded no other dtype (a comparison's blocks: no copy into
        torch and back)."""
        import numpy as np

        try:
            dtype = ds.dtype if index == () and hasattr(ds, "id") else None  # h5py makes it anew when asked
            if dtype is not None and dtype.kind in "biufc":
                # a whole dataset of numbers, read by its id: h5py's ds[()] sets up a reader for each dataset
                # object on its first read, which costs several times what reading a small tensor does
                arr = np.empty(ds.shape, dtype=dtype)
                if arr.size:
                    ds.id.read(self.h5py.h5s.ALL, self.h5py.h5s.ALL, arr)
            else:
                arr = np.asarray(ds[index])
        except Exception as e:
            raise self.damaged(e) from e
        name = self._marked_dtype(ds, where)
        if numpy and name not in _STR2DTYPE:
            return arr
        t = torch.from_numpy(arr.copy()) if arr.ndim else torch.tensor(arr)
        dtype = _STR2DTYPE.get(name)
        if dtype is None:
            return t
        if t.dtype != _BITS_AS[dtype]:
            raise self.error(f"where {where} is marked {name} but holds {arr.dtype}")
        return t.view(dtype)

    def _marked_dtype(self, ds: Any, where: str) -> str:
        """The torch dtype the dataset at ``where`` is marked with (bfloat16 stored as its bits), "" for none."""
        name = self._marked.get(where)
        if name is None:
            # h5py's attrs.get of a missing attribute raises and catches inside: the low-level check is cheap
            marked = not hasattr(ds, "id") or self.h5py.h5a.exists(ds.id, b"torch_dtype")
            name = self._marked[where] = str(_attr(ds.attrs.get("torch_dtype", ""))) if marked else ""
        return name

    def load(self, gname: str, dname: str) -> torch.Tensor:
        return self.read(self.checked(gname, dname), f"'{gname}/{dname}'")

    def blocks(self, gname: str, dname: str, numpy: bool = False) -> Iterator[Any]:
        """The tensor in pieces of at most ``COMPARE_BLOCK_ELEMENTS`` elements, in C order, flattened (with
        ``numpy``, NumPy arrays where :meth:`read` gives them)."""
        ds = self.checked(gname, dname)
        shape = tuple(ds.shape)
        if math.prod(shape) <= COMPARE_BLOCK_ELEMENTS:  # one block: read whole, h5py's fast path (a slice is not)
            yield self.read(ds, f"'{gname}/{dname}'", numpy=numpy).reshape(-1)
            return
        for index in _blocks(shape, COMPARE_BLOCK_ELEMENTS):
            yield self.read(ds, f"'{gname}/{dname}'", index, numpy=numpy).reshape(-1)

    def __enter__(self) -> _Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()


class _PlainDataset:
    """A call's dataset checked plain (a hard link, its data in this file), by its id: its dtype, shape and chunks
    read once, its whole data read through the id; h5py's ``Dataset`` is made only where a slice or an attribute
    is asked for."""

    __slots__ = ("_h5py", "id", "dtype", "shape", "chunks", "_dataset")

    def __init__(self, h5py: Any, oid: Any, dtype: Any, shape: tuple[int, ...], chunks: tuple[int, ...] | None) -> None:
        self._h5py, self.id, self.dtype, self.shape, self.chunks = h5py, oid, dtype, shape, chunks
        self._dataset: Any = None

    def _full(self) -> Any:
        if self._dataset is None:
            self._dataset = self._h5py.Dataset(self.id, readonly=True)
        return self._dataset

    @property
    def attrs(self) -> Any:
        return self._full().attrs

    def __getitem__(self, index: Any) -> Any:
        return self._full()[index]


def _hard_links(h5py: Any, group: Any) -> set[str]:
    """The names in ``group`` that are hard links (objects inside this file), from one listing of its links."""
    names: set[str] = set()

    def visit(raw: bytes, info: Any) -> None:
        if info.type == h5py.h5l.TYPE_HARD and raw.isascii():
            names.add(raw.decode())

    group.id.links.iterate(visit, info=True)
    return names


def _attr(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if hasattr(value, "ndim") and value.ndim:
        return value.tolist()
    return value.item() if hasattr(value, "item") else value


def _max_bytes(value: Any, caller: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise FwdtraceError(f"{caller} expected max_bytes as a non-negative int, got {value!r}")
    return value


def read_dump(
    path: str | os.PathLike[str], show: bool = True, values: bool = False, max_bytes: int = MAX_TENSOR_BYTES
) -> dict[str, Any]:
    """Print the tree of a dump and return it as a dict.

    >>> import tempfile, torch, fwdtrace
    >>> d = fwdtrace.Dumper(tempfile.mkdtemp()); model = torch.nn.Linear(2, 1)
    >>> d.register(model, grads=False); _ = model(torch.ones(1, 2))
    >>> tree = fwdtrace.read_dump(d.remove()[0], show=False)
    >>> tree["groups"]["000_Linear"]["datasets"]["output0"], tree["status"]
    ({'shape': [1, 1], 'dtype': 'float32'}, 'complete')

    ``{"status": ..., "attrs": {...}, "groups": {name: {"attrs": {...}, "datasets": {name: {"shape", "dtype"}}}}}``;
    with ``values=True`` each dataset also holds its tensor under ``"value"`` (each at most
    ``max_bytes``). ``status`` is ``"complete"`` or ``"incomplete: stopped after NNN_Class
    (reason)"``. Files from elsewhere are safe to read: links and storage outside the
    file are refused with a :class:`FwdtraceError` naming them.
    """
    max_bytes = _max_bytes(max_bytes, "read_dump()")
    with _Reader(path, "read_dump()", max_bytes) as r:
        tree: dict[str, Any] = {"status": r.status, "attrs": r.attrs, "groups": {}}
        lines = [f"{r.path.name}: {len(r.groups)} module calls"]
        if r.status != "complete":
            lines[0] += f"; {r.status}"
        try:
            for name, group in r.groups:
                datasets: dict[str, Any] = {}
                for dname in group:
                    entry: dict[str, Any] = {"shape": r.shape(name, dname), "dtype": r.dtype(name, dname)}
                    if r.statistics:
                        entry["statistics"] = as_dict(r.summary(name, dname))
                    elif values:
                        entry["value"] = r.load(name, dname)
                    datasets[dname] = entry
                attrs = {k: _attr(v) for k, v in group.attrs.items()}
                tree["groups"][name] = {"attrs": attrs, "datasets": datasets}
                lines.append(f"{name}  {attrs.get('module_key', '')}")
                lines += [f"    {d:<14} {e['dtype']}{e['shape']}" for d, e in datasets.items()]
        except FwdtraceError:
            raise
        except Exception as e:
            raise r.damaged(e) from e
    if show:
        print("\n".join(lines))
    return tree


def _blocks(shape: tuple[int, ...], per_block: int) -> Iterator[tuple[Any, ...]]:
    """Indices that cover ``shape`` in C order, each at most ``per_block`` elements (or one element).

    >>> list(_blocks((2, 3), 4))  # one row of 3 at a time
    [(slice(0, 1, None),), (slice(1, 2, None),)]
    >>> list(_blocks((1, 5), 2))  # a row over the budget is read in parts
    [(0, slice(0, 2, None)), (0, slice(2, 4, None)), (0, slice(4, 5, None))]
    """
    if not shape or 0 in shape:
        yield ()
        return
    axis, inner = len(shape) - 1, 1  # inner: the elements of one index along axis
    while axis > 0 and inner * shape[axis] <= per_block:
        inner *= shape[axis]
        axis -= 1
    step = max(1, per_block // inner)
    for outer in itertools.product(*(range(n) for n in shape[:axis])):
        for start in range(0, shape[axis], step):
            yield (*outer, slice(start, min(start + step, shape[axis])))


# Before version 5 a statistics vector held 9 fields (no zeros, no histogram placement) and a histogram of 16 bins
# over [min, max]: read as today's layout, the fields it lacks NaN.
_V4_FIELDS = ("count", "finite", "nans", "infs", "mean", "std", "min", "max", "norm")
_V4_BINS = 16


def _vector_width(version: int) -> int:
    """The length of a statistics vector in a dump of ``version`` (up to its samples)."""
    return (len(_V4_FIELDS) + _V4_BINS if version < 5 else len(FIELDS) + BINS) + SAMPLES


def _upgraded(vector: torch.Tensor, version: int) -> torch.Tensor:
    """A statistics vector of a dump of ``version`` in today's layout (:data:`fwdtrace.statistics.FIELDS`)."""
    if version >= 5:
        return vector
    head = dict(zip(_V4_FIELDS, vector[:len(_V4_FIELDS)].tolist(), strict=True))
    fields = [head.get(name, math.nan) for name in FIELDS]
    fields[FIELDS.index("underflow")] = fields[FIELDS.index("overflow")] = 0.0
    return torch.cat([torch.tensor(fields, dtype=torch.float64), vector[len(_V4_FIELDS):]])
