"""The alignment pass: two traces' calls paired through the dataflow where their names differ, checked against
what each refactor is known to have renamed, added or duplicated."""

from __future__ import annotations

import torch
from torch import nn

import fwdtrace
from fwdtrace.passes.align import align

_X = torch.ones(2, 4)


class _TwoHeads(nn.Module):
    """Two parallel projections of the same shapes (an ambiguity only call order settles), named by the caller."""

    def __init__(self, first: str, second: str, extra: bool = False) -> None:
        super().__init__()
        self.names = first, second
        self.add_module(first, nn.Linear(4, 4))
        self.add_module(second, nn.Linear(4, 4))
        self.extra = nn.Linear(4, 4) if extra else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = (getattr(self, n)(x) for n in self.names)
        if self.extra is not None:
            b = b + self.extra(x)
        return a * b


def _keys(a: fwdtrace.Graph, b: fwdtrace.Graph, a2b: dict[int, int]) -> dict[str, str]:
    return {str(a.nodes[i].key): str(b.nodes[j].key) for i, j in a2b.items() if a.nodes[i].key}


def test_parallel_calls_renamed_together_pair_in_call_order() -> None:
    a = fwdtrace.trace(_TwoHeads("q", "k"), _X)
    b = fwdtrace.trace(_TwoHeads("query", "key"), _X)
    assert _keys(a, b, align(a, b, {})) == {"q.Linear": "query.Linear", "k.Linear": "key.Linear", "mul": "mul"}


def test_an_added_call_of_the_same_kind_is_never_paired_by_guess() -> None:
    a = fwdtrace.trace(_TwoHeads("q", "k"), _X)
    b = fwdtrace.trace(_TwoHeads("query", "key", extra=True), _X)  # a third Linear(4, 4) of x, and an add
    keys = _keys(a, b, align(a, b, {}))
    # three Linears read x in b and two in a: which two are q and k is not for the dataflow to guess
    assert "q.Linear" not in keys and "k.Linear" not in keys
    assert "extra.Linear" not in keys.values() and keys.get("mul") == "mul"


def test_calls_paired_by_name_are_kept_and_anchor_the_rest() -> None:
    a = fwdtrace.trace(_TwoHeads("q", "k", extra=True), _X)
    b = fwdtrace.trace(_TwoHeads("query", "key", extra=True), _X)
    extra = next(n.id for n in a.nodes if n.key == "extra.Linear"), next(n.id for n in b.nodes if n.key == "extra.Linear")
    keys = _keys(a, b, align(a, b, dict([extra])))
    assert keys == {"q.Linear": "query.Linear", "k.Linear": "key.Linear", "extra.Linear": "extra.Linear",
                    "add": "add", "mul": "mul"}
