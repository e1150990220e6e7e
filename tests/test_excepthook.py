"""install_excepthook(): the failing layer first, then the usual traceback; colour only on a TTY."""

from __future__ import annotations

import io
import sys
import traceback

import pytest
import torch
from test_analysis import LAYER_NOTE, Deep

import fwdtrace
from fwdtrace.excepthook import layer_block


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def hook():
    before = sys.excepthook
    fwdtrace.install_excepthook()
    yield sys.excepthook
    fwdtrace.uninstall_excepthook()
    assert sys.excepthook is before


def failure(run=fwdtrace.analyze) -> BaseException:
    try:
        run(Deep(), torch.randn(2, 4))
    except RuntimeError as e:
        return e
    raise AssertionError("the model was expected to fail")


@pytest.mark.parametrize("run", [fwdtrace.trace, fwdtrace.analyze], ids=["trace", "analyze"])
def test_hook_prints_the_layer_block_before_the_traceback(hook, run, capsys):
    exc = failure(run)
    sys.excepthook(type(exc), exc, exc.__traceback__)
    err = capsys.readouterr().err
    block, rest = err.split("(full traceback below)\n", 1)
    assert block.splitlines() == [
        "fwdtrace: the forward failed in a layer",
        "| module  blocks.1.inner.proj.Linear (torch.nn.Linear)",
        "| inputs  float32[2, 4]",
        f"| error   RuntimeError: {str(exc).splitlines()[0]}",
    ]
    assert "\033[" not in err  # captured stderr is no terminal
    # then exactly what Python prints, notes included
    assert rest == "".join(traceback.format_exception(exc))


def test_colour_only_on_a_tty(hook, monkeypatch):
    exc = failure()
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    sys.excepthook(type(exc), exc, exc.__traceback__)
    assert "\033[1mblocks.1.inner.proj.Linear\033[0m" in tty.getvalue()


def test_the_note_is_found_through_a_chain_of_exceptions(hook, capsys):
    inner = failure()
    try:
        raise fwdtrace.FwdtraceError("analysis failed") from inner
    except fwdtrace.FwdtraceError as outer:
        assert inner.__notes__ == [LAYER_NOTE]
        sys.excepthook(type(outer), outer, outer.__traceback__)
    err = capsys.readouterr().err
    assert err.startswith("fwdtrace: the forward failed in a layer\n| module  blocks.1.inner.proj.Linear")
    assert "| error   RuntimeError: mat1 and mat2 shapes cannot be multiplied" in err


def test_errors_without_a_layer_pass_through_untouched(hook, capsys):
    try:
        raise ValueError("plain")
    except ValueError as e:
        sys.excepthook(type(e), e, e.__traceback__)
        expected = "".join(traceback.format_exception(e))
    assert capsys.readouterr().err == expected


def test_an_op_inside_a_layer_is_named():
    class Cat(torch.nn.Module):
        def forward(self, x):
            return torch.cat([x, x.T], dim=1)

    with pytest.raises(RuntimeError) as info:
        fwdtrace.trace(torch.nn.Sequential(Cat()), torch.randn(2, 3))
    block = layer_block(info.value)
    assert block is not None
    assert block.splitlines()[1:4] == [
        f"| module  0.Cat ({Cat.__module__}.{Cat.__qualname__})",
        "| op      torch.cat",
        "| inputs  [float32[2, 3], float32[3, 2]], dim=1",  # what torch.cat received: a list and dim
    ]


def test_installing_twice_keeps_one_hook_and_uninstall_restores_the_original():
    original = sys.excepthook
    fwdtrace.install_excepthook()
    ours = sys.excepthook
    fwdtrace.install_excepthook()
    assert sys.excepthook is ours is not original
    fwdtrace.uninstall_excepthook()
    assert sys.excepthook is original
    fwdtrace.uninstall_excepthook()  # a second time changes nothing
    assert sys.excepthook is original
