"""Plugins: a small distribution on sys.path registers callbacks and atomic layers through entry points."""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fwdtrace
from fwdtrace import plugins
from fwdtrace.registry import REGISTRY

GOOD = '''
import torch
import fwdtrace

CALLS = []
SETUPS = []


@fwdtrace.register_atomic
class Gate(torch.nn.Module):
    """A user layer the plugin wants as one node."""

    def forward(self, x):
        return x * torch.sigmoid(x)


@fwdtrace.hook_forward(torch.nn.Tanh)
def count_tanh(module, inputs, output):
    CALLS.append(tuple(output.shape))


def setup():
    SETUPS.append(1)
'''


def write_distribution(site: Path, name: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
    """What pip would leave in site-packages: a module and NAME-VERSION.dist-info with entry_points.txt."""
    info = site / f"{name.replace('-', '_')}-0.1.dist-info"  # wheels escape '-' in the folder name
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    lines = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
    (info / "entry_points.txt").write_text(f"[{plugins.ENTRY_POINT_GROUP}]\n{lines}")
    for module, source in modules.items():
        (site / f"{module}.py").write_text(textwrap.dedent(source))


@pytest.fixture
def site(tmp_path: Path):
    """A temporary site directory on sys.path; afterwards the plugins and their modules are gone."""
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    before = set(sys.modules)
    yield tmp_path
    sys.path.remove(str(tmp_path))
    for name in set(sys.modules) - before:
        if name.startswith("fwdplug_"):
            del sys.modules[name]
    plugins.load_plugins(reload=True)  # back to the environment's own plugins (conftest clears hooks)


def test_a_plugin_registers_callbacks_and_atomic_layers_lazily_on_the_first_trace(site):
    write_distribution(site, "fwdplug-good", {"good": "fwdplug_good", "good_setup": "fwdplug_good:setup"},
                       {"fwdplug_good": GOOD})
    plugins._loaded = None  # as in a fresh process: nothing loaded yet
    assert "fwdplug_good" not in sys.modules
    model = torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Linear(3, 3))
    graph = fwdtrace.trace(model, torch.ones(2, 3))  # the trace loads the plugins
    module = sys.modules["fwdplug_good"]
    assert module.CALLS == [(2, 3)]
    assert module.SETUPS == [1]
    assert REGISTRY.is_atomic(module.Gate)
    gated = fwdtrace.trace(torch.nn.Sequential(module.Gate()), torch.ones(2))
    assert [n.target for n in gated.nodes if n.kind != "input" and n.kind != "output"] == ["fwdplug_good.Gate"]
    assert [n.target for n in graph.nodes if n.kind == "module"] == ["torch.nn.Tanh", "torch.nn.Linear"]


def test_plugins_load_once(site):
    write_distribution(site, "fwdplug-once", {"once": "fwdplug_once:setup"}, {"fwdplug_once": GOOD})
    assert "once" in plugins.load_plugins(reload=True)
    assert plugins.load_plugins() == plugins.load_plugins()
    fwdtrace.trace(torch.nn.Tanh(), torch.ones(1))
    fwdtrace.install()
    assert sys.modules["fwdplug_once"].SETUPS == [1]


def test_a_broken_plugin_warns_with_its_name_and_tracing_goes_on(site):
    write_distribution(site, "fwdplug-broken", {"broken": "fwdplug_broken"},
                       {"fwdplug_broken": "raise ImportError('needs a library that is not installed')\n"})
    write_distribution(site, "fwdplug-fine", {"fine": "fwdplug_fine"}, {"fwdplug_fine": GOOD})
    with pytest.warns(RuntimeWarning, match=r"^fwdtrace plugin 'broken' \(fwdplug_broken from fwdplug-broken 0.1\) "
                                            r"failed to load and is skipped: ImportError: needs a library"):
        loaded = plugins.load_plugins(reload=True)
    assert "fine" in loaded and "broken" not in loaded
    graph = fwdtrace.trace(torch.nn.Tanh(), torch.ones(4))
    assert [n.kind for n in graph.nodes] == ["input", "module", "output"]
    assert sys.modules["fwdplug_fine"].CALLS == [(4,)]


def test_a_plugin_callable_that_raises_is_skipped_too(site):
    source = "def setup():\n    raise RuntimeError('bad config')\n"
    write_distribution(site, "fwdplug-raises", {"raises": "fwdplug_raises:setup"}, {"fwdplug_raises": source})
    with pytest.warns(RuntimeWarning, match=r"^fwdtrace plugin 'raises' .* RuntimeError: bad config"):
        assert "raises" not in plugins.load_plugins(reload=True)


ONNX_PLUGIN = '''
import torch
import fwdtrace


@fwdtrace.register_atomic
class Swish(torch.nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(x)


fwdtrace.onnx_equivalent(Swish, "Sigmoid+Mul", "Swish")
'''


def test_a_plugin_declares_onnx_equivalences(site, monkeypatch):
    onnx_ops = pytest.importorskip("fwdtrace.onnx.ops")
    monkeypatch.setattr(onnx_ops, "_RULES", dict(onnx_ops._RULES))  # the plugin's rule goes with the test
    write_distribution(site, "fwdplug-onnx", {"onnx": "fwdplug_onnx"}, {"fwdplug_onnx": ONNX_PLUGIN})
    assert "onnx" in plugins.load_plugins(reload=True)
    swish = sys.modules["fwdplug_onnx"].Swish
    (node,) = [n for n in fwdtrace.trace(swish(), torch.ones(3)).nodes if n.kind == "module"]
    equivalence = onnx_ops.equivalence_for(node)
    assert node.target == "fwdplug_onnx.Swish"
    assert equivalence is not None and equivalence.op_types == {"Sigmoid", "Mul", "Swish"}
