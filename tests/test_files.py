"""Atomic writes: whole or nothing, never through a symlink, no silent overwrite when asked."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fwdtrace import FwdtraceError
from fwdtrace._files import AtomicFile, atomic_write, write_bytes


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="half way"), atomic_write(target, caller="test") as tmp:
        tmp.write_bytes(b"new, partly")
        raise RuntimeError("half way")
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["out.bin"]


def test_an_os_error_while_writing_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(FwdtraceError, match=r"^test could not write '.*out.bin': No space left on device"), \
            atomic_write(tmp_path / "out.bin", caller="test"):
        raise OSError(28, "No space left on device")
    assert os.listdir(tmp_path) == []


def test_the_temporary_file_is_fresh_and_beside_the_target(tmp_path: Path) -> None:
    f = AtomicFile(tmp_path / "d.hdf5", caller="test", partial_name=True)
    assert f.tmp.parent == tmp_path and f.tmp.name.startswith("d.hdf5.partial-") and f.tmp.stat().st_size == 0
    mode = f.tmp.stat().st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask  # the user's usual mode, not mkstemp's private 0o600
    f.discard()
    f.discard()  # twice is harmless
    assert os.listdir(tmp_path) == []


def test_a_symlink_at_the_target_is_replaced_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    target = tmp_path / "out.bin"
    target.symlink_to(victim)
    write_bytes(target, b"data", caller="test")
    assert victim.read_bytes() == b"keep" and not target.is_symlink() and target.read_bytes() == b"data"


def test_overwrite_false_refuses_an_existing_target_even_one_that_appears_late(tmp_path: Path) -> None:
    target = tmp_path / "out.bin"
    f = AtomicFile(target, caller="test", overwrite=False)
    f.check_target()  # nothing there yet
    f.tmp.write_bytes(b"mine")
    target.write_bytes(b"someone else's")  # appears while we write
    with pytest.raises(FwdtraceError, match=r"^test expected a new file, got '.*out.bin', which exists; pass overwrite=True"):
        f.commit()
    assert target.read_bytes() == b"someone else's" and os.listdir(tmp_path) == ["out.bin"]
