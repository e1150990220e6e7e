"""Dumps written off the training thread: the same file, with bounded memory, a full queue waited for or counted."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import fwdtrace
from fwdtrace import FwdtraceError


def _model() -> nn.Module:
    torch.manual_seed(0)
    # in place after each layer: the values dumped must be the layer's, not what the model writes later
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    tree = fwdtrace.read_dump(path, show=False, values=True)
    return {f"{g}/{d}": e["value"] for g, group in tree["groups"].items() for d, e in group["datasets"].items()}


def _run(tmp_path: Path, name: str, hold: threading.Event | None = None, **kwargs: object) -> tuple[Path, str]:
    model = _model()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    with fwdtrace.Dumper(tmp_path / name, **kwargs) as dumper:
        dumper.register(model)
        if hold is not None:  # the writer is busy until hold is set: everything else queues behind it
            dumper._recordings[0].writer.put(hold.wait, 0, "held")
        model(x).sum().backward()
        if hold is not None:
            hold.set()
    path = dumper.paths[0]
    return path, fwdtrace.read_dump(path, show=False)["status"]


def test_a_background_dump_is_the_same_as_a_direct_one(tmp_path: Path) -> None:
    direct, _ = _run(tmp_path, "direct")
    background, status = _run(tmp_path, "background", background=True)
    assert status == "complete"
    expected, got = _tensors(direct), _tensors(background)
    assert list(got) == list(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_a_full_queue_drops_and_counts_or_waits(tmp_path: Path) -> None:
    total = len(_tensors(_run(tmp_path, "direct")[0]))
    # drop: with the writer held, the first tensor is taken (alone in the queue), every other one is dropped
    path, status = _run(tmp_path, "drop", threading.Event(), background=True, queue_bytes=1, when_full="drop")
    assert status.startswith("incomplete: stopped after") and f"{total - 1} tensors dropped" in status
    assert len(_tensors(path)) == 1
    assert fwdtrace.read_dump(path, show=False)["attrs"]["dropped"] == total - 1
    # wait: the step waits for room instead; released by a timer, every tensor is there
    hold = threading.Event()
    timer = threading.Timer(0.2, hold.set)
    timer.start()
    path, status = _run(tmp_path, "wait", hold, background=True, queue_bytes=1, when_full="wait")
    timer.join()
    assert status == "complete" and len(_tensors(path)) == total


def test_the_next_register_leaves_a_step_its_writer_still_writes_and_closes_it_once_written(tmp_path: Path) -> None:
    # A background step's writes overlap the next steps' compute: register() does not wait for them.
    model, x = _model(), torch.randn(3, 4)
    hold = threading.Event()
    with fwdtrace.Dumper(tmp_path, background=True) as dumper:
        dumper.register(model, step=0)
        dumper._recordings[0].writer.put(lambda: hold.wait(20), 0, "held")  # the writer busy until hold is set
        model(x).sum().backward()
        dumper.register(model, step=1)  # step 0 is over but not written: left open, not waited for
        assert not hold.is_set() and len(dumper.paths) == 0 and repr(dumper).endswith("0 written, 2 open)")
        model(x).sum().backward()
        hold.set()
        deadline = time.monotonic() + 20
        while not all(r.writer.idle for r in dumper._recordings) and time.monotonic() < deadline:
            time.sleep(0.01)  # both writers drain
        dumper.register(model, step=2)
        assert [p.name for p in dumper.paths] == [f"0-epoch_{s}-step_dump.hdf5" for s in (0, 1)]
        model(x).sum().backward()
    assert [fwdtrace.read_dump(p, show=False)["status"] for p in dumper.paths] == ["complete"] * 3
    assert _tensors(dumper.paths[0]).keys() == _tensors(dumper.paths[2]).keys()


def test_a_write_that_fails_on_the_writer_thread_is_raised_on_the_training_thread(tmp_path: Path) -> None:
    model = _model()
    dumper = fwdtrace.Dumper(tmp_path / "failing", background=True)
    dumper.register(model)
    dumper._recordings[0].writer.put(lambda: 1 / 0, 0, "000_Sequential")
    # raised by the next write after the writer failed, or at the latest when the dump is closed
    with pytest.raises(FwdtraceError, match=r"^Dumper could not write .*\(000_Sequential\): ZeroDivisionError"):
        try:
            model(torch.ones(1, 4)).sum().backward()
        finally:
            dumper.remove()
    assert dumper.paths == [] and not list((tmp_path / "failing").iterdir())


@pytest.mark.parametrize("kwargs, message", [
    ({"background": 1}, r"^Dumper expected background as a bool, got int"),
    ({"queue_bytes": 0}, r"^Dumper expected queue_bytes as a positive int, got int 0"),
    ({"when_full": "block"}, r"^Dumper expected when_full as 'wait' or 'drop', got 'block'"),
])
def test_writer_options_are_checked(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(FwdtraceError, match=message):
        fwdtrace.Dumper(tmp_path, **kwargs)
