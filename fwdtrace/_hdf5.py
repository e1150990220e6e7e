"""One set of rules for an HDF5 file from elsewhere (a dump, a reopened live run): plain objects inside it only.

External links, soft links, external storage and virtual datasets are refused: following or
reading them would read other files (any file the process may read, served back to whoever
asked). A dataset's declared size is checked against what the file really stores before
anything is allocated: a small file cannot make a reader allocate gigabytes. Each check
raises what ``error(what)`` makes of a short fact, so the message names the caller's file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import FwdtraceError

__all__ = ["check_link", "check_dataset", "check_stored"]

Error = Callable[[str], FwdtraceError]


def check_link(h5py: Any, parent: Any, name: str, where: str, error: Error) -> None:
    """``parent[name]`` is a hard link (an object inside this file), else ``error``."""
    link = parent.get(name, getlink=True)
    if isinstance(link, h5py.ExternalLink):
        raise error(f"where {where} is an external link to {link.filename!r} ({link.path}), not followed")
    if not isinstance(link, h5py.HardLink):
        raise error(f"where {where} is a {type(link).__name__} to {getattr(link, 'path', '?')!r}, not followed")


def check_dataset(h5py: Any, ds: Any, where: str, error: Error) -> None:
    """``ds`` is a dataset whose data lies in this file, else ``error``."""
    if not isinstance(ds, h5py.Dataset):
        raise error(f"where {where} is a {type(ds).__name__}, not a dataset")
    if ds.is_virtual:
        raise error(f"where {where} is a virtual dataset (data from other files), not read")
    if ds.external:
        files = ", ".join(repr(e[0].decode() if isinstance(e[0], bytes) else e[0]) for e in ds.external)
        raise error(f"where {where} keeps its data in external files ({files}), not read")
    if ds.shape is None:
        raise error(f"where {where} has no dataspace")


def check_stored(ds: Any, where: str, error: Error, slack: int = 0) -> None:
    """``ds`` declares no more bytes than the file stores for it (plus ``slack``: a chunk being written), else ``error``."""
    declared = ds.size * ds.dtype.itemsize
    stored = ds.id.get_storage_size()
    if declared > stored + slack:
        raise error(f"where {where} declares {ds.shape} ({declared} bytes) but the file stores {stored} bytes for it")
