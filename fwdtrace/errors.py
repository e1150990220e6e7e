"""The one error class of fwdtrace, and the note that points a failure at its layer.

Internal code raises short facts; public functions re-raise them with what the
user passed (the einops way). Every fwdtrace error is a :class:`FwdtraceError`.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
from collections.abc import Iterable
from typing import Any

__all__ = ["FwdtraceError", "FwdtraceWarning", "describe", "shapes_text", "add_layer_note", "one_line", "NOTE_PREFIX",
           "check_callback"]

NOTE_PREFIX = "fwdtrace:"


class FwdtraceError(Exception):
    """Base class of every error fwdtrace raises on bad input or a failed step.

    >>> import fwdtrace
    >>> try:
    ...     fwdtrace.trace("not a model")
    ... except fwdtrace.FwdtraceError as e:
    ...     print(str(e).split(":")[0])
    trace() expected a torch.nn.Module as model, got str
    """


class FwdtraceWarning(UserWarning):
    """What fwdtrace has to tell you without stopping, in fwdtrace's words: a picture drawn with
    fwdtrace's own layout where Graphviz cannot lay out (and what to install), an ONNX export that
    left outputs out or read tensors as Python values. Silence them all with
    ``warnings.filterwarnings("ignore", category=fwdtrace.FwdtraceWarning)``.

    >>> import warnings, fwdtrace
    >>> issubclass(fwdtrace.FwdtraceWarning, UserWarning)
    True
    """


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first caller outside fwdtrace (and contextlib)."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame: Any = sys._getframe(1)
    level = 1
    while frame is not None and (frame.f_code.co_filename.startswith(package)
                                 or frame.f_code.co_filename == contextlib.__file__):
        frame, level = frame.f_back, level + 1
    return level


def describe(obj: Any) -> str:
    """A short, type-first description of a value for error messages: ``str``, ``Tensor[1, 3]``."""
    import torch

    if isinstance(obj, torch.Tensor):
        return f"Tensor{list(obj.shape)}"
    if isinstance(obj, type):
        return f"class {obj.__module__}.{obj.__qualname__}"
    return type(obj).__name__


def check_callback(fn: Any, caller: str, signature: str, name: str = "fn") -> None:
    """Raise unless ``fn`` (the argument ``name``) is a callable that takes ``signature``'s positional
    arguments, ``(module, inputs, output)``.

    Checked when the callback is registered, not when it is first called inside a forward.
    ``*args`` and defaults count as the signature allows; a builtin without a signature is taken as it is.

    >>> check_callback(lambda output: output, "replace_output()", "(module, inputs, output)")
    Traceback (most recent call last):
    ...
    fwdtrace.errors.FwdtraceError: replace_output() expected fn as a callable (module, inputs, output), got function <lambda>(output)
    """
    if not callable(fn):
        raise FwdtraceError(f"{caller} expected {name} as a callable {signature}, got {describe(fn)}")
    count = len([p for p in signature.strip("()").split(",") if p.strip()])
    try:
        found = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to check (a builtin): its call will say
        return
    try:
        found.bind(*[None] * count)
    except TypeError:
        shown = getattr(fn, "__name__", None) or type(fn).__name__
        raise FwdtraceError(f"{caller} expected {name} as a callable {signature}, got {describe(fn)} {shown}{found}") from None


def shapes_text(tensors: Iterable[Any]) -> str:
    """``float32[1, 3, 8, 8], int64[2]`` for the tensors among ``tensors``."""
    import torch

    from ._tree import tensor_text

    parts = [tensor_text(t) for t in tensors if isinstance(t, torch.Tensor)]
    return ", ".join(parts) if parts else "no tensors"


def add_layer_note(
    exc: BaseException, module_key: str, class_name: str, inputs_text: str, op: str | None = None
) -> None:
    """Add one PEP 678 note naming the layer (and the torch function, ``op``) where ``exc`` was raised.

    Only the innermost layer adds a note: outer layers see the note and leave it.
    Every fwdtrace feature that runs a model (trace, probes, analysis) uses this.
    """
    notes = getattr(exc, "__notes__", ())
    if any(isinstance(n, str) and n.startswith(NOTE_PREFIX) for n in notes):
        return
    where = f"in {op} called by module" if op else "in module"
    exc.add_note(f"{NOTE_PREFIX} raised {where} '{module_key}' ({class_name}) with inputs {inputs_text}")


def one_line(exc: BaseException) -> str:
    """``"RuntimeError: first line of the message; fwdtrace: raised in module ..."``: an error in one line.

    >>> one_line(ValueError("bad value\\nmore detail"))
    'ValueError: bad value'

    The layer note that traces, probes and analysis add is kept: it names where it happened.
    """
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    notes = [n for n in getattr(exc, "__notes__", ()) if isinstance(n, str) and n.startswith(NOTE_PREFIX)]
    return text + "".join(f"; {n.strip()}" for n in notes)
