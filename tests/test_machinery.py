"""Other tools' machinery around layers (FSDP2's unshard, accelerate's offload hooks) against the same model without it.

The reference is the very model, same weights, traced and run without the tool: the trace of the
wrapped model must hold the same module nodes and the same function nodes between them, wired the
same way, plus exactly one node per unshard or offload; its outputs (and FSDP's gradients) are
torch's own.
"""

from __future__ import annotations

import gc
import re

import pytest
import torch
from process_groups import world_of_one
from torch import nn

import fwdtrace
from fwdtrace.graph import Graph
from fwdtrace.passes.draw import to_dot
from fwdtrace.patching import patched_functions

MACHINERY_TARGETS = ("fsdp.unshard", "accelerate.onload")


class Gain(nn.Module):
    """Reads its own parameter between layers: the parameter a tool swaps in must keep its name."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.fc = nn.Linear(n, n)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x)) * self.gain


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), Gain(8), nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 2))


def skeleton(graph: Graph) -> tuple[list[tuple], list[tuple]]:
    """The graph without the machinery's nodes: each node by what it is, where and what it reads, edges by node positions."""
    kept = [n for n in graph.nodes if n.target not in MACHINERY_TARGETS]
    position = {n.id: i for i, n in enumerate(kept)}
    nodes = [(n.kind, n.target, n.module_path, n.call_index, n.scope, [(r.param, r.shape, r.dtype) for r in n.inputs],
              [r.shape for r in n.outputs]) for n in kept]
    edges = sorted((position[e.src], position[e.dst], e.shape) for e in graph.edges if e.src in position and e.dst in position)
    return nodes, edges


def assert_model_picture(graph: Graph, reference: Graph, target: str, expected: dict[str, list[str]]) -> None:
    """``graph`` is ``reference`` plus one ``target`` node per module path of ``expected``, which
    outputs that module's tensors by name, comes before the module's first node, and feeds only
    nodes that read those tensors."""
    assert skeleton(graph) == skeleton(reference)
    made = [n for n in graph.nodes if n.target in MACHINERY_TARGETS]
    assert [n.target for n in made] == [target] * len(expected)
    assert {n.module_path: sorted(r.param for r in n.outputs) for n in made} == expected
    for n in made:
        first = next(m for m in graph.nodes if m.kind in ("module", "function") and m.target not in MACHINERY_TARGETS
                     and (not n.module_path or f"{m.module_path}.".startswith(f"{n.module_path}.")))
        assert n.id < first.id
        # drawn in the module it serves, or beside it where that module is one box (an atomic layer)
        layer = next((m for m in graph.nodes if m.kind == "module" and m.module_path == n.module_path), None)
        assert n.scope == (layer.scope if layer is not None else first.scope[:len(n.module_path.split(".")) if n.module_path else 0])
        assert not n.inputs
        for e in graph.out_edges(n.id):
            assert any(r.obj_id == e.obj_id and r.param is not None for r in graph.nodes[e.dst].inputs)
    # the picture: each such node a box of its own, joined by a dashed edge to each layer drawn as
    # one node whose parameters it put in place (the functions reading them have data edges)
    source = to_dot(graph).source
    assert "unused results" not in source
    assert source.count(f'label="{target}"') == len(expected)
    layers = {n.module_path for n in reference.nodes if n.kind == "module"}
    owner2params: dict[str, set[str]] = {}
    for name in (name for names in expected.values() for name in names):
        if name.rpartition(".")[0] in layers:
            owner2params.setdefault(name.rpartition(".")[0], set()).add(name)
    dashed = re.findall(r'-> \S+ \[style=dashed tooltip="parameters: ([^"]*)"\]', source)
    assert sorted(sorted(d.split(", ")) for d in dashed) == sorted(sorted(p) for p in owner2params.values())


def assert_same_analysis(model: nn.Module, reference: nn.Module, x: torch.Tensor) -> None:
    """``analyze`` says of ``model`` what it says of ``reference``: class, device, sizes, FLOPs, per key; and times it."""
    def numbers(a: fwdtrace.Analysis) -> tuple:
        rows = [(r.key, r.module_path, r.class_name, r.calls, r.input_shapes, r.output_shapes, r.params, r.flops, r.flops_total)
                for r in a.rows]
        return a.model, a.device, a.params, a.trainable_params, a.flops, a.repeats, rows

    assert numbers(fwdtrace.analyze(model, x, warmup=0, repeats=1)) == numbers(fwdtrace.analyze(reference, x, warmup=0, repeats=1))


