"""The Graph: edges from producers, JSON round trip, determinism, networkx export."""

from __future__ import annotations

import gc
import os
import random
import subprocess
import sys
import time

import pytest
import torch
import zoo

import fwdtrace
from fwdtrace import FwdtraceError, Graph, TensorRef

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ref(obj_id: int, shape: tuple[int, ...] = (2,)) -> TensorRef:
    return TensorRef(obj_id, shape, "float32")


def test_edges_go_from_the_last_writer_to_each_reader() -> None:
    g = Graph()
    g.add_node("input", "input", outputs=[_ref(0)])
    g.add_node("function", "torch.Tensor.relu_", inputs=[_ref(0)], outputs=[_ref(0)])  # in place
    g.add_node("function", "torch.Tensor.add", inputs=[_ref(0), _ref(0)], outputs=[_ref(1)])  # x + x
    g.add_node("output", "output", inputs=[_ref(1)])
    assert [(e.src, e.dst, e.obj_id) for e in g.edges] == [(0, 1, 0), (1, 2, 0), (2, 3, 1)]
    assert [n.name for n in g.nodes] == ["input", "relu_", "add", "output"]


def test_names_are_unique() -> None:
    g = Graph()
    names = [g.add_node("module", "torch.nn.Linear", name="blocks.0.fc").name for _ in range(3)]
    assert names == ["blocks_0_fc", "blocks_0_fc_1", "blocks_0_fc_2"]


def _probed_names(bases: list[str]) -> list[str]:
    """The reference: probe ``base``, ``base_1``, ``base_2``, ... until one is free."""
    taken: set[str] = set()
    out = []
    for base in bases:
        base = base.replace(".", "_") if base else "node"
        name, i = base, 1
        while name in taken:
            name, i = f"{base}_{i}", i + 1
        taken.add(name)
        out.append(name)
    return out


def test_names_match_probing_from_one_whatever_the_order() -> None:
    # Bases that collide with each other's suffixed names: "x_1" is both x's first repeat and a base.
    pool = ["x", "x_1", "x_2", "x.1", "x_1_1", "", "node", "node_1", "add", "add_3"]
    rng = random.Random(0)
    for _ in range(50):
        bases = [rng.choice(pool) for _ in range(rng.randint(1, 40))]
        g = Graph()
        names = [g.add_node("function", "torch.Tensor.add", name=b or None).name for b in bases]
        assert names == _probed_names([b or "add" for b in bases])
        assert len(set(names)) == len(names)


def test_a_loaded_graph_names_new_nodes_as_the_original_would() -> None:
    g = Graph()
    for base in ["mul", "mul", "mul_1", "mul", "add"]:
        g.add_node("function", "torch.Tensor.mul", name=base)
    loaded = Graph.from_json(g.to_json())
    more = ["mul", "mul_1", "add", "mul"]
    assert [loaded.add_node("function", "torch.Tensor.mul", name=b).name for b in more] == [
        g.add_node("function", "torch.Tensor.mul", name=b).name for b in more
    ]


def _trace_cpu_seconds(n: int, repeats: int) -> float:
    # Process CPU time, the best of a few: the machine is shared, wall time is not ours.
    x = torch.ones(4)
    best = float("inf")
    for _ in range(repeats):
        gc.collect()  # each run starts without the last one's garbage
        start = time.process_time()
        graph = fwdtrace.trace(zoo.Chain(n), x)
        best = min(best, time.process_time() - start)
        assert len(graph.find(target="torch.Tensor.mul")) == n
    return best


def test_trace_time_per_op_stays_flat_from_1k_to_16k_ops() -> None:
    # Generous on purpose (benchmarks/trace_scaling.py has the real figures): probing names
    # one by one made the 16k trace about 10x slower per op than the 1k one.
    _trace_cpu_seconds(100, 1)  # plugins, caches
    per_op_1k = _trace_cpu_seconds(1000, 3) / 1000
    per_op_16k = _trace_cpu_seconds(16000, 2) / 16000
    assert per_op_16k <= 3 * per_op_1k, (per_op_1k, per_op_16k)


