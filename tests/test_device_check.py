"""benchmarks/device_check.py stays runnable where there is no GPU: its smoke mode on the CPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "device_check.py"


def _script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_smoke_run_writes_a_passing_table(tmp_path: Path) -> None:
    out = tmp_path / "device-check.md"
    cheap = ["trace", "probe", "dump", "autocast"]  # the others are as cheap to call, slower to run here
    assert _script().main(["--device", "cpu", "--out", str(out), *(a for c in cheap for a in ("--only", c))]) == 0
    text = out.read_text()
    assert "A smoke run on the CPU" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == len(cheap) and all("| pass |" in r for r in rows), text


def test_every_check_is_listed_in_the_docstring() -> None:
    script = _script()
    assert len(script.CHECKS) == 12 and script.__doc__.count("\n- ``") == len(script.CHECKS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the script would run on it")
def test_asked_for_cuda_without_one_it_says_so_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "device-check.md"
    assert _script().main(["--out", str(out)]) == 0
    assert "no GPU here" in capsys.readouterr().out and not out.exists()
