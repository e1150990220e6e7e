"""export_onnx and onnx_graph, checked against onnxruntime, the onnx package and torch itself."""

from __future__ import annotations

import functools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import zoo
from onnx import helper

import fwdtrace
from fwdtrace import FwdtraceError
from fwdtrace._tree import tensors_of
from fwdtrace.onnx_export import onnx_scope

EXPORTERS = ["dynamo", "torchscript"]


def run_ort(proto: onnx.ModelProto, *inputs: torch.Tensor) -> list[np.ndarray]:
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return session.run(None, {n: t.numpy() for n, t in zip(names, inputs, strict=True)})


def assert_runs_like_torch(proto: onnx.ModelProto, expected: object, *inputs: torch.Tensor) -> None:
    want = [t.detach().numpy() for t in tensors_of(expected)]
    got = run_ort(proto, *inputs)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


class WithKeyword(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        y = self.fc(x)
        return y if scale is None else y * scale


class DataDependentBranch(torch.nn.Module):
    """torch.export cannot follow a branch on a tensor's value; TorchScript traces one side."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x - 1


class Spectrum(torch.nn.Module):
    """The TorchScript exporter has no symbolic for rfft; the dynamo exporter does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.rfft(x).abs()


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_export_returns_a_valid_model_that_computes_like_torch(exporter: str) -> None:
    model, (x,) = zoo.mobilenetish()
    proto = fwdtrace.export_onnx(model, x, exporter=exporter)
    onnx.checker.check_model(proto)
    assert_runs_like_torch(proto, model(x), x)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_keyword_inputs_become_graph_inputs(exporter: str) -> None:
    torch.manual_seed(0)
    model = WithKeyword().eval()
    x, scale = torch.randn(2, 4), torch.tensor([3.0])
    proto = fwdtrace.export_onnx(model, x, exporter=exporter, scale=scale)
    assert len(proto.graph.input) == 2
    assert_runs_like_torch(proto, model(x, scale=scale), x, scale)


def _passes_flag(forward):
    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        kwargs.setdefault("flag", True)  # as transformers' decorators pass use_cache
        return forward(self, *args, **kwargs)

    return wrapper


class WithDefaults(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    @_passes_flag
    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, flag: bool = False, keep: int = 0):
        y = self.fc(x)[:, keep:]
        return y * 2 if flag else y


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_defaults_stay_defaults_for_a_wrapped_forward(exporter: str) -> None:
    # the TorchScript exporter appends forward's defaults as positions: flag twice, keep an input
    torch.manual_seed(0)
    model, x = WithDefaults().eval(), torch.randn(2, 4)
    proto = fwdtrace.export_onnx(model, x, exporter=exporter)
    assert [i.name for i in proto.graph.input] == ["x"]
    assert_runs_like_torch(proto, model(x), x)


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("factory", [zoo.DictOutput, zoo.DataclassOutput])
def test_dict_and_dataclass_outputs_become_their_tensors_in_order(exporter: str, factory: type) -> None:
    torch.manual_seed(0)
    model = factory().eval()
    x = torch.randn(2, 4)
    proto = fwdtrace.export_onnx(model, x, exporter=exporter)
    assert_runs_like_torch(proto, model(x), x)
    assert "forward" not in model.__dict__  # the flattening forward is gone again


def test_path_writes_the_same_model(tmp_path) -> None:
    model, (x,) = zoo.shared_weights()
    target = tmp_path / "model.onnx"
    proto = fwdtrace.export_onnx(model, x, exporter="torchscript", path=target)
    assert onnx.load(str(target)).SerializeToString() == proto.SerializeToString()


def test_bad_exporter_name_is_refused() -> None:
    model, (x,) = zoo.shared_weights()
    with pytest.raises(FwdtraceError, match=r"^export_onnx\(\) expected exporter 'dynamo' or 'torchscript', got 'onnx'"):
        fwdtrace.export_onnx(model, x, exporter="onnx")


def test_non_module_is_refused() -> None:
    with pytest.raises(FwdtraceError, match=r"^export_onnx\(\) expected a torch.nn.Module as model, got builtin_function_or_method"):
        fwdtrace.export_onnx(torch.relu, torch.ones(1))


# None of the zoo models makes an exporter fail, so these two do, one per exporter.
@pytest.mark.parametrize(
    ("model", "exporter", "message"),
    [
        (DataDependentBranch().eval(), "dynamo",
         r"^the dynamo ONNX exporter failed on DataDependentBranch: TorchExportError: .*"
         r"caused by GuardOnDataDependentSymNode: .*\(try exporter='torchscript'\)$"),
        (Spectrum().eval(), "torchscript",
         r"^the torchscript ONNX exporter failed on Spectrum: UnsupportedOperatorError: "
         r"Exporting the operator 'aten::fft_rfft' .*\(try exporter='dynamo'\)$"),
    ],
)
def test_exporter_failure_names_the_exporter_and_suggests_the_other(model, exporter, message) -> None:
    with pytest.raises(FwdtraceError, match=message) as info:
        fwdtrace.export_onnx(model, torch.randn(3, 8), exporter=exporter)
    assert info.value.__cause__ is not None  # the exporter's own error stays reachable


def test_the_other_exporter_succeeds_where_one_fails() -> None:
    x = torch.randn(3, 8)
    assert_runs_like_torch(fwdtrace.export_onnx(DataDependentBranch(), x, exporter="torchscript"),
                           DataDependentBranch()(x), x)


# -- onnx_graph -----------------------------------------------------------------------------------
def _value_edges(proto: onnx.ModelProto) -> set[tuple[str, str]]:
    """(producer node name, consumer node name) pairs, straight from the proto."""
    producer = {o: n.name for n in proto.graph.node for o in n.output}
    return {(producer[i], n.name) for n in proto.graph.node for i in n.input if i in producer}


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_onnx_graph_has_the_protos_nodes_edges_and_initializers(exporter: str) -> None:
    model, (x,) = zoo.resnetish()
    proto = fwdtrace.export_onnx(model, x, exporter=exporter)
    g = fwdtrace.onnx_graph(proto)
    ops = [n for n in g.nodes if n.kind == "function"]
    assert [n.meta["onnx_name"] for n in ops] == [n.name for n in proto.graph.node]
    assert [n.meta["op_type"] for n in ops] == [n.op_type for n in proto.graph.node]
    id2name = {n.id: n.meta["onnx_name"] for n in ops}
    edges = {(id2name[e.src], id2name[e.dst]) for e in g.edges if e.src in id2name and e.dst in id2name}
    assert edges == _value_edges(proto)
    params = {r.param for n in ops for r in n.inputs if r.param}
    used = {i for n in proto.graph.node for i in n.input}
    assert params == {init.name for init in proto.graph.initializer} & used
    (out,) = g.output_nodes
    assert [r.shape for r in out.inputs] == [tuple(model(x).shape)]
    assert fwdtrace.onnx_graph(proto).to_json() == g.to_json()  # deterministic


def test_prune_drops_constants_and_shape_arithmetic() -> None:
    model, (x,) = zoo.mobilenetish()
    proto = fwdtrace.export_onnx(model, x, exporter="torchscript")
    assert any(n.op_type == "Constant" for n in proto.graph.node)
    pruned = fwdtrace.onnx_graph(proto, prune=True)
    assert [n.meta["op_type"] for n in pruned.nodes if n.kind == "function"] == [
        "Conv", "Clip", "Conv", "Clip", "Conv", "Clip", "GlobalAveragePool", "Flatten", "Gemm"
    ]


def test_onnx_graph_reads_files_and_draws(tmp_path) -> None:
    model, (x,) = zoo.shared_weights()
    path = tmp_path / "m.onnx"
    fwdtrace.export_onnx(model, x, exporter="torchscript", path=path)
    g = fwdtrace.onnx_graph(path)
    nxg = g.to_networkx()
    assert nxg.number_of_nodes() == len(g.nodes) and nxg.number_of_edges() == len(g.edges)
    svg = g.render(str(tmp_path / "m.svg"))
    assert open(svg).read().lstrip().startswith(("<?xml", "<svg"))


def test_onnx_graph_refuses_other_things() -> None:
    with pytest.raises(FwdtraceError, match=r"^onnx_graph\(\) expected an onnx.ModelProto or a path"):
        fwdtrace.onnx_graph(42)  # type: ignore[arg-type]


def _node(name: str, **props: str) -> onnx.NodeProto:
    node = helper.make_node("Relu", ["a"], ["b"], name=name)
    for k, v in props.items():
        node.metadata_props.add(key=k, value=v)
    return node


@pytest.mark.parametrize(
    ("node", "path"),
    [
        (_node("node_conv", **{"pkg.torch.onnx.name_scopes": "['', 'blocks', 'blocks.0', 'blocks.0.c1', 'conv2d']"}),
         "blocks.0.c1"),
        (_node("node_add", **{"pkg.torch.onnx.name_scopes": "['', 'add']"}), ""),
        (_node("/blocks/blocks.1/down/down.0/Conv"), "blocks.1.down.0"),
        (_node("/layers.0/ff/ff.2/MatMul"), "layers.0.ff.2"),
        (_node("/act_1/Clip"), "act_1"),
        (_node("/Relu"), ""),
        (_node("Identity_3"), None),
        (_node(""), None),
    ],
)
def test_onnx_scope_reads_both_exporters_conventions(node: onnx.NodeProto, path: str | None) -> None:
    assert onnx_scope(node)[0] == path