def test_add_node_refuses_an_unknown_kind() -> None:
    with pytest.raises(FwdtraceError, match=r"^Graph\.add_node expected kind in \('input', 'module', 'function', 'output'\), got 'layer'"):
        Graph().add_node("layer", "torch.nn.Linear")


@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_json_round_trip_gives_an_equal_graph(name: str) -> None:
    model, inputs = zoo.ZOO[name]()
    graph = fwdtrace.trace(model, *inputs)
    text = graph.to_json()
    again = Graph.from_json(text)
    assert again == graph
    assert again.to_json() == text
    assert [n.to_dict() for n in again.nodes] == [n.to_dict() for n in graph.nodes]
    assert [n.scope for n in again.nodes] == [n.scope for n in graph.nodes]
    # a loaded graph keeps growing correctly: edges find the producers it loaded
    tail = again.nodes[-1].inputs[0]
    node = again.add_node("function", "torch.Tensor.neg", inputs=[tail])
    assert again.in_edges(node.id)[0].src == graph.edges[-1].src


def test_from_json_errors() -> None:
    with pytest.raises(FwdtraceError, match=r"^Graph\.from_json expected JSON text written by Graph\.to_json"):
        Graph.from_json("{not json")
    with pytest.raises(FwdtraceError, match=r"^Graph\.from_dict expected a dict with format 'fwdtrace\.Graph', got dict with format 'onnx'"):
        Graph.from_json('{"format": "onnx"}')
    with pytest.raises(FwdtraceError, match=r"^Graph\.from_dict expected a dict with format 'fwdtrace\.Graph', got list"):
        Graph.from_json("[1, 2]")


def test_two_traces_give_byte_identical_json() -> None:
    for name in sorted(zoo.ZOO):
        model, inputs = zoo.ZOO[name]()
        fresh_model, fresh_inputs = zoo.ZOO[name]()
        first = fwdtrace.trace(model, *inputs).to_json()
        assert fwdtrace.trace(model, *inputs).to_json() == first
        assert fwdtrace.trace(fresh_model, *fresh_inputs, pin=False).to_json() == first


_CHILD = """
import sys
sys.path.insert(0, "tests")
import torch, zoo, fwdtrace
torch.set_num_threads(1)
for name in sys.argv[1:]:
    model, inputs = zoo.ZOO[name]()
    sys.stdout.write(fwdtrace.trace(model, *inputs, pin=False).to_json(indent=None) + "\\n")
"""


