"""A module's parameters and their gradients, taken once each backward has finished with them.

The ``weight`` and ``weight_grad`` sampling kinds of the recorder and the live service share
this: which parameters a module key stands for (:func:`module_parameters`), what each kind
reads from one (:func:`parameter_value`) and when (:func:`after_backward`: once per backward,
after the parameter's gradient is accumulated, before any optimizer step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["PARAMETER_KINDS", "module_parameters", "parameter_value", "after_backward"]

PARAMETER_KINDS = ("weight", "weight_grad")


def module_parameters(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` of every parameter under ``module``, named as ``named_parameters()`` names them.

    >>> [name for name, _ in module_parameters(torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU()))]
    ['0.weight', '0.bias']

    A parameter shared by two submodules is listed once, under its first name.
    """
    return list(module.named_parameters())


def parameter_value(parameter: torch.Tensor, kind: str) -> torch.Tensor | None:
    """What ``kind`` samples of ``parameter``: itself for ``"weight"``, its ``.grad`` (or None) for ``"weight_grad"``.

    >>> p = torch.nn.Parameter(torch.ones(2)); (p * 3).sum().backward()
    >>> parameter_value(p, "weight_grad").tolist()
    [3.0, 3.0]
    """
    if kind not in PARAMETER_KINDS:
        raise ValueError(f"parameter kinds are {PARAMETER_KINDS}, got {kind!r}")
    return parameter.detach() if kind == "weight" else parameter.grad


def after_backward(
    parameters: list[tuple[str, torch.nn.Parameter]], callback: Callable[[str, torch.Tensor], None]
) -> list[Any]:
    """Call ``callback(name, parameter)`` each time a backward has accumulated into ``parameter.grad``.

    >>> lin = torch.nn.Linear(2, 1); seen = []
    >>> handles = after_backward(module_parameters(lin), lambda name, p: seen.append((name, p.grad.shape)))
    >>> lin(torch.ones(1, 2)).sum().backward(); seen
    [('bias', torch.Size([1])), ('weight', torch.Size([1, 2]))]
    >>> for h in handles: h.remove()

    Uses ``Tensor.register_post_accumulate_grad_hook``: once per parameter per backward (a
    module called twice in a step still counts one), in the order autograd finishes them.
    Parameters without ``requires_grad`` are never called back. Returns the hook handles.
    """
    handles = []
    for name, parameter in parameters:
        if parameter.requires_grad:
            handles.append(parameter.register_post_accumulate_grad_hook(lambda p, name=name: callback(name, p)))
    return handles
