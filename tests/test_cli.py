"""The ``fwdtrace`` command's shared parts: factory loading, shapes, exit codes, closed pipes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fwdtrace import FwdtraceError
from fwdtrace.cli import load_factory, main, parse_shape

TESTS = Path(__file__).parent

BAD_SHAPES = [("1,3,x", "'1,3,x'"), ("", "''"), ("1,0,4", "'1,0,4'"), ("-1,3", "'-1,3'")]


def test_parse_shape() -> None:
    assert parse_shape("1,3,224,224") == (1, 3, 224, 224)
    assert parse_shape("2x8") == (2, 8)


@pytest.mark.parametrize("text, shown", BAD_SHAPES)
def test_bad_shapes(text: str, shown: str) -> None:
    with pytest.raises(FwdtraceError, match=rf"^expected --input-shape as positive integers .* got {shown}"):
        parse_shape(text)


def test_load_factory() -> None:
    model = load_factory("zoo:ResNetish")
    assert isinstance(model, torch.nn.Module) and type(model).__name__ == "ResNetish"
    with pytest.raises(FwdtraceError, match=r"^expected a factory as 'pkg.module:function', got 'zoo'"):
        load_factory("zoo")
    with pytest.raises(FwdtraceError, match=r"^could not import 'no_such_pkg' for factory"):
        load_factory("no_such_pkg:make")
    with pytest.raises(FwdtraceError, match=r"^zoo:nothing: module 'zoo' has no attribute 'nothing'"):
        load_factory("zoo:nothing")
    with pytest.raises(FwdtraceError, match=r"^factory 'zoo:resnetish' expected to return a torch.nn.Module, got tuple"):
        load_factory("zoo:resnetish")  # returns (model, inputs)


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["no-such-command"]) == 2
    assert main(["analyze", "zoo:ResNetish", "--input-shape", "1,3,x"]) == 2
    assert "expected --input-shape" in capsys.readouterr().err


def test_a_closed_pipe_is_not_a_crash() -> None:
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    command = [sys.executable, "-m", "fwdtrace.cli", "analyze", "zoo:ResNetish", "--input-shape", "1,3,16,16",
               "--json", "--repeats", "1", "--warmup", "1"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # as `| head` does once it has read enough; here before anything is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "Traceback" not in err and "BrokenPipeError" not in err
