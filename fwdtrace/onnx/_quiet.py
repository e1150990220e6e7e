"""What other libraries print while an exporter runs: kept from the user, summarised, logged at DEBUG.

torch's exporters and onnxscript warn and print on every call (FutureWarnings of torch's own
internals, onnxscript's "Evaluation failed" while folding constants, the TorchScript
exporter's "Torch IR graph at exception" dump before its error). :func:`quiet` captures
them: Python warnings, the ``torch``/``onnxscript`` loggers, ``sys.stdout``/``sys.stderr``
and, where an exporter writes from C++, file descriptors 1 and 2. What matters is said once
in fwdtrace's words (a :class:`~fwdtrace.errors.FwdtraceWarning`); everything captured goes
to the ``fwdtrace.onnx`` logger at DEBUG, and ``verbose=True`` captures nothing.

Warning filters, ``sys.stdout`` and file descriptors belong to the whole process: one
capture runs at a time (a lock; a second thread's export waits), and while it runs, what
other threads print is captured with it (it goes to the DEBUG log, not the terminal).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator

from ..errors import FwdtraceWarning, user_stacklevel

logger = logging.getLogger("fwdtrace.onnx")
# Loggers of the libraries an export runs through; their records are captured, not shown.
_LIBRARY_LOGGERS = ("torch.onnx", "torch.export", "torch._export", "torch._dynamo", "torch.fx", "onnxscript",
                    "onnx_ir", "transformers")
_lock = threading.RLock()
_state = threading.local()


class _Collect(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(f"[{record.name}] {record.levelname}: {record.getMessage()}")
        except Exception:  # a record whose message cannot be formatted is not worth failing an export
            self.lines.append(f"[{record.name}] {record.levelname}: {record.msg!r}")


@contextlib.contextmanager
def quiet(what: str, verbose: bool = False, fds: bool = False) -> Iterator[None]:
    """Capture what ``what`` (``"the torchscript exporter"``) warns and prints while the block runs.

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as shown:
    ...     warnings.simplefilter("always")
    ...     with quiet("a noisy library"):
    ...         print("noise"); warnings.warn("more noise", FutureWarning)
    >>> shown
    []

    ``fds=True`` also captures file descriptors 1 and 2 (C++ writes). Inside another
    capture, on this thread, it adds nothing. ``verbose=True`` leaves everything as it is.
    """
    if verbose:
        yield
        return
    if getattr(_state, "active", False):  # inside a capture: only what it does not capture yet
        if fds and not _state.fds:
            _state.fds = True
            try:
                with _fd_capture(True, _state.fd_text):
                    yield
            finally:
                _state.fds = False
        else:
            yield
        return
    with _lock:
        _state.active, _state.fds = True, fds
        lines: list[str] = []
        handler = _Collect(lines)
        saved = []
        for name in _LIBRARY_LOGGERS:
            lg = logging.getLogger(name)
            saved.append((lg, lg.propagate))
            lg.addHandler(handler)
            lg.propagate = False
        out, err = io.StringIO(), io.StringIO()
        fd_text: list[str] = []
        _state.fd_text = fd_text
        failed = True
        try:
            with warnings.catch_warnings(record=True) as caught, _fd_capture(fds, fd_text), \
                    contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                warnings.simplefilter("always")
                yield
            failed = False
        finally:
            for lg, propagate in saved:
                lg.removeHandler(handler)
                lg.propagate = propagate
            _state.active = _state.fds = False
            raw = [f"{w.category.__name__} ({w.filename}:{w.lineno}): {w.message}" for w in caught]
            raw += lines + [t for t in (out.getvalue(), err.getvalue(), *fd_text) if t.strip()]
            if raw and logger.isEnabledFor(logging.DEBUG):
                logger.debug("%s printed or warned (captured by fwdtrace):\n%s", what, "\n".join(raw))
            if not failed:
                _summarise(what, caught)


def _summarise(what: str, caught: list[warnings.WarningMessage]) -> None:
    """The one thing worth a user's attention: a trace that read Python values from tensors."""
    traced = [w for w in caught if w.category.__name__ == "TracerWarning"]
    if not traced:
        return
    places = list(dict.fromkeys(f"{os.path.basename(w.filename)}:{w.lineno}" for w in traced))
    shown = ", ".join(places[:3]) + (f" and {len(places) - 3} more" if len(places) > 3 else "")
    warnings.warn(
        f"{what} traced the model with values read from tensors as Python values ({len(places)} place"
        f"{'s' if len(places) > 1 else ''}: {shown}): the ONNX model holds what these inputs computed there, "
        "constants and branches included; verbose=True shows the exporter's own warnings",
        FwdtraceWarning,
        stacklevel=user_stacklevel(),
    )


@contextlib.contextmanager
def _fd_capture(enabled: bool, text: list[str]) -> Iterator[None]:
    """File descriptors 1 and 2 into a temporary file; ``text`` gets what was written."""
    if not enabled:
        yield
        return
    _flush()
    with tempfile.TemporaryFile() as tmp:
        saved = [os.dup(1), os.dup(2)]
        try:
            os.dup2(tmp.fileno(), 1)
            os.dup2(tmp.fileno(), 2)
            yield
        finally:
            _flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            tmp.seek(0)
            text.append(tmp.read().decode("utf-8", "replace"))


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
