"""The tracer against independent references: plain forward hooks, raw ``id()``, torch's own outputs."""

from __future__ import annotations

import collections
import gc
import sys
import warnings
import weakref
from typing import Any

import networkx as nx
import pytest
import torch
import torch.nn.functional as F
import zoo
from torch import nn

import fwdtrace
from fwdtrace import FwdtraceError
from fwdtrace.registry import REGISTRY


# -- helpers ----------------------------------------------------------------------------------------
def patchable_state() -> dict[tuple[type, str], Any]:
    """What every layer's forward, ``nn.Module.__call__`` and ``_call_impl`` hold right now (by identity)."""
    classes = {*REGISTRY.atomic, *(c for c, _ in REGISTRY.callbacks)}
    state: dict[tuple[type, str], Any] = {(c, "forward"): c.__dict__.get("forward") for c in classes}
    state[(nn.Module, "__call__")] = nn.Module.__dict__["__call__"]
    state[(nn.Module, "_call_impl")] = nn.Module.__dict__["_call_impl"]
    return state


def assert_same_objects(before: dict[tuple[type, str], Any]) -> None:
    after = patchable_state()
    changed = [f"{o.__qualname__}.{n}" for (o, n), v in before.items() if after[(o, n)] is not v]
    assert not changed, f"still patched: {changed}"
    assert nn.Module.__dict__["__call__"] is nn.modules.module.Module._wrapped_call_impl


def recipe_model() -> nn.Module:
    """The model of the original recipe: conv1 -> relu -> conv2."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 3, 1, 1), nn.ReLU(), nn.Conv2d(3, 1, 1, 1))


def atomic_hook_calls(model: nn.Module, *inputs: Any, **kwargs: Any) -> list[tuple[str, tuple[int, ...]]]:
    """(module path, output shape) of every outermost atomic layer call, seen by plain forward hooks."""
    calls: list[tuple[str, tuple[int, ...]]] = []
    depth = [0]
    handles = []
    for path, m in model.named_modules():
        if not REGISTRY.is_atomic(type(m)):
            continue

        def pre(mod: nn.Module, args: Any) -> None:
            depth[0] += 1

        def post(mod: nn.Module, args: Any, out: Any, path: str = path) -> None:
            depth[0] -= 1
            if depth[0] == 0:
                first = out if isinstance(out, torch.Tensor) else out[0]
                calls.append((path, tuple(first.shape)))

        handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    try:
        with torch.no_grad():
            model(*inputs, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return calls


def module_calls(graph: fwdtrace.Graph) -> list[tuple[str, tuple[int, ...]]]:
    return [(n.module_path, n.outputs[0].shape) for n in graph.nodes if n.kind == "module"]


# -- the recipe and the id-reuse trap --------------------------------------------------------------
@pytest.mark.parametrize("pin", [True, False])
def test_recipe_callbacks_see_ids_0_1_2_3(pin: bool) -> None:
    seen: list[tuple[str, int, int]] = []

    @fwdtrace.hook_forward("torch.nn.Conv2d.forward")
    def on_conv(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        seen.append(("Conv2d", fwdtrace.obj_id(inputs[0]), fwdtrace.obj_id(output)))

    @fwdtrace.hook_forward("torch.nn.ReLU.forward")
    def on_relu(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        seen.append(("ReLU", fwdtrace.obj_id(inputs[0]), fwdtrace.obj_id(output)))

    with torch.no_grad():  # the setting where raw ids get reused (see the next test)
        graph = fwdtrace.trace(recipe_model(), torch.ones(1, 3, 3, 3), pin=pin)
    assert seen == [("Conv2d", 0, 1), ("ReLU", 1, 2), ("Conv2d", 2, 3)]
    assert [(e.src, e.dst, e.obj_id) for e in graph.edges] == [(0, 1, 0), (1, 2, 1), (2, 3, 2), (3, 4, 3)]


def test_raw_ids_repeat_on_the_recipe_model_without_pinning() -> None:
    """The trap itself: CPython gives a dead tensor's id() to the next one."""
    model = recipe_model()
    raw: list[int] = []  # ids only: keeping the tensors would pin them
    handles = [m.register_forward_hook(lambda m, i, o: raw.append(id(o))) for m in model]
    try:
        with torch.no_grad():
            model(torch.ones(1, 3, 3, 3))
    finally:
        for h in handles:
            h.remove()
    assert len(raw) == 3
    assert len(set(raw)) < 3, "three different tensors should have shared an id()"


@pytest.mark.parametrize("pin", [True, False])
def test_many_short_lived_tensors_never_share_an_obj_id(pin: bool) -> None:
    class Chain(nn.Module):
        def __init__(self, raw_ids: list[int] | None = None) -> None:
            super().__init__()
            self.raw_ids = raw_ids

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(40):
                x = x + 1  # each temporary dies right away: its id() is free for the next
                if self.raw_ids is not None:
                    self.raw_ids.append(id(x))
            return x

    raw: list[int] = []
    with torch.no_grad():
        Chain(raw)(torch.zeros(2))
        graph = fwdtrace.trace(Chain(), torch.zeros(2), pin=pin)
    assert len(set(raw)) < len(raw)  # the reuse happens on this model
    adds = graph.find(kind="function")
    assert len(adds) == 40
    assert len({n.outputs[0].obj_id for n in adds}) == 40
    # a single chain input -> add -> add ... -> output, never a shortcut to a reused id
    assert [(e.src, e.dst) for e in graph.edges] == [(i, i + 1) for i in range(41)]


def test_pin_false_keeps_no_tensor_alive_and_pin_true_does() -> None:
    model, (x,) = zoo.resnetish()
    for pin in (True, False):
        refs: list[weakref.ref[torch.Tensor]] = []
        handles = [m.register_forward_hook(lambda m, i, o, refs=refs: refs.append(weakref.ref(o)))
                   for m in model.modules()]
        try:
            with torch.no_grad(), fwdtrace.Tracer(pin=pin):
                model(x)
                gc.collect()
                alive = sum(r() is not None for r in refs)
        finally:
            for h in handles:
                h.remove()
        gc.collect()
        assert len(refs) > 20
        assert alive == (len(refs) if pin else 0)
        assert all(r() is None for r in refs)  # after the trace, nothing is kept either way


