"""The live history on disk (fwdtrace/live/history.py): rows back as written, retention, reopening, bad logdirs.

References: numpy's own histogram and the values written; the file as h5py reads it from a
copy taken while the writer is still open (what a crash would leave); the scalars a training
loop logged and the gradient norms torch computes, read back from the reopened run.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from test_live import Net, health_step, request

import fwdtrace
import fwdtrace.live
from fwdtrace import FwdtraceError, Graph
from fwdtrace.live import sampler
from fwdtrace.live.history import HISTORY_FILE, History


def _row(rng: np.random.Generator, step: int, bins: int = 4) -> dict:
    x = rng.normal(size=50) * step
    edges = np.linspace(x.min(), x.max(), bins + 1)
    counts = np.histogram(x, bins=edges)[0]
    return {"step": step, "time": 1000.0 + step, "call": step, "stats": {
        "numel": x.size, "mean": x.mean(), "std": x.std(), "min": x.min(), "max": x.max(), "nan": 0, "inf": 0,
        "zero_fraction": 0.0, "underflow": 0, "overflow": 0}, "histogram": counts.tolist(), "bin_edges": edges.tolist()}


def _plain_rows(f: h5py.File) -> dict[tuple[str, ...], np.ndarray]:
    """Every series' and scalar's written ``meta`` rows (physical order), as plain h5py reads the file's catalog."""
    text = f["names"][:].tobytes()
    out = {}
    for entry in f["catalog"][:]:
        name = tuple(json.loads(text[entry["name_start"]:entry["name_start"] + entry["name_length"]]))
        meta = f["series_meta" if entry["table"] == 0 else "scalar_meta"][entry["slot"]]
        out[name] = meta[meta["seq"] >= 0]
    return out


