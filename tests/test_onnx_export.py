"""export_onnx and onnx_graph, checked against onnxruntime, the onnx package and torch itself."""

from __future__ import annotations

import functools
import os
import warnings

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
from fwdtrace.onnx import export as onnx_export
from fwdtrace.onnx.export import onnx_scope

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


# -- large models: external data through a file, written whole or not at all -----------------------
def _mlp() -> tuple[torch.nn.Module, torch.Tensor]:
    """Two weights of 16 KiB and 2 KiB (external data), two biases under 1 KiB (stay inline)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).eval()
    return model, torch.randn(2, 64)


@pytest.fixture
def every_model_is_large(monkeypatch):
    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_THRESHOLD", 0)


def _locations(proto: onnx.ModelProto) -> dict[str, str | None]:
    """Initializer name -> the file its data is in, None when it is inside the model."""
    return {
        i.name: {e.key: e.value for e in i.external_data}["location"]
        if i.data_location == onnx.TensorProto.EXTERNAL else None
        for i in proto.graph.initializer
    }


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_a_large_model_is_written_with_external_data(exporter: str, tmp_path, every_model_is_large) -> None:
    model, x = _mlp()
    target = tmp_path / "m.onnx"
    proto = fwdtrace.export_onnx(model, x, exporter=exporter, path=target)
    assert sorted(os.listdir(tmp_path)) == ["m.onnx", "m.onnx.data"]  # no temporary files left
    weights = {n: p.detach() for n, p in model.named_parameters()}
    assert _locations(proto) == {"0.weight": "m.onnx.data", "0.bias": None, "2.weight": "m.onnx.data", "2.bias": None}
    assert _locations(onnx.load(str(target), load_external_data=False)) == _locations(proto)
    assert os.path.getsize(target.with_name("m.onnx.data")) == sum(weights[n].nbytes for n in ("0.weight", "2.weight"))
    assert os.path.getsize(target) < weights["0.weight"].nbytes  # the model file holds no weight
    # onnx and onnxruntime read it back: the weights are torch's, the outputs too
    loaded = onnx.load(str(target))
    for init in loaded.graph.initializer:
        value = onnx.numpy_helper.to_array(init)
        np.testing.assert_array_equal(value, weights[init.name].numpy().reshape(value.shape))
    session = ort.InferenceSession(str(target), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    np.testing.assert_allclose(got, model(x).detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_a_large_model_without_path_comes_back_with_its_weights(exporter: str, every_model_is_large) -> None:
    model, x = _mlp()
    proto = fwdtrace.export_onnx(model, x, exporter=exporter)
    assert set(_locations(proto).values()) == {None}
    assert_runs_like_torch(proto, model(x), x)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_onnx_graph_and_check_onnx_read_a_large_export_without_its_weights(
    exporter: str, tmp_path, monkeypatch, every_model_is_large
) -> None:
    model, x = _mlp()
    target = tmp_path / "m.onnx"
    fwdtrace.export_onnx(model, x, exporter=exporter, path=target)
    os.remove(tmp_path / "m.onnx.data")  # reading the weights would fail now
    from_file = fwdtrace.onnx_graph(target)
    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_THRESHOLD", 1 << 30)
    in_memory = fwdtrace.onnx_graph(fwdtrace.export_onnx(model, x, exporter=exporter))
    assert from_file == in_memory
    # check_onnx: the export goes through a file and only tensors shape inference reads are loaded
    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_THRESHOLD", 0)
    loaded: list[int] = []
    real = onnx.external_data_helper.load_external_data_for_tensor

    def spy(tensor: onnx.TensorProto, base_dir: str) -> None:
        loaded.append(int(np.prod(tensor.dims)))
        real(tensor, base_dir)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("check_onnx loaded every weight")

    monkeypatch.setattr(onnx.external_data_helper, "load_external_data_for_tensor", spy)
    monkeypatch.setattr(onnx, "load_external_data_for_model", refuse)
    monkeypatch.setattr(onnx.external_data_helper, "load_external_data_for_model", refuse)
    report = fwdtrace.check_onnx(model, x, exporter=exporter)
    assert report.ok, report.text
    assert len(report.matched) == 3
    assert all(n <= 64 for n in loaded)


def test_path_replaces_a_planted_link_instead_of_following_it(tmp_path, every_model_is_large) -> None:
    model, x = _mlp()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    for name in ("m.onnx", "m.onnx.data"):
        (elsewhere / name).write_bytes(b"keep me")
        (out / name).symlink_to(elsewhere / name)
    fwdtrace.export_onnx(model, x, exporter="torchscript", path=out / "m.onnx")
    for name in ("m.onnx", "m.onnx.data"):
        assert (elsewhere / name).read_bytes() == b"keep me"
        assert not (out / name).is_symlink()
    assert sorted(os.listdir(out)) == ["m.onnx", "m.onnx.data"]
    onnx.checker.check_model(str(out / "m.onnx"))


@pytest.mark.parametrize("large", [False, True])
def test_a_failed_write_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch, large: bool) -> None:
    model, x = _mlp()
    target = tmp_path / "m.onnx"
    target.write_bytes(b"the old model")
    if large:
        monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_THRESHOLD", 0)

    def full_disk(*args: object) -> None:
        raise OSError(28, "No space left on device")

    if large:  # fails while the weights are written
        monkeypatch.setattr(onnx_export, "_move_to_data_file", full_disk)
    else:  # fails when the complete file would be moved in place
        monkeypatch.setattr(onnx_export.os, "replace", full_disk)
    with pytest.raises(FwdtraceError, match=r"^export_onnx\(\) could not write '.*m\.onnx'.*: OSError: \[Errno 28\]"):
        fwdtrace.export_onnx(model, x, exporter="torchscript", path=target)
    assert target.read_bytes() == b"the old model"
    assert os.listdir(tmp_path) == ["m.onnx"]


def test_a_large_export_into_a_missing_folder_is_refused(tmp_path, every_model_is_large) -> None:
    model, x = _mlp()
    with pytest.raises(FwdtraceError, match=r"^export_onnx\(\) expected path in an existing folder, got '.*nowhere"):
        fwdtrace.export_onnx(model, x, exporter="torchscript", path=tmp_path / "nowhere" / "m.onnx")
    assert os.listdir(tmp_path) == []


class _SetsStateWhileTraced(torch.nn.Module):
    """transformers' Swin pattern: forward stores a tensor in a plain attribute when torch.jit traces it."""

    def __init__(self) -> None:
        super().__init__()
        self.window = 8
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if min(x.shape) <= self.window:
            self.window = torch.min(torch.tensor(x.shape)) if torch.jit.is_tracing() else min(x.shape)
        if torch.jit.is_tracing():
            self.linear.traced = x  # a new attribute on a child, holding a traced tensor
        return self.linear(x) * self.window


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_an_export_leaves_the_model_as_it_found_it(exporter: str) -> None:
    # a later trace of the model is the trace before the export: nothing the exporter's run set remains
    # (the conformance corpus checks the same on each of its models, tests/corpus.py's assert_left_as_found)
    model, args, kwargs = _SetsStateWhileTraced().eval(), (torch.randn(2, 4),), {}
    model(*args)  # eager's own caching happens before the snapshot, as a user's first call would
    with torch.no_grad():
        before = fwdtrace.trace(model, *args, **kwargs).to_json()
        state = {path: dict(vars(m)) for path, m in model.named_modules()}
        fwdtrace.export_onnx(model, *args, exporter=exporter, **kwargs)
        after = {path: dict(vars(m)) for path, m in model.named_modules()}
        assert after.keys() == state.keys()
        for path, attrs in state.items():
            assert after[path].keys() == attrs.keys(), path
            changed = [k for k, v in attrs.items() if after[path][k] is not v]
            assert not changed, f"{path or 'model'}: {changed}"
        assert fwdtrace.trace(model, *args, **kwargs).to_json() == before


