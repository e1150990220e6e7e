"""A process group of one rank (gloo, in memory) for tests that need torch.distributed, left as it was found; and
runs of several ranks in processes of their own, none left running after the test."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest


@contextlib.contextmanager
def world_of_one() -> Iterator[None]:
    """A gloo process group of rank 0 of 1 while inside (the running one, where a test started one already);
    ``sys.excepthook`` put back after it: ``init_process_group`` prefixes every traceback with '[rank0]:' for the
    rest of the process, which tests of the excepthook run later on the same worker would see."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    made, excepthook = not dist.is_initialized(), sys.excepthook
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if made:
            dist.destroy_process_group()
        sys.excepthook = excepthook


def run_in_session(command: list[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, timeout=timeout, **kwargs)`` in a session of its own, every
    process of which is killed when it returns or times out: ranks that a launcher left waiting for each other
    (its time-out killed only the launcher) do not run on after the test."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(command, timeout, out, err) from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(command, proc.returncode, out, err)
