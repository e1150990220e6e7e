"""fwdtrace: see, check and reach into the graph your eager PyTorch model really runs.

>>> import torch, fwdtrace
>>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU())
>>> graph = fwdtrace.trace(model, torch.ones(1, 3, 8, 8))
>>> [n.target for n in graph.nodes if n.kind == "module"]
['torch.nn.Conv2d', 'torch.nn.ReLU']

``import fwdtrace`` imports nothing heavy, not even torch: every public name is loaded on
first use, and the features built on ONNX, HDF5 or Graphviz import those libraries then.
So a recorder worker (``python -m fwdtrace.recorder``, which only draws) starts without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Every public name, loaded on first attribute access: name -> module.
_LAZY: dict[str, str] = {
    # the core: trace, graph, registry (torch only)
    "FwdtraceError": "fwdtrace.errors",
    "FwdtraceWarning": "fwdtrace.errors",
    "Graph": "fwdtrace.graph",
    "Node": "fwdtrace.node",
    "Edge": "fwdtrace.node",
    "Scope": "fwdtrace.node",
    "TensorRef": "fwdtrace.node",
    "Tracer": "fwdtrace.tracer",
    "trace": "fwdtrace.tracer",
    "obj_id": "fwdtrace.tracer",
    "install": "fwdtrace.tracer",
    "uninstall": "fwdtrace.tracer",
    "hook_forward": "fwdtrace.registry",
    "register_atomic": "fwdtrace.registry",
    "remove_hook": "fwdtrace.registry",
    "clear_hooks": "fwdtrace.registry",
    "module_keys": "fwdtrace.instrument.keys",
    # ONNX cross-check
    "export_onnx": "fwdtrace.onnx.export",
    "onnx_graph": "fwdtrace.onnx.export",
    "compare_onnx": "fwdtrace.onnx.compare",
    "check_onnx": "fwdtrace.onnx.compare",
    "TopologyReport": "fwdtrace.onnx.compare",
    "render_side_by_side": "fwdtrace.onnx.compare",
    "onnx_equivalent": "fwdtrace.onnx.ops",
    # ONNX emitted from one eager run
    "to_onnx": "fwdtrace.onnx.emit",
    "onnx_symbolic": "fwdtrace.onnx.emit",
    "remove_onnx_symbolic": "fwdtrace.onnx.emit",
    # hooks toolkit
    "Probe": "fwdtrace.probe",
    "Dumper": "fwdtrace.dump",
    "read_dump": "fwdtrace.dump",
    "compare_dumps": "fwdtrace.dump",
    "compare_ranks": "fwdtrace.dump",
    "RanksReport": "fwdtrace.dump",
    "find_overflow": "fwdtrace.dump",
    "DumpReport": "fwdtrace.dump",
    # analysis
    "analyze": "fwdtrace.analysis",
    "Analysis": "fwdtrace.analysis",
    "install_excepthook": "fwdtrace.excepthook",
    "uninstall_excepthook": "fwdtrace.excepthook",
    # live sampler service
    "serve": "fwdtrace.live.server",
    # out-of-process recorder
    "Recorder": "fwdtrace.recorder",
    # Model Explorer
    "view": "fwdtrace.passes.model_explorer",
}

__all__ = [*_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fwdtrace' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    # The public names and the module's dunders only: not the helpers this file imports (Any,
    # importlib, TYPE_CHECKING) nor submodules that happen to be loaded, so tab completion
    # shows the API. Submodules (fwdtrace.instrument.keys, fwdtrace.passes.draw) are imported by name.
    return sorted({*__all__, *(n for n in globals() if n.startswith("__") and n.endswith("__"))})


if TYPE_CHECKING:  # for type checkers and IDEs: the lazy names, imported eagerly ("X as X" re-exports)
    from .analysis import Analysis as Analysis
    from .analysis import analyze as analyze
    from .dump import Dumper as Dumper
    from .dump import DumpReport as DumpReport
    from .dump import RanksReport as RanksReport
    from .dump import compare_dumps as compare_dumps
    from .dump import compare_ranks as compare_ranks
    from .dump import find_overflow as find_overflow
    from .dump import read_dump as read_dump
    from .errors import FwdtraceError as FwdtraceError
    from .errors import FwdtraceWarning as FwdtraceWarning
    from .excepthook import install_excepthook as install_excepthook
    from .excepthook import uninstall_excepthook as uninstall_excepthook
    from .graph import Graph as Graph
    from .instrument.keys import module_keys as module_keys
    from .live.server import serve as serve
    from .node import Edge as Edge
    from .node import Node as Node
    from .node import Scope as Scope
    from .node import TensorRef as TensorRef
    from .onnx.compare import TopologyReport as TopologyReport
    from .onnx.compare import check_onnx as check_onnx
    from .onnx.compare import compare_onnx as compare_onnx
    from .onnx.compare import render_side_by_side as render_side_by_side
    from .onnx.emit import onnx_symbolic as onnx_symbolic
    from .onnx.emit import remove_onnx_symbolic as remove_onnx_symbolic
    from .onnx.emit import to_onnx as to_onnx
    from .onnx.export import export_onnx as export_onnx
    from .onnx.export import onnx_graph as onnx_graph
    from .onnx.ops import onnx_equivalent as onnx_equivalent
    from .passes.model_explorer import view as view
    from .probe import Probe as Probe
    from .recorder import Recorder as Recorder
    from .registry import clear_hooks as clear_hooks
    from .registry import hook_forward as hook_forward
    from .registry import register_atomic as register_atomic
    from .registry import remove_hook as remove_hook
    from .tracer import Tracer as Tracer
    from .tracer import install as install
    from .tracer import obj_id as obj_id
    from .tracer import trace as trace
    from .tracer import uninstall as uninstall
