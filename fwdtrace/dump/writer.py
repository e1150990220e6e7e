"""The background writer thread a dump's file operations run on (``Dumper(background=True)``)."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable


class _Writer:
    """A thread that runs a dump's file operations in order, with at most ``max_bytes`` of tensors queued.

    A tensor that would go over waits for room (``when_full="wait"``) or is dropped and counted
    (``"drop"``); one alone in the queue is always taken. An operation that raises stops the
    writing: the ones after it are skipped and the error is raised on the training thread.
    """

    def __init__(self, max_bytes: int, when_full: str) -> None:
        self.max_bytes, self.when_full = max_bytes, when_full
        self.queue: collections.deque[tuple[Callable[[], None], int, str]] = collections.deque()
        self.cond = threading.Condition()
        self.queued_bytes = 0
        self.dropped = 0
        self.error: BaseException | None = None
        self.where = ""
        self.stopping = False
        self.skip = False  # the dump is dropped: the operations left are not run
        self.thread = threading.Thread(target=self._run, name="fwdtrace-dump-writer", daemon=True)
        self.thread.start()

    def put(self, op: Callable[[], None], nbytes: int, where: str) -> bool:
        with self.cond:
            if nbytes and self.queued_bytes and self.queued_bytes + nbytes > self.max_bytes:
                if self.when_full == "drop":
                    self.dropped += 1
                    return False
                while self.queued_bytes and self.queued_bytes + nbytes > self.max_bytes and self.error is None:
                    self.cond.wait()
            self.queue.append((op, nbytes, where))
            self.queued_bytes += nbytes
            self.cond.notify_all()
        return True

    @property
    def idle(self) -> bool:
        """Whether every operation queued so far has run."""
        with self.cond:
            return not self.queue

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self.stopping:
                    self.cond.wait()
                if not self.queue:
                    return
                op, nbytes, where = self.queue[0]
            if self.error is None and not self.skip:
                try:
                    op()
                except Exception as e:
                    self.error, self.where = e, where
            with self.cond:
                self.queue.popleft()
                self.queued_bytes -= nbytes
                self.cond.notify_all()

    def finish(self, skip: bool = False) -> None:
        """Wait for every queued operation (``skip``: the ones not begun are skipped); the thread ends."""
        with self.cond:
            if skip:
                self.skip = True
            self.stopping = True
            self.cond.notify_all()
        # CPython's ``with`` is not signal-safe: a Ctrl-C landing between the lock taken and the block entered
        # (or the block left and the lock released) leaves this thread holding the lock, and the writer would
        # wait for it forever. No block of this thread holds it here: whatever it holds was left by such a signal.
        if self.cond._is_owned():  # type: ignore[attr-defined]
            self.cond._release_save()  # type: ignore[attr-defined]
        self.thread.join()