@pytest.mark.parametrize("offload", ["cpu_offload", "disk_offload"])
def test_dumps_probes_and_analysis_of_an_offloaded_model_equal_the_plain_models(offload, tmp_path):
    """accelerate keeps an offloaded model's weights on the meta device between forwards: a dump (tensors with
    gradients, and statistics), a Probe and ``analyze`` see what they see on the same model without offloading."""
    accelerate = pytest.importorskip("accelerate")
    reference, model = make_model(), make_model()
    if offload == "cpu_offload":
        accelerate.cpu_offload(model, torch.device("cpu"))
    else:
        accelerate.disk_offload(model, str(tmp_path / "weights"), torch.device("cpu"))
    assert next(model.parameters()).device.type == "meta"
    x = torch.randn(3, 4)
    for values in ("tensors", "statistics"):
        paths = []
        for name, m in (("plain", reference), ("offloaded", model)):
            with fwdtrace.Dumper(tmp_path / f"{values}-{name}", values=values) as dumper:
                dumper.register(m)
                m(x).square().sum().backward()
            paths += dumper.paths
        report = fwdtrace.compare_dumps(*paths)
        assert report.equal and not report.only_in_a and not report.only_in_b, report.to_text()
        assert fwdtrace.read_dump(paths[1])["attrs"]["math_device"] == "cpu"
    for m in (model, reference):
        m.zero_grad()
    with fwdtrace.Probe(model) as probe, fwdtrace.Probe(reference) as probe_reference:
        assert probe.shapes(x) == probe_reference.shapes(x)
    assert_same_analysis(model, reference, x)


# -- FSDP2 ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def process_group():
    with world_of_one():
        yield


def sharded(model: nn.Module, units: list[str]) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    for path in units:  # inner units first, as FSDP wants
        fully_shard(model.get_submodule(path), mesh=mesh)
    return fully_shard(model, mesh=mesh)


# Each unit's own parameters: those under its path and under no inner unit.
FSDP_UNITS = {
    "": ["0.bias", "0.weight"],
    "2": ["2.fc.bias", "2.fc.weight", "2.gain"],
    "3": ["3.0.bias", "3.0.weight"],
    "4": ["4.bias", "4.weight"],  # an atomic layer: its unshard runs inside its one node's call
}


@pytest.mark.parametrize("pin", [False, True])
def test_fsdp2_unshard_is_one_collective_node_per_unit(process_group, pin):
    reference, model = make_model(), sharded(make_model(), ["2", "3", "4"])
    x = torch.randn(3, 4)
    # fully_shard made each unit's class its own (FSDPLinear, FSDPSequential): keys name the model's
    assert type(model[4]).__name__ == "FSDPLinear"
    assert fwdtrace.module_keys(model) == fwdtrace.module_keys(reference)
    expected = fwdtrace.trace(reference, x, pin=pin)
    for _ in range(2):  # the first step also runs FSDP's lazy initialisation
        with fwdtrace.Tracer(pin=pin) as t:
            y = model(x)
        assert_model_picture(t.graph, expected, "fsdp.unshard", FSDP_UNITS)
        assert [n.attrs for n in t.graph.nodes if n.target == "fsdp.unshard"] == [{"collective": "all_gather"}] * 4
        torch.testing.assert_close(y, reference(x))
        # FSDP's bookkeeping ran whole while hidden: the traced forward's backward gives torch's
        # gradients (and reshards the root, which stays unsharded from forward to backward)
        y.square().sum().backward()
        reference(x).square().sum().backward()
        for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)
        model.zero_grad()
        reference.zero_grad()
    assert_same_analysis(model, reference, x)
    assert not [(o.__name__, n) for o, n in patched_functions() if o.__module__.startswith("torch.distributed")]


# -- accelerate -------------------------------------------------------------------------------------------
def test_accelerate_cpu_offload_is_one_transfer_node_per_layer():
    accelerate = pytest.importorskip("accelerate")
    reference, model = make_model(), accelerate.cpu_offload(make_model(), torch.device("cpu"))
    x = torch.randn(3, 4)

    def copies_of_the_weights() -> set[int]:  # CPU parameters equal to the model's, other than the reference's own
        gc.collect()
        return {id(o) for o in gc.get_objects() if type(o) is nn.Parameter and o.device.type == "cpu"
                and not any(o is p for p in reference.parameters()) and any(
                    o.shape == p.shape and torch.equal(o, p) for p in reference.parameters())}

    before = copies_of_the_weights()  # other tests in this process may hold equal parameters of their own
    with torch.no_grad(), fwdtrace.Tracer():
        model(x)
        # the weights brought in are let go after the layer ran, as untraced: the trace holds none
        assert copies_of_the_weights() - before == set()
    with fwdtrace.Tracer() as t:
        y = model(x)
    # accelerate brings each module's own weights in before that module runs
    layers = {path: sorted(f"{path}.{name}" for name, _ in m.named_parameters(recurse=False))
              for path, m in reference.named_modules() if any(True for _ in m.parameters(recurse=False))}
    assert_model_picture(t.graph, fwdtrace.trace(reference, x), "accelerate.onload", layers)
    assert {n.attrs["transfer"] for n in t.graph.nodes if n.target == "accelerate.onload"} == {"to cpu"}
    torch.testing.assert_close(y, reference(x))
    # the weights wait on the meta device between forwards; the model runs on the CPU, and is timed there
    assert next(model.parameters()).device.type == "meta"
    assert_same_analysis(model, reference, x)
    assert not [(o.__name__, n) for o, n in patched_functions() if o.__module__.startswith("accelerate")]
