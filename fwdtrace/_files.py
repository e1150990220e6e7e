"""Atomic writes: a file appears whole under its name, or not at all.

The data goes to a fresh temporary file in the target's folder, created with ``O_EXCL``
(so neither it nor a symlink planted at its name is ever opened for writing) and, where
fwdtrace writes the bytes itself, written through the descriptor that created it (a file
renamed over its name meanwhile is never written), then moved in place with ``os.replace``,
which replaces a symlink at the target name instead of writing through it: a symlink the
user names as the file is replaced by the file, the file it pointed to is left as it was.
A folder at the target name, or a folder that does not exist, is refused with
fwdtrace's error before anything is written. On failure the temporary file is removed.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .errors import FwdtraceError

__all__ = ["AtomicFile", "QuietWrites", "atomic_write", "write_bytes", "write_files", "check_folder", "not_a_regular_file"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class AtomicFile:
    """A temporary file beside ``target``; :meth:`commit` moves it in place, :meth:`discard` removes it.

    >>> import tempfile, pathlib
    >>> target = pathlib.Path(tempfile.mkdtemp()) / "out.txt"
    >>> f = AtomicFile(target, caller="example")
    >>> _ = f.tmp.write_text("whole"); f.commit(); target.read_text()
    'whole'

    ``tmp`` exists (empty, created with ``O_EXCL``) once the object is made; its name is
    ``.{name}.{random}.tmp``, or ``{name}.partial-{random}`` with ``partial_name=True`` so a
    file a killed process leaves behind says what it is, or ``{stem}.partial-{random}{suffix}``
    with ``keep_suffix=True`` for writers that pick the format by the name (ffmpeg). With ``overwrite=False``,
    :meth:`commit` refuses an existing target (atomically, with a hard link where the
    file system has them).
    """

    def __init__(
        self,
        target: str | os.PathLike[str],
        caller: str,
        overwrite: bool = True,
        partial_name: bool = False,
        keep_suffix: bool = False,
        keep_open: bool = False,
    ) -> None:
        self.target = Path(target)
        self.caller = caller
        self.overwrite = overwrite
        self.fd: int | None = None
        folder = self.target.parent
        name = self.target.name
        for _ in range(100):
            token = secrets.token_hex(4)
            if keep_suffix:
                tmp = folder / f"{self.target.stem}.partial-{token}{self.target.suffix}"
            else:
                tmp = folder / (f"{name}.partial-{token}" if partial_name else f".{name}.{token}.tmp")
            try:
                # 0o666 before the umask, as open() gives: the file gets the user's usual mode.
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | os.O_CLOEXEC, 0o666)
            except FileExistsError:
                continue
            except OSError as e:
                raise FwdtraceError(f"{caller} could not create a file in {str(folder)!r}: {e.strerror or e}") from e
            self.tmp = tmp
            if keep_open:  # written through this descriptor: never reopened by a name someone could swap
                self.fd = fd
            else:
                os.close(fd)
            return
        raise FwdtraceError(f"{caller} could not find a free temporary name in {str(folder)!r}")  # pragma: no cover

    def write(self, data: bytes) -> None:
        """Write ``data`` through the descriptor that created the temporary file (``keep_open=True``)."""
        assert self.fd is not None, "AtomicFile(keep_open=True) writes through its descriptor"
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view):]

    def _close(self) -> None:
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def check_target(self) -> None:
        """Raise if the target is a folder, or exists and ``overwrite`` is False (before any work is done)."""
        if os.path.isdir(self.target) and not os.path.islink(self.target):
            self.discard()
            raise FwdtraceError(f"{self.caller} expected a file to write, got {str(self.target)!r}, which is a folder")
        if not self.overwrite and os.path.lexists(self.target):
            raise FwdtraceError(
                f"{self.caller} expected a new file, got {str(self.target)!r}, which exists; "
                "pass overwrite=True to replace it"
            )

    def commit(self) -> None:
        """Move the temporary file to the target name (removing it if that fails)."""
        try:
            self._close()
            if self.overwrite:
                os.replace(self.tmp, self.target)
                return
            try:
                os.link(self.tmp, self.target, follow_symlinks=False)  # fails if the target exists
            except FileExistsError:
                self.discard()
                self.check_target()
                raise
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
                    raise
                self.check_target()  # no hard links here: check, then replace
                os.replace(self.tmp, self.target)
                return
            self.tmp.unlink()
        except FwdtraceError:
            raise
        except OSError as e:
            self.discard()
            raise FwdtraceError(f"{self.caller} could not write {str(self.target)!r}: {e.strerror or e}") from e

    def discard(self) -> None:
        """Remove the temporary file; harmless when it is already gone."""
        self._close()
        try:
            self.tmp.unlink()
        except FileNotFoundError:
            pass


class QuietWrites:
    """A file HDF5 writes through (h5py's ``fileobj`` driver) that never reports a failed write to it.

    >>> import tempfile, os, h5py
    >>> path = os.path.join(tempfile.mkdtemp(), "a.h5")
    >>> open(path, "wb").close()  # AtomicFile makes the file; this opens it as it is
    >>> quiet = QuietWrites(path)
    >>> with h5py.File(quiet, "w") as f:
    ...     f["x"] = [1, 2]
    >>> quiet.close(); quiet.error is None
    True

    HDF5 does not survive a write the system refuses (a full disk, a file size limit): its cache
    keeps the dirty entries, every later flush fails again, h5py's clean-up prints "Exception
    ignored" tracebacks, and the library's own clean-up at exit crashed the process (SIGSEGV).
    Here the first refused write is kept in :attr:`error` and it and every later write are
    kept in memory instead (HDF5 may read them back), so HDF5 goes on as if the disk had taken
    them and closes cleanly; the caller checks :attr:`error` after each operation and drops the
    file. What a refused write keeps in memory is bounded by :attr:`KEEP_BYTES`; past that,
    writes are dropped and read back as zeros (the file is being dropped anyway).
    """

    KEEP_BYTES = 1 << 26

    def __init__(self, path: str | os.PathLike[str]) -> None:
        # O_NOFOLLOW: the file is AtomicFile's fresh temporary file, never a link planted at its name
        self.fd = os.open(path, os.O_RDWR | _NOFOLLOW | os.O_CLOEXEC)
        self.position = 0
        self.size = 0  # of the file as HDF5 sees it: what is on disk and what was kept
        self.error: OSError | None = None
        self.kept: dict[int, bytes] = {}  # offset -> bytes of the writes made after the error
        self.kept_bytes = 0

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self.position = offset if whence == os.SEEK_SET else self.position + offset if whence == os.SEEK_CUR \
            else self.size + offset
        return self.position

    def tell(self) -> int:
        return self.position

    def read(self, size: int = -1) -> bytes:
        size = max(0, self.size - self.position) if size < 0 else size
        data = bytearray(os.pread(self.fd, size, self.position))
        data.extend(bytes(size - len(data)))  # past the end of what the disk holds: zeros, as HDF5 expects
        for start, kept in self.kept.items():  # few: only writes made after the error
            lo, hi = max(start, self.position), min(start + len(kept), self.position + size)
            if lo < hi:
                data[lo - self.position:hi - self.position] = kept[lo - start:hi - start]
        self.position += size
        return bytes(data)

    def write(self, data: bytes | bytearray | memoryview) -> int:
        size = self.write_at(self.position, data, keep=True)
        self.position += size
        return size

    def write_at(self, offset: int, data: Any, keep: bool = False) -> int:
        """Write ``data`` (any buffer) at ``offset``; after a refused write, kept in memory if ``keep`` (what HDF5
        may read back: the caller's own raw data it never reads)."""
        view = memoryview(data).cast("B")
        size = len(view)
        if self.error is None:
            try:
                done = 0
                while done < size:  # a write near a size limit can be short: the rest fails with EFBIG
                    done += os.pwrite(self.fd, view[done:], offset + done)
            except OSError as e:
                self.error = e
        if keep and self.error is not None and self.kept_bytes + size <= self.KEEP_BYTES:
            self.kept[offset] = bytes(view)
            self.kept_bytes += size
        self.size = max(self.size, offset + size)
        return size

    def truncate(self, size: int | None = None) -> int:
        size = self.position if size is None else size
        if self.error is None:
            try:
                os.ftruncate(self.fd, size)
            except OSError as e:
                self.error = e
        self.size = size
        return size

    def flush(self) -> None:
        pass  # every write went to the system at once

    def close(self) -> None:
        """Close the descriptor (after HDF5 closed the file)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@contextmanager
def atomic_write(target: str | os.PathLike[str], caller: str, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temporary path to write; on leaving the block it becomes ``target``, or is removed on error.

    >>> import tempfile, pathlib
    >>> target = pathlib.Path(tempfile.mkdtemp()) / "out.bin"
    >>> with atomic_write(target, caller="example") as tmp:
    ...     _ = tmp.write_bytes(b"data")
    >>> target.read_bytes()
    b'data'
    """
    f = AtomicFile(target, caller, overwrite=overwrite)
    try:
        f.check_target()
        yield f.tmp
    except OSError as e:
        f.discard()
        raise FwdtraceError(f"{caller} could not write {str(f.target)!r}: {e.strerror or e}") from e
    except BaseException:
        f.discard()
        raise
    f.commit()


def write_bytes(target: str | os.PathLike[str], data: bytes, caller: str) -> None:
    """Write ``data`` to ``target`` atomically; a failed write raises FwdtraceError naming ``target``.

    >>> import tempfile, pathlib
    >>> target = pathlib.Path(tempfile.mkdtemp()) / "a.txt"
    >>> write_bytes(target, b"hi", caller="example"); target.read_bytes()
    b'hi'
    """
    write_files({Path(target): data}, caller)


def write_files(files: Mapping[Path, bytes], caller: str) -> None:
    """Write each file atomically, all written before any is moved in place: an error (a full disk, a
    folder at one of the names) leaves every target as it was.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> write_files({d / "a.json": b"{}", d / "a.extra.json": b"[]"}, caller="example"); sorted(p.name for p in d.iterdir())
    ['a.extra.json', 'a.json']
    """
    staged: list[AtomicFile] = []
    try:
        for target, data in files.items():
            f = AtomicFile(target, caller, keep_open=True)
            staged.append(f)
            f.check_target()
            f.write(data)
        for f in staged:
            f._close()  # every write done and closed before the first is moved in place
    except OSError as e:
        for f in staged:
            f.discard()
        raise FwdtraceError(f"{caller} could not write {str(staged[-1].target)!r}: {e.strerror or e}") from e
    except BaseException:
        for f in staged:
            f.discard()
        raise
    for i, f in enumerate(staged):
        try:
            f.commit()
        except BaseException:
            for rest in staged[i + 1:]:
                rest.discard()
            raise


def check_folder(target: str | os.PathLike[str], caller: str) -> None:
    """Raise unless ``target``'s folder exists and ``target`` is not a folder (checked before costly work)."""
    path = Path(target)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise FwdtraceError(f"{caller} expected an existing folder for {str(path)!r}, but {str(folder)!r} is not one")
    if path.is_dir() and not path.is_symlink():
        raise FwdtraceError(f"{caller} expected a file to write, got {str(path)!r}, which is a folder")


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def not_a_regular_file(path: str | os.PathLike[str]) -> str | None:
    """None for a regular file (links followed), else what ``path`` is instead, to end an error message.

    >>> not_a_regular_file("/dev/zero"), not_a_regular_file("/no/such/file")
    ('which is not a regular file but a character device', 'which does not exist')

    Reading a FIFO blocks and ``/dev/zero`` never ends: inputs are checked before they are opened.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "which does not exist"
    except OSError as e:
        return f"which cannot be read: {e.strerror or e}"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "which is a folder"
    kind = next((name for test, name in _KINDS if test(mode)), "something else")
    return f"which is not a regular file but {kind}"
