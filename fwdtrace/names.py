"""What a torch function is called in the graph: ``torch.cat``, ``torch.Tensor.view``, ``mylib.twice``.

A ``TorchFunctionMode`` sees builtins, tensor methods, properties and operators registered
with ``torch.library``; each gets the dotted name a user would write to call it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["function_name", "UniqueNames"]

_FUNC2NAME: dict[Any, str] = {}


def function_name(func: Any) -> str:
    """The dotted name of a function a ``TorchFunctionMode`` sees.

    >>> import torch
    >>> function_name(torch.cat), function_name(torch.Tensor.view), function_name(torch.ops.aten.add.Tensor)
    ('torch.cat', 'torch.Tensor.view', 'aten.add')

    Operators registered with ``torch.library`` are named by their namespace and name
    (``torch.ops.mylib.twice`` and its overloads are ``mylib.twice``), whatever the Python
    object torch hands over for them.
    """
    name = _FUNC2NAME.get(func)
    if name is not None:
        return name
    short = getattr(func, "__name__", None) or repr(func)
    if isinstance(func, torch._ops.OpOverloadPacket):
        name = func._qualified_op_name.replace("::", ".")
    elif isinstance(func, torch._ops.OpOverload):
        name = func.overloadpacket._qualified_op_name.replace("::", ".")
    elif isinstance(func, torch._ops.HigherOrderOperator):
        name = f"{func.namespace}.{func.name()}"
    elif short == "__get__" and hasattr(func, "__self__"):  # a Tensor property such as .T
        name = f"torch.Tensor.{func.__self__.__name__}"
    elif getattr(torch.Tensor, short, None) is func:
        name = f"torch.Tensor.{short}"
    elif getattr(torch.nn.functional, short, None) is func:
        name = f"torch.nn.functional.{short}"
    elif getattr(torch, short, None) is func:
        name = f"torch.{short}"
    elif getattr(func, "__module__", None) == "torch._tensor" and getattr(func, "__qualname__", "").startswith(
        "TensorBase."
    ):  # x ** 2 and x **= 2 arrive as torch._tensor's wrappers of TensorBase.pow and pow_
        name = f"torch.Tensor.{func.__qualname__.split('.', 1)[1]}"
    else:
        module = getattr(func, "__module__", None) or "torch"
        name = f"{module}.{getattr(func, '__qualname__', short)}"
    _FUNC2NAME[func] = name
    return name


class UniqueNames:
    """Hands out each name once: the base itself, then ``base_1``, ``base_2``, ... (the first free suffix).

    >>> names = UniqueNames()
    >>> [names.take(n) for n in ("relu", "relu", "relu_1", "relu")]
    ['relu', 'relu_1', 'relu_1_1', 'relu_2']

    Names are never given back, so every suffix below the last one handed out for a base is
    still taken: probing resumes there (O(1) per name, the same names as probing from 1).
    """

    __slots__ = ("taken", "_next_suffix")

    def __init__(self) -> None:
        self.taken: set[str] = set()
        self._next_suffix: dict[str, int] = {}

    def take(self, base: str) -> str:
        taken = self.taken
        if base not in taken:
            taken.add(base)
            return base
        i = self._next_suffix.get(base, 1)
        name = f"{base}_{i}"
        while name in taken:
            i += 1
            name = f"{base}_{i}"
        self._next_suffix[base] = i + 1
        taken.add(name)
        return name
