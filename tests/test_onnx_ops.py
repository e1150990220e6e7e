"""The equivalence registry: names, the class hierarchy and torchlib-derived rules, checked against torch and onnxscript."""

from __future__ import annotations

import pytest
import torch

import fwdtrace
from fwdtrace.onnx import ops as onnx_ops


class Pows(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x ** 2
        y **= 2
        return y


def test_x_to_the_n_is_recorded_under_a_private_name_that_rules_read_as_pow() -> None:
    graph = fwdtrace.trace(Pows(), torch.randn(2, 3))
    targets = [n.target for n in graph.nodes if n.kind == "function"]
    assert all(t.rsplit(".", 1)[-1] in ("pow", "pow_") for t in targets) and len(targets) == 2
    for node in graph.nodes[1:-1]:
        assert onnx_ops.canonical_target(node.target) in ("torch.Tensor.pow", "torch.Tensor.pow_")
        eq = onnx_ops.equivalence_for(node)
        assert eq is not None and "Pow" in eq.op_types


@pytest.mark.parametrize(
    ("target", "canonical"),
    [
        ("torch._tensor.TensorBase.pow", "torch.Tensor.pow"),
        ("torch._C.TensorBase.__rpow__", "torch.Tensor.__rpow__"),
        ("torch.Tensor.add", "torch.Tensor.add"),
        ("mypkg.TensorBase.pow", "mypkg.TensorBase.pow"),
    ],
)
def test_canonical_target(target: str, canonical: str) -> None:
    assert onnx_ops.canonical_target(target) == canonical


class SameNorm(torch.nn.LayerNorm):
    pass


class OwnNorm(torch.nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


class GrandchildNorm(SameNorm):
    pass


def _layer_node(module: torch.nn.Module) -> fwdtrace.Node:
    return fwdtrace.trace(module, torch.randn(2, 4)).nodes[1]


def test_a_subclass_that_keeps_its_parents_forward_takes_its_rule() -> None:
    for cls in (SameNorm, GrandchildNorm):
        node = _layer_node(cls(4))
        assert node.target == f"{__name__}.{cls.__name__}"
        eq = onnx_ops.equivalence_for(node)
        assert eq is not None and eq.source == "torch.nn.LayerNorm"
        assert eq == onnx_ops.equivalence_for(_layer_node(torch.nn.LayerNorm(4)))


def test_a_subclass_with_its_own_forward_has_no_rule_until_given_one(restore_rules) -> None:
    node = _layer_node(OwnNorm(4))
    assert onnx_ops.rule_target(node.target) is None and onnx_ops.equivalence_for(node) is None
    fwdtrace.onnx_equivalent(OwnNorm, "LayerNormalization+Mul")
    assert [p.text for p in onnx_ops.equivalence_for(node).patterns] == ["LayerNormalization+Mul"]


def test_a_rule_given_to_a_subclass_beats_the_inherited_one(restore_rules) -> None:
    node = _layer_node(SameNorm(4))
    assert onnx_ops.equivalence_for(node).source == "torch.nn.LayerNorm"  # looked up, then overridden
    fwdtrace.onnx_equivalent(SameNorm, "LayerNormalization+Identity")
    assert onnx_ops.equivalence_for(node).source == f"{__name__}.SameNorm"
    assert onnx_ops.equivalence_for(_layer_node(GrandchildNorm(4))).source == f"{__name__}.SameNorm"


@pytest.mark.parametrize(
    ("target", "aten"),
    [("torch.addcmul", "aten::addcmul"), ("torch.erfc", "aten::erfc"), ("torch.Tensor.addcmul_", "aten::addcmul")],
)
def test_functions_without_a_written_rule_take_torchlibs(target: str, aten: str) -> None:
    from onnxscript.function_libs.torch_lib.registration import default_registry

    name = onnx_ops.rule_target(target)
    assert name == target
    fn = default_registry._registry[aten].overloads[0]
    ops = {n.op_type for n in fn.to_function_proto().node} - onnx_ops._NOT_WORK - {"CastLike"}
    node = fwdtrace.Node(0, "function", target, "f")
    assert onnx_ops.equivalence_for(node).op_types == ops


def test_unknown_functions_and_layers_have_no_rule() -> None:
    assert onnx_ops.rule_target("torch.no_such_function") is None
    assert onnx_ops.rule_target("mypkg.layers.Block") is None


@pytest.mark.parametrize("name", ["zeros_like", "ones_like", "full_like", "empty_like", "randn_like", "rand_like"])
def test_new_tensors_shaped_like_an_input_are_not_wiring(name: str) -> None:
    target = f"torch.{name}"
    assert target in onnx_ops.NEW_TENSOR_FUNCTIONS
    assert onnx_ops.equivalence_for(fwdtrace.Node(0, "function", target, name)).optional


def test_recurrent_cells_have_rules() -> None:
    for cls in (torch.nn.LSTMCell, torch.nn.GRUCell, torch.nn.RNNCell):
        node = fwdtrace.trace(cls(4, 6), torch.randn(3, 4)).nodes[1]
        assert node.kind == "module" and onnx_ops.equivalence_for(node) is not None
