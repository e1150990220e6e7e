"""The package as users get it: light import, every public name reachable, typed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
