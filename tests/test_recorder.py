"""fwdtrace.Recorder: videos read back with imageio, workers that never block training nor outlive it.

Reference points are independent of the recorder: frames are counted by decoding the files,
worker liveness is read from /proc, drops are checked against the calls the test made.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import imageio.v2 as imageio
import numpy as np
import pytest
import torch
from torch import nn

import fwdtrace
from fwdtrace.errors import FwdtraceError
from fwdtrace.recorder import views
from fwdtrace.recorder.worker import VideoFile

ROOT = Path(__file__).parent.parent


def frames_of(path: Path) -> list[np.ndarray]:
    return imageio.mimread(path, memtest=False)


def changed(a: np.ndarray, b: np.ndarray) -> float:
    """The fraction of pixels that differ clearly (more than video compression noise)."""
    return float((np.abs(a.astype(int) - b.astype(int)).max(axis=-1) > 48).mean())


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 24), nn.Tanh(), nn.Linear(24, 6))


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie waiting for a reaper counts as exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


# -- one training loop, read back ------------------------------------------------------------------


def test_training_loop_writes_every_frame_and_pixels_follow_activations(tmp_path: Path) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)  # tiny: same input, (visibly) same activations
    xa, xb = torch.randn(16, 8), torch.randn(16, 8) * 3
    steps, every = 8, 2
    with fwdtrace.Recorder(tmp_path, every=every, timeout=20) as rec:
        assert rec.track(model, "2.Linear", kind="both") == ["2.Linear"]
        assert rec.track(model, nn.Tanh) == ["1.Tanh"]
        assert len(rec.processes) == 1 and rec.processes[0].is_alive()
        for step in range(steps):
            opt.zero_grad()
            model(xa if step < steps // 2 else xb).square().mean().backward()
            opt.step()
    paths = rec.stop()
    stems = ["1.Tanh.forward", "2.Linear.forward", "2.Linear.grad"]
    assert [p.name for p in paths] == sorted(f"{s}{ext}" for s in stems for ext in (".mp4", ".png"))
    assert not any(p.is_alive() for p in rec.processes)
    assert not model[2]._forward_hooks and not model[2]._backward_hooks  # hooks removed
    for stem in stems:
        frames = frames_of(tmp_path / f"{stem}.mp4")
        assert len(frames) == steps // every - rec.dropped_by[stem]
        assert frames[0].shape == (480, 640, 3)
    frames = frames_of(tmp_path / "1.Tanh.forward.mp4")
    assert rec.dropped == 0  # the queue (64) holds the whole run
    same_input = changed(frames[0], frames[1])  # steps 0 and 2: only the step label differs
    new_input = changed(frames[1], frames[2])  # steps 2 and 4: another input
    assert same_input < 0.01 and new_input > 0.05, (same_input, new_input)
    last = imageio.imread(tmp_path / "1.Tanh.forward.png")
    assert changed(last, frames[-1]) < changed(last, frames[0]) / 4  # the PNG is the last frame, uncompressed


def test_slow_worker_makes_the_queue_drop_not_the_step_wait(tmp_path: Path) -> None:
    model, x = mlp(), torch.randn(4, 8)
    delay, calls = 0.5, 30
    with fwdtrace.Recorder(tmp_path, queue_size=2, timeout=10, _worker_delay=delay) as rec:
        rec.track(model, "2.Linear")
        start = time.perf_counter()
        for _ in range(calls):
            model(x)
        elapsed = time.perf_counter() - start
    # Waiting on the worker would take about (calls - queue - in flight) * delay = 13 s.
    assert elapsed < calls * delay / 3, elapsed
    assert rec.dropped > 0
    assert len(frames_of(tmp_path / "2.Linear.forward.mp4")) == calls - rec.dropped


def test_exception_leaving_the_with_finalises_files(tmp_path: Path) -> None:
    model = mlp()
    with pytest.raises(RuntimeError, match="^boom"), fwdtrace.Recorder(tmp_path, timeout=10) as rec:
        rec.track(model, "0.Linear", name="student")
        for _ in range(3):
            model(torch.randn(2, 8))
        raise RuntimeError("boom")
    assert not any(p.is_alive() for p in rec.processes)
    assert len(frames_of(tmp_path / "student.0.Linear.forward.mp4")) == 3 - rec.dropped
    with pytest.raises(FwdtraceError, match=r"^Recorder.current\(\) expected a live Recorder, got none"):
        fwdtrace.Recorder.current()


# -- the parent interrupted or killed --------------------------------------------------------------

CHILD = """
import json, os, sys, time, torch, fwdtrace
from torch import nn

