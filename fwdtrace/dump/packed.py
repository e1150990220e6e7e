"""A statistics dump's packed step: every statistics vector a row of one matrix, with its JSON index."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .._host import HostCopy
from ..statistics import BINS, FIELDS, SAMPLES
from ..statistics.engine import Pending, finish

if TYPE_CHECKING:
    import numpy as np

from .layout import _DATASET_RE, _GROUP_RE, STATISTICS_DATASET, STATISTICS_INDEX, _create_text


class _Packed:
    """A statistics dump's step, kept until the file closes and then written as two datasets: HDF5's cost per
    object (a group per call, a dataset and its attributes per tensor) is paid twice per step."""

    WIDTH = len(FIELDS) + BINS + SAMPLES

    BATCH = 256  # CPU summaries whose histograms are binned together (each holds its 4,104 gathered values)

    def __init__(self) -> None:
        self.calls: dict[str, dict[str, Any]] = {}  # group name -> its attributes, in call order
        # (group, tensor name, dtype) and the shapes, in write order: flat tuples of str or int, which Python's
        # collector stops tracking at its next pass (a step's thousands add nothing towards a full collection)
        self.rows: list[tuple[str, str, str]] = []
        self.shapes: list[tuple[int, ...]] = []
        self.vectors: list[np.ndarray | HostCopy | Pending] = []
        self.pending: dict[int, Pending] = {}  # id() -> a CPU summary not binned yet (rows may share one)

    def add(self, group: str, name: str, vector: np.ndarray | HostCopy | Pending, shape: tuple[int, ...],
            dtype: str) -> None:
        """One row. A CPU summary's histogram is binned with the next ones' (:func:`fwdtrace.statistics.engine.finish`):
        in batches, where the values taken are still in the cache, rather than between two layers' work."""
        self.rows.append((group, name, dtype))
        self.shapes.append(shape)
        self.vectors.append(vector)
        if isinstance(vector, Pending) and vector.vector is None:
            self.pending[id(vector)] = vector
            if len(self.pending) >= self.BATCH:
                self._finish()

    def _finish(self) -> None:
        if self.pending:
            finish(list(self.pending.values()))
            self.pending.clear()

    def write(self, file: Any) -> None:
        import numpy as np

        self._finish()
        # a tensor of fewer than SAMPLES values has fewer samples: the rest of its row is NaN
        matrix = np.full((len(self.vectors), self.WIDTH), np.nan)
        for row, vector in zip(matrix, self.vectors, strict=True):
            values = vector.array() if isinstance(vector, HostCopy) else vector
            if isinstance(values, Pending):
                assert values.vector is not None  # binned by _finish
                values = values.vector
            row[:values.size] = values
        # float64, deflated at the fastest level: the counts and the histograms compress well, the rest a little
        # (smaller and 30% faster here than byte-shuffled at the default level)
        options: dict[str, Any] = {"compression": "gzip", "compression_opts": 1} if len(matrix) else {}
        file.create_dataset(STATISTICS_DATASET, data=matrix, **options)
        rows = [[group, name, list(shape), dtype] for (group, name, dtype), shape in zip(self.rows, self.shapes, strict=True)]
        index = {"calls": [[name, attrs] for name, attrs in self.calls.items()], "rows": rows}
        _create_text(file, STATISTICS_INDEX, json.dumps(index, separators=(",", ":")))


class _PackedTensor:
    """A tensor of a packed statistics dump: its row of the matrix, its shape and dtype (as attributes too, where
    a statistics dataset of the unpacked layout keeps them)."""

    def __init__(self, row: int, shape: list[int], dtype: str) -> None:
        self.row, self.shape, self.dtype = row, shape, dtype
        self.attrs = {"tensor_shape": shape, "tensor_dtype": dtype}


class _PackedGroup:
    """A call of a packed statistics dump, read as an HDF5 group is: its attributes, its tensors by name."""

    def __init__(self, attrs: dict[str, Any]) -> None:
        self.attrs = attrs
        self.datasets: dict[str, _PackedTensor] = {}

    def __iter__(self) -> Iterator[str]:
        return iter(self.datasets)

    def __len__(self) -> int:
        return len(self.datasets)

    def __contains__(self, name: object) -> bool:
        return name in self.datasets

    def __getitem__(self, name: str) -> _PackedTensor:
        return self.datasets[name]


_STR_ATTRS = ("module_key", "module_path", "class_name", "function")


def _bad_call_attrs(attrs: Any) -> str | None:
    """What is wrong with a call's attributes that the comparison reads as str or int (a file from elsewhere)."""
    for name in _STR_ATTRS:
        if name in attrs and not isinstance(attrs[name], str):
            return f"whose {name} is {attrs[name]!r}, not a str"
    call_index = attrs.get("call_index", 0)
    if not isinstance(call_index, int) or isinstance(call_index, bool) or not 0 <= call_index < 1 << 63:
        return f"whose call_index is {call_index!r}, not a count"
    return None


def _bad_index(index: Any) -> str | None:
    """What is wrong with a packed statistics dump's index (a file from elsewhere), or None."""
    if not isinstance(index, dict) or not isinstance(index.get("calls"), list) or not isinstance(index.get("rows"), list):
        return "is not an object of 'calls' and 'rows' lists"
    names = set()
    for call in index["calls"]:
        if not (isinstance(call, list) and len(call) == 2 and isinstance(call[0], str) and _GROUP_RE.match(call[0])
                and isinstance(call[1], dict)
                and all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in call[1].values())):
            return f"has a call {str(call)[:80]!r}, not [NNN_ClassName, {{attribute: str or int}}]"
        typed = _bad_call_attrs(call[1])
        if typed is not None:
            return f"has a call {call[0]!r} {typed}"
        if call[0] in names:
            return f"has the call {call[0]!r} twice"
        names.add(call[0])
    for row in index["rows"]:
        if not (isinstance(row, list) and len(row) == 4 and isinstance(row[0], str) and isinstance(row[1], str)
                and _DATASET_RE.match(row[1]) and isinstance(row[2], list)
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in row[2])
                and isinstance(row[3], str)):
            return f"has a row {str(row)[:80]!r}, not [group, tensor name, shape, dtype]"
    return None
