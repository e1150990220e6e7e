"""Where a report writes its outputs: report.render(path), report.to_model_explorer(folder) and
``fwdtrace dump-diff --picture/--model-explorer``, at an existing file or folder, a symlink, a path
in a folder that does not exist, and a symlink planted inside a folder fwdtrace writes into."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import fwdtrace
from fwdtrace import FwdtraceError
from fwdtrace._files import AtomicFile, write_files
from fwdtrace.cli import main as cli_main


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    folder = tmp_path_factory.mktemp("dumps")
    paths: list[str] = []
    for scale in (1.0, 2.0):
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        torch.nn.init.constant_(model[0].weight, scale)
        dumper = fwdtrace.Dumper(folder / f"run{scale}", calls="all")
        dumper.register(model, grads=False)
        model(torch.ones(1, 2))
        paths += [str(p) for p in dumper.remove()]
    return paths


@pytest.fixture(scope="module")
def report(dumps: list[str]) -> Any:
    return fwdtrace.compare_dumps(*dumps)


def _render(report: Any, dumps: list[str], path: Path) -> None:
    report.render(path)


def _dump_diff(*argv: str) -> None:
    """The command line in this process; its error (exit 2) raised again with the message it printed."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = cli_main(["dump-diff", *argv])
    if code == 2:
        raise FwdtraceError(err.getvalue())
    assert code == 1, err.getvalue()  # the runs differ by their weights


def _dump_diff_picture(report: Any, dumps: list[str], path: Path) -> None:
    _dump_diff(*dumps, "--picture", str(path))


def _explorer(report: Any, dumps: list[str], path: Path) -> None:
    report.to_model_explorer(path)


def _dump_diff_explorer(report: Any, dumps: list[str], path: Path) -> None:
    _dump_diff(*dumps, "--model-explorer", str(path))


PICTURES = [_render, _dump_diff_picture]
FOLDERS = [_explorer, _dump_diff_explorer]
Writer = Callable[[Any, list[str], Path], None]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and not p.is_symlink()}


@pytest.mark.parametrize("write", PICTURES, ids=lambda f: f.__name__.strip("_"))
def test_a_picture_replaces_a_file_or_a_symlink_and_refuses_a_folder(write: Writer, report: Any, dumps: list[str],
                                                                      tmp_path: Path) -> None:
    existing = tmp_path / "existing.svg"
    existing.write_text("old")
    write(report, dumps, existing)
    assert existing.read_bytes().lstrip().startswith((b"<?xml", b"<svg")) and os.listdir(tmp_path) == ["existing.svg"]
    # A symlink the user names as the file: replaced by the picture, what it pointed to left as it was.
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    link = tmp_path / "link.svg"
    link.symlink_to(victim)
    write(report, dumps, link)
    assert victim.read_text() == "keep" and not link.is_symlink() and link.read_bytes() == existing.read_bytes()
    # A folder at the name, and a folder that does not exist: fwdtrace's error, nothing written.
    (tmp_path / "folder.svg").mkdir()
    (tmp_path / "folder.svg" / "inside").write_text("x")
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(FwdtraceError, match=r"expected a file to write, got '.*folder\.svg', which is a folder"):
        write(report, dumps, tmp_path / "folder.svg")
    with pytest.raises(FwdtraceError, match=r"expected an existing folder for '.*missing/p\.svg'"):
        write(report, dumps, tmp_path / "missing" / "p.svg")
    assert sorted(os.listdir(tmp_path)) == before and os.listdir(tmp_path / "folder.svg") == ["inside"]


@pytest.mark.parametrize("write", FOLDERS, ids=lambda f: f.__name__.strip("_"))
def test_model_explorer_files_replace_planted_symlinks_and_refuse_what_is_not_a_folder(
        write: Writer, report: Any, dumps: list[str], tmp_path: Path) -> None:
    out = tmp_path / "diff"
    write(report, dumps, out)  # a new folder in an existing one
    written = _files(out)
    assert "diff.json" in written and "diff.verdict.json" in written
    # Again into the same folder, with a symlink planted at one of the names and an old file at another.
    victim = tmp_path / "victim.json"
    victim.write_text("keep")
    (out / "diff.max_rel.json").unlink()
    (out / "diff.max_rel.json").symlink_to(victim)
    (out / "diff.json").write_text("old")
    write(report, dumps, out)
    assert victim.read_text() == "keep" and not (out / "diff.max_rel.json").is_symlink()
    assert _files(out) == written and sorted(os.listdir(out)) == sorted(written)  # no temporary left
    # A symlink the user names as the folder is that folder.
    (tmp_path / "named").symlink_to(out, target_is_directory=True)
    write(report, dumps, tmp_path / "named")
    assert _files(out) == written
    # A file, a dangling symlink, a folder in a folder that does not exist: fwdtrace's error, nothing made.
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for path in (tmp_path / "a-file", tmp_path / "dangling", tmp_path / "missing" / "diff"):
        before = sorted(os.listdir(tmp_path))
        with pytest.raises(FwdtraceError, match=r"to_model_explorer\(\) expected a folder, or a new one in an existing folder"):
            write(report, dumps, path)
        assert sorted(os.listdir(tmp_path)) == before and not (tmp_path / "nowhere").exists()


def test_a_folder_at_one_node_data_name_leaves_every_file_as_it_was(report: Any, tmp_path: Path) -> None:
    report.to_model_explorer(tmp_path)
    written = _files(tmp_path)
    (tmp_path / "diff.json").write_text("old graph")
    (tmp_path / "diff.verdict.json").unlink()
    (tmp_path / "diff.verdict.json").mkdir()
    with pytest.raises(FwdtraceError, match=r"^DumpReport\.to_model_explorer\(\) expected a file to write, got "
                                            r"'.*diff\.verdict\.json', which is a folder"):
        report.to_model_explorer(tmp_path)
    # never a new graph beside old node data: nothing moved in place, no temporary left
    assert (tmp_path / "diff.json").read_text() == "old graph"
    assert sorted(os.listdir(tmp_path)) == sorted(written)


def test_a_file_swapped_in_at_the_temporary_name_is_never_written(tmp_path: Path) -> None:
    """A hard link to another file renamed over the temporary name (a symlink would be refused by O_NOFOLLOW):
    the bytes go through the descriptor that created the temporary file, not to whatever now has its name."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    f = AtomicFile(tmp_path / "out.json", caller="test", keep_open=True)
    os.link(victim, tmp_path / "planted")
    os.replace(tmp_path / "planted", f.tmp)
    f.write(b"data")
    f.commit()
    assert victim.read_bytes() == b"keep"
    # write_files writes the same way, every file before the first is moved in place
    write_files({tmp_path / "a": b"1", tmp_path / "b": b"2"}, caller="test")
    assert (tmp_path / "a").read_bytes() == b"1" and (tmp_path / "b").read_bytes() == b"2"


def test_nothing_is_left_when_the_disk_fills_during_a_write(report: Any, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    report.to_model_explorer(tmp_path)
    written = _files(tmp_path)
    calls = [0]
    real_write = os.write

    def full(fd: int, data: Any) -> int:
        calls[0] += 1
        if calls[0] == 3:
            raise OSError(28, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(FwdtraceError, match=r"^DumpReport\.to_model_explorer\(\) could not write '.*': No space left"):
        report.to_model_explorer(tmp_path)
    monkeypatch.undo()
    assert _files(tmp_path) == written and sorted(os.listdir(tmp_path)) == sorted(written)
    shutil.rmtree(tmp_path)