def test_a_fresh_process_writes_the_same_json() -> None:
    names = ["resnetish", "transformer_encoder", "embed_norm_gelu"]
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "PYTHONHASHSEED": "123"}
    out = subprocess.run([sys.executable, "-c", _CHILD, *names], cwd=REPO, env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout.splitlines()
    here = [fwdtrace.trace(zoo.ZOO[n]()[0], *zoo.ZOO[n]()[1]).to_json(indent=None) for n in names]
    assert out == here
    assert "0x" not in "".join(here)  # no addresses


def test_to_networkx_carries_node_and_edge_attributes() -> None:
    model, inputs = zoo.densenetish()
    graph = fwdtrace.trace(model, *inputs)
    g = graph.to_networkx()
    assert list(g.nodes) == [n.id for n in graph.nodes]
    assert g.number_of_edges() == len(graph.edges)
    for n in graph.nodes:
        data = g.nodes[n.id]
        assert (data["kind"], data["target"], data["name"], data["module_path"], data["call_index"]) == (
            n.kind, n.target, n.name, n.module_path, n.call_index)
        assert data["attrs"] == n.attrs
        assert [r["obj_id"] for r in data["outputs"]] == [r.obj_id for r in n.outputs]
        assert [tuple(r["shape"]) for r in data["inputs"]] == [r.shape for r in n.inputs]
    for e in graph.edges:
        data = g.edges[e.src, e.dst, e.obj_id]
        assert (data["obj_id"], data["shape"], data["dtype"]) == (e.obj_id, e.shape, e.dtype)
    # concatenation: each torch.cat reads every earlier feature map
    import networkx as nx

    cats = graph.find(target="torch.cat")
    assert [g.in_degree(c.id) for c in cats] == [1, 2, 3, 4]
    assert nx.is_directed_acyclic_graph(g)


def test_find_and_node_fields() -> None:
    model, inputs = zoo.resnetish()
    graph = fwdtrace.trace(model, *inputs)
    convs = graph.find(kind="module", target="torch.nn.Conv2d")
    named = [p for p, m in model.named_modules() if isinstance(m, torch.nn.Conv2d)]
    assert sorted(n.module_path for n in convs) == sorted(named)
    assert graph.find(module_path="blocks.1.down.0")[0].module_key == "blocks.1.down.0.Conv2d"
    assert graph.find(module_path="blocks.1.down.0")[0].class_name == "Conv2d"
    assert len(graph) == len(list(graph)) == len(graph.nodes)
    assert repr(graph).startswith(f"Graph({len(graph.nodes)} nodes: 1 input, ")
    assert str(graph).splitlines()[0].split() == ["id", "kind", "name", "target", "module_path", "inputs", "->", "outputs"]


MALFORMED = [
    ('{"format": "fwdtrace.Graph", "nodes": [{"id": 0}], "edges": []}', r"node 0 has no 'kind'"),
    ('{"format": "fwdtrace.Graph", "nodes": {}, "edges": []}', r"its body has nodes and edges should be lists"),
    ('{"format": "fwdtrace.Graph"}', r"its body has no 'nodes'"),
    ('{"format": "fwdtrace.Graph", "nodes": [{"id": 0, "kind": "op", "target": "t", "name": "n"}], "edges": []}',
     r"node 0 has kind 'op' is not one of input, module, function, output"),
    ('{"format": "fwdtrace.Graph", "nodes": [], "edges": [{"src": 0, "dst": 1, "obj_id": 0, "shape": [], "dtype": "f"}]}',
     r"edge 0 has it joins node 0 to node 1, of 0 nodes"),
    ('{"format": "fwdtrace.Graph", "nodes": [{"id": 0, "kind": "input", "target": "t", "name": "n", "inputs": [3]}], '
     '"edges": []}', r"node 0 has "),
]


@pytest.mark.parametrize("text, message", MALFORMED)
def test_a_malformed_body_is_a_fwdtrace_error(text: str, message: str) -> None:
    with pytest.raises(FwdtraceError, match=r"^Graph\.from_dict expected a graph written by Graph\.to_json, got one whose " + message):
        Graph.from_json(text)


_NODE = '{{"id": {0}, "kind": "function", "target": "t", "name": "n{0}"}}'
_EDGE = '{{"src": {0}, "dst": {1}, "obj_id": 0, "shape": [], "dtype": "f"}}'
UNTRUSTED = [  # what a crafted file may hold that no trace writes
    ([_EDGE.format(1, 0)], r"edge 0 has it runs from node 1 back to node 0"),  # a loop once 0 -> 1 is there
    ([_EDGE.format(0, 1), _EDGE.format(1, 1)], r"edge 1 has it runs from node 1 back to node 1"),
    ([_EDGE.format(0, 7)], r"edge 0 has it joins node 0 to node 7, of 2 nodes"),  # dangling
    ([_EDGE.format(-1, 1)], r"edge 0 has it joins node -1 to node 1, of 2 nodes"),
]


@pytest.mark.parametrize("edges, message", UNTRUSTED)
def test_cyclic_and_dangling_edges_are_refused_naming_the_source(edges: list[str], message: str) -> None:
    text = ('{"format": "fwdtrace.Graph", "nodes": [' + ", ".join(_NODE.format(i) for i in range(2))
            + '], "edges": [' + ", ".join(edges) + "]}")
    with pytest.raises(FwdtraceError, match=r"^Graph\.from_dict expected a graph written by Graph\.to_json in "
                                            r"'run/graph\.json', got one whose " + message):
        Graph.from_json(text, source="run/graph.json")


def test_json_nested_too_deep_is_a_fwdtrace_error_naming_the_source() -> None:
    with pytest.raises(FwdtraceError, match=r"^Graph\.from_json expected JSON text written by Graph\.to_json in "
                                            r"'dump\.h5': RecursionError"):
        Graph.from_json("[" * 200_000 + "]" * 200_000, source="dump.h5")