@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_pin_true_and_false_give_the_same_graph(name: str) -> None:
    model, inputs = zoo.ZOO[name]()
    with torch.no_grad():
        pinned = fwdtrace.trace(model, *inputs, pin=True)
        unpinned = fwdtrace.trace(model, *inputs, pin=False)
    assert pinned == unpinned
    assert pinned.to_json() == unpinned.to_json()


# -- the graph against plain hooks and torch -------------------------------------------------------
@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_module_nodes_match_plain_forward_hooks(name: str) -> None:
    model, inputs = zoo.ZOO[name]()
    with torch.no_grad():
        graph = fwdtrace.trace(model, *inputs)
        expected = model(*inputs)
    assert module_calls(graph) == atomic_hook_calls(model, *inputs)
    assert [r.shape for n in graph.output_nodes for r in n.inputs] == [tuple(expected.shape)]


@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_graph_is_connected_end_to_end(name: str) -> None:
    model, inputs = zoo.ZOO[name]()
    graph = fwdtrace.trace(model, *inputs)
    edges = {(e.src, e.dst, e.obj_id) for e in graph.edges}
    producer: dict[int, int] = {}
    for node in graph.nodes:
        for ref in node.inputs:
            # from a node (a constant like torch.arange is one) or a graph input, or a parameter/buffer
            assert ref.param is not None or (producer.get(ref.obj_id), node.id, ref.obj_id) in edges, (node, ref)
        for ref in node.outputs:
            producer[ref.obj_id] = node.id
    params = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    assert {r.param for n in graph.nodes for r in n.inputs if r.param} <= params
    g = graph.to_networkx()
    for out in graph.output_nodes:
        assert any(nx.has_path(g, i.id, out.id) for i in graph.input_nodes), out