def test_rows_come_back_as_written_and_retention_keeps_the_newest(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    written = [_row(rng, step) for step in range(1, 12)]
    with History(tmp_path / "run", retention=5) as history:
        for i, r in enumerate(written):
            history.append("0.Linear", "forward", "output", **r)
            if i == 4:
                full = history.path.stat().st_size
        assert history.path.stat().st_size == full  # the file stops growing with the ring: rows are rewritten in place
        history.append("0.Linear", "forward", "input", **written[0])
        rows = history.rows("0.Linear", "forward", "output")
        assert [r["step"] for r in rows] == [7, 8, 9, 10, 11]  # the ring kept the newest 5 of 11
        assert [r["seq"] for r in rows] == [6, 7, 8, 9, 10]
        for got, want in zip(rows, written[6:], strict=True):
            assert got["histogram"] == want["histogram"] and got["bin_edges"] == want["bin_edges"]
            assert {k: got[k] for k in want["stats"]} == want["stats"]  # float64 on disk: exact
        assert [r["step"] for r in history.rows("0.Linear", "forward", "output", before=10, limit=2)] == [8, 9]
        assert history.rows("0.Linear", "forward", "output", before=7) == []
        assert [(s["role"], s["rows"], s["appended"], s["first_step"], s["last_step"]) for s in history.series()] == [
            ("output", 5, 11, 7, 11), ("input", 1, 1, 1, 1)]
        with h5py.File(history.path, "r", swmr=True) as f:  # on disk: no dataset grew past the retention
            assert f["series_meta"].shape[1] == f["series_values"].shape[1] == 5
            assert [len(m) for m in _plain_rows(f).values()] == [5, 1]

    # Reopened read-only: the same rows; writing is refused. Reopened to write: the ring goes on.
    with History(tmp_path / "run", read_only=True) as history:
        assert history.rows("0.Linear", "forward", "output") == rows
        with pytest.raises(FwdtraceError, match=r"^History\(\): the run in .* is open read-only"):
            history.append("0.Linear", "forward", "output", **written[0])
    with History(tmp_path / "run") as history:
        history.append("0.Linear", "forward", "output", **_row(rng, 12))
        assert [r["step"] for r in history.rows("0.Linear", "forward", "output")] == [8, 9, 10, 11, 12]
    with pytest.raises(FwdtraceError, match=r"^History\(\) expected retention=5 for the run in .*, got retention=6"):
        History(tmp_path / "run", retention=6)


def test_samples_group_the_roles_of_one_call_and_scalars_keep_their_series(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    written = {}
    with History(tmp_path, retention=3) as history:
        for step in (1, 2, 3, 4):
            sample = {"step": step, "call": step, "time": 50.0 + step, "tensors": []}
            for role in ("input", "output"):
                r = _row(rng, step)
                sample["tensors"].append({"role": role, "index": 0, "numeric": True, **r["stats"],
                                          "histogram": r["histogram"], "bin_edges": r["bin_edges"]})
            sample["tensors"].append({"role": "output", "index": 1, "numeric": False})  # a bool output: no row
            history.append_sample("body.Linear", "forward", sample)
            written[step] = sample
            history.append_scalar("loss", 1.0 / step, step=step, time=50.0 + step)
        samples = history.samples("body.Linear", "forward", before=4, limit=1)
        assert [(s["step"], [t["role"] for t in s["tensors"]]) for s in samples] == [(3, ["input", "output"])]
        for got, want in zip(samples[0]["tensors"], written[3]["tensors"], strict=False):
            assert {k: got[k] for k in ("index", "mean", "std", "histogram", "bin_edges")} == \
                {k: want[k] for k in ("index", "mean", "std", "histogram", "bin_edges")}
        assert [s["step"] for s in history.samples("body.Linear", "forward")] == [2, 3, 4]
        assert history.scalars("loss") == [{"step": s, "time": 50.0 + s, "value": 1.0 / s} for s in (2, 3, 4)]
        assert history.scalars("loss", before=4, limit=1) == [{"step": 3, "time": 53.0, "value": 1.0 / 3}]
        assert history.scalar_names() == ["loss"] and history.scalars("lr") == []
        with pytest.raises(FwdtraceError, match=r"^History\(\) expected 4 histogram bins for 'body.Linear'"):
            history.append("body.Linear", "forward", "input", **_row(rng, 5, bins=3))


def test_what_an_append_wrote_is_on_disk_while_the_writer_is_open(tmp_path: Path) -> None:
    """A copy of the file taken mid-run (what a killed process leaves) opens and holds every row appended."""
    rng = np.random.default_rng(2)
    history = History(tmp_path, retention=100)
    try:
        for step in range(1, 8):
            history.append("a.ReLU", "grad", "grad_output", **_row(rng, step))
        history.append_scalar("lr", 0.1, step=7, time=0.0)
        shutil.copy(history.path, tmp_path / "copy.h5")
        with h5py.File(tmp_path / "copy.h5", "r", libver="latest", swmr=True) as f:
            metas = _plain_rows(f)
        assert metas[("a.ReLU", "grad", "grad_output")]["step"].tolist() == list(range(1, 8))
        assert metas[("lr",)]["value"].tolist() == [0.1]
    finally:
        history.close()


def test_scalar_batches_wrap_the_ring_and_keep_the_newest(tmp_path: Path) -> None:
    logged: list[tuple[int, float]] = []
    with History(tmp_path, retention=5) as history:
        for batch in (3, 4, 1, 9, 5):  # wraps inside a batch, lands on the ring's edge, overflows it whole
            points = [(len(logged) + i, 0.5 * (len(logged) + i)) for i in range(batch)]
            history.append_scalars([("loss", step, 7.0, value) for step, value in points])
            logged += points
            assert [(p["step"], p["value"]) for p in history.scalars("loss")] == logged[-5:]
        with h5py.File(history.path, "r", swmr=True) as f:
            assert f["scalar_meta"].shape[1] == 5 and sorted(_plain_rows(f)[("loss",)]["seq"]) == list(range(17, 22))
    with History(tmp_path) as history:  # continued: the ring goes on from the newest seq
        history.append_scalars([("loss", 22, 7.0, 11.0), ("lr", 22, 7.0, 0.1)])
        assert [p["step"] for p in history.scalars("loss")] == [18, 19, 20, 21, 22]
        assert history.scalar_names() == ["loss", "lr"]


def test_logged_and_health_scalars_are_on_disk_when_the_run_is_reopened(tmp_path: Path) -> None:
    """Every point log_scalar and the health arm kept while serving comes back from the reopened run; the oldest
    beyond the retention are dropped."""
    torch.manual_seed(0)
    model = Net()
    losses, lrs, health = [], [], []
    with fwdtrace.serve(model, port=0, logdir=tmp_path / "run", retention=12) as server:
        server.sampler.arm("Net", "health")
        for i in range(8):
            loss, reference = health_step(model, torch.randn(3, 8), poisoned=i == 5)
            health.append(reference)
            fwdtrace.live.log_scalar("loss", loss.detach())  # step: the service's, forwards so far
            losses.append((i + 1, float(loss.detach())))
            for k in range(2):  # more points than the retention: the newest 12 are kept
                fwdtrace.live.log_scalar("lr", 0.1 / (2 * i + k + 1), step=2 * i + k)
                lrs.append((2 * i + k, 0.1 / (2 * i + k + 1)))
    norms, nans, infs = (list(column) for column in zip(*health, strict=True))
    assert nans[5] > 0 and sum(nans) == nans[5]

    with fwdtrace.live.reopen(tmp_path / "run", port=0) as reopened:  # what `fwdtrace serve --logdir` calls
        answer = request(reopened, "GET", "/api/scalars")[1]
        svg = request(reopened, "GET", "/api/scalar.svg?name=lr")[1].decode()  # the page's chart, hover titles
    shown = [(int(s), float(v)) for s, v in re.findall(r"<title>step (\d+): lr=(\S+)</title>", svg)]
    assert [s for s, _ in shown] == [s for s, _ in lrs[-12:]]
    assert [v for _, v in shown] == pytest.approx([v for _, v in lrs[-12:]], rel=1e-5)  # six digits shown
    got = answer["scalars"]
    assert answer["names"] == ["Net/grad_inf", "Net/grad_nan", "Net/grad_norm", "loss", "lr"]
    assert got["loss"]["steps"] == [s for s, _ in losses]
    assert [v if v is not None else math.nan for v in got["loss"]["values"]] == pytest.approx(
        [v for _, v in losses], rel=1e-6, nan_ok=True)
    assert list(zip(got["lr"]["steps"], got["lr"]["values"], strict=True)) == lrs[-12:]  # floats: exact
    assert got["Net/grad_norm"]["steps"] == list(range(1, 9))
    assert [v if v is not None else math.nan for v in got["Net/grad_norm"]["values"]] == pytest.approx(
        norms, rel=1e-6, nan_ok=True)
    assert got["Net/grad_nan"]["values"] == nans and got["Net/grad_inf"]["values"] == infs


def _titles(svg: bytes, name: str) -> list[tuple[int, float]]:
    """A scalar chart's points as its hover titles give them."""
    return [(int(s), float(v)) for s, v in re.findall(rf"<title>step (\d+): {name}=(\S+)</title>", svg.decode())]


def test_scalar_charts_scroll_back_over_the_history_beyond_the_in_memory_log(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """before=/limit= on /api/scalar.svg and /api/scalars read the history on disk (from memory without one);
    /api/history spans each scalar's steps kept; bad values answer 400."""
    monkeypatch.setattr(sampler, "SCALAR_WRITE_INTERVAL", 0.05)
    logged = [(step, 0.1 / (step + 1)) for step in range(20)]  # the reference: what the loop logged
    with fwdtrace.serve(Net(), port=0, logdir=tmp_path, retention=12) as server:
        server.sampler.scalars.points = 4  # the in-memory log keeps the newest 4 points per name
        for step, value in logged:
            fwdtrace.live.log_scalar("lr", value, step=step)
        history = server.history
        assert history is not None
        deadline = time.monotonic() + 60  # until the summariser's periodic pass has written them all
        while [p["step"] for p in history.scalars("lr")][-1:] != [19]:
            assert time.monotonic() < deadline, "the summariser never wrote the scalars"
            time.sleep(0.02)
        assert request(server, "GET", "/api/scalars")[1]["scalars"]["lr"]["steps"] == [16, 17, 18, 19]
        status, svg = request(server, "GET", "/api/scalar.svg?name=lr&before=12&limit=3")
        assert status == 200 and [s for s, _ in _titles(svg, "lr")] == [9, 10, 11]
        assert [v for _, v in _titles(svg, "lr")] == pytest.approx([v for _, v in logged[9:12]], rel=1e-5)  # 6 digits
        live = request(server, "GET", "/api/scalars?before=12&limit=3")[1]
        assert list(zip(live["scalars"]["lr"]["steps"], live["scalars"]["lr"]["values"], strict=True)) == logged[9:12]
        # without limit: the default window, down to the oldest the retention kept (steps 8 to 19 of 20)
        assert [s for s, _ in _titles(request(server, "GET", "/api/scalar.svg?name=lr&before=12")[1], "lr")] == [8, 9, 10, 11]
        assert request(server, "GET", "/api/history")[1]["scalars"] == [
            {"name": "lr", "rows": 12, "appended": 20, "first_step": 8, "last_step": 19}]
        for path in ("/api/scalar.svg?name=lr&", "/api/scalars?"):
            for query, error in (("before=x", "expected before= an integer, got 'x'"),
                                 ("limit=0", "expected limit= an integer in 1..10000, got 0"),
                                 ("before=5&limit=10001", "expected limit= an integer in 1..10000, got 10001")):
                assert request(server, "GET", path + query) == (400, {"error": error, "status": 400})

    with fwdtrace.live.reopen(tmp_path, port=0) as reopened:  # the finished run answers the same
        assert request(reopened, "GET", "/api/scalar.svg?name=lr&before=12&limit=3")[1] == svg
        assert request(reopened, "GET", "/api/scalars?before=12&limit=3")[1]["scalars"] == live["scalars"]
        assert request(reopened, "GET", "/api/history")[1]["scalars"][0]["first_step"] == 8
        assert request(reopened, "GET", "/api/scalar.svg?name=lr&limit=0")[0] == 400

    with fwdtrace.serve(Net(), port=0) as server:  # no history: the window comes from memory
        for step, value in logged[:6]:
            fwdtrace.live.log_scalar("lr", value, step=step)
        shown = _titles(request(server, "GET", "/api/scalar.svg?name=lr&before=4&limit=2")[1], "lr")
        assert [s for s, _ in shown] == [2, 3] and [v for _, v in shown] == pytest.approx([v for _, v in logged[2:4]], rel=1e-5)
        answer = request(server, "GET", "/api/scalars?before=4&limit=2")[1]
        assert answer["scalars"]["lr"] == {"steps": [2, 3], "values": [v for _, v in logged[2:4]], "seq": None}


def test_log_scalar_never_writes_the_file_in_the_calling_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    writers: list[threading.Thread] = []
    written = threading.Event()
    append = History.append_scalars

    def recording(self: History, points: list) -> None:  # type: ignore[type-arg]
        writers.append(threading.current_thread())
        append(self, points)
        written.set()

    monkeypatch.setattr(History, "append_scalars", recording)
    monkeypatch.setattr(sampler, "SCALAR_WRITE_INTERVAL", 0.05)
    with fwdtrace.serve(Net(), port=0, logdir=tmp_path) as server:
        summariser = server.sampler._worker
        for step in range(50):
            fwdtrace.live.log_scalar("loss", torch.tensor(1.0 / (step + 1)), step=step)
        assert written.wait(60), "the summariser's periodic pass never wrote the scalars"  # while serving
        fwdtrace.live.log_scalar("loss", 0.0, step=50)
        assert server.history is not None and server.history.scalars("loss")[-1]["step"] >= 49
    assert writers and all(t is summariser for t in writers)  # stop()'s last pass too
    with History(tmp_path, read_only=True) as history:
        assert [p["step"] for p in history.scalars("loss")] == list(range(51))


def test_a_failing_scalar_write_is_reported_and_the_summariser_goes_on(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    calls = [threading.Event(), threading.Event()]

    def full(self: History, points: list) -> None:  # type: ignore[type-arg]
        calls.pop(0).set()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(History, "append_scalars", full)
    monkeypatch.setattr(sampler, "SCALAR_WRITE_INTERVAL", 0.05)
    model = Net()
    first, second = calls
    with fwdtrace.serve(model, port=0, logdir=tmp_path) as server:
        fwdtrace.live.log_scalar("loss", 1.0)
        assert first.wait(60)
        fwdtrace.live.log_scalar("loss", 2.0)
        assert second.wait(60)  # the summariser lived through the first failure, and recorded it before this
        answer = request(server, "GET", "/api/scalars")[1]
        assert answer["write_error"] == "writing 1 scalar points failed: OSError: [Errno 28] No space left on device"
        assert answer["scalars"]["loss"]["values"] == [1.0, 2.0] and answer["lost"] == 0  # still served from memory
        server.sampler.arm("body.0.Linear", "forward")
        model(torch.ones(1, 8))
        assert [s["step"] for s in server.sampler.samples("body.0.Linear", "forward")] == [1]


BAD_LOGDIRS = [
    ("a file", lambda p: (p / "f").write_text("x") and p / "f", {},
     r"^History\(\) expected logdir as a directory \(new, empty, or a fwdtrace live run\), got '.*f', which is a file"),
    ("a folder of other files", lambda p: (p / "notes.txt").write_text("x") and p, {},
     r"^History\(\) expected logdir as a new or empty directory, or a fwdtrace live run \(holding history.h5\), "
     r"got '.*', which holds other files \(notes.txt\)"),
    ("under a file", lambda p: (p / "f").write_text("x") and p / "f" / "run", {},
     r"^History\(\) could not make the logdir '.*run'"),
    ("not HDF5", lambda p: (p / HISTORY_FILE).write_text("x") and p, {},
     r"^History\(\) could not open the history '.*history.h5'"),
    ("HDF5, not a history", lambda p: h5py.File(p / HISTORY_FILE, "w").close() or p, {},
     r"^History\(\) expected '.*history.h5' to be a fwdtrace live history"),
    ("missing, to reopen", lambda p: p / "nothing", {"read_only": True},
     r"^History\(\) expected logdir as the directory of a fwdtrace live run, got '.*nothing', which does not exist"),
    ("no history, to reopen", lambda p: p, {"read_only": True},
     r"^History\(\) expected logdir as the directory of a fwdtrace live run \(holding history.h5\), got .*, which has no"),
    ("retention", lambda p: p, {"retention": 0}, r"^History\(\) expected retention as a positive int .*, got int 0"),
    ("not a path", lambda p: 3, {}, r"^History\(\) expected logdir as a directory path \(str or Path\), got int"),
]


@pytest.mark.parametrize("make, kwargs, message", [b[1:] for b in BAD_LOGDIRS], ids=[b[0] for b in BAD_LOGDIRS])
def test_a_bad_logdir_says_what_was_expected(tmp_path: Path, make, kwargs: dict, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(FwdtraceError, match=message):
        History(make(tmp_path), **kwargs)


def test_a_reader_in_another_process_never_stops_the_writer_adding_series(tmp_path: Path) -> None:
    """``fwdtrace serve --logdir`` opened beside a running run: the writer's new series and later writes all land."""
    import os
    import subprocess
    import sys

    with History(tmp_path) as history:
        history.append_scalar("loss", 1.0, step=0, time=0.0)
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        reader = subprocess.Popen(
            [sys.executable, "-c", "import sys\nfrom fwdtrace.live.history import History\n"
             f"r = History({str(tmp_path)!r}, read_only=True)\nprint(r.scalar_names(), flush=True)\n"
             "sys.stdin.readline()\nprint(len(r.scalars('loss')), flush=True)\n"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert reader.stdout is not None and reader.stdout.readline().strip() == "['loss']"  # the file is open there
            for step in range(1, 6):
                history.append_scalar(f"new{step}", float(step), step=step, time=0.0)  # a new series each time
                history.append_scalar("loss", 1.0 / step, step=step, time=0.0)
                history.append("0.Linear", "forward", f"role{step}", step=step, time=0.0, stats={"mean": 1.0},
                               histogram=[1, 2], bin_edges=[0.0, 1.0, 2.0])
            out, _ = reader.communicate("\n", timeout=120)
        finally:
            if reader.poll() is None:
                reader.kill()
        assert out.strip() == "1"  # the reader still reads (the run as it was when it opened it)
        assert history.scalar_names() == ["loss"] + [f"new{s}" for s in range(1, 6)]
        assert [r["value"] for r in history.scalars("loss")] == [1.0 / max(s, 1) for s in range(6)]
        assert len(history.series()) == 5


# -- a reopened run is a file from elsewhere ------------------------------------------------------


def _finished_run(path: Path) -> Path:
    with History(path) as history:
        for step in range(3):
            history.append_scalar("loss", 1.0 / (step + 1), step=step, time=0.0)
            history.append("0.Linear", "forward", "output", step=step, time=0.0, stats={"mean": 1.0},
                           histogram=[1, 2], bin_edges=[0.0, 1.0, 2.0])
    return path / HISTORY_FILE


def _groups_run(path: Path) -> Path:
    """A finished run of the earlier layout, a group per series, as plain h5py writes it."""
    path.mkdir()
    with h5py.File(path / HISTORY_FILE, "w", libver="latest") as f:
        f.attrs["fwdtrace_live_history"], f.attrs["retention"] = 1, 100
        series, scalars = f.create_group("series").create_group("0"), f.create_group("scalars").create_group("0")
        series.attrs.update({"key": "0.Linear", "kind": "forward", "role": "output", "bins": 2})
        meta = np.array([(s, s, 0, 0, 0.0) for s in range(3)], dtype=[("seq", "<i8"), ("step", "<i8"), ("call", "<i8"),
                                                                   ("index", "<i8"), ("time", "<f8")])
        series.create_dataset("meta", data=meta, maxshape=(100,), chunks=(64,))
        values = np.zeros((3, 10 + 2 * 2 + 1))
        values[:, 1], values[:, 10:12], values[:, 12:] = 1.0, [1, 2], [0.0, 1.0, 2.0]
        series.create_dataset("values", data=values, maxshape=(100, 15), chunks=(64, 15))
        scalars.attrs["name"] = "loss"
        points = np.array([(s, s, 0.0, 1.0 / (s + 1)) for s in range(3)],
                          dtype=[("seq", "<i8"), ("step", "<i8"), ("time", "<f8"), ("value", "<f8")])
        scalars.create_dataset("meta", data=points, maxshape=(100,), chunks=(64,))
    return path / HISTORY_FILE


def test_a_run_of_the_earlier_layout_is_read_and_not_continued(tmp_path: Path) -> None:
    _groups_run(tmp_path / "run")
    with History(tmp_path / "run", read_only=True) as old:
        assert old.scalars("loss") == [{"step": s, "time": 0.0, "value": 1.0 / (s + 1)} for s in range(3)]
        assert [(r["step"], r["mean"], r["histogram"], r["bin_edges"]) for r in old.rows("0.Linear", "forward", "output")
                ] == [(s, 1.0, [1, 2], [0.0, 1.0, 2.0]) for s in range(3)]
    with pytest.raises(FwdtraceError, match=r"^History\(\) cannot continue the run in .*written by an earlier fwdtrace"):
        History(tmp_path / "run")


def _replace(file: h5py.File, name: str, **kwargs: object) -> None:
    old = file[name]
    dtype, shape = old.dtype, old.shape
    del file[name]
    file.create_dataset(name, dtype=dtype, shape=kwargs.pop("shape", shape), **kwargs)


def _external_storage(file: h5py.File, outside: Path) -> None:
    if "scalars" in file:
        _replace(file, "scalars/0/meta", external=[(str(outside), 0, 3 * 32)])
    else:
        _replace(file, "names", external=[(str(outside), 0, file["names"].shape[0])])


def _external_link(file: h5py.File, outside: Path) -> None:
    name = "scalars/0" if "scalars" in file else "catalog"
    del file[name]
    file[name] = h5py.ExternalLink(str(outside), "/")


def _soft_link(file: h5py.File, outside: Path) -> None:
    name, to = ("series/0/values", "/scalars/0/meta") if "series" in file else ("series_values", "/scalar_meta")
    del file[name]
    file[name] = h5py.SoftLink(to)


def _huge(file: h5py.File, outside: Path) -> None:
    if "scalars" in file:
        file.attrs["retention"] = 4_000_000
        _replace(file, "scalars/0/meta", shape=(4_000_000,), maxshape=(4_000_000,), chunks=(256,))
    else:
        _replace(file, "catalog", shape=(4_000_000,), maxshape=(None,), chunks=(256,))


def _huge_chunks(file: h5py.File, outside: Path) -> None:  # reading a slot's first chunk would take all its rows
    _replace(file, "scalar_meta", maxshape=(None, 10_000), chunks=(1, 10_000))


def _wide(file: h5py.File, outside: Path) -> None:  # a series declaring more bins than its table holds
    catalog = file["catalog"][:]
    catalog["bins"][catalog["table"] == 0] = 1000
    file["catalog"][:] = catalog


def _wrong_layout(file: h5py.File, outside: Path) -> None:
    if "series" in file:
        del file["series/0"].attrs["kind"]
    else:
        file["names"][:] = np.frombuffer(b"{" * file["names"].shape[0], np.uint8)


CRAFTED = [
    (_external_storage, "keeps its data in external files"),
    (_external_link, "is an external link to"),
    (_soft_link, "is a SoftLink"),
    (_huge, r"declares \(4000000,\) \(1[23][28]000000 bytes\) but the file stores"),
    (_wrong_layout, "lacks the text attributes key, kind, role|where catalog entry 0 is not named as \\[name\\] in JSON"),
]
CRAFTED_TABLES = [
    (_huge_chunks, r"where 'scalar_meta' is \(64, 10000\) in chunks \(1, 10000\), not the layout written"),
    (_wide, "where catalog entry 1 has 1000 bins, more than its table holds"),
]


@pytest.mark.parametrize(("craft", "message", "layout"), [(*c, layout) for c in CRAFTED for layout in ("tables", "groups")]
                         + [(*c, "tables") for c in CRAFTED_TABLES],
                         ids=[f"{c.__name__.strip('_')}-{layout}" for c, _ in CRAFTED for layout in ("tables", "groups")]
                         + [f"{c.__name__.strip('_')}-tables" for c, _ in CRAFTED_TABLES])
def test_a_crafted_run_is_refused_with_one_error_naming_it(tmp_path: Path, craft: object, message: str,
                                                           layout: str) -> None:
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"SECRET" * 100)
    path = _finished_run(tmp_path / "run") if layout == "tables" else _groups_run(tmp_path / "run")
    with h5py.File(path, "a") as file:
        craft(file, outside)  # type: ignore[operator]
    with pytest.raises(FwdtraceError, match=rf"^reopen\(\) expected a fwdtrace live run, got '{re.escape(str(path))}', .*({message})"):
        History(tmp_path / "run", read_only=True, caller="reopen()")


def test_a_crafted_seq_makes_no_read_take_more_rows_than_the_file_stores(tmp_path: Path) -> None:
    """A slot whose one stored row claims ``seq`` 2**40, in a run of 4 M rows per series: a read takes the stored rows."""
    import tracemalloc

    with History(tmp_path, retention=1 << 22) as history:
        history.append_scalar("loss", 1.0, step=0, time=0.0)
    with h5py.File(tmp_path / HISTORY_FILE, "a", libver="latest") as f:
        row = f["scalar_meta"][0, 0]
        row["seq"] = 1 << 40
        f["scalar_meta"][0, 0] = row
    with History(tmp_path, read_only=True) as crafted:
        tracemalloc.start()
        try:
            points = crafted.scalars("loss")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert points == [{"step": 0, "time": 0.0, "value": 1.0}]
        assert peak < 1 << 20  # 256 rows of 32 bytes, not 4 M of them (134 MB)


def test_a_symlinked_history_is_not_followed(tmp_path: Path) -> None:
    real = _finished_run(tmp_path / "real")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / HISTORY_FILE).symlink_to(real)
    with pytest.raises(FwdtraceError, match=r"^reopen\(\) could not open the history .*is a symbolic link, not followed"):
        History(tmp_path / "run", read_only=True, caller="reopen()")


def test_damaged_copies_of_a_finished_run_open_or_raise_one_error(tmp_path: Path) -> None:
    data = _finished_run(tmp_path / "run").read_bytes()
    reference = History(tmp_path / "run", read_only=True)
    expected = reference.scalars("loss")
    reference.close()
    opened = refused = 0
    for offset in range(0, len(data), max(1, len(data) // 40)):  # one flipped byte at each of 40 places
        damaged = bytearray(data)
        damaged[offset] ^= 0xFF
        run = tmp_path / f"damaged{offset}"
        run.mkdir()
        (run / HISTORY_FILE).write_bytes(bytes(damaged))
        try:
            history = History(run, read_only=True)
        except FwdtraceError as e:  # never a raw error, never a hang (no SWMR back-off on a finished run)
            assert str(run / HISTORY_FILE) in str(e)
            refused += 1
            continue
        history.close()
        opened += 1
    assert opened + refused >= 40 and refused >= 1
    assert expected == [{"step": s, "time": 0.0, "value": 1.0 / (s + 1)} for s in range(3)]


@pytest.mark.parametrize("name", ["keys.json", "graph.json"])
def test_the_run_files_beside_the_history_are_not_followed_through_links(tmp_path: Path, name: str) -> None:
    _finished_run(tmp_path / "run")
    secret = tmp_path / "secret.json"
    secret.write_text('[{"key": "SECRET"}]')
    (tmp_path / "run" / name).symlink_to(secret)
    history = History(tmp_path / "run", read_only=True, caller="reopen()")
    with pytest.raises(FwdtraceError, match=rf"^reopen\(\) expected '.*{name}' to be the run's {name}, got a symbolic link"):
        history.keys() if name == "keys.json" else history.graph_json()
    history.close()


def test_serve_refuses_retention_when_reopening_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fwdtrace.cli import main

    _finished_run(tmp_path / "run")
    assert main(["serve", "--logdir", str(tmp_path / "run"), "--retention", "5", "--port", "0"]) == 2
    assert capsys.readouterr().err.startswith("fwdtrace serve: error: fwdtrace serve expected --retention only with a "
                                              "model factory (it bounds a new history)")


def test_scalar_windows_of_many_names_come_in_bounded_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fwdtrace.live import server as live_server

    monkeypatch.setattr(live_server, "MAX_POINTS", 20)  # 200 names at limit=10000 would be 2 M points in one answer
    with fwdtrace.serve(Net(), port=0) as server:
        names = [f"s{i:02d}" for i in range(7)]
        for step in range(5):
            for name in names:
                fwdtrace.live.log_scalar(name, float(step), step=step)
        seen: dict[str, list[int]] = {}
        offset: int | None = 0
        pages = 0
        while offset is not None:
            status, answer = request(server, "GET", f"/api/scalars?before=100&limit=6&offset={offset}")
            assert status == 200 and len(answer["scalars"]) <= 3 and answer["names"] == names  # 20 // 6 names a page
            seen.update({n: c["steps"] for n, c in answer["scalars"].items()})
            offset, pages = answer["next_offset"], pages + 1
        assert pages == 3 and seen == {n: [0, 1, 2, 3, 4] for n in names}
        assert request(server, "GET", "/api/scalars?before=1&offset=-1")[0] == 400


def test_a_new_series_costs_the_same_with_200_series_as_with_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted in HDF5 object lookups (not time): re-opening every series at each new one grew with their number."""
    lookups = [0]
    getitem = h5py.Group.__getitem__

    def counting(self: h5py.Group, name: object) -> object:
        lookups[0] += 1
        return getitem(self, name)

    with History(tmp_path) as history:
        def new_series(i: int) -> int:
            lookups[0] = 0
            history.append_scalar(f"s{i}", 1.0, step=0, time=0.0)
            history.append("0.Linear", "forward", f"r{i}", step=0, time=0.0, stats={}, histogram=[1], bin_edges=[0.0, 1.0])
            return lookups[0]

        new_series(0)
        monkeypatch.setattr(h5py.Group, "__getitem__", counting)
        with_two = new_series(1)
        for i in range(2, 200):
            new_series(i)
        assert new_series(200) == with_two
        assert [p["value"] for p in history.scalars("s0")] == [1.0] and len(history.series()) == 201


HDF5_CALLS = [(h5py.File, "__init__"), (h5py.File, "close"), (h5py.File, "flush"), (h5py.Group, "__getitem__"),
              (h5py.Group, "create_group"), (h5py.Group, "create_dataset"), (h5py.Dataset, "__getitem__"),
              (h5py.Dataset, "__setitem__"), (h5py.Dataset, "resize")]


def _record_hdf5_calls(monkeypatch: pytest.MonkeyPatch, calls: list[tuple[str, threading.Thread]]) -> None:
    """Append ``(call, thread)`` to ``calls`` for every h5py call of :data:`HDF5_CALLS`, as it is made."""
    def recording(name: str, method: object) -> object:
        def call(*args: object, **kwargs: object) -> object:
            calls.append((name, threading.current_thread()))
            return method(*args, **kwargs)  # type: ignore[operator]
        return call

    for cls, name in HDF5_CALLS:
        monkeypatch.setattr(cls, name, recording(f"{cls.__name__}.{name}", getattr(cls, name)))


def test_a_new_series_never_reopens_the_file_and_costs_the_same_hdf5_calls_at_200_series_as_at_2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted in h5py calls (not time): adding a series used to close the file and open it again each time."""
    calls: list[tuple[str, threading.Thread]] = []
    with History(tmp_path) as history:
        def new_series(i: int) -> list[str]:
            calls.clear()
            history.append_scalar(f"s{i}", float(i), step=i, time=0.0)
            history.append("0.Linear", "forward", f"r{i}", step=i, time=0.0, stats={"mean": float(i)}, histogram=[i, 1],
                           bin_edges=[0.0, 1.0, 2.0])
            return sorted(name for name, _ in calls)

        new_series(0)
        _record_hdf5_calls(monkeypatch, calls)
        with_two = new_series(1)
        assert "File.__init__" not in with_two and "File.close" not in with_two and with_two.count("File.flush") == 2
        for i in range(2, 200):
            assert new_series(i) == with_two or i % 64 == 0  # a table grows by a batch of 64 slots in one resize
        assert new_series(200) == with_two
        monkeypatch.undo()
        assert [p["value"] for p in history.scalars("s7")] == [7.0] and len(history.series()) == 201
        assert [(r["step"], r["mean"], r["histogram"]) for r in history.rows("0.Linear", "forward", "r150")] == [
            (150, 150.0, [150, 1])]


def test_a_catalog_entry_grown_but_never_written_is_skipped_and_the_run_goes_on(tmp_path: Path) -> None:
    """A writer killed while it named a new series: the catalog grew, its entry reads as never written."""
    path = _finished_run(tmp_path)
    with h5py.File(path, "a", libver="latest") as f:
        f["catalog"].resize((f["catalog"].shape[0] + 1,))
        f["names"].resize((f["names"].shape[0] + 7,))
    with History(tmp_path, read_only=True) as killed:
        assert killed.scalar_names() == ["loss"] and [s["key"] for s in killed.series()] == ["0.Linear"]
    with History(tmp_path) as continued:
        continued.append_scalar("lr", 0.5, step=3, time=0.0)
        continued.append_scalar("loss", 0.25, step=3, time=0.0)
    with History(tmp_path, read_only=True) as finished:
        assert finished.scalar_names() == ["loss", "lr"] and finished.scalars("lr")[0]["value"] == 0.5
        assert [p["value"] for p in finished.scalars("loss")] == [1.0, 0.5, 1.0 / 3, 0.25]


def test_series_of_any_bins_share_the_tables_and_read_back_as_written(tmp_path: Path) -> None:
    """A series with more bins than any before widens ``series_values`` in place (SWMR mode), the others unchanged."""
    rng = np.random.default_rng(3)
    written = {bins: [_row(rng, step, bins=bins) for step in (1, 2)] for bins in (2, 200, 60)}
    with History(tmp_path, retention=4) as history:
        for step in range(2):
            for bins, rows in written.items():
                history.append(f"{bins}.Linear", "forward", "output", **rows[step])
    with h5py.File(tmp_path / HISTORY_FILE, "r") as plain:
        assert plain["series_values"].shape[2] == 10 + 2 * 200 + 1
    with History(tmp_path, read_only=True) as finished:
        for bins, rows in written.items():
            got = finished.rows(f"{bins}.Linear", "forward", "output")
            assert [(r["histogram"], r["bin_edges"], r["std"]) for r in got] == [
                (w["histogram"], w["bin_edges"], w["stats"]["std"]) for w in rows]


def test_the_history_is_written_from_the_summariser_only_never_the_training_thread(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, threading.Thread]] = []
    model = Net()
    with fwdtrace.serve(model, port=0, logdir=tmp_path) as server:
        summariser = server.sampler._worker
        _record_hdf5_calls(monkeypatch, calls)
        server.sampler.arm("*", "forward")
        for step in range(6):
            if step == 3:
                server.sampler.arm("*", "grad")  # new series while training
            loss = model(torch.randn(4, 8)).pow(2).mean()
            model.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
            fwdtrace.live.log_scalar(f"loss{step % 2}", loss)
        server.sampler.drain(60)
        fwdtrace.live.log_scalar("last", 1.0)
        server.sampler.close()  # its last pass writes the scalars, in the summariser
        monkeypatch.undo()
        roles = {(s["kind"], s["role"]) for s in server.history.series()}  # type: ignore[union-attr]
        assert ("grad", "grad_output") in roles and ("forward", "output") in roles
        assert server.history.scalar_names() == ["loss0", "loss1", "last"]  # type: ignore[union-attr]
    writes = {name for name, _ in calls}
    assert {"Dataset.__setitem__", "Dataset.resize", "File.flush"} <= writes  # new series were added meanwhile
    assert {thread.name for _, thread in calls} == {summariser.name}


FULL_DISK = """
import os, resource, signal, sys
from fwdtrace.live.history import History
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
history = History(sys.argv[1])
history.append_scalar("loss", 1.0, 0, 0.0)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(sys.argv[1] + "/history.h5") + 20_000, hard))
failed = []
for i in range(200):  # new series until the disk is full
    try:
        history.append_scalar(f"s{i}", 1.0, i, 0.0)
    except Exception as e:
        failed.append(type(e).__name__)
        if len(failed) == 3:
            break
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # space returns
history.append_scalar("after", 2.0, 1, 0.0)
history.append_scalar("loss", 3.0, 2, 0.0)
history.close()
print(",".join(sorted(set(failed))))
"""


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE stands in for a full disk")
def test_a_full_disk_ends_nothing_writes_resume_when_space_returns_and_the_run_reopens(tmp_path: Path) -> None:
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "FwdtraceError"  # the failed writes say so, as fwdtrace errors
    with History(tmp_path, read_only=True) as finished:  # by fwdtrace
        assert [p["value"] for p in finished.scalars("loss")] == [1.0, 3.0]
        assert finished.scalars("after")[0]["value"] == 2.0
    with h5py.File(tmp_path / HISTORY_FILE, "r") as plain:  # and by plain h5py
        assert "scalar_meta" in plain and "catalog" in plain


def test_serve_on_a_damaged_run_exits_naming_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fwdtrace.cli import main

    path = _finished_run(tmp_path / "run")
    data = bytearray(path.read_bytes())
    data[len(data) // 2:] = bytes(len(data) - len(data) // 2)  # the second half zeroed
    path.write_bytes(bytes(data))
    assert main(["serve", "--logdir", str(tmp_path / "run"), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fwdtrace serve: error: reopen() ") and str(path) in err and "Traceback" not in err


def test_a_run_whose_writer_was_killed_while_adding_a_series_reopens_read_only(tmp_path: Path) -> None:
    """Killed in the moment the file is out of SWMR mode (a series being added): flagged open for plain writing."""
    import os
    import subprocess

    path = _finished_run(tmp_path / "run")
    killed = f"import h5py, os\nf = h5py.File({str(path)!r}, 'a', libver='latest')\nf.flush()\nos._exit(0)\n"
    subprocess.run([sys.executable, "-c", killed], check=True, timeout=60, env={**os.environ})
    with pytest.raises(OSError, match="not already open for SWMR writing"):  # what plain h5py says
        h5py.File(path, "r", libver="latest", swmr=True)
    before = path.read_bytes()
    with History(tmp_path / "run", read_only=True) as finished:
        assert [p["value"] for p in finished.scalars("loss")] == [1.0, 0.5, 1.0 / 3]
        assert len(finished.rows("0.Linear", "forward", "output")) == 3
    assert path.read_bytes() == before  # read as it is, not repaired


def test_a_cyclic_graph_beside_the_history_is_refused_naming_its_file(tmp_path: Path) -> None:
    from fwdtrace.live import reopen

    _finished_run(tmp_path / "run")
    graph = fwdtrace.trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()), torch.ones(1, 2)).to_dict()
    graph["edges"].append({**graph["edges"][-1], "src": graph["edges"][-1]["dst"], "dst": graph["edges"][-1]["src"]})
    (tmp_path / "run" / "graph.json").write_text(json.dumps(graph))
    with pytest.raises(FwdtraceError, match=rf"^Graph\.from_dict expected a graph written by Graph\.to_json in "
                                            rf"'{re.escape(str(tmp_path / 'run' / 'graph.json'))}', got one whose "
                                            rf"edge {len(graph['edges']) - 1} has it runs from node"):
        reopen(tmp_path / "run", port=0)


def test_a_flipped_byte_says_the_history_is_damaged_and_what_still_reads(tmp_path: Path) -> None:
    graph = fwdtrace.trace(torch.nn.Linear(2, 2), torch.ones(1, 2))
    with History(tmp_path / "run") as history:
        history.append_scalar("loss", 1.0, step=0, time=0.0)
        history.write_run(graph.to_json(), [{"key": "Linear"}])
    data = (tmp_path / "run" / HISTORY_FILE).read_bytes()
    damaged_seen = 0
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    path = tmp_path / "copy" / HISTORY_FILE
    for offset in range(8, 4096, 29):  # the superblock and the object headers, all checksummed in this layout
        flipped = bytearray(data)
        flipped[offset] ^= 0xFF
        path.write_bytes(bytes(flipped))
        try:
            History(tmp_path / "copy", read_only=True, caller="reopen()").close()  # as reopen() opens it
            continue
        except FwdtraceError as e:
            message = str(e)
        assert str(path) in message, message
        if "checksum" in message:  # HDF5's words, now after what they mean
            damaged_seen += 1
            assert message.startswith(f"reopen() could not open the history {str(path)!r}: the file is damaged"), message
            assert "graph.json and keys.json beside it are separate files and still read" in message, message
            assert message.endswith("(HDF5 said: incorrect metadata checksum after all read attempts)"), message
    assert damaged_seen >= 3
    # What the message says still reads does: the graph beside the damaged history.
    assert Graph.from_json((tmp_path / "copy" / "graph.json").read_text()) == graph
