"""Shared fixtures. Plain ``pytest`` passes with no environment variables."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # so tests can `import zoo`

torch.set_num_threads(1)  # the suite runs two workers on two cores
_ORIGINAL_CALL_IMPL = torch.nn.Module.__dict__["_call_impl"]


@pytest.fixture(autouse=True)
def _no_leftover_hooks():
    """Every test starts and ends with no user callbacks registered and nothing patched."""
    import fwdtrace
    from fwdtrace.patching import patched_functions
    from fwdtrace.registry import REGISTRY

    atomic_before = set(REGISTRY.atomic)
    functions_before = {path: (t, t.atomic, t.everywhere) for path, t in REGISTRY.functions.items()}
    yield
    fwdtrace.uninstall()
    fwdtrace.clear_hooks()
    REGISTRY.atomic = atomic_before
    REGISTRY.functions = {path: t for path, (t, _, _) in functions_before.items()}
    for t, atomic, everywhere in functions_before.values():
        t.atomic, t.everywhere = atomic, everywhere
    assert patched_functions() == [], "a hooked function is still patched"
    assert torch.nn.Module.__dict__["__call__"] is torch.nn.modules.module.Module._wrapped_call_impl
    assert torch.nn.Module.__dict__["_call_impl"] is _ORIGINAL_CALL_IMPL


@pytest.fixture
def restore_rules():
    """ONNX equivalence rules and symbolics (onnx_equivalent, onnx_symbolic) a test registers are gone after it."""
    from fwdtrace.onnx import emit as onnx_emit
    from fwdtrace.onnx import ops as onnx_ops

    saved = [(table, dict(table)) for table in (onnx_ops._RULES, onnx_emit._SYMBOLICS)]
    yield
    for table, before in saved:
        table.clear()
        table.update(before)
    onnx_ops._inherited.clear()
