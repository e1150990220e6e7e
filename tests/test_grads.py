"""fwdtrace.instrument.grads: a call's gradients by tensor hooks, against torch's full backward hooks and autograd."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from fwdtrace.instrument.grads import register_grad_hook


class TwoInputs(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * b.sin()


def test_a_leaf_input_keeps_no_hook_after_its_backward_nor_after_its_graph_is_freed() -> None:
    model = nn.Sequential(nn.Linear(3, 2))
    x = torch.randn(4, 3, requires_grad=True)
    got: list[tuple] = []
    handle = register_grad_hook(model[0], lambda m, gin, gout: got.append(gin))
    model(x).sum().backward()
    torch.testing.assert_close(got[0][0], x.grad, rtol=0, atol=0)  # x feeds only the Linear
    assert not x._backward_hooks
    for _ in range(5):  # forwards with no backward (an evaluation with grad on): their graphs go, so do the hooks
        model(x)
    gc.collect()
    assert not x._backward_hooks
    handle.remove()
    assert not model[0]._forward_hooks and not model[0]._forward_pre_hooks


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_replace_on_a_call_with_two_inputs_needing_gradients_is_torch_s_own() -> None:
    # Each input's gradient arrives at its own time: the call falls back to torch's BackwardHook.
    torch.manual_seed(0)
    a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    module, reference = TwoInputs(), TwoInputs()
    register_grad_hook(module, lambda m, gin, gout: (gin[0] * 2, gin[1] * 3), replace=True)
    reference.register_full_backward_hook(lambda m, gin, gout: (gin[0] * 2, gin[1] * 3))
    module(a * 1, b * 1).sum().backward()
    got = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    reference(a * 1, b * 1).sum().backward()
    torch.testing.assert_close(got, (a.grad, b.grad), rtol=0, atol=0)


def test_an_error_in_a_gradient_hook_goes_to_on_error_not_to_the_backward() -> None:
    model = nn.Sequential(nn.Linear(3, 2), nn.ReLU(inplace=True))
    errors: list[BaseException] = []

    def broken(m: nn.Module, gin: tuple, gout: tuple) -> None:
        raise MemoryError("no room")

    register_grad_hook(model[0], broken, on_error=errors.append)
    model(torch.randn(2, 3)).sum().backward()  # no exception here
    assert [type(e) for e in errors] == [MemoryError]