def test_functional_ops_between_layers_become_function_nodes() -> None:
    class Ops(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = F.relu(self.fc(x))  # (2, 4)
            h = torch.cat([h, x], 0)  # (4, 4)
            h = h + x.repeat(2, 1)
            v = h.view(2, 2, 4)
            f = torch.flatten(v, 1)  # (2, 8)
            m = torch.matmul(f, f.T)  # (2, 2)
            s = torch.softmax(m, -1)
            q = v[:, None]  # (2, 1, 2, 4)
            a = F.scaled_dot_product_attention(q, q, q)
            return a.sum(1)[0] + s.sum()

    torch.manual_seed(0)
    model, x = Ops(), torch.randn(2, 4)
    graph = fwdtrace.trace(model, x)
    targets = [n.target for n in graph.nodes if n.kind == "function"]
    assert targets == [
        "torch.nn.functional.relu", "torch.cat", "torch.Tensor.repeat", "torch.Tensor.add", "torch.Tensor.view",
        "torch.flatten", "torch.Tensor.T", "torch.matmul", "torch.softmax", "torch.Tensor.__getitem__",
        "torch.nn.functional.scaled_dot_product_attention", "torch.Tensor.sum", "torch.Tensor.__getitem__",
        "torch.Tensor.sum", "torch.Tensor.add",
    ]
    assert graph.find(target="torch.nn.Linear")[0].module_path == "fc"
    assert all(n.module_path == "" for n in graph.nodes if n.kind == "function")
    assert graph.output_nodes[0].inputs[0].shape == tuple(model(x).shape)
    assert graph.find(target="torch.cat")[0].outputs[0].shape == (4, 4)


class _CountFunctions(torch.overrides.TorchFunctionMode):
    def __init__(self, funcs: list[Any]) -> None:
        super().__init__()
        self.funcs = funcs

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.funcs.append(func)
        return func(*args, **(kwargs or {}))


def test_ops_inside_a_leaf_layer_are_not_nodes() -> None:
    torch.manual_seed(0)
    layers_inputs = [
        (nn.MultiheadAttention(8, 2, batch_first=True), (torch.randn(1, 3, 8),) * 3),
        (nn.LSTM(4, 5, batch_first=True), (torch.randn(2, 3, 4),)),
        (nn.GRU(4, 5), (torch.randn(3, 2, 4),)),
        (nn.BatchNorm2d(3), (torch.randn(2, 3, 4, 4),)),
        (nn.GELU(), (torch.randn(5),)),
    ]
    for layer, inputs in layers_inputs:
        funcs: list[Any] = []
        with _CountFunctions(funcs):
            layer(*inputs)
        graph = fwdtrace.trace(layer, *inputs)
        assert funcs  # the layer's forward does call torch functions ...
        assert [n.kind for n in graph.nodes if n.kind in ("module", "function")] == ["module"]  # ... not nodes


# -- subclasses, atomic user classes, weight sharing -----------------------------------------------
class InheritsForward(nn.Conv2d):
    pass


class OverridesForward(nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x * 2) + 1


@pytest.mark.parametrize("cls", [InheritsForward, OverridesForward])
def test_a_layer_subclass_is_one_node_per_call(cls: type[nn.Conv2d]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(cls(3, 3, 1), nn.ReLU(), cls(3, 2, 1))
    x = torch.randn(1, 3, 4, 4)
    seen: list[torch.Tensor] = []

    @fwdtrace.hook_forward(nn.Conv2d)
    def grab(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        seen.append(output)

    graph = fwdtrace.trace(model, x)
    assert [(n.kind, n.target) for n in graph.nodes[1:-1]] == [
        ("module", f"{__name__}.{cls.__qualname__}"), ("module", "torch.nn.ReLU"), ("module", f"{__name__}.{cls.__qualname__}"),
    ]
    assert module_calls(graph) == atomic_hook_calls(model, x)
    assert graph.nodes[1].inputs[0].obj_id == graph.nodes[0].outputs[0].obj_id  # its input is x itself
    # the callback ran once per call and saw the subclass's own output, as torch computes it
    with torch.no_grad():
        assert len(seen) == 2
        torch.testing.assert_close(seen[0], model[0](x))
        torch.testing.assert_close(seen[1], model(x))


def test_a_subclass_overriding_forward_under_install_runs_callbacks_once_on_its_output() -> None:
    torch.manual_seed(0)
    layer, x = OverridesForward(3, 3, 1), torch.randn(1, 3, 2, 2)
    expected = layer(x).detach() * 10

    @fwdtrace.hook_forward("torch.nn.Conv2d")
    def scale(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        return output * 10

    fwdtrace.install()
    try:
        torch.testing.assert_close(layer(x).detach(), expected)
    finally:
        fwdtrace.uninstall()


def test_a_quantize_dynamic_model_is_drawn_as_its_layers_not_their_packed_kernels() -> None:
    torch.manual_seed(0)
    float_model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.LSTM(8, 6, batch_first=True))
    model = torch.ao.quantization.quantize_dynamic(float_model, {nn.Linear, nn.LSTM}, dtype=torch.qint8)
    x = torch.randn(2, 5, 4)
    calls: list[tuple[str, str, tuple[int, ...], tuple[int, ...]]] = []
    handles = [
        m.register_forward_hook(lambda m, i, o, path=path: calls.append(
            (path, type(m).__name__, tuple(i[0].shape), tuple((o if isinstance(o, torch.Tensor) else o[0]).shape))))
        for path, m in model.named_modules() if path
    ]
    try:
        with torch.no_grad():
            expected = model(x)[0]
    finally:
        for h in handles:
            h.remove()
    assert [c[1] for c in calls] == ["Linear", "ReLU", "LSTM"]  # the quantized classes keep the float names
    with torch.no_grad(), fwdtrace.Tracer() as t:
        got = model(x)[0]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    nodes = [n for n in t.graph.nodes if n.kind in ("module", "function")]
    assert [(n.module_path, n.target.rsplit(".", 1)[-1], n.inputs[0].shape, n.outputs[0].shape) for n in nodes] == calls
    assert nodes[0].target == "torch.ao.nn.quantized.dynamic.modules.linear.Linear"
    assert nodes[2].target == "torch.ao.nn.quantized.dynamic.modules.rnn.LSTM"


def _torch_encoder(heads: int = 2, nested: bool = False) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, heads, 16, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested).eval()


_KERNELS = ("aten::_transformer_encoder_layer_fwd", "aten::_native_multi_head_attention", "aten::layer_norm",
            "aten::linear", "aten::_nested_tensor_from_mask")


def _kernels_run(run: Any) -> collections.Counter[str]:
    """The kernels torch's profiler sees ``run()`` call, by name (the reference for what really ran)."""
    with torch.profiler.profile() as prof:
        run()
    return collections.Counter(e.name for e in prof.events() if e.name in _KERNELS)


def test_an_eval_transformer_encoder_under_no_grad_is_traced_as_the_fused_kernel_torch_runs() -> None:
    model, x = _torch_encoder(), torch.randn(2, 5, 8)
    traced: list[Any] = []
    with torch.no_grad():
        expected = model(x)
        untraced = _kernels_run(lambda: model(x))

        def run() -> None:
            with fwdtrace.Tracer() as t:
                traced.append(model(x))
            traced.append(t.graph)

        seen = _kernels_run(run)
    assert untraced["aten::_transformer_encoder_layer_fwd"] == 2 and "aten::linear" not in untraced
    assert seen == untraced  # tracing no longer sends the layers down their slow path
    torch.testing.assert_close(traced[0], expected, rtol=0, atol=0)
    graph = traced[1]
    nodes = [n for n in graph.nodes if n.kind in ("module", "function")]
    assert [(n.kind, n.target, n.module_path, n.attrs["fused"]) for n in nodes] == [
        ("module", "torch.nn.TransformerEncoderLayer", f"layers.{i}", "torch._transformer_encoder_layer_fwd")
        for i in range(2)
    ]
    (x_ref,) = graph.input_nodes[0].outputs
    assert [r.obj_id for r in nodes[0].inputs] == [x_ref.obj_id]  # what each fused call really read and gave
    assert [r.obj_id for r in nodes[1].inputs] == [r.obj_id for r in nodes[0].outputs]
    assert [r.obj_id for n in graph.output_nodes for r in n.inputs] == [r.obj_id for r in nodes[1].outputs]
    assert nodes[1].outputs[0].shape == tuple(expected.shape)


def test_a_transformer_layer_torch_runs_slowly_is_traced_as_its_sub_layers_each_run_once() -> None:
    model, x = _torch_encoder(heads=1), torch.randn(2, 5, 8)  # an odd head count rules torch's fused path out
    with torch.no_grad():
        untraced = _kernels_run(lambda: model(x))
        graphs: list[fwdtrace.Graph] = []
        seen = _kernels_run(lambda: graphs.append(fwdtrace.trace(model, x)))
    assert "aten::_transformer_encoder_layer_fwd" not in untraced
    assert seen == untraced  # the try of the fused path ran no sub-layer twice
    assert module_calls(graphs[0]) == atomic_hook_calls(model, x)
    assert not any("fused" in n.attrs for n in graphs[0].nodes)


def test_multihead_attention_runs_its_fast_path_inside_its_node_as_untraced() -> None:
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.MultiheadAttention(8, 2, batch_first=True)).eval(), torch.randn(2, 5, 8)
    with torch.no_grad():
        untraced = _kernels_run(lambda: model[0](x, x, x))
        seen = _kernels_run(lambda: fwdtrace.trace(model[0], x, x, x))
    assert untraced["aten::_native_multi_head_attention"] == 1
    assert seen == untraced


def test_training_or_opened_transformer_layers_are_traced_as_their_sub_layers() -> None:
    model, x = _torch_encoder(), torch.randn(2, 5, 8)
    with torch.no_grad(), fwdtrace.Tracer(through=(nn.TransformerEncoderLayer,)) as t:
        model(x)
    assert module_calls(t.graph) == atomic_hook_calls(model.train(), x)  # the calls they make: slow path
    assert len(t.graph.find(target="torch.nn.LayerNorm")) == 4
    graph = fwdtrace.trace(model, x)  # training: torch's slow path, as untraced
    assert module_calls(graph) == atomic_hook_calls(model, x)


def test_an_encoder_that_would_run_nested_tensors_says_the_trace_ran_padded() -> None:
    model, x = _torch_encoder(nested=True), torch.randn(2, 5, 8)
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    with torch.no_grad(), pytest.warns(UserWarning, match="nested tensors untraced"):
        fwdtrace.trace(model, x, src_key_padding_mask=padding)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        fwdtrace.trace(model, x)  # no padding mask: nothing nested, nothing to say


def test_user_classes_made_atomic() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.fc(x)) * 2

    class Gate(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sigmoid() * x

    model, x = nn.Sequential(Block(), Gate()), torch.ones(2, 4)
    before = [n.target for n in fwdtrace.trace(model, x).nodes]
    assert "torch.nn.Linear" in before and "torch.Tensor.sigmoid" in before

    fwdtrace.register_atomic(Block)

    @fwdtrace.hook_forward(Gate, atomic=True)
    def noop(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        return None

    graph = fwdtrace.trace(model, x)
    assert [(n.kind, n.class_name, n.module_path) for n in graph.nodes] == [
        ("input", "input", ""), ("module", "Block", "0"), ("module", "Gate", "1"), ("output", "output", ""),
    ]
    assert module_calls(graph) == atomic_hook_calls(model, x)


def test_weight_sharing_gives_one_node_per_call() -> None:
    model, (x,) = zoo.shared_weights()
    graph = fwdtrace.trace(model, x)
    shared = graph.find(module_path="shared")
    assert [n.call_index for n in shared] == [0, 1]
    assert [n.name for n in shared] == ["shared", "shared_1"]
    assert collections.Counter(p for p, _ in atomic_hook_calls(model, x))["shared"] == 2
    assert shared[1].inputs[0].obj_id == graph.find(module_path="act")[0].outputs[0].obj_id


def test_a_shared_container_gets_one_scope_per_call() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x).relu()

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Block()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.block(self.block(x))

    graph = fwdtrace.trace(Twice(), torch.ones(1, 3))
    inner = [n for n in graph.nodes if n.kind in ("module", "function")]
    assert [(n.target, n.call_index, [(s.module_path, s.call_index) for s in n.scope]) for n in inner] == [
        ("torch.nn.Linear", 0, [("block", 0)]), ("torch.Tensor.relu", 0, [("block", 0)]),
        ("torch.nn.Linear", 1, [("block", 1)]), ("torch.Tensor.relu", 1, [("block", 1)]),
    ]


# -- inputs and outputs of every shape -------------------------------------------------------------
@pytest.mark.parametrize("factory", [zoo.DictOutput, zoo.DataclassOutput])
def test_dict_and_dataclass_outputs(factory: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model, x = factory(), torch.randn(2, 4)
    out = model(x)
    leaves = out if isinstance(out, dict) else vars(out)
    graph = fwdtrace.trace(model, x)
    assert [n.name for n in graph.output_nodes] == [f"output_{k}" for k in leaves]
    assert [n.inputs[0].shape for n in graph.output_nodes] == [tuple(v.shape) for v in leaves.values()]
    for node in graph.output_nodes:  # each output is produced by a node of the graph
        assert len(graph.in_edges(node.id)) == 1


def test_transformers_model_output_and_kwargs_inputs() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16,
    )
    torch.manual_seed(0)
    bert = transformers.BertModel(config).eval()
    ids, mask = torch.randint(0, 40, (1, 6)), torch.ones(1, 6, dtype=torch.long)
    with torch.no_grad():
        out = bert(input_ids=ids, attention_mask=mask)
        graph = fwdtrace.trace(bert, input_ids=ids, attention_mask=mask)
    leaves = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
    assert len(leaves) >= 2
    assert [n.name for n in graph.input_nodes] == ["input_ids", "attention_mask"]
    assert [n.name for n in graph.output_nodes] == [f"output_{k}" for k in leaves]
    assert [n.inputs[0].shape for n in graph.output_nodes] == [tuple(v.shape) for v in leaves.values()]
    assert module_calls(graph) == atomic_hook_calls(bert, input_ids=ids, attention_mask=mask)
    assert {r.param for n in graph.nodes for r in n.inputs if r.param} <= dict(bert.named_buffers()).keys()


def test_nested_and_keyword_inputs_become_named_input_nodes() -> None:
    class TwoInputs(nn.Module):
        def forward(self, pair: tuple[torch.Tensor, torch.Tensor], scale: torch.Tensor, flag: bool = True) -> torch.Tensor:
            return (pair[0] + pair[1]) * scale

    a, b, s = torch.ones(2), torch.zeros(2), torch.full((2,), 3.0)
    graph = fwdtrace.trace(TwoInputs(), (a, b), scale=s, flag=False)
    assert [(n.name, n.outputs[0].shape) for n in graph.input_nodes] == [("pair[0]", (2,)), ("pair[1]", (2,)), ("scale", (2,))]
    assert [n.target for n in graph.nodes if n.kind == "function"] == ["torch.Tensor.add", "torch.Tensor.mul"]
    assert [r.obj_id for r in graph.find(target="torch.Tensor.add")[0].inputs] == [0, 1]


def test_python_control_flow_records_the_path_taken() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.act = nn.ReLU()
            self.alt = nn.Tanh()

        def forward(self, x: torch.Tensor, use_relu: bool) -> torch.Tensor:
            h = self.fc(x)
            if use_relu:
                return self.act(h)
            for _ in range(2):
                h = self.alt(h)
            return h

    model, x = Branchy(), torch.ones(1, 3)
    relu = fwdtrace.trace(model, x, True)
    tanh = fwdtrace.trace(model, x, False)
    assert module_calls(relu) == atomic_hook_calls(model, x, True)
    assert module_calls(tanh) == atomic_hook_calls(model, x, False)
    assert [n.module_path for n in relu.find(kind="module")] == ["fc", "act"]
    assert [(n.module_path, n.call_index) for n in tanh.find(kind="module")] == [("fc", 0), ("alt", 0), ("alt", 1)]


# -- devices and grad modes -------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["resnetish", "transformer_encoder", "lstm_tagger"])
def test_meta_device_gives_the_same_graph(name: str) -> None:
    model, inputs = zoo.ZOO[name]()
    cpu = fwdtrace.trace(model, *inputs)
    meta = fwdtrace.trace(model.to("meta"), *(t.to("meta") for t in inputs))
    assert meta == cpu


def test_grad_enabled_trace_then_backward_matches_a_plain_backward() -> None:
    model, (x,) = zoo.resnetish()
    model.train()
    plain = model(x).square().sum()
    plain.backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]
    model.zero_grad()
    with fwdtrace.Tracer(pin=False) as tracer:
        traced = model(x).square().sum()
    traced.backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, reference[n])
    with torch.no_grad(), fwdtrace.Tracer() as no_grad_tracer:
        model(x)
    assert tracer.graph == no_grad_tracer.graph


