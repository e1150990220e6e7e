"""Walking tensors in nested inputs and outputs, against torch's own pytree."""

from __future__ import annotations

import dataclasses

import torch
import torch.utils._pytree as pytree

from fwdtrace._tree import iter_tensors, tensors_of


@dataclasses.dataclass
class Pair:
    left: torch.Tensor
    right: object


def test_paths_and_order_in_nested_containers() -> None:
    a, b, c, d = (torch.full((i + 1,), float(i)) for i in range(4))
    obj = {"x": a, "rest": [b, (c, 3, "s")], 7: d, "none": None}
    got = list(iter_tensors(obj, "in"))
    assert [p for p, _ in got] == ["in.x", "in.rest[0]", "in.rest[1][0]", "in[7]"]
    assert all(x is y for (_, x), y in zip(got, [a, b, c, d], strict=True))
    # the same leaves, in the same order, as torch's own pytree
    leaves = [t for t in pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)]
    assert all(x is y for x, y in zip(tensors_of(obj), leaves, strict=True))


def test_dataclasses_and_model_outputs_are_opened() -> None:
    a, b = torch.ones(1), torch.zeros(2)
    assert [(p, t is a or t is b) for p, t in iter_tensors(Pair(a, {"k": b}), "out")] == [
        ("out.left", True), ("out.right.k", True),
    ]
    from transformers.modeling_outputs import BaseModelOutput

    output = BaseModelOutput(last_hidden_state=a, hidden_states=(a, b))
    assert [p for p, _ in iter_tensors(output, "output")] == [
        "output.last_hidden_state", "output.hidden_states[0]", "output.hidden_states[1]",
    ]


def test_no_tensors() -> None:
    assert tensors_of([1, "a", {"b": None}]) == []
    x = torch.ones(1)
    assert tensors_of(x) == [x]
    assert list(iter_tensors(Pair, "cls")) == []  # a dataclass type is not an instance
