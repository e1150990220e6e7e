"""An opt-in ``sys.excepthook`` that puts the failing layer at the top of the traceback.

Errors raised in a traced, probed or analysed forward carry a PEP 678 note naming the
module key, class and input shapes (:func:`fwdtrace.errors.add_layer_note`). Python prints
notes at the very end of a long traceback; this hook prints them first, as a short block,
highlighted when the stream is a terminal, and then the usual traceback.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from types import TracebackType
from typing import Any, TextIO

from .errors import NOTE_PREFIX

__all__ = ["install_excepthook", "uninstall_excepthook", "layer_block"]

_NOTE = re.compile(
    rf"^{re.escape(NOTE_PREFIX)} raised in (?:(?P<op>\S+) called by )?module '(?P<key>[^']*)' "
    r"\((?P<cls>[^)]*)\) with inputs (?P<inputs>.*)$",
    re.DOTALL,
)
_RED, _BOLD, _DIM, _RESET = "\033[31m", "\033[1m", "\033[2m", "\033[0m"
_previous: Any = None  # the hook we replaced, while ours is installed


def _layer_notes(exc: BaseException) -> Iterator[tuple[BaseException, str]]:
    """(exception, note) for every fwdtrace note along the exception's chain, outermost first."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for note in getattr(current, "__notes__", ()):
            if isinstance(note, str) and note.startswith(NOTE_PREFIX):
                yield current, note
        current = current.__cause__ or current.__context__


def layer_block(exc: BaseException, color: bool = False) -> str | None:
    """The short block naming the layer where ``exc`` was raised, or None if no layer is known.

    >>> import torch
    >>> from fwdtrace.tracer import layer_notes
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    >>> try:
    ...     with layer_notes(model):
    ...         model(torch.ones(1, 3))
    ... except RuntimeError as e:
    ...     print(layer_block(e).splitlines()[1])
    | module  0.Linear (torch.nn.Linear)
    """
    found = next(_layer_notes(exc), None)
    if found is None:
        return None
    raised, note = found
    bold, red, reset = (_BOLD, _RED, _RESET) if color else ("", "", "")
    first = str(raised).strip().splitlines()
    lines = [f"{red}{bold}fwdtrace: the forward failed in a layer{reset}"]
    match = _NOTE.match(note)
    if match is None:  # a note in a shape this hook does not know: show it as it is
        lines.append(f"| {note}")
    else:
        lines.append(f"| module  {bold}{match['key']}{reset} ({match['cls']})")
        if match["op"]:
            lines.append(f"| op      {match['op']}")
        lines.append(f"| inputs  {match['inputs']}")
    lines.append(f"| error   {red}{type(raised).__name__}{reset}: {first[0] if first else ''}")
    return "\n".join(lines)


def _hook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    stream: TextIO = sys.stderr
    color = _isatty(stream)
    block = layer_block(exc, color=color) if isinstance(exc, BaseException) else None
    if block is not None:
        print(block, file=stream)
        print(f"{_DIM if color else ''}(full traceback below){_RESET if color else ''}", file=stream)
    (_previous or sys.__excepthook__)(exc_type, exc, tb)


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or replaced streams
        return False


def install_excepthook() -> None:
    """Print the failing layer first for uncaught errors; undo with :func:`uninstall_excepthook`.

    >>> import sys, fwdtrace
    >>> fwdtrace.install_excepthook()
    >>> sys.excepthook.__module__
    'fwdtrace.excepthook'
    >>> fwdtrace.uninstall_excepthook()

    The hook then calls the one it replaced, so the full traceback follows. Installing
    twice changes nothing. IPython and Jupyter do not use ``sys.excepthook``; they print
    the same notes at the end of their tracebacks.
    """
    global _previous
    if sys.excepthook is _hook:
        return
    _previous = sys.excepthook
    sys.excepthook = _hook


def uninstall_excepthook() -> None:
    """Put back the ``sys.excepthook`` that :func:`install_excepthook` replaced (if still ours)."""
    global _previous
    if sys.excepthook is _hook:
        sys.excepthook = _previous or sys.__excepthook__
    _previous = None
