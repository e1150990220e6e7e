"""The folding pass: which nodes are side computations or dead ends, which calls form loops.

Each expectation is read off the model's own code: the ops its forward writes outside the
data path, the results it never uses, the loops it runs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_draw import dot_labels as box_labels
from torch import nn

import fwdtrace
from fwdtrace.passes.fold import find_folds


class MaskedEncoder(nn.Module):
    """Token ids plus a padding mask; positions from arange; mask arithmetic into attention."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(20, d)
        self.pos = nn.Embedding(8, d)
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1]).unsqueeze(0)  # side: 2 ops -> pos
        h = self.tok(ids) + self.pos(positions)
        bias = (1.0 - mask[:, None, :].float()) * -1e4  # side: getitem, float, rsub, mul -> add below
        scores = self.q(h) @ self.k(h).transpose(1, 2)
        unused = scores.detach().abs().max()  # noqa: F841  (a dead end: 3 ops nothing reads)
        return torch.softmax(scores + bias, -1) @ h


def test_side_computations_and_dead_ends_match_the_code() -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 20, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    graph = fwdtrace.trace(MaskedEncoder().eval(), ids, mask)
    side = find_folds(graph).side
    by_reason = {reason: sorted(graph.nodes[i].target.rsplit(".", 1)[-1] for i, r in side.items() if r == reason)
                 for reason in ("side", "dead end")}
    assert by_reason["side"] == sorted(["arange", "unsqueeze", "__getitem__", "float", "__rsub__", "mul"])
    assert by_reason["dead end"] == sorted(["detach", "abs", "max"])
    # Token ids are data: the Embedding reads them as its main input, so nothing on their way is side.
    assert all(graph.nodes[i].kind == "function" for i in side)


def test_side_boxes_name_what_they_feed() -> None:
    torch.manual_seed(0)
    graph = fwdtrace.trace(MaskedEncoder().eval(), torch.randint(0, 20, (2, 8)), torch.ones(2, 8, dtype=torch.long))
    source = graph.to_dot(None).source
    assert "mask arithmetic, 4 ops" in source
    assert "position / index arithmetic, 2 ops\n→ pos" in source
    assert "unused results, 3 ops" in source
    full = graph.to_dot(None, fold_side=False).source
    assert "ops" not in full and "arange" in full


@pytest.mark.parametrize("exporter", ["torchscript", "fwdtrace"])
def test_onnx_data_path_starts_at_the_token_ids_an_embedding_table_reads(exporter: str) -> None:
    import networkx as nx

    torch.manual_seed(0)
    model, ids = MaskedEncoder().eval(), torch.randint(0, 20, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    if exporter == "fwdtrace":
        proto = fwdtrace.to_onnx(model, ids, mask)
    else:
        proto = fwdtrace.export_onnx(model, ids, mask, exporter=exporter)
    og = fwdtrace.onnx_graph(proto)
    side = find_folds(og).side
    # The reference: what the token ids reach is the data path; the rest (here the mask and
    # position arithmetic) is side, whatever reaches an output.
    full = nx.DiGraph(og.to_networkx())
    ids_input, mask_input = og.input_nodes
    assert [r.dtype for r in ids_input.outputs + mask_input.outputs] == ["int64", "int64"]
    on_path = nx.descendants(full, ids_input.id)
    live = set().union(*(nx.ancestors(full, n.id) for n in og.nodes if n.kind == "output"))
    expected = {n.id for n in og.nodes if n.kind == "function" and n.id in live and n.id not in on_path}
    assert {i for i, why in side.items() if why == "side"} == expected
    table = next(n for n in og.nodes if any(r.param and r.param.endswith("tok.weight") for r in n.inputs))
    assert table.id not in side and len(expected) < len(og.nodes) // 2
    labels = box_labels(og.to_dot(None, open_leaf_layers=True))
    assert any(label.startswith("Gather") for label in labels)
    assert sum(label.startswith(("mask arithmetic", "constants", "position")) for label in labels) <= 2


class Decoder(nn.Module):
    """Greedy decoding: the same cell, head and argmax at every step."""

    def __init__(self, d: int = 8, vocab: int = 11, steps: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.cell = nn.LSTMCell(d, d)
        self.head = nn.Linear(d, vocab)
        self.steps = steps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        c = torch.zeros_like(h)
        token = torch.zeros(h.shape[0], dtype=torch.long)
        logits = []
        for _ in range(self.steps):
            h, c = self.cell(self.embed(token), (h, c))
            logits.append(self.head(h))
            token = logits[-1].argmax(-1)
        return torch.stack(logits, 1)


def test_a_decoding_loop_is_one_loop_with_its_count() -> None:
    torch.manual_seed(0)
    graph = fwdtrace.trace(Decoder().eval(), torch.randn(2, 8))
    loops = find_folds(graph).loops
    assert len(loops) == 1
    loop = loops[0]
    # One step calls embed, cell, head, argmax: four items, six times; the first is drawn.
    assert (len(loop.body), loop.count, len(loop.hidden)) == (4, 6, 20)
    labels = box_labels(graph.to_dot(None))
    assert "loop in the model: ×5 more of\nembed (Embedding), cell (LSTMCell), head (Linear), argmax" in labels
    assert sum("LSTMCell" in label for label in labels) == 2  # the first step's cell, and the loop box


class PerBox(nn.Module):
    """A post-processing loop over boxes, one iteration taking another branch (as torchvision's
    mask pasting does): still one loop."""

    def forward(self, boxes: torch.Tensor) -> torch.Tensor:
        out = []
        for i in range(boxes.shape[0]):
            b = boxes[i]
            w = (b[2] - b[0]) if i != 7 else (0 - b[0]) + b[2]
            out.append(F.relu(w * b[1] + b[3]))
        return torch.stack(out)


def test_a_loop_with_one_odd_iteration_stays_one_loop() -> None:
    graph = fwdtrace.trace(PerBox(), torch.rand(20, 4))
    loops = find_folds(graph).loops
    assert len(loops) == 1
    assert loops[0].count == 20 and len(loops[0].body) == 9
    assert len(loops[0].body) + len(loops[0].hidden) == len(graph.nodes) - 3  # all but input, stack, output


def test_different_blocks_and_short_repeats_are_not_loops() -> None:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8 + i), nn.ReLU(), nn.Linear(8 + i, 8)) for i in range(4)])
    assert find_folds(fwdtrace.trace(model, torch.ones(1, 8))).loops == []
    # q, k and v reshaped the same way: three short repeats, not worth a loop box.
    class Heads(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = x + 1, x * 2, x - 1
            q, k, v = (t.view(2, 6, 2, 4).transpose(1, 2) for t in (q, k, v))
            return q @ k.transpose(-1, -2) @ v

    assert find_folds(fwdtrace.trace(Heads(), torch.ones(2, 6, 8))).loops == []


def test_onnx_shape_arithmetic_is_a_side_computation() -> None:
    # A reshape to a shape computed from the input's (Shape, Gather, Unsqueeze, Concat), as exporters
    # write it for dynamic sizes. The trace of the model has no node for it (a shape is a Python int
    # there); the ONNX picture drew it on the data path, hundreds of boxes in a detector's post-processing.
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    int64 = lambda name, values: helper.make_tensor(name, TensorProto.INT64, [len(values)], values)  # noqa: E731
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="/lin/MatMul"),
             helper.make_node("Shape", ["x"], ["s"], name="/Shape"),
             helper.make_node("Gather", ["s", "zero"], ["n"], name="/Gather", axis=0),
             helper.make_node("Concat", ["n", "rest"], ["shape"], name="/Concat", axis=0),
             helper.make_node("Reshape", ["y", "shape"], ["out"], name="/Reshape")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 6])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [3, 2, 3])],
                              initializer=[numpy_helper.from_array(np.ones((6, 6), np.float32), "w"),
                                           int64("zero", [0]), int64("rest", [2, 3])])
    og = fwdtrace.onnx_graph(onnx.helper.make_model(graph))
    side = find_folds(og).side
    op2id = {str(n.meta["op_type"]): n.id for n in og.nodes if n.kind == "function"}
    assert {op2id["Shape"], op2id["Gather"], op2id["Concat"]} <= set(side)
    assert {op2id["MatMul"], op2id["Reshape"]}.isdisjoint(side)


