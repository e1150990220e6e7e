"""Walking the tensors inside nested inputs and outputs, and naming what they are.

Tuples, lists, dicts (transformers' ModelOutput is one) and dataclasses are opened, and on
request transformers' KV caches; every tensor leaf is yielded with a readable path such as
``output.logits`` or ``x[1]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch

_DTYPE2NAME: dict[torch.dtype, str] = {}
# Plain objects opened like containers when asked (``caches=True``): transformers' KV caches
# (DynamicCache and its layers), which models return as ``cache`` (``past_key_values`` before
# transformers 5.24). Other objects stay closed: their attributes may be anything. Only a model's
# outputs open them: the trace's output nodes and the flattening of an export (see
# fwdtrace.onnx.export), which must agree.
_CACHE_MODULES = ("transformers.cache_utils",)


def dtype_name(dtype: torch.dtype) -> str:
    """``"float32"`` for ``torch.float32``: the dtype as graphs, dumps and messages write it."""
    name = _DTYPE2NAME.get(dtype)
    if name is None:
        name = _DTYPE2NAME[dtype] = str(dtype).removeprefix("torch.")
    return name


def tensor_text(t: torch.Tensor) -> str:
    """``"float32[1, 3, 8, 8]"``: a tensor's dtype and shape, as every message shows them."""
    return f"{dtype_name(t.dtype)}{list(t.shape)}"


def arguments_text(args: tuple, kwargs: Mapping[str, Any]) -> str:
    """What a call received, nested as it was received: tensors as dtype and shape.

    >>> arguments_text(([torch.ones(2, 3), torch.ones(4, dtype=torch.int64)], 0.5), {"mask": None})
    '[float32[2, 3], int64[4]], 0.5, mask=None'

    A list given as the only argument stays one list, not two inputs. Containers show at
    most ``_SHOWN`` items, numbers and short strings their value, any other object its type.
    """
    parts = [_value_text(a, 0) for a in args] + [f"{k}={_value_text(v, 0)}" for k, v in kwargs.items()]
    return ", ".join(parts) if parts else "no arguments"


_SHOWN = 8  # items shown per container in arguments_text, the rest counted
_DEPTH = 3  # containers opened inside containers


def _value_text(obj: Any, depth: int) -> str:
    if isinstance(obj, torch.Tensor):
        return tensor_text(obj)
    if obj is None or isinstance(obj, (bool, int, float)):
        return repr(obj)
    if isinstance(obj, str):
        return repr(obj) if len(obj) <= 20 else "str"
    if isinstance(obj, (list, tuple, Mapping)):
        opening, closing = ("[", "]") if isinstance(obj, list) else ("{", "}") if isinstance(obj, Mapping) else ("(", ")")
        if depth >= _DEPTH:
            return f"{opening}...{closing}"
        if isinstance(obj, Mapping):
            items = [f"{k!r}: {_value_text(v, depth + 1)}" for k, v in list(obj.items())[:_SHOWN]]
        else:
            items = [_value_text(v, depth + 1) for v in list(obj)[:_SHOWN]]
        if len(obj) > _SHOWN:
            items.append(f"... {len(obj) - _SHOWN} more")
        comma = "," if isinstance(obj, tuple) and len(obj) == 1 else ""
        return f"{opening}{', '.join(items)}{comma}{closing}"
    return type(obj).__name__


def iter_tensors(obj: Any, path: str = "", caches: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(path, tensor)`` for every tensor leaf of ``obj``, depth first, in order.

    ``caches=True`` also opens transformers' KV caches (``output.cache.layers[0].keys``).
    """
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            key = f"{path}.{k}" if isinstance(k, str) and k.isidentifier() else f"{path}[{k!r}]"
            yield from iter_tensors(v, key, caches)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, f"{path}[{i}]", caches)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name), f"{path}.{f.name}", caches)
    elif caches and is_cache(obj):
        for k, v in vars(obj).items():
            yield from iter_tensors(v, f"{path}.{k}", caches)


def is_cache(obj: Any) -> bool:
    """True for a transformers KV cache object (or one of its layers)."""
    return type(obj).__module__.startswith(_CACHE_MODULES) and hasattr(obj, "__dict__")


def tensors_of(obj: Any, caches: bool = False) -> list[torch.Tensor]:
    """The tensor leaves of ``obj`` in order (``caches=True``: transformers' KV caches' too)."""
    if isinstance(obj, torch.Tensor):  # the common case, without a generator
        return [obj]
    return [t for _, t in iter_tensors(obj, caches=caches)]
