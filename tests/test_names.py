"""Names of torch functions in the graph: torch's own by their Python path, torch.library ops by namespace."""

from __future__ import annotations

import pytest
import torch

import fwdtrace
from fwdtrace.names import function_name
from fwdtrace.onnx import ops as onnx_ops

# The names registered below are the reference: torch.ops.<ns>.<op> is "<ns>.<op>" in the graph.
TWICE = "fwdtrace_names::twice"  # torch.library.custom_op
THRICE = "fwdtrace_names_lib::thrice"  # torch.library.Library + a CPU impl
CHECKED = "fwdtrace_names::checked"  # raises on negative input


@torch.library.custom_op(TWICE, mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@torch.library.custom_op(CHECKED, mutates_args=())
def checked(x: torch.Tensor) -> torch.Tensor:
    if bool((x < 0).any()):
        raise ValueError("checked: negative input")
    return x.clone()


_LIB = torch.library.Library(THRICE.split("::")[0], "DEF")
_LIB.define("thrice(Tensor x) -> Tensor")
_LIB.impl("thrice", lambda x: x * 3, "CPU")


def _dotted(qualified: str) -> str:
    return qualified.replace("::", ".")


class CustomOpNet(torch.nn.Module):
    """A Linear, the custom ops called three ways, a ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.ops.fwdtrace_names.twice(self.fc(x))  # the OpOverloadPacket
        h = twice(h)  # the CustomOpDef: its default OpOverload
        h = torch.ops.fwdtrace_names_lib.thrice.default(h)  # an OpOverload by hand
        return torch.relu(h)


NAMES = [
    (torch.cat, "torch.cat"),
    (torch.Tensor.view, "torch.Tensor.view"),
    (torch.nn.functional.relu, "torch.nn.functional.relu"),
    (torch.ops.aten.add, "aten.add"),
    (torch.ops.aten.add.Tensor, "aten.add"),
    (torch.ops.fwdtrace_names.twice, _dotted(TWICE)),
    (torch.ops.fwdtrace_names.twice.default, _dotted(TWICE)),
    (torch.ops.fwdtrace_names_lib.thrice, _dotted(THRICE)),
    (torch.ops.fwdtrace_names_lib.thrice.default, _dotted(THRICE)),
]


@pytest.mark.parametrize(("func", "name"), NAMES)
def test_function_name(func: object, name: str) -> None:
    assert function_name(func) == name


def test_custom_ops_are_nodes_named_by_namespace_and_name() -> None:
    model, x = CustomOpNet().eval(), torch.randn(2, 4)
    with torch.no_grad(), fwdtrace.Tracer() as tracer:
        y = model(x)
    graph = tracer.graph
    functions = [n for n in graph.nodes if n.kind == "function"]
    assert [n.target for n in functions] == [_dotted(TWICE), _dotted(TWICE), _dotted(THRICE), "torch.relu"]
    assert [n.name for n in functions] == ["twice", "twice_1", "thrice", "relu"]
    # a chain: each op reads what the one before wrote, and the result is the model's
    ids = [graph.find(module_path="fc")[0].id] + [n.id for n in functions]
    assert [(e.src, e.dst) for e in graph.edges if e.dst in ids[1:]] == list(zip(ids, ids[1:], strict=False))
    with torch.no_grad():
        assert torch.equal(y, torch.relu(model.fc(x) * 2 * 2 * 3))
    text, dot = graph.to_json(), graph.to_dot().source
    assert "pybind11" not in text + dot and "torch._ops" not in text + dot
    assert f'label="{_dotted(TWICE)}"' in dot and f'label="{_dotted(THRICE)}"' in dot


def test_an_error_in_a_custom_op_names_it() -> None:
    class Net(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return checked(x - 1)

    with pytest.raises(ValueError, match=r"^checked: negative input") as info:
        fwdtrace.trace(Net(), torch.zeros(3))
    assert any(_dotted(CHECKED) in note for note in getattr(info.value, "__notes__", []))


@pytest.fixture
def twice_exports_as_twice(monkeypatch: pytest.MonkeyPatch):
    """TorchScript exports torch.ops.fwdtrace_names.twice as a custom-domain ONNX op 'Twice'."""
    monkeypatch.setattr(onnx_ops, "_RULES", dict(onnx_ops._RULES))
    torch.onnx.register_custom_op_symbolic(TWICE, lambda g, x: g.op("fwdtrace_names::Twice", x), 17)
    yield
    torch.onnx.unregister_custom_op_symbolic(TWICE, 17)


def test_the_onnx_report_names_custom_ops(twice_exports_as_twice) -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(torch.ops.fwdtrace_names.twice(self.fc(x)))

    model, x = Net().eval(), torch.randn(2, 4)
    before = fwdtrace.check_onnx(model, x, exporter="torchscript")
    # no rule knows the op: it is undecided, named by its path, and the relu reading its result still pairs
    # (ONNX infers no shape for a custom-domain op's result)
    assert before.status == "incomplete" and before.missing == [] and before.extra == []
    assert [label for label, _ in before.undecided] == [f"twice = {_dotted(TWICE)}"]
    assert f"no ONNX rule knows {_dotted(TWICE)}" in before.text
    assert ("relu = torch.relu", ("/Relu",)) in before.matched
    fwdtrace.onnx_equivalent(torch.ops.fwdtrace_names.twice, "Twice")  # the op object, named as the trace names it
    after = fwdtrace.check_onnx(model, x, exporter="torchscript")
    assert after.ok, after.text
    assert (f"twice = {_dotted(TWICE)}", ("/Twice",)) in after.matched


def test_power_operators_are_named_as_tensor_methods() -> None:
    """``x ** 2`` reaches a mode as torch._tensor's wrapper of TensorBase.pow: named as users write it."""

    class Powers(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x**2
            y **= 2
            return y

    x = torch.arange(3.0)
    graph = fwdtrace.trace(Powers(), x)
    assert [n.target for n in graph.nodes if n.kind == "function"] == ["torch.Tensor.pow", "torch.Tensor.pow_"]
    torch.testing.assert_close(Powers()(x), x**4)