if __name__ == "__main__":
    out, mode = sys.argv[1], sys.argv[2]
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    rec = fwdtrace.Recorder(out, timeout=3)
    try:
        with rec:
            rec.track(model, ["0.Linear", "2.Linear"])
            calls = 0
            while True:
                model(torch.randn(8, 8))
                calls += 1
                if calls == 5:
                    while not all(os.path.exists(os.path.join(out, k + ".forward.mp4")) for k in ("0.Linear", "2.Linear")):
                        time.sleep(0.05)  # the worker is drawing; now interrupt or kill us
                    print(json.dumps({"workers": [p.pid for p in rec.processes]}), flush=True)
                time.sleep(0.02)
    except KeyboardInterrupt:
        print(json.dumps({"calls": calls, "dropped_by": rec.dropped_by, "paths": [str(p) for p in rec.stop()]}), flush=True)
"""


def start_child(tmp_path: Path) -> tuple[subprocess.Popen, list[int]]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(out), "run"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's job
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"the child exited early with {proc.wait()}"
    return proc, json.loads(line)["workers"]


@pytest.mark.skipif(not Path("/proc").exists(), reason="reads worker states from /proc")
def test_ctrl_c_in_the_parent_finalises_every_file(tmp_path: Path) -> None:
    proc, workers = start_child(tmp_path)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the whole group, workers included
    out, _ = proc.communicate(timeout=60)
    result = json.loads(out.strip().splitlines()[-1])
    assert proc.returncode == 0
    assert all(gone(pid) for pid in workers)
    for key in ("0.Linear", "2.Linear"):
        stem = f"{key}.forward"
        assert len(frames_of(tmp_path / "out" / f"{stem}.mp4")) == result["calls"] - result["dropped_by"][stem]


@pytest.mark.skipif(not Path("/proc").exists(), reason="reads worker states from /proc")
def test_kill_9_of_the_parent_leaves_no_worker_and_playable_files(tmp_path: Path) -> None:
    proc, workers = start_child(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    deadline = time.monotonic() + 3 + 10  # the child's timeout, and slack for a busy machine
    while not all(gone(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(pid) for pid in workers)
    for key in ("0.Linear", "2.Linear"):
        frames = frames_of(tmp_path / "out" / f"{key}.forward.mp4")
        assert len(frames) >= 1 and frames[0].shape == (480, 640, 3)
        assert (tmp_path / "out" / f"{key}.forward.png").exists()


# -- torch.distributed -----------------------------------------------------------------------------

RANKS = """
import sys, torch, torch.distributed as dist, fwdtrace
from torch import nn

if __name__ == "__main__":
    dist.init_process_group("gloo")
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    with fwdtrace.Recorder(sys.argv[1] + "/all", timeout=20) as every_rank, \\
            fwdtrace.Recorder(sys.argv[1] + "/one", timeout=20, ranks=[1]) as rank1:
        every_rank.track(model, "0.Linear")
        rank1.track(model, "1.ReLU")
        assert len(rank1.processes) == (1 if dist.get_rank() == 1 else 0)
        for _ in range(3):
            model(torch.randn(2, 4) + dist.get_rank())
    dist.barrier()
    dist.destroy_process_group()
