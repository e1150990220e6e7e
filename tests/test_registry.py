"""The decorator registry: targets, callbacks, atomic classes, the default leaf layers of torch.nn."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_tracer import assert_same_objects, patchable_state
from torch import nn

import fwdtrace
from fwdtrace import FwdtraceError
from fwdtrace.registry import REGISTRY, default_atomic_classes, forward_owner, qualified_name, resolve_target

# target -> the class it names
GOOD_TARGETS = [
    ("torch.nn.Conv2d.forward", nn.Conv2d),
    ("torch.nn.Conv2d", nn.Conv2d),
    ("torch.nn.modules.activation.ReLU.forward", nn.ReLU),
    (nn.LSTM, nn.LSTM),
    (nn.Linear.forward, nn.Linear),
]


@pytest.mark.parametrize(("target", "cls"), GOOD_TARGETS)
def test_targets_resolve_to_their_class(target: Any, cls: type) -> None:
    assert resolve_target(target) is cls


BAD_TARGETS = [
    ("torch.nn.Conv3x3", r"^torch\.nn\.Conv3x3: module 'torch\.nn' has no attribute 'Conv3x3'"),
    ("torch.nn.Conv2d.forwrd", r"^torch\.nn\.Conv2d\.forwrd: type object 'Conv2d' has no attribute 'forwrd'"),
    ("no_such_package.Layer", r"^no_such_package: No module named 'no_such_package'"),
    # (methods and functions are targets too: tests/test_hook_functions.py)
    ("torch.nn.Conv2d.__constants__", r"^hook_forward\(\) expected a torch\.nn\.Module subclass or its forward method .*, or a function or method"),
    ("torch.float32", r"^hook_forward\(\) expected a torch\.nn\.Module subclass or its forward method .*got 'torch\.float32' \(dtype\)"),
    (int, r"^hook_forward\(\) expected a torch\.nn\.Module subclass or its forward method .*\(class builtins\.int\)"),
    ("torch..nn", r"^expected a dotted path such as 'torch\.nn\.Conv2d\.forward', got 'torch\.\.nn'"),
    ("__import__('os').system('true')", r"^expected a dotted path"),  # resolved with getattr, never eval
]


@pytest.mark.parametrize(("target", "message"), BAD_TARGETS)
def test_bad_targets_raise_naming_what_failed(target: Any, message: str) -> None:
    before = patchable_state()
    with pytest.raises(FwdtraceError, match=message):
        fwdtrace.hook_forward(target)
    assert REGISTRY.callbacks == []
    assert_same_objects(before)


def test_the_forward_of_a_local_class_asks_for_the_class() -> None:
    class Local(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(FwdtraceError, match=r"^hook_forward\(\) could not find the class of .*<locals>\.Local\.forward "
                       r"by its path '.*'; pass the class itself"):
        fwdtrace.hook_forward(Local.forward)
    assert resolve_target(Local) is Local


def test_register_atomic_of_a_non_class_names_itself() -> None:
    with pytest.raises(FwdtraceError, match=r"^register_atomic\(\) expected a torch\.nn\.Module subclass"):
        fwdtrace.register_atomic("torch.float32")


def test_hook_forward_atomic_called_without_decorating_registers_the_class() -> None:
    """Issue 20: ``hook_forward(Cls, atomic=True)`` as a plain call (no callback applied) did nothing."""

    class Block(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2 + 1

    model = nn.Sequential(Block(), nn.ReLU())
    opened = [n.target for n in fwdtrace.trace(model, torch.ones(2)).nodes if n.kind != "input" and n.kind != "output"]
    assert opened == ["torch.Tensor.mul", "torch.Tensor.add", "torch.nn.ReLU"]
    fwdtrace.hook_forward(Block, atomic=True)  # the result (a decorator) thrown away
    kinds = [(n.kind, n.target) for n in fwdtrace.trace(model, torch.ones(2)).nodes if n.kind == "module"]
    assert kinds == [("module", qualified_name(Block)), ("module", "torch.nn.ReLU")]
    assert REGISTRY.callbacks == []


def test_the_decorated_function_is_returned_unchanged_and_callable_alone() -> None:
    def callback(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        return output + 1

    decorated = fwdtrace.hook_forward(nn.ReLU)(callback)
    assert decorated is callback
    assert decorated(nn.ReLU(), (torch.zeros(1),), torch.zeros(1)).item() == 1.0
    assert fwdtrace.remove_hook(callback) == 1
    assert fwdtrace.remove_hook(callback) == 0


def test_a_non_none_return_replaces_the_output() -> None:
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), torch.randn(3, 4)
    with torch.no_grad():
        expected = model[2](model[1](model[0](x)) * 3)  # torch itself, with the ReLU output tripled
        plain = model(x)

    @fwdtrace.hook_forward("torch.nn.ReLU.forward")
    def triple(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        return output * 3

    @fwdtrace.hook_forward("torch.nn.Linear")
    def observe(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        return None  # None keeps the output

    with torch.no_grad():
        with fwdtrace.Tracer() as tracer:
            traced = model(x)
        torch.testing.assert_close(traced, expected)
        torch.testing.assert_close(model(x), plain)  # no trace, not installed: nothing changes
        fwdtrace.install()
        try:
            torch.testing.assert_close(model(x), expected)
        finally:
            fwdtrace.uninstall()
    relu = tracer.graph.find(target="torch.nn.ReLU")[0]
    second = tracer.graph.find(module_path="2")[0]
    assert second.inputs[0].obj_id == relu.outputs[0].obj_id  # the graph follows the replacement
    assert relu.outputs[0].obj_id != relu.inputs[0].obj_id


def test_a_callback_runs_for_subclasses_and_only_for_its_class() -> None:
    seen: list[str] = []

    @fwdtrace.hook_forward(nn.modules.conv._ConvNd)
    def conv_any(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        seen.append(type(module).__name__)

    model = nn.Sequential(nn.Conv1d(1, 1, 1), nn.ReLU(), nn.Conv1d(1, 1, 1), nn.ConvTranspose1d(1, 1, 1))
    fwdtrace.trace(model, torch.ones(1, 1, 4))
    assert seen == ["Conv1d", "Conv1d", "ConvTranspose1d"]


def test_re_registering_a_function_of_the_same_name_replaces_it() -> None:
    """Re-running a notebook cell defines a new function object with the same qualified name."""
    seen: list[int] = []
    for version in (1, 2):
        def callback(module: nn.Module, inputs: tuple, output: torch.Tensor, version: int = version) -> None:
            seen.append(version)

        fwdtrace.hook_forward(nn.ReLU)(callback)
    fwdtrace.trace(nn.ReLU(), torch.ones(1))
    assert seen == [2]


def test_forward_owner_is_the_class_whose_dict_holds_forward() -> None:
    class Inherits(nn.Linear):
        pass

    assert forward_owner(Inherits) is nn.Linear
    assert forward_owner(nn.LSTM) is nn.LSTM
    with pytest.raises(FwdtraceError, match=r"^torch\.nn\.Module has no forward\(\) of its own or inherited to hook"):
        forward_owner(nn.Module)


def test_qualified_names() -> None:
    class Mine(nn.Module):
        pass

    assert qualified_name(nn.Conv2d) == "torch.nn.Conv2d"
    assert qualified_name(Mine) == f"{__name__}.{Mine.__qualname__}"


# -- the default registry --------------------------------------------------------------------------
def _mha() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return nn.MultiheadAttention(8, 2, batch_first=True), (torch.randn(2, 3, 8),) * 3


LEAF_LAYERS: list[tuple[str, Any]] = [
    ("Conv1d", lambda: (nn.Conv1d(2, 3, 3), (torch.randn(1, 2, 8),))),
    ("Conv2d", lambda: (nn.Conv2d(2, 3, 3, stride=2), (torch.randn(1, 2, 8, 8),))),
    ("Conv3d", lambda: (nn.Conv3d(2, 3, 1), (torch.randn(1, 2, 2, 2, 2),))),
    ("ConvTranspose2d", lambda: (nn.ConvTranspose2d(2, 3, 2, stride=2), (torch.randn(1, 2, 4, 4),))),
    ("Linear", lambda: (nn.Linear(4, 3), (torch.randn(2, 4),))),
    ("Bilinear", lambda: (nn.Bilinear(4, 5, 3), (torch.randn(2, 4), torch.randn(2, 5)))),
    ("BatchNorm1d", lambda: (nn.BatchNorm1d(4), (torch.randn(3, 4),))),
    ("BatchNorm2d", lambda: (nn.BatchNorm2d(2), (torch.randn(2, 2, 3, 3),))),
    ("LayerNorm", lambda: (nn.LayerNorm(4), (torch.randn(2, 4),))),
    ("GroupNorm", lambda: (nn.GroupNorm(2, 4), (torch.randn(2, 4, 3),))),
    ("RMSNorm", lambda: (nn.RMSNorm(4), (torch.randn(2, 4),))),
    ("Embedding", lambda: (nn.Embedding(10, 4), (torch.tensor([[1, 2, 3]]),))),
    ("ReLU", lambda: (nn.ReLU(), (torch.randn(5),))),
    ("GELU", lambda: (nn.GELU(), (torch.randn(5),))),
    ("SiLU", lambda: (nn.SiLU(), (torch.randn(5),))),
    ("Sigmoid", lambda: (nn.Sigmoid(), (torch.randn(5),))),
    ("Tanh", lambda: (nn.Tanh(), (torch.randn(5),))),
    ("LeakyReLU", lambda: (nn.LeakyReLU(0.2), (torch.randn(5),))),
    ("Softmax", lambda: (nn.Softmax(-1), (torch.randn(2, 5),))),
    ("MaxPool2d", lambda: (nn.MaxPool2d(2), (torch.randn(1, 2, 4, 4),))),
    ("AvgPool2d", lambda: (nn.AvgPool2d(2), (torch.randn(1, 2, 4, 4),))),
    ("AdaptiveAvgPool2d", lambda: (nn.AdaptiveAvgPool2d(1), (torch.randn(1, 2, 4, 4),))),
    ("Dropout", lambda: (nn.Dropout(0.5).eval(), (torch.randn(5),))),
    ("Flatten", lambda: (nn.Flatten(), (torch.randn(2, 3, 4),))),
    ("Upsample", lambda: (nn.Upsample(scale_factor=2), (torch.randn(1, 1, 2, 2),))),
    ("MultiheadAttention", _mha),
    ("RNN", lambda: (nn.RNN(4, 5), (torch.randn(3, 2, 4),))),
    ("LSTM", lambda: (nn.LSTM(4, 5, num_layers=2), (torch.randn(3, 2, 4),))),
    ("GRU", lambda: (nn.GRU(4, 5, batch_first=True), (torch.randn(2, 3, 4),))),
]


@pytest.mark.parametrize(("name", "factory"), LEAF_LAYERS, ids=[n for n, _ in LEAF_LAYERS])
def test_leaf_torch_layers_are_one_node_per_call_with_no_user_code(name: str, factory: Any) -> None:
    torch.manual_seed(0)
    layer, inputs = factory()
    assert getattr(nn, name) in default_atomic_classes()

    class TwoCalls(nn.Module):  # a user model calling the layer twice
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, *args: torch.Tensor) -> Any:
            self.layer(*args)
            return self.layer(*args)

    hook_calls: list[Any] = []
    handle = layer.register_forward_hook(lambda m, i, o: hook_calls.append(o))
    try:
        with torch.no_grad():
            graph = fwdtrace.trace(TwoCalls(), *inputs)
    finally:
        handle.remove()
    nodes = [n for n in graph.nodes if n.kind in ("module", "function")]
    assert [(n.kind, n.target, n.module_path, n.call_index) for n in nodes] == [
        ("module", f"torch.nn.{name}", "layer", 0), ("module", f"torch.nn.{name}", "layer", 1),
    ]
    assert len(hook_calls) == 2
    out = hook_calls[1]
    first = out if isinstance(out, torch.Tensor) else out[0]
    assert nodes[1].outputs[0].shape == tuple(first.shape)
    assert [r.shape for r in nodes[1].inputs if r.param is None] == [tuple(t.shape) for t in inputs]


def test_layer_attrs_come_from_torch_constants() -> None:
    conv = nn.Conv2d(3, 8, 3, stride=2, padding=1)
    graph = fwdtrace.trace(nn.Sequential(conv, nn.Flatten(), nn.LazyLinear(4)), torch.ones(1, 3, 8, 8))
    attrs = graph.find(target="torch.nn.Conv2d")[0].attrs
    for name in ("in_channels", "out_channels", "kernel_size", "stride", "padding"):
        value = getattr(conv, name)
        assert attrs[name] == (list(value) if isinstance(value, tuple) else value)
    linear = graph.find(module_path="2")[0]
    assert linear.target == "torch.nn.Linear"  # a lazy layer becomes its real class on first call
    assert linear.attrs["in_features"] == 8 * 4 * 4


def test_containers_and_wrappers_are_not_atomic() -> None:
    atomic = set(default_atomic_classes())
    for name in ("Module", "Sequential", "ModuleList", "ModuleDict", "TransformerEncoderLayer", "DataParallel"):
        assert getattr(nn, name) not in atomic
    torch.manual_seed(0)
    model = nn.DataParallel(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    graph = fwdtrace.trace(model, torch.ones(1, 2))
    assert [n.module_path for n in graph.find(kind="module")] == ["module.0", "module.1"]


def test_a_callback_on_every_module_matches_plain_forward_hooks() -> None:
    import zoo

    model, (x,) = zoo.resnetish()
    calls: list[nn.Module] = []
    hooked: list[nn.Module] = []

    @fwdtrace.hook_forward(nn.Module)
    def every(module: nn.Module, inputs: tuple, output: Any) -> None:
        calls.append(module)

    handles = [m.register_forward_hook(lambda m, i, o: hooked.append(m)) for m in model.modules()]
    try:
        with torch.no_grad():
            fwdtrace.trace(model, x)
            assert len(calls) == len(hooked) == 25 and all(a is b for a, b in zip(calls, hooked, strict=True))
            fwdtrace.install()
            model(x)
            fwdtrace.uninstall()
    finally:
        for h in handles:
            h.remove()
    assert len(calls) == len(hooked) == 50 and all(a is b for a, b in zip(calls, hooked, strict=True))