def test_the_dynamo_exporters_table_is_built_once_and_each_export_gets_its_own_copy(monkeypatch) -> None:
    """The ATen -> ONNX table torch rebuilds at every dynamo export is built once; exports from the kept
    table write the same model as one from a fresh table, and the classmethod is put back each time."""
    from torch.onnx._internal.exporter._registration import ONNXRegistry

    original = vars(ONNXRegistry)["from_torchlib"]
    builds = []

    def counting(cls, *args, **kwargs):  # type: ignore[no-untyped-def]
        builds.append(args or kwargs)
        return original.__func__(cls, *args, **kwargs)

    monkeypatch.setattr(onnx_export, "_TORCHLIB_REGISTRIES", {})
    monkeypatch.setattr(ONNXRegistry, "from_torchlib", classmethod(counting))
    counted = vars(ONNXRegistry)["from_torchlib"]
    model, x = zoo.BasicBlock(4, 4).eval(), torch.randn(1, 4, 8, 8)
    protos = []
    for _ in range(3):
        protos.append(fwdtrace.export_onnx(model, x, exporter="dynamo"))
        assert vars(ONNXRegistry)["from_torchlib"] is counted  # restored, the very object
    assert len(builds) == 1
    with warnings.catch_warnings():  # torch's own FutureWarnings, which fwdtrace's export keeps quiet
        warnings.simplefilter("ignore")
        plain = torch.onnx.export(model, (x,), dynamo=True, verbose=False).model_proto  # a fresh table, no fwdtrace
    assert len(builds) == 2
    for proto in protos:
        assert [(n.op_type, list(n.input), list(n.output)) for n in proto.graph.node] == \
            [(n.op_type, list(n.input), list(n.output)) for n in plain.graph.node]
    assert_runs_like_torch(protos[-1], model(x), x)