def test_a_run_of_constants_is_no_loop_and_hides_no_module_call() -> None:
    # An ONNX file's axes and shapes are Constant nodes; a run of them, with the module calls between
    # them taken for odd iterations, was a "loop of Constant" holding a RetinaNet's backbone and head.
    import onnx
    from onnx import TensorProto, helper

    const = lambda name: helper.make_node("Constant", [], [name], name=f"/{name}",  # noqa: E731
                                          value=helper.make_tensor(name, TensorProto.FLOAT, [1], [1.0]))
    nodes = [const(f"k{i}") for i in range(3)]
    nodes += [helper.make_node("Relu", ["x"], ["b1"], name="/backbone/stem/Relu"),
              helper.make_node("Relu", ["b1"], ["b2"], name="/backbone/body/Relu")]
    nodes += [const(f"k{i}") for i in range(3, 6)]
    nodes += [helper.make_node("Relu", ["b2"], ["h"], name="/head/Relu")]
    nodes += [const(f"k{i}") for i in range(6, 10)]
    last = "h"
    for i in range(10):
        nodes.append(helper.make_node("Add", [last, f"k{i}"], [f"a{i}"], name=f"/Add_{i}"))
        last = f"a{i}"
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info(last, TensorProto.FLOAT, [1])])
    og = fwdtrace.onnx_graph(onnx.helper.make_model(graph))
    folds = find_folds(og)
    assert not [loop for loop in folds.loops if all(og.nodes[i].target == "onnx.Constant"
                                                    for i in loop.body if isinstance(i, int))]
    labels = box_labels(og.to_dot(1))
    assert "backbone" in labels and "head" in labels


def test_a_loop_body_of_more_than_128_calls_is_found() -> None:
    # A detector's per-level post-processing in an ONNX file is ~140 nodes a level, constants included.
    ops = [torch.sin, torch.cos, torch.tanh, torch.sigmoid, torch.exp, torch.neg, torch.abs, torch.relu, torch.square]
    body = [ops[(k * k + 3 * k) % len(ops)] for k in range(150)]

    class Levels(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = []
            for level in range(4):
                y = x[level]
                for op in body:
                    y = op(y)
                out.append(y)
            return torch.stack(out)

    graph = fwdtrace.trace(Levels(), torch.randn(4, 2))
    loops = find_folds(graph).loops
    assert [(len(loop.body), loop.count) for loop in loops] == [(151, 4)]