# -- restore, nesting, install ----------------------------------------------------------------------
def test_a_trace_patches_one_attribute_and_puts_the_very_same_object_back() -> None:
    before = patchable_state()
    model, inputs = zoo.resnetish()

    @fwdtrace.hook_forward(nn.Conv2d)
    def noop(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        pass

    with fwdtrace.Tracer():
        during = patchable_state()
        changed = [f"{o.__qualname__}.{n}" for (o, n), v in during.items() if before.get((o, n), v) is not v]
        assert changed == ["Module._call_impl"]  # the one dispatch point, layer forwards untouched
        model(*inputs)
    assert_same_objects(before)


def test_a_forward_that_raises_keeps_its_type_gets_a_note_and_leaves_nothing_patched() -> None:
    before = patchable_state()
    model, x = nn.Sequential(nn.Linear(4, 3), nn.Sequential(nn.ReLU(), nn.Linear(4, 2))), torch.ones(2, 4)
    with pytest.raises(RuntimeError) as plain:
        model(x)
    with pytest.raises(RuntimeError) as traced:
        fwdtrace.trace(model, x)
    assert str(traced.value) == str(plain.value)
    assert traced.value.__notes__ == [
        "fwdtrace: raised in module '1.1.Linear' (torch.nn.Linear) with inputs float32[2, 3]"
    ]
    assert_same_objects(before)


def test_an_op_between_layers_that_raises_is_noted_with_its_function() -> None:
    class Bad(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, torch.ones(3, 3)], 0)

    before = patchable_state()
    with pytest.raises(RuntimeError) as info:
        fwdtrace.trace(nn.Sequential(Bad()), torch.ones(2, 4))
    assert len(info.value.__notes__) == 1
    assert info.value.__notes__[0].startswith(
        f"fwdtrace: raised in torch.cat called by module '0.Bad' ({__name__}.{Bad.__qualname__}) with inputs [float32[2, 4], float32[3, 3]], 0"
    )
    assert_same_objects(before)