"""


def test_torchrun_writes_one_set_of_files_per_rank(tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script), str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    names = sorted(p.name for p in (tmp_path / "all").iterdir())
    assert names == [f"0.Linear.forward.rank{r}{ext}" for r in (0, 1) for ext in (".mp4", ".png")]
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["1.ReLU.forward.rank1.mp4", "1.ReLU.forward.rank1.png"]
    assert len(frames_of(tmp_path / "all" / "0.Linear.forward.rank1.mp4")) == 3


# -- bad input -------------------------------------------------------------------------------------

BAD_RECORDERS = [
    ({"every": 0}, r"^Recorder expected every as a positive int, got 0"),
    ({"every": -2}, r"^Recorder expected every as a positive int, got -2"),
    ({"queue_size": 0}, r"^Recorder expected queue_size as a positive int"),
    ({"timeout": 0}, r"^Recorder expected timeout as a positive number, got 0"),
    ({"views": ("heatmap", "surface")}, r"^Recorder expected views among auto, heatmap, histogram, pca, got \['heatmap', 'surface'\]"),
    ({"ranks": [-1]}, r"^Recorder expected ranks as non-negative ints"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_RECORDERS)
def test_bad_settings_raise_at_the_call(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(FwdtraceError, match=message):
        fwdtrace.Recorder(tmp_path, **kwargs)


def test_unwritable_out_dir_raises(tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("")
    with pytest.raises(FwdtraceError, match=r"^Recorder expected a writable out_dir, got '.*a_file/videos'"):
        fwdtrace.Recorder(tmp_path / "a_file" / "videos")


BAD_TRACKS = [
    ({"keys": "0.Linaer"}, r"^Recorder.track\(\) expected a module key or path, a glob or a class of Sequential, got '0.Linaer', which matches no key or path; closest keys: '0.Linear'"),
    ({"keys": nn.Conv2d}, r"^Recorder.track\(\) expected a module key or path, a glob or a class of Sequential, got Conv2d, of which"),
    ({"kind": "weights"}, r"^Recorder.track\(\) expected kind as one of forward, grad, both, got 'weights'"),
]


@pytest.mark.parametrize(("kwargs", "message"), BAD_TRACKS)
def test_bad_track_raises_at_the_call(tmp_path: Path, kwargs: dict, message: str) -> None:
    rec = fwdtrace.Recorder(tmp_path, ranks=[])  # a rank that records nothing validates all the same, no worker
    with pytest.raises(FwdtraceError, match=message):
        rec.track(mlp(), **kwargs)
    rec.stop()


def test_inactive_rank_records_nothing_and_current_finds_the_live_recorder(tmp_path: Path) -> None:
    model = mlp()
    rec = fwdtrace.Recorder(tmp_path, ranks=[3])
    assert fwdtrace.Recorder.current() is rec
    assert rec.track(model) == ["0.Linear", "1.Tanh", "2.Linear"]  # None: every leaf
    model(torch.randn(2, 8))
    assert rec.processes == [] and not model[0]._forward_hooks
    assert rec.stop() == [] and list(tmp_path.iterdir()) == []
    with pytest.raises(FwdtraceError, match=r"^Recorder.track\(\) expected a running recorder, got one already stopped"):
        rec.track(model)


def test_two_models_with_one_key_need_a_name(tmp_path: Path) -> None:
    rec = fwdtrace.Recorder(tmp_path, ranks=[])
    rec.track(mlp(), "0.Linear")
    with pytest.raises(FwdtraceError, match=r"^Recorder.track\(\) expected keys not yet recorded from another model, got '0.Linear'"):
        rec.track(mlp(), "0.Linear")
    rec.stop()


def test_import_fwdtrace_does_not_import_the_drawing_libraries() -> None:
    code = "import fwdtrace, sys; fwdtrace.Recorder; print([m for m in ('matplotlib', 'imageio') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# -- views and files, in this process ----------------------------------------------------------------


def test_reduce_sends_small_numpy_arrays_and_the_full_range() -> None:
    t = torch.randn(4, 3, 600, 700)
    t[1, 2, 3, 4] = 100.0
    payload = views.reduce(t, ("heatmap", "histogram", "pca"))
    assert payload["range"] == (float(t.min()), 100.0) and payload["shape"] == [4, 3, 600, 700]
    assert all(isinstance(v, np.ndarray) for k, v in payload.items() if k in views.VIEWS)  # no tensor crosses
    assert np.array_equal(payload["heatmap"], t[0, 0, ::3, ::3].numpy())  # the first 2D slice, strided to <= 256
    assert payload["histogram"].size <= views.HISTOGRAM_MAX
    assert 256 < payload["pca"].shape[0] <= views.PCA_ROWS_MAX
    assert payload["pca"].shape[1] == 3  # pixels as points, channels as features


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_reduce_copies_cuda_tensors_to_cpu() -> None:
    t = torch.randn(32, 32, device="cuda")
    payload = views.reduce(t, ("auto",))
    assert np.array_equal(payload["heatmap"], t.cpu().numpy())


@pytest.mark.parametrize(
    ("view", "shape", "expected"),
    [("auto", (5, 7), "heatmap"), ("auto", (1, 5, 7), "heatmap"), ("auto", (2, 5, 7), "histogram"), ("auto", (9,), "histogram"), ("pca", (5, 7), "pca")],
)
def test_auto_view_by_shape(view: str, shape: tuple, expected: str) -> None:
    assert views.resolve_view(view, shape) == expected


@pytest.mark.parametrize("view", ["heatmap", "histogram", "pca"])
def test_each_view_draws_what_it_is_given(view: str) -> None:
    torch.manual_seed(0)
    a, b = torch.randn(64, 16), torch.randn(64, 16).cumsum(0)
    fa = views.draw_frame("k", views.reduce(a, (view,)), (view,))
    fa_again = views.draw_frame("k", views.reduce(a, (view,)), (view,))
    fb = views.draw_frame("k", views.reduce(b, (view,)), (view,))
    assert np.array_equal(fa, fa_again) and changed(fa, fb) > 0.01


@pytest.mark.parametrize("suffix", [".mp4", ".gif"])
def test_video_file_round_trip(tmp_path: Path, suffix: str) -> None:
    video = VideoFile(tmp_path / f"v{suffix}", fps=5)
    for value in (0, 128, 255):
        video.append(np.full((480, 640, 3), value, dtype=np.uint8))
    video.close()
    frames = frames_of(tmp_path / f"v{suffix}")
    assert [int(np.median(f)) // 32 for f in frames] == [0, 4, 7]
    assert imageio.imread(tmp_path / "v.png").shape == (480, 640, 3)
