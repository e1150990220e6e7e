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


class _Split(nn.Module):
    """Two outputs, of which a model may use one."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x.exp()


def test_no_call_outlives_its_graph_after_a_backward_or_without_one() -> None:
    """A call's hooks live on its autograd graph and the call holds none of the graph: once the graph is freed
    (a step's backward done, an evaluation's output dropped) the calls go too. A call that held its graph's nodes
    made a cycle through C++ the collector cannot break: every step's calls, and a forward without backward's
    saved activations, stayed for good."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    seen: list[int] = []
    handles = [register_grad_hook(m, lambda m, gin, gout: seen.append(1)) for m in model.modules()]
    x = torch.randn(3, 4)
    for _ in range(3):
        model(x).sum().backward()
    for _ in range(3):  # an evaluation with gradients on: no backward
        model(x)
    gc.collect()
    assert len(seen) == 3 * 6
    assert [len(h.calls) for h in handles] == [0] * 6
    for h in handles:
        h.remove()


def test_an_output_no_gradient_reaches_is_none_and_its_call_reported_when_each_backward_ends() -> None:
    torch.manual_seed(1)
    split = _Split()
    x = torch.randn(5, requires_grad=True)
    got: list[tuple] = []
    ref: list[tuple] = []
    handle = register_grad_hook(split, lambda m, gin, gout: got.append((gin, gout)))
    torch_handle = split.register_full_backward_hook(lambda m, gin, gout: ref.append((gin, gout)))
    a, _ = split(x * 1)
    loss = (a * a).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    assert len(got) == len(ref) == 2
    for (gin, gout), (rin, rout) in zip(got, ref, strict=True):
        torch.testing.assert_close(gout[0], rout[0], rtol=0, atol=0)
        assert gout[1] is None and rout[1] is None
        torch.testing.assert_close(gin[0], rin[0], rtol=0, atol=0)
    handle.remove()
    torch_handle.remove()
