"""The package as users get it: light import, every public name reachable, typed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fwdtrace

HEAVY = ("onnx", "onnxscript", "onnxruntime", "h5py", "networkx", "graphviz", "pygraphviz", "transformers", "tensorboard")


def test_import_loads_nothing_heavy_not_even_torch() -> None:
    code = f"import fwdtrace, sys; print(sorted(m for m in {(*HEAVY, 'torch')!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_public_name_resolves() -> None:
    missing = [name for name in fwdtrace.__all__ if getattr(fwdtrace, name, None) is None]
    assert missing == []
    assert set(fwdtrace.__all__) <= set(dir(fwdtrace))


def test_dir_shows_the_public_names_only() -> None:
    shown = set(dir(fwdtrace))
    dunders = {n for n in shown if n.startswith("__") and n.endswith("__")}
    assert "__version__" in dunders and "__all__" in dunders
    assert shown - dunders == set(fwdtrace.__all__)
    for helper in ("Any", "TYPE_CHECKING", "importlib", "annotations", "_LAZY", "tracer", "keys", "errors"):
        assert helper not in shown
    assert all(getattr(fwdtrace, name, None) is not None for name in shown - dunders)


def test_unknown_attribute_is_an_attribute_error() -> None:
    try:
        fwdtrace.no_such_name  # noqa: B018
    except AttributeError as e:
        assert "no_such_name" in str(e)
    else:
        raise AssertionError("expected AttributeError")


def test_package_is_typed() -> None:
    assert (Path(fwdtrace.__file__).parent / "py.typed").exists()


GROUPED = '''
import os, pytest

@pytest.fixture(scope="module")
def run(request):
    return request.param

@pytest.mark.parametrize("entry", range(4))
@pytest.mark.parametrize("run", [pytest.param(n, marks=pytest.mark.xdist_group(n)) for n in "ab"], indirect=True)
def test_entry(run, entry):
    with open(os.environ["GROUPED_LOG"], "a") as log:
        log.write(f"{run} {os.getpid()}\\n")
'''


def test_xdist_groups_stay_on_one_worker(tmp_path: Path) -> None:
    """make test's ``--dist loadgroup`` keeps each corpus model's cases on one worker, as test_conformance.py
    is written for (pytest 9.2 with pytest-xdist 3.8 silently split them, doing each model's work twice)."""
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    log = tmp_path / "log"
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-q", "-p", "no:cacheprovider",
                           "test_grouped.py"], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "GROUPED_LOG": str(log)})
    assert done.returncode == 0, done.stdout[-2000:]
    workers: dict[str, set[str]] = {}
    for line in log.read_text().splitlines():
        group, pid = line.split()
        workers.setdefault(group, set()).add(pid)
    assert sorted(workers) == ["a", "b"] and all(len(pids) == 1 for pids in workers.values()), workers


# -- the sdist, and the wheel built from it --------------------------------------------------------
ROOT = Path(__file__).parent.parent
BUILD = '''
import sys
from setuptools import build_meta
print(getattr(build_meta, sys.argv[1])(sys.argv[2]))
'''


def _build(kind: str, source: Path, out: Path) -> Path:
    """Build with setuptools' own PEP 517 hooks (what pip and ``python -m build`` call), in ``source``."""
    done = subprocess.run([sys.executable, "-c", BUILD, kind, str(out)], cwd=source, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return out / done.stdout.strip().splitlines()[-1]


def test_sdist_holds_every_tracked_file_so_make_test_runs_from_it(tmp_path: Path) -> None:
    """The sdist is the repository as git tracks it (the suite, its test models and golden files, the
    docs and notebooks it runs, the Makefile): ``make test`` runs from it; its wheel carries the
    package alone, with its data, and the metadata leads to the docs."""
    import shutil
    import tarfile
    import zipfile

    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=False)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout (an unpacked sdist): nothing to compare with")
    source = tmp_path / "source"
    caches = shutil.ignore_patterns(".venv*", ".git", "__pycache__", "*.egg-info", ".*_cache", "build", "dist", "artifacts")
    shutil.copytree(ROOT, source, ignore=caches)
    sdist = _build("build_sdist", source, tmp_path / "dist")
    top = sdist.name.removesuffix(".tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.removeprefix(f"{top}/") for n in tar.getnames() if tar.getmember(n).isfile()}
        tar.extractall(tmp_path / "unpacked", filter="data")
    package = {str(p.relative_to(ROOT)) for p in (ROOT / "fwdtrace").rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    assert {n for n in names if n.startswith("fwdtrace/")} == package
    files = {f for f in tracked.stdout.splitlines() if (ROOT / f).is_file()}
    assert sorted(files - names) == []
    assert "PKG-INFO" in names and not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    assert (ROOT / "LICENSE").read_text().startswith("MIT License\n\nCopyright (c) 2026 the fwdtrace developers\n")
    info = (tmp_path / "unpacked" / top / "PKG-INFO").read_text()
    assert "License-Expression: MIT\n" in info and "Classifier: Typing :: Typed\n" in info
    site = re.search(r"^site_url: (\S+)$", (ROOT / "mkdocs.yml").read_text(), re.M)
    repo = re.search(r"^repo_url: (\S+)$", (ROOT / "mkdocs.yml").read_text(), re.M)
    assert site and repo
    assert f"Project-URL: Documentation, {site[1]}\n" in info and f"Project-URL: Source, {repo[1]}\n" in info
    assert f"Project-URL: Changelog, {site[1]}changelog/\n" in info

    wheel = _build("build_wheel", tmp_path / "unpacked" / top, tmp_path / "wheel")
    with zipfile.ZipFile(wheel) as whl:
        files = set(whl.namelist())
    assert package <= files  # py.typed and the live page's static files included
    assert f"{top}.dist-info/licenses/LICENSE" in files