@torch.jit._script_if_tracing
def _doubled_unless_empty(x: torch.Tensor) -> torch.Tensor:
    if x.numel() == 0:  # scripted when traced: TorchScript writes an If whose branches read x from outside
        return x
    return x * 2


class DoublesUnlessEmpty(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _doubled_unless_empty(x[x > 0.5] + 1)  # data-dependent size: the If is not folded away


def test_onnx_graph_gives_an_if_the_values_its_branches_read() -> None:
    # torchvision's batched_nms exports this way: the If's only input is its condition
    x = torch.tensor([0.2, 0.7, 0.9])
    proto = fwdtrace.export_onnx(DoublesUnlessEmpty(), x, exporter="torchscript")
    assert_runs_like_torch(proto, DoublesUnlessEmpty()(x), x)
    (if_node,) = [n for n in proto.graph.node if n.op_type == "If"]
    add_out = next(n.output[0] for n in proto.graph.node if n.op_type == "Add")
    assert add_out not in if_node.input  # read only from inside its else-branch
    og = fwdtrace.onnx_graph(proto)
    (if_og,) = [n for n in og.nodes if n.target == "onnx.If"]
    (add_og,) = [n for n in og.nodes if n.target == "onnx.Add"]
    assert add_og.outputs[0].obj_id in {r.obj_id for r in if_og.inputs}
    assert if_og.meta["data"]


class _CrashesTheExporter(torch.nn.Module):
    """Kills its own process with SIGFPE while an ONNX exporter traces it, as torch's TorchScript exporter dies
    on some chains of empty-tensor reshapes; eager calls run as usual."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.onnx.is_in_onnx_export():
            import signal

            os.kill(os.getpid(), signal.SIGFPE)
        return self.fc(x)


def test_an_isolated_export_turns_a_crash_of_the_exporters_process_into_an_error() -> None:
    model, x = _CrashesTheExporter().eval(), torch.randn(3, 4)
    with pytest.raises(FwdtraceError, match=r"^export_onnx\(\): the torchscript ONNX exporter crashed on "
                                            r"_CrashesTheExporter: its process was killed by SIGFPE"):
        fwdtrace.export_onnx(model, x, exporter="torchscript", isolate=True)
    with pytest.raises(FwdtraceError, match=r"^check_onnx\(\): the torchscript ONNX exporter crashed .* SIGFPE"):
        fwdtrace.check_onnx(model, x, exporter="torchscript", isolate=True)
    assert torch.equal(model(x), model.fc(x))  # this process lives on, the model as it was


def test_an_isolated_export_that_crashes_leaves_nothing_beside_its_path(
        monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    # a model large enough for external data: the exporter writes into a folder of its own beside the file
    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_THRESHOLD", 0)
    model, x = _CrashesTheExporter().eval(), torch.randn(3, 4)
    with pytest.raises(FwdtraceError, match=r"^export_onnx\(\): the torchscript ONNX exporter crashed .* SIGFPE"):
        fwdtrace.export_onnx(model, x, path=os.path.join(str(tmp_path), "m.onnx"), exporter="torchscript",
                             isolate=True)
    assert os.listdir(str(tmp_path)) == []  # the killed child's folder went with it, no file half-written


class _HangsTheExporter(torch.nn.Module):
    """Its export never ends: a child deadlocked on a lock another thread held at the fork."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.onnx.is_in_onnx_export():
            import time

            time.sleep(600)
        return self.fc(x)


def test_an_isolated_export_interrupted_takes_its_child_with_it() -> None:
    import multiprocessing
    import signal

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.5, 2.0)  # Ctrl-C, and again should it wait for the child
    try:
        with pytest.raises(KeyboardInterrupt):
            fwdtrace.export_onnx(_HangsTheExporter(), torch.randn(3, 4), exporter="torchscript", isolate=True)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
        left = multiprocessing.active_children()
        for child in left:
            child.kill()
            child.join()
    assert left == []  # the hung child was ended, not left behind to sleep on


