"""A dump file's layout: its attributes, dataset names and the dtypes HDF5 stores as bit patterns."""

from __future__ import annotations

import re
from typing import Any

import torch

from .._tree import dtype_name
from ..errors import FwdtraceError

FORMAT_ATTR = "fwdtrace_dump"
FORMAT_VERSION = 5  # 2: completeness attributes, sanitized group names; 3: statistics dumps; 4: packed statistics;
# 5: statistics vectors of fwdtrace.statistics (zero counts, power-of-two histogram bins)
VALUES = ("tensors", "statistics")  # what a dump stores per tensor (the file's "values" attribute)
CALLS = ("modules", "functions", "all")  # which calls a dump records (the file's "calls" attribute)
ORDER_DATASET = "execution_order"
GRAPH_DATASET = "trace_graph"  # the step's trace (Graph.to_json) in a dump that records function calls
# A statistics dump's step: every statistics vector as a row of one matrix, in the order written, and one JSON
# table of its calls (group name, attributes) and rows (group, tensor name, shape, dtype)
STATISTICS_DATASET = "statistics"
STATISTICS_INDEX = "statistics_index"
MAX_TENSOR_BYTES = 1 << 32  # the default cap on one tensor read from a dump (4 GiB)
COMPARE_BLOCK_ELEMENTS = 1 << 16  # compare_dumps reads and compares this many elements at a time
MAX_CHUNK_BYTES = 1 << 26  # HDF5 decompresses a whole chunk to read any of it: larger chunks are refused
MATH_PREFIX = "math_"  # the file attributes of how the run computed (see fwdtrace.precision.math_record)
WRITING = "being written"  # the status of a dump until it is closed: what a killed writer leaves
_GROUP_RE = re.compile(r"^(\d+)_(\w+)$", re.ASCII)
_DATASET_RE = re.compile(r"^\w+$", re.ASCII)
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
# dtypes HDF5 has no type for: stored as the integer bit pattern of the same size.
_BITS_AS: dict[torch.dtype, torch.dtype] = {torch.bfloat16: torch.int16}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _BITS_AS[getattr(torch, _name)] = torch.uint8
_STR2DTYPE = {dtype_name(d): d for d in _BITS_AS}


def _h5py() -> Any:
    try:
        import h5py
    except ImportError as e:  # pragma: no cover - h5py is a dependency
        raise FwdtraceError("HDF5 dumps need h5py: pip install h5py") from e
    return h5py


def group_name(call_number: int, class_name: str) -> str:
    """``"007_Conv2d"``: a call's group name; a class name cannot nest groups or escape the pattern.

    >>> group_name(7, "Block/../../x")
    '007_Block_______x'
    """
    return f"{call_number:03d}_{re.sub(r'[^A-Za-z0-9_]', '_', class_name) or 'Module'}"


def _create_text(file: Any, name: str, text: str) -> None:
    """``text`` as a dataset of its UTF-8 bytes, deflated: a dump's names, keys and JSON repeat themselves, and
    stored as one HDF5 string they were most of a statistics dump's file."""
    import numpy as np

    data = np.frombuffer(text.encode(), dtype=np.uint8)
    file.create_dataset(name, data=data, **({"compression": "gzip"} if data.size else {}))
