"""A process group of one rank (gloo, in memory) for tests that need torch.distributed, left as it was found."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

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