class _TakesAList(nn.Module):
    def forward(self, xs: list[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
        if len(xs) != 3:
            raise ValueError(f"expected three tensors, got {len(xs)}")
        return sum(xs) * scale


@pytest.mark.parametrize("run", [
    lambda model, *args, **kwargs: fwdtrace.trace(model, *args, **kwargs),
    lambda model, *args, **kwargs: fwdtrace.analyze(model, *args, repeats=0, **kwargs),
], ids=["trace", "analyze"])
def test_the_layer_note_shows_what_forward_received(run) -> None:  # noqa: ANN001
    """A list given as the only argument is one list in the note, not two inputs; other arguments as given."""
    xs = [torch.ones(2, 3), torch.ones(2, 3, dtype=torch.float64)]
    with pytest.raises(ValueError, match="expected three tensors") as info:
        run(_TakesAList(), xs)
    assert info.value.__notes__ == [
        f"fwdtrace: raised in module '{_TakesAList.__name__}' ({__name__}._TakesAList) with inputs [float32[2, 3], float64[2, 3]]"
    ]
    with pytest.raises(ValueError) as info:
        run(_TakesAList(), (torch.ones(1),), scale=0.5)
    assert info.value.__notes__[0].endswith("with inputs (float32[1],), scale=0.5")


def test_nested_tracers_raise_and_leave_nothing_patched() -> None:
    before = patchable_state()
    with pytest.raises(FwdtraceError, match=r"^a fwdtrace Tracer is already active: nested tracing is not supported"):
        with fwdtrace.Tracer():
            with fwdtrace.Tracer():
                pass
    assert_same_objects(before)

    @fwdtrace.hook_forward(nn.ReLU)
    def trace_again(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        fwdtrace.trace(module, inputs[0])

    with pytest.raises(FwdtraceError, match=r"^a fwdtrace Tracer is already active"):
        fwdtrace.trace(nn.ReLU(), torch.ones(1))
    assert_same_objects(before)


def test_install_runs_callbacks_on_every_forward_and_once_inside_a_trace() -> None:
    before = patchable_state()
    model, (x,) = zoo.resnetish()
    calls: list[str] = []
    hook_calls: list[str] = []
    names = {m: p for p, m in model.named_modules()}

    @fwdtrace.hook_forward(nn.Conv2d)
    def count(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        calls.append(names[module])

    handles = [m.register_forward_hook(lambda m, i, o: hook_calls.append(names[m]))
               for m in model.modules() if isinstance(m, nn.Conv2d)]
    try:
        with torch.no_grad():
            model(x)
            assert calls == [] and len(hook_calls) == 6  # not installed, no trace: no callbacks
            hook_calls.clear()
            fwdtrace.install()
            model(x)
            assert calls == hook_calls and len(calls) == 6
            graph = fwdtrace.trace(model, x)  # the trace runs each callback once, not twice
            assert calls == hook_calls and len(calls) == 12
            assert len(graph.find(target="torch.nn.Conv2d")) == 6
            with pytest.raises(FwdtraceError, match=r"^install\(\) cannot run while a trace is active"):
                with fwdtrace.Tracer():
                    fwdtrace.install()
            fwdtrace.uninstall()
            model(x)
            assert len(calls) == 12 and len(hook_calls) == 18
    finally:
        fwdtrace.uninstall()
        for h in handles:
            h.remove()
    assert_same_objects(before)


# -- bad input ---------------------------------------------------------------------------------------
BAD_CALLS = [
    (lambda: fwdtrace.trace("not a model", torch.ones(1)), r"^trace\(\) expected a torch\.nn\.Module as model, got str"),
    (lambda: fwdtrace.trace(nn.Linear(2, 2), [1, 2], scale=3.0),
     r"^trace\(\) expected at least one tensor among the model's inputs .*got \(list, scale=float\)"),
    (lambda: fwdtrace.trace(nn.Linear(2, 2)), r"^trace\(\) expected at least one tensor among the model's inputs"),
    (lambda: fwdtrace.obj_id(torch.ones(1)), r"^obj_id\(\) works only while a trace is active"),
]


@pytest.mark.parametrize(("call", "message"), BAD_CALLS)
def test_bad_input_raises_a_clear_error_and_patches_nothing(call: Any, message: str) -> None:
    before = patchable_state()
    with pytest.raises(FwdtraceError, match=message):
        call()
    assert_same_objects(before)


def test_obj_id_of_a_non_tensor() -> None:
    before = patchable_state()
    with pytest.raises(FwdtraceError, match=r"^obj_id\(\) expected a torch\.Tensor, got int"):
        with fwdtrace.Tracer():
            fwdtrace.obj_id(3)
    assert_same_objects(before)


def test_hooks_on_a_leaf_are_not_nodes() -> None:
    """Instrumentation (a probe's forward hook) is not part of the model's graph."""
    model, (x,) = zoo.mobilenetish()
    stats: list[float] = []
    handles = [m.register_forward_hook(lambda m, i, o: stats.append(o.abs().mean().item()))
               for m in model.modules() if isinstance(m, nn.Conv2d)]
    try:
        hooked = fwdtrace.trace(model, x)
    finally:
        for h in handles:
            h.remove()
    assert len(stats) == 3
    assert hooked == fwdtrace.trace(model, x)


def test_layers_made_in_forward_get_their_own_paths() -> None:
    """Throwaway layers die at once and CPython hands their id() to the next one."""

    class OnTheFly(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for cls in (nn.ReLU, nn.Tanh, nn.Sigmoid, nn.ReLU):
                x = cls()(x)
            return x

    seen: list[str] = []
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: seen.append(type(m).__name__))
    try:
        graph = fwdtrace.trace(OnTheFly(), torch.ones(2))
    finally:
        handle.remove()
    layers = graph.find(kind="module")
    assert [n.class_name for n in layers] == seen[:-1] == ["ReLU", "Tanh", "Sigmoid", "ReLU"]
    assert len({n.module_path for n in layers}) == 4
    assert all(n.module_path == f"<{n.class_name}@{i + 1}>" and n.call_index == 0 for i, n in enumerate(layers))


# -- where users already hook: their hooks, instance forwards, scripted and compiled modules -------
class TwoLayers(nn.Module):
    """conv1 -> relu -> conv2 -> flatten -> fc: the layers between which every case checks the path."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 5 * 5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.conv2(self.relu(self.conv1(x))), 1))


def two_layers() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return TwoLayers().eval(), torch.randn(2, 3, 5, 5)


def connected(graph: fwdtrace.Graph, src_path: str, dst_path: str) -> bool:
    """Whether a path of edges leads from the node of ``src_path`` to the node of ``dst_path``."""
    g = graph.to_networkx()
    (src,), (dst,) = graph.find(kind="module", module_path=src_path), graph.find(kind="module", module_path=dst_path)
    return nx.has_path(g, src.id, dst.id)


def outputs_reach_the_output_node(graph: fwdtrace.Graph) -> bool:
    g = graph.to_networkx()
    return all(nx.has_path(g, i.id, o.id) for i in graph.input_nodes for o in graph.output_nodes)


def test_a_users_forward_hook_that_replaces_an_output_keeps_the_edge() -> None:
    model, x = two_layers()
    replaced: list[torch.Tensor] = []

    def double(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        replaced.append(output * 2)
        return replaced[-1]

    handle = model.conv1.register_forward_hook(double)
    try:
        graph = fwdtrace.trace(model, x, pin=True)  # pinned: the hook's tensor keeps its id() to compare
    finally:
        handle.remove()
    (conv1,) = graph.find(module_path="conv1")
    (relu,) = graph.find(module_path="relu")
    assert len(replaced) == 1 and conv1.outputs[0].shape == tuple(replaced[0].shape)
    assert conv1.outputs[0].obj_id == relu.inputs[0].obj_id  # what the call returned: the hook's tensor
    assert connected(graph, "conv1", "relu") and connected(graph, "conv1", "fc")


def test_a_users_pre_hook_that_changes_an_input_keeps_the_edge() -> None:
    model, x = two_layers()
    handle = model.conv2.register_forward_pre_hook(lambda m, args: (args[0] + 1,))
    try:
        graph = fwdtrace.trace(model, x)
    finally:
        handle.remove()
    assert connected(graph, "relu", "conv2") and connected(graph, "conv2", "fc")
    assert outputs_reach_the_output_node(graph)


def test_an_instance_level_forward_override_is_traced_like_the_layer() -> None:
    model, x = two_layers()
    plain = fwdtrace.trace(model, x)
    original = model.conv2.forward

    def logged_forward(*args: Any, **kwargs: Any) -> Any:  # as accelerate's hooks wrap forward
        return original(*args, **kwargs)

    model.conv2.forward = logged_forward  # type: ignore[method-assign]
    try:
        graph = fwdtrace.trace(model, x)
    finally:
        del model.conv2.forward
    assert graph == plain
    assert connected(graph, "relu", "conv2") and connected(graph, "conv2", "fc")


def test_a_scripted_submodule_is_one_opaque_node_wired_to_its_neighbours() -> None:
    model, x = two_layers()
    tail = nn.Sequential(model.conv2, nn.ReLU())
    with torch.no_grad():
        expected = model.fc(torch.flatten(tail(model.relu(model.conv1(x))), 1))
    model.conv2 = torch.jit.script(tail)
    with pytest.warns(UserWarning, match=r"fwdtrace: scripted modules \(torch\.jit\) are opaque.*'conv2'"):
        graph = fwdtrace.trace(model, x)
    (scripted,) = graph.find(module_path="conv2")
    assert scripted.target == "torch.jit.ScriptModule" and scripted.attrs == {"original_name": "Sequential"}
    assert connected(graph, "relu", "conv2") and connected(graph, "conv2", "fc")
    assert graph.find(module_path="conv2.0") == []  # its insides are not seen
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected)


def test_a_scripted_root_is_one_node_between_input_and_output() -> None:
    model, x = two_layers()
    scripted = torch.jit.script(model)
    with pytest.warns(UserWarning, match=r"opaque"):
        graph = fwdtrace.trace(scripted, x)
    assert [n.kind for n in graph.nodes] == ["input", "module", "output"]
    assert outputs_reach_the_output_node(graph)


def test_a_torch_compiled_model_is_traced_through_the_module_it_wraps() -> None:
    model, x = two_layers()
    reference = fwdtrace.trace(model, x)
    compiled = torch.compile(model, backend="eager")
    with pytest.warns(UserWarning, match=r"torch\.compile'd modules were traced through the modules they wrap"):
        graph = fwdtrace.trace(compiled, x)
    assert graph == reference


def test_module_compile_traces_uncompiled_and_keeps_working_compiled() -> None:
    import torch._dynamo

    torch._dynamo.reset()
    model, x = two_layers()
    reference = fwdtrace.trace(model, x)
    with torch.no_grad():
        expected = model(x)
    compiles: list[int] = []

    def counting_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        compiles.append(len(gm.graph.nodes))
        return gm.forward

    model.compile(backend=counting_backend)
    for _ in range(5):  # traces and compiled calls taking turns
        with pytest.warns(UserWarning, match=r"^fwdtrace: compiled modules \(module\.compile\(\)\) were traced uncompiled"):
            graph = fwdtrace.trace(model, x)
        assert graph == reference
        with torch.no_grad():
            torch.testing.assert_close(model(x), expected)
    assert len(compiles) == 1  # compiled once: the traces neither broke nor recompiled it
    torch._dynamo.reset()


class BNAct(nn.BatchNorm2d):
    """timm's BatchNormAct2d in small: a BatchNorm2d subclass that also owns and calls an activation."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(super().forward(x))


def test_a_layer_subclass_that_calls_its_own_children_shows_them() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), BNAct(4), nn.Conv2d(4, 2, 1)).eval()
    x = torch.randn(1, 3, 4, 4)
    graph = fwdtrace.trace(model, x)
    hooked: list[str] = []
    names = {m: p for p, m in model.named_modules()}
    handles = [m.register_forward_hook(lambda m, i, o: hooked.append(names[m]))
               for m in model.modules() if isinstance(m, (nn.Conv2d, nn.ReLU))]
    try:
        model(x)
    finally:
        for h in handles:
            h.remove()
    assert [n.module_path for n in graph.find(kind="module")] == hooked == ["0", "1.act", "2"]
    assert [n.target for n in graph.find(kind="function")] == ["torch.nn.functional.batch_norm"]
    assert connected(graph, "0", "1.act") and connected(graph, "1.act", "2")


# -- writes through views, reassigned buffers, tensors from Python data (issue 13) -----------------
def producer_of_read(graph: fwdtrace.Graph, target: str) -> list[str]:
    """The targets of the nodes whose outputs the (only) node of ``target`` reads, by its edges."""
    (node,) = graph.find(target=target)
    return [graph.nodes[e.src].target for e in graph.edges if e.dst == node.id]


@pytest.mark.parametrize("write", [
    lambda y: y[:1].zero_(),
    lambda y: y.view(2, 3)[0].mul_(0),
    lambda y: y.unsqueeze(0).transpose(0, 1)[:2].add_(1),
    lambda y: y.__setitem__(slice(0, 1), 0.0),
], ids=["slice", "view-of-view", "chain-of-views", "setitem"])
def test_a_write_through_a_view_produces_the_base(write: Any) -> None:
    class WriteThroughView(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x.clone()
            write(y)
            return y * 2

    x = torch.arange(6.0)
    graph = fwdtrace.trace(WriteThroughView(), x)
    g = graph.to_networkx()
    writer = next(n for n in graph.nodes if n.target.endswith("_") or n.target.endswith("__setitem__"))
    (mul,) = graph.find(target="torch.Tensor.mul")
    (clone,) = graph.find(target="torch.Tensor.clone")
    assert nx.has_path(g, writer.id, mul.id)  # the write reaches what reads y afterwards
    assert not any(e.src == clone.id and e.dst == mul.id for e in graph.edges)  # not the stale value
    expected = x.clone()
    write(expected)
    torch.testing.assert_close(WriteThroughView()(x), expected * 2)  # and that is what torch computes


def test_a_reassigned_buffer_does_not_name_a_new_tensor_under_pin_false() -> None:
    class Reassigns(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("b1", torch.ones(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.b1 = self.b1 + 1  # the old buffer dies; a new tensor may get its id()
            return (x * self.b1).relu() + torch.ones(4)

    graphs = []
    for pin in (True, False):
        model = Reassigns()
        graphs.append(fwdtrace.trace(model, torch.ones(4), pin=pin))
    assert graphs[0] == graphs[1]
    named = [r.param for n in graphs[1].nodes for r in n.inputs + n.outputs if r.param]
    assert named == ["b1"]  # read once, as the buffer; nothing made later carries its name


def test_tensors_made_from_python_data_have_a_producer() -> None:
    import numpy as np

    class FromData(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = torch.Tensor([3.0, 4.0])
            b = torch.from_numpy(np.ones(2, dtype=np.float32))
            c = torch.tensor([1.0, 2.0])
            return x + a + b + c

    graph = fwdtrace.trace(FromData(), torch.ones(2))
    produced = {r.obj_id for n in graph.nodes for r in n.outputs}
    read = [r.obj_id for n in graph.nodes for r in n.inputs]
    assert all(oid in produced for oid in read)  # every tensor read was made by a node
    assert len(graph.find(target="torch.tensor")) == 3
    g = graph.to_networkx()
    (out,) = graph.output_nodes
    assert all(nx.has_path(g, n.id, out.id) for n in graph.find(target="torch.tensor"))


def test_a_layer_built_in_forward_adds_no_initialisation_nodes() -> None:
    class BuildsALayer(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.Linear(4, 3)(x).relu()

    graph = fwdtrace.trace(BuildsALayer(), torch.ones(2, 4))
    assert [n.target for n in graph.nodes] == ["input", "torch.nn.Linear", "torch.Tensor.relu", "output"]


def test_through_opens_a_layer_class_for_one_trace_only() -> None:
    class Norm2d(nn.LayerNorm):  # timm's LayerNorm2d: a LayerNorm with a forward of its own
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias,
                                self.eps).permute(0, 3, 1, 2)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), Norm2d(4), nn.Flatten(), nn.LayerNorm(4 * 2 * 2))
    x = torch.randn(1, 3, 2, 2)
    with fwdtrace.Tracer(through=(Norm2d,)) as tracer:
        model(x)
    opened = tracer.graph
    assert [n.target for n in opened.find(module_path="1")] == [
        "torch.Tensor.permute", "torch.nn.functional.layer_norm", "torch.Tensor.permute"]
    assert [n.target for n in opened.find(module_path="3")] == ["torch.nn.LayerNorm"]  # the base stays whole
    assert connected(opened, "0", "3")
    assert [n.target for n in fwdtrace.trace(model, x).find(module_path="1")] == [f"{__name__}.{Norm2d.__qualname__}"]
    with pytest.raises(FwdtraceError, match=r"^Tracer\(\) expected through as a tuple of torch\.nn\.Module classes"):
        fwdtrace.Tracer(through=[Norm2d])  # type: ignore[arg-type]


def test_an_op_handing_back_its_input_is_not_a_write() -> None:
    """``a.float()`` on a float view returns ``a`` itself: no write, so ``x``'s readers keep their producer."""

    class FloatOfView(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a = x.transpose(0, 1)
            b = a.float()  # the very same tensor as a
            return x[0] * 2 + b.sum()

    graph = fwdtrace.trace(FloatOfView(), torch.ones(2, 3))
    assert producer_of_read(graph, "torch.Tensor.__getitem__") == ["input"]


@pytest.mark.parametrize("pin", [False, True])
def test_a_tensor_reshaped_in_place_is_read_with_its_new_shape(pin: bool) -> None:
    # TensorRefs are made once per tensor and shared by its readers; an in-place reshape must not reuse a stale one.
    class Squeezing(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 2
            seen = [tuple(y.shape)]
            y.unsqueeze_(0)
            seen.append(tuple(y.shape))
            y.t_() if y.dim() == 2 else y.squeeze_(0)
            seen.append(tuple(y.shape))
            self.seen = seen
            return y + 1

    model = Squeezing()
    graph = fwdtrace.trace(model, torch.ones(3, 4), pin=pin)
    ops = {n.target.rsplit(".", 1)[-1]: n for n in graph.nodes if n.kind == "function"}
    assert ops["mul"].outputs[0].shape == model.seen[0]
    assert ops["unsqueeze_"].outputs[0].shape == model.seen[1]
    assert ops["squeeze_"].outputs[0].shape == model.seen[2]
    assert ops["add"].inputs[0].shape == model.seen[2]
    # the same tensor all along: one obj_id, and each write is the producer of the next read
    assert len({ops[k].outputs[0].obj_id for k in ("mul", "unsqueeze_", "squeeze_")}) == 1
    assert graph.in_edges(ops["add"].id)[0].src == ops["squeeze_"].id


def _scaled_sum(x: torch.Tensor) -> torch.Tensor:
    return (x * 2).sum()


class _CallsScaledSum(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _scaled_sum(x) + 1


def test_a_tracer_records_functions_named_atomic_as_one_node_for_that_trace_only() -> None:
    from fwdtrace.registry import REGISTRY, FunctionTarget

    here = sys.modules[__name__]
    target = FunctionTarget(f"{__name__}._scaled_sum", here, "_scaled_sum", atomic=True)
    model, x = _CallsScaledSum(), torch.ones(3)
    with fwdtrace.Tracer(atomic=(target,)) as tracer:
        y = model(x)
    assert y.item() == 7.0  # the function still ran
    assert [n.target for n in tracer.graph.nodes if n.kind == "function"] == [target.path, "torch.Tensor.add"]
    assert target.path not in REGISTRY.functions and vars(here)["_scaled_sum"] is _scaled_sum  # nothing stays
    plain = [n.target for n in fwdtrace.trace(model, x).nodes if n.kind == "function"]
    assert plain == ["torch.Tensor.mul", "torch.Tensor.sum", "torch.Tensor.add"]