def test_an_isolated_export_without_fork_is_an_error_saying_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    import multiprocessing

    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])  # Windows' only one
    with pytest.raises(FwdtraceError, match=r"^check_onnx\(\) with isolate=True exports in a forked child process, "
                                            r"and this platform has no fork: export without isolate=True"):
        fwdtrace.check_onnx(torch.nn.Linear(4, 2), torch.randn(3, 4), exporter="torchscript", isolate=True)
    assert multiprocessing.active_children() == []


def test_an_isolated_export_is_the_export_and_says_its_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = zoo.ZOO["resnetish"]()
    plain = fwdtrace.export_onnx(model, *x, exporter="torchscript")
    isolated = fwdtrace.export_onnx(model, *x, exporter="torchscript", isolate=True)
    assert [n.op_type for n in isolated.graph.node] == [n.op_type for n in plain.graph.node]
    # the reference: onnxruntime gives eager's output on the isolated file
    (got,) = run_ort(isolated, *x)
    with torch.no_grad():
        assert np.allclose(got, model(*x).numpy(), rtol=1e-4, atol=1e-5)
    assert fwdtrace.check_onnx(model, *x, exporter="torchscript", isolate=True).ok
    # an error raised in the exporter's run, said as without isolate (the other exporter not tried: its first
    # run in the child costs seconds, and the hint is no part of the isolation)
    monkeypatch.setattr(onnx_export, "_other_exporter_hint", lambda *a, **k: "")
    with pytest.raises(FwdtraceError, match=r"^the torchscript ONNX exporter failed on _Refuses: ValueError: refuses"):
        fwdtrace.export_onnx(_Refuses(), torch.randn(2, 4), exporter="torchscript", isolate=True)


class _Refuses(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.onnx.is_in_onnx_export():
            raise ValueError("refuses to be exported")
        return x * 2


class _Lazy(torch.nn.Module):
    """Layers that take their sizes from their first input (``nn.Lazy*``): no weight exists before the first call."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.LazyConv2d(4, 3, padding=1)
        self.norm = torch.nn.LazyBatchNorm2d()
        self.fc = torch.nn.LazyLinear(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.norm(self.conv(x))).mean((2, 3)))


@pytest.mark.parametrize(("exporter", "isolate"), [("dynamo", False), ("torchscript", False), ("torchscript", True),
                                                  ("fwdtrace", False)])
def test_a_lazily_built_model_is_exported_before_its_first_call(exporter: str, isolate: bool, tmp_path) -> None:
    # the layers are built by a call of the example inputs before the export (TorchScript's exporter and to_onnx
    # read the weights first); the file holds the weights they were built with, and the model keeps them
    torch.manual_seed(0)
    model, x = _Lazy().eval(), torch.randn(2, 3, 8, 8)
    path = tmp_path / "m.onnx"
    if exporter == "fwdtrace":
        proto = fwdtrace.to_onnx(model, x, path=path)
    else:
        proto = fwdtrace.export_onnx(model, x, exporter=exporter, path=path, isolate=isolate)
    assert type(model.fc) is torch.nn.Linear
    with torch.no_grad():
        assert_runs_like_torch(proto, model(x), x)  # the reference: eager, on the weights the build drew
        assert_runs_like_torch(onnx.load(str(path)), model(x), x)


def test_a_lazily_built_model_that_cannot_run_its_example_is_an_error_naming_the_build() -> None:
    model = _Lazy().train()
    with pytest.raises(FwdtraceError, match=r"^export_onnx\(\) could not build _Lazy's lazy layers: its first call "
                                            r"on float32\[2, 3\] raised "):
        fwdtrace.export_onnx(model, torch.randn(2, 3), exporter="torchscript")
    assert all(m.training for m in model.modules())  # the build's call in eval mode, the modes put back
