"""fwdtrace.Recorder: videos read back with imageio, workers that never block training nor outlive it.

Reference points are independent of the recorder: frames are counted by decoding the files,
worker liveness is read from /proc, drops are checked against the calls the test made. Tests
wait on conditions with generous bounds (the suite runs on loaded cores), never on a time budget;
``timeout=`` of a recorder is such a bound too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from pathlib import Path

import imageio.v2 as imageio
import numpy as np
import pytest
import torch
import zoo
from torch import nn

import fwdtrace
from fwdtrace.errors import FwdtraceError
from fwdtrace.recorder import views
from fwdtrace.recorder.recorder import _Channel, file_stem
from fwdtrace.recorder.worker import VideoFile

ROOT = Path(__file__).parent.parent
CHECKOUT_ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}  # this fwdtrace
BOUND = 120.0  # seconds to wait for something that takes well under one on an idle machine
SLOW = 300.0  # a recorder's timeout: how long stop() may wait for a worker on a loaded machine


def frames_of(path: Path) -> list[np.ndarray]:
    return imageio.mimread(path, memtest=False)


def changed(a: np.ndarray, b: np.ndarray) -> float:
    """The fraction of pixels that differ clearly (more than video compression noise)."""
    return float((np.abs(a.astype(int) - b.astype(int)).max(axis=-1) > 48).mean())


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 24), nn.Tanh(), nn.Linear(24, 6))


def wait_until(condition: Callable[[], bool], what: str, bound: float = BOUND) -> None:
    deadline = time.monotonic() + bound
    while not condition():
        assert time.monotonic() < deadline, f"waited {bound} s for {what}"
        time.sleep(0.05)


def drawing(folder: Path, stem: str) -> bool:
    """Whether a worker has opened a video for ``stem`` in ``folder`` (under whatever name)."""
    return any(n.startswith(stem + ".") and n.endswith(".mp4") for n in os.listdir(folder))


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
    with fwdtrace.Recorder(tmp_path, every=every, timeout=SLOW) as rec:
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
    [worker] = rec.throughput()  # the worker's own count of what it drew, against the decoded files
    assert worker["frames"] == sum(len(frames_of(tmp_path / f"{stem}.mp4")) for stem in stems)
    assert worker["draw_s"] > 0 and worker["fps"] == worker["frames"] / worker["draw_s"]
    assert rec.finish_s is not None and f"workers finished {rec.finish_s:.1f} s after training" in repr(rec)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # the reference's, as expected
def test_grad_recording_works_beside_in_place_relu_and_sees_torch_full_backward_grads(tmp_path: Path) -> None:
    model, reference = zoo.inplace_mlp()
    seen, _ = zoo.full_backward_grads(reference)
    recorded: list[torch.Tensor] = []  # what the recorder hands its views, in the training thread
    batches = zoo.inplace_batches()
    with fwdtrace.Recorder(tmp_path, transform=lambda t: recorded.append(t.clone()) or t, timeout=SLOW) as rec:
        assert rec.track(model, list(zoo.INPLACE_KEYS), kind="grad") == list(zoo.INPLACE_KEYS)
        for x in batches:
            for m in (model, reference):
                zoo.sgd_step(m, m(x).square().mean())  # raised RuntimeError from BackwardHookFunction before
    rec.stop()
    want = [seen[key][step][1][0] for step in range(len(batches)) for key in zoo.INPLACE_KEYS]
    # the two keys' gradients are ready at one autograd node, in no set order: match them as a set
    assert len(recorded) == len(want)
    for w in want:
        match = next(i for i, got in enumerate(recorded) if torch.equal(got, w))
        del recorded[match]
    for key in zoo.INPLACE_KEYS:
        assert len(frames_of(tmp_path / f"{key}.grad.mp4")) == len(batches) - rec.dropped_by[f"{key}.grad"]


def test_a_stalled_worker_makes_the_queues_drop_not_the_step_wait(tmp_path: Path) -> None:
    model, x = mlp(), torch.randn(4, 8)
    calls, queue_size, stems = 30, 4, ["0.Linear.forward", "2.Linear.forward"]
    rec = fwdtrace.Recorder(tmp_path, queue_size=queue_size, timeout=SLOW)
    rec.track(model, ["0.Linear", "2.Linear"])
    worker = rec.processes[0]
    os.kill(worker.pid, signal.SIGSTOP)  # the worker draws nothing until SIGCONT
    try:
        training = threading.Thread(target=lambda: [model(x) for _ in range(calls)])
        training.start()
        training.join(BOUND)  # a step that waited for the stalled worker would never end
        assert not training.is_alive()
        dropped_while_stalled = rec.dropped_by
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    rec.stop()
    share = queue_size // len(stems)
    for stem in stems:  # each file keeps its share queued; at most IN_FLIGHT items reached the stalled worker
        assert dropped_while_stalled[stem] >= calls - share - _Channel.IN_FLIGHT
        assert len(frames_of(tmp_path / f"{stem}.mp4")) == calls - rec.dropped_by[stem]
        assert rec.stats()[stem]["recorded"] == calls


def test_exception_leaving_the_with_finalises_files(tmp_path: Path) -> None:
    model = mlp()
    with pytest.raises(RuntimeError, match="^boom"), fwdtrace.Recorder(tmp_path, timeout=SLOW) as rec:
        rec.track(model, "0.Linear", name="student")
        for _ in range(3):
            model(torch.randn(2, 8))
        raise RuntimeError("boom")
    assert not any(p.is_alive() for p in rec.processes)
    assert len(frames_of(tmp_path / "student.0.Linear.forward.mp4")) == 3 - rec.dropped
    with pytest.raises(FwdtraceError, match=r"^Recorder.current\(\) expected a live Recorder, got none"):
        fwdtrace.Recorder.current()


# -- fair drops: a worker that falls behind draws every file -----------------------------------------


class HandFedWorker:
    """Stands in for a worker process (its pipe, its credits and the process): it takes a frame
    only when the test hands it a credit, and keeps the file stem of every frame it got."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.credits = 0
        self.waiting = 0  # senders blocked in acquire()
        self.got: list[str] = []
        self.items: list[tuple] = []  # every frame sent, whole
        self.stopped = False
        self.pid, self.exitcode, self.name = -1, None, "hand-fed"

    def acquire(self, timeout: float | None = None) -> bool:
        with self.cond:
            self.waiting += 1
            self.cond.notify_all()
            taken = self.cond.wait_for(lambda: self.credits > 0, timeout)
            self.waiting -= 1
            if taken:
                self.credits -= 1
            return taken

    def give(self, n: int = 1) -> None:
        with self.cond:
            self.credits += n
            self.cond.notify_all()

    def send(self, item: tuple | None) -> None:
        with self.cond:
            if item is None:
                self.stopped = True
            else:
                self.got.append(item[0])
                self.items.append(item)
            self.cond.notify_all()

    def settle(self, frames: int) -> None:
        """Wait until ``frames`` frames arrived and the sender waits for the next credit."""
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.got) == frames and self.waiting and not self.credits, BOUND)

    def close(self) -> None:
        pass

    def report(self, deadline: float) -> None:
        return None

    def is_alive(self) -> bool:
        return not self.stopped

    def join(self, timeout: float | None = None) -> None:
        pass

    def terminate(self) -> None:
        self.stopped = True


def test_a_worker_that_falls_behind_draws_every_file_in_turn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The worker takes one frame per training step, at the same point of every step: one shared
    # drop-oldest queue then always hands it the same file (issue 24: 735 frames against 3).
    worker = HandFedWorker()
    monkeypatch.setattr(fwdtrace.Recorder, "_spawn", lambda self, index: (worker, worker, worker))
    model, x, steps = mlp(), torch.randn(4, 8), 30
    calls: Counter[str] = Counter()  # the reference: plain forward hooks
    for key in ("0", "1", "2"):
        model.get_submodule(key).register_forward_hook(lambda m, i, o, key=key: calls.update([key]))
    rec = fwdtrace.Recorder(tmp_path, queue_size=6, timeout=SLOW)
    rec.track(model, None)
    stems = ["0.Linear.forward", "1.Tanh.forward", "2.Linear.forward"]
    for step in range(steps):
        model(x)
        worker.give()
        worker.settle(step + 1)
    while_behind = Counter(worker.got)
    assert sorted(while_behind) == stems and max(while_behind.values()) - min(while_behind.values()) <= 1
    worker.give(1000)  # now it keeps up: stop() sends what is queued
    rec.stop()
    drained = Counter(worker.got) - while_behind
    stats = rec.stats()
    for stem, key in zip(stems, ("0", "1", "2"), strict=True):
        assert drained[stem] <= 6 // len(stems)  # each file kept its share queued, no more
        assert stats[stem]["recorded"] == calls[key] == steps
        assert stats[stem]["sent"] == worker.got.count(stem)
        assert stats[stem]["sent"] + stats[stem]["dropped"] == steps
        assert rec.dropped_by[stem] == stats[stem]["dropped"] > 0
    assert rec.dropped == sum(s["dropped"] for s in stats.values())
    assert f"dropped={rec.dropped})" in repr(rec)


# -- a worker that dies ------------------------------------------------------------------------------


@pytest.mark.skipif(not Path("/proc").exists(), reason="reads worker states from /proc")
def test_a_worker_killed_with_kill_9_is_reported_once_and_replaced(tmp_path: Path) -> None:
    model, x = mlp(), torch.randn(4, 8)
    stems = ["0.Linear.forward", "2.Linear.forward"]
    with pytest.warns(RuntimeWarning) as caught:
        rec = fwdtrace.Recorder(tmp_path, timeout=SLOW)
        rec.track(model, ["0.Linear", "2.Linear"])
        first = rec.processes[0]
        model(x)
        wait_until(lambda: all(drawing(tmp_path, stem) for stem in stems), "the worker to draw")
        os.kill(first.pid, signal.SIGKILL)
        wait_until(lambda: gone(first.pid), "the worker to die")
        wait_until(lambda: rec.processes[0].pid != first.pid, "the recorder to notice")
        assert "running, 1 worker death(s)" in repr(rec)
        for _ in range(3):
            model(x)
        paths = rec.stop()
    deaths = [str(w.message) for w in caught if "died" in str(w.message)]
    assert len(deaths) == 1 and f"(pid {first.pid}) died (killed by SIGKILL); restarted it" in deaths[0]
    assert all(stem in deaths[0] for stem in stems)
    assert any(str(w.message).startswith("Recorder.stop(): files that lost frames to a dead worker") for w in caught)
    assert not any(p.is_alive() for p in rec.processes)
    for stem in stems:  # the new worker wrote the frames it was sent
        assert rec.stats()[stem]["worker_deaths"] == 1 and not rec.stats()[stem]["failed"]
        assert tmp_path / f"{stem}.mp4" in paths and 1 <= len(frames_of(tmp_path / f"{stem}.mp4")) <= rec.stats()[stem]["sent"]
    assert not [name for name in os.listdir(tmp_path) if ".partial-" in name]  # the killed worker's unfinished videos went


@pytest.mark.skipif(not Path("/proc").exists(), reason="reads worker states from /proc")
def test_a_worker_that_cannot_be_restarted_marks_its_files_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_Channel, "RESTARTS", 0)
    model, x = mlp(), torch.randn(4, 8)
    with pytest.warns(RuntimeWarning) as caught:
        rec = fwdtrace.Recorder(tmp_path, timeout=SLOW)
        rec.track(model, "0.Linear")
        first = rec.processes[0]
        os.kill(first.pid, signal.SIGKILL)
        wait_until(lambda: "failed: 0.Linear.forward" in repr(rec), "the recorder to notice")
        for _ in range(5):
            model(x)
        assert rec.stop() == []
    [death] = [str(w.message) for w in caught if "died" in str(w.message)]
    assert "its files are marked failed" in death and "0.Linear.forward" in death
    stats = rec.stats()["0.Linear.forward"]
    assert stats["failed"] and stats["recorded"] == 5 and stats["dropped"] == 5 - stats["sent"] == 5


# -- files: whole when they appear, never through a link, always inside out_dir -------------------


def test_a_video_appears_at_its_name_only_when_finished(tmp_path: Path) -> None:
    model, x = mlp(), torch.randn(4, 8)
    with fwdtrace.Recorder(tmp_path, timeout=SLOW) as rec:
        rec.track(model, "0.Linear")
        model(x)
        wait_until(lambda: drawing(tmp_path, "0.Linear.forward"), "the worker to draw")
        [partial] = os.listdir(tmp_path)  # no final name while recording
        assert partial.startswith("0.Linear.forward.partial-") and partial.endswith(".mp4")
        model(x)
    assert sorted(os.listdir(tmp_path)) == ["0.Linear.forward.mp4", "0.Linear.forward.png"]
    assert len(frames_of(tmp_path / "0.Linear.forward.mp4")) == 2 - rec.dropped


def test_a_symlink_at_a_file_name_is_replaced_not_written_through(tmp_path: Path) -> None:
    out, model = tmp_path / "out", mlp()
    out.mkdir()
    victims = {ext: tmp_path / f"victim{ext}" for ext in (".mp4", ".png")}
    for ext, victim in victims.items():
        victim.write_bytes(b"keep me")
        (out / f"0.Linear.forward{ext}").symlink_to(victim)
    with fwdtrace.Recorder(out, timeout=SLOW) as rec:
        rec.track(model, "0.Linear")
        for _ in range(3):
            model(torch.randn(4, 8))
    assert all(victim.read_bytes() == b"keep me" for victim in victims.values())
    assert rec.stop() == [out / "0.Linear.forward.mp4", out / "0.Linear.forward.png"]
    assert not any(p.is_symlink() for p in rec.stop())
    assert len(frames_of(out / "0.Linear.forward.mp4")) == 3 - rec.dropped


def test_keys_with_slashes_write_inside_out_dir_under_distinct_names(tmp_path: Path) -> None:
    out, outside = tmp_path / "out", tmp_path / "outside"
    outside.mkdir()
    names = [str(outside / "x"), "a/b", "a%2Fb", "a_b"]  # module names torch accepts
    model = nn.Sequential(OrderedDict((name, nn.Linear(2, 2)) for name in names))
    with fwdtrace.Recorder(out, timeout=SLOW) as rec:
        keys = rec.track(model, None)
        for _ in range(2):
            model(torch.randn(3, 2))
    assert keys == [f"{name}.Linear" for name in names]
    assert list(outside.iterdir()) == []
    files = sorted(out.iterdir())
    assert len(files) == 2 * len(names) and all(f.parent == out and f.is_file() for f in files)
    assert sorted(s["key"] for s in rec.stats().values()) == sorted(keys)
    for stem in rec.stats():
        assert not stem.startswith(".") and "/" not in stem
        assert len(frames_of(out / f"{stem}.mp4")) == 2 - rec.dropped_by[stem]


FILE_STEMS = [
    ("blocks.0.attn.Linear.forward", "blocks.0.attn.Linear.forward"),  # keys read as themselves
    ("/etc/x.Linear.forward", "%2Fetc%2Fx.Linear.forward"),
    ("a%2Fb.Linear.forward", "a%252Fb.Linear.forward"),  # % escaped too: distinct from "a/b"
    ("...0.Linear.forward", "%2E..0.Linear.forward"),  # never hidden, never "." or ".."
    ("é ü.forward", "%C3%A9%20%C3%BC.forward"),
]


@pytest.mark.parametrize(("text", "stem"), FILE_STEMS)
def test_file_stem(text: str, stem: str) -> None:
    assert file_stem(text) == stem


def test_file_stem_of_long_keys_is_short_and_distinct() -> None:
    a, b = "x" * 300 + ".a", "x" * 300 + ".b"
    assert len(file_stem(a)) == 160 and file_stem(a) != file_stem(b) and file_stem(a) == file_stem(a)


# -- the parent interrupted or killed --------------------------------------------------------------

CHILD = """
import json, os, sys, time, torch, fwdtrace
from torch import nn

if __name__ == "__main__":
    out, mode = sys.argv[1], sys.argv[2]
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    rec = fwdtrace.Recorder(out, timeout=30)
    try:
        with rec:
            rec.track(model, ["0.Linear", "2.Linear"])
            calls = 0
            while True:
                model(torch.randn(8, 8))
                calls += 1
                if calls == 5:
                    deadline = time.monotonic() + 120
                    while not all(any(n.startswith(k + ".forward.partial-") for n in os.listdir(out)) for k in ("0.Linear", "2.Linear")):
                        assert time.monotonic() < deadline, "no worker drew"
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
        env=CHECKOUT_ENV,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"the child exited early with {proc.wait()}"
    return proc, json.loads(line)["workers"]


@pytest.mark.skipif(not Path("/proc").exists(), reason="reads worker states from /proc")
def test_ctrl_c_in_the_parent_finalises_every_file(tmp_path: Path) -> None:
    proc, workers = start_child(tmp_path)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the whole group, workers included
    out, _ = proc.communicate(timeout=2 * SLOW)
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
    wait_until(lambda: all(gone(pid) for pid in workers), "the workers to see their parent gone")
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
    with fwdtrace.Recorder(sys.argv[1] + "/all", timeout=300) as every_rank, \\
            fwdtrace.Recorder(sys.argv[1] + "/one", timeout=300, ranks=[1]) as rank1:
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
    env = {**CHECKOUT_ENV, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(script), str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
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
    ({"bins": 0}, r"^Recorder expected bins as a positive int or a list of 2\+ increasing finite edges, got 0"),
    ({"bins": [1.0, 0.5]}, r"^Recorder expected bins as a positive int or a list of 2\+ increasing finite edges, got \[1.0, 0.5\]"),
    ({"transform": "abs"}, r"^Recorder expected transform as a callable \(tensor\), got str$"),
    # checked here, not in the recording step that would call it
    ({"transform": lambda t, scale: t * scale}, r"^Recorder expected transform as a callable \(tensor\), got function <lambda>\(t, scale\)$"),
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
    ({"kind": "weights"}, r"^Recorder.track\(\) expected kind as one of forward, grad, both, weight, weight_grad \(or a list of them\), got 'weights'"),
    ({"kind": ["forward", 3]}, r"^Recorder.track\(\) expected kind as one of .*, got \['forward', 3\]"),
    ({"kind": []}, r"^Recorder.track\(\) expected kind as one of .*, got \[\]"),
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


def test_the_worker_never_imports_torch_and_training_never_imports_the_drawing_libraries() -> None:
    # A worker (python -m fwdtrace.recorder) only draws: what it imports, without torch (seconds and
    # hundreds of MB per worker); then the training side, without matplotlib or imageio.
    code = ("import sys, fwdtrace.recorder.worker, fwdtrace.recorder.views; "
            "print('torch' in sys.modules); import fwdtrace; fwdtrace.Recorder; "
            "print('torch' in sys.modules, [m for m in ('matplotlib', 'imageio') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["False", "True []"]


# -- views and files, in this process ----------------------------------------------------------------


def test_reduce_sends_small_numpy_arrays_and_the_full_range() -> None:
    t = torch.randn(4, 3, 600, 700)
    t[1, 2, 3, 4] = 100.0
    payload = views.reduce(t, ("heatmap", "histogram", "pca"))
    assert payload["range"] == (float(t.min()), 100.0) and payload["shape"] == [4, 3, 600, 700]
    assert all(isinstance(v, np.ndarray) for k, v in payload.items() if k in views.VIEWS)  # no tensor crosses
    assert np.array_equal(payload["heatmap"], t[0, 0, ::3, ::3].numpy())  # the first 2D slice, strided to <= 256
    assert payload["histogram"].size == fwdtrace.statistics.width(views.HISTOGRAM_BINS)  # the summary, not values
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


# -- what frames show: parameters, which gradient, steady histogram axes ------------------------------


def test_weight_and_weight_grad_are_each_parameter_after_backward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    worker = HandFedWorker()
    worker.give(10_000)
    monkeypatch.setattr(fwdtrace.Recorder, "_spawn", lambda self, index: (worker, worker, worker))
    torch.manual_seed(0)
    model = mlp()
    twin = mlp()  # the reference: the same model trained alongside, read after each backward by hand
    opt, twin_opt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(twin.parameters(), lr=0.5)
    expected: dict[str, list[tuple[float, float]]] = {}
    rec = fwdtrace.Recorder(tmp_path, timeout=SLOW)
    assert rec.track(model, "2.Linear", kind=["weight", "weight_grad", "grad"]) == ["2.Linear"]
    for _ in range(3):
        x = torch.randn(4, 8)
        for m, o in ((model, opt), (twin, twin_opt)):
            o.zero_grad()
            m(x).square().mean().backward()
        for name, p in twin[2].named_parameters():
            p = p.detach()
            expected.setdefault(f"2.Linear.{name}.weight", []).append((float(p.min()), float(p.max())))
            grad = twin[2].get_parameter(name).grad
            expected.setdefault(f"2.Linear.{name}.weight_grad", []).append((float(grad.min()), float(grad.max())))
        opt.step()
        twin_opt.step()
    rec.stop()
    assert set(rec.stats()) == {*expected, "2.Linear.grad"}
    for stem, ranges in expected.items():
        items = [item for item in worker.items if item[0] == stem]
        assert [item[2]["range"] for item in items] == ranges, stem  # before each optimizer step, as the twin's
        label = "weight_grad (.grad)" if stem.endswith("_grad") else "weight"
        assert [item[1] for item in items] == [f"{stem.rsplit('.', 1)[0]}  {label}  step {s}" for s in range(3)]
    grads = [item[1] for item in worker.items if item[0] == "2.Linear.grad"]
    assert grads == [f"2.Linear  grad_output  step {s}" for s in range(3)]  # says which gradient of the layer
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())  # hooks removed


def test_a_layer_with_several_outputs_says_which_one_is_drawn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    worker = HandFedWorker()
    worker.give(10_000)
    monkeypatch.setattr(fwdtrace.Recorder, "_spawn", lambda self, index: (worker, worker, worker))
    lstm = nn.LSTM(4, 3)
    rec = fwdtrace.Recorder(tmp_path, timeout=SLOW)
    rec.track(lstm, "LSTM")
    out = lstm(torch.randn(5, 2, 4))[0].detach()
    rec.stop()
    [item] = worker.items
    assert item[1] == "LSTM  output 0 of 3  step 0" and item[2]["range"] == (float(out.min()), float(out.max()))


def histogram_limits(canvas: views.FrameCanvas, tensor: torch.Tensor) -> tuple[tuple[float, float], np.ndarray]:
    canvas.draw("k", views.reduce(tensor, ("histogram",), canvas.bins), ("histogram",))
    panel = canvas.panels["histogram"]
    return tuple(panel.ax.get_xlim()), panel.artist.get_data().edges


def test_histogram_axes_hold_while_a_signal_grows_inside_them_and_double_when_it_leaves() -> None:
    torch.manual_seed(0)
    canvas = views.FrameCanvas(bins=32)
    base = torch.randn(2, 500)
    first, edges = histogram_limits(canvas, base)
    assert first[0] <= float(base.min()) and float(base.max()) < first[1]
    for scale in (0.5, 0.8, 1.0):  # inside the first frame's bins: the axes hold still
        limits, same = histogram_limits(canvas, base * scale)
        assert limits == first and np.array_equal(same, edges)
    grown = base * 3 + 2  # the drift the issue saw: -0.86..0.55, then -1.73..5.11
    limits, new_edges = histogram_limits(canvas, grown)
    assert limits[0] <= float(grown.min()) and float(grown.max()) < limits[1]
    width, old_width = new_edges[1] - new_edges[0], edges[1] - edges[0]
    assert np.log2(width / old_width) >= 1 and float(np.log2(width / old_width)).is_integer()
    assert histogram_limits(canvas, base)[0] == limits  # back inside: stays on the grown axes
    counts = canvas.panels["histogram"].artist.get_data().values
    assert counts.tolist() == np.histogram(base.numpy(), bins=new_edges)[0].tolist()


def test_fixed_bins_keep_the_axes_and_say_what_fell_outside() -> None:
    canvas = views.FrameCanvas(bins=[-1.0, 0.0, 1.0])
    limits, edges = histogram_limits(canvas, torch.tensor([[-0.5, 0.5, 0.7, 3.0]]))
    assert limits == (-1.0, 1.0) and edges.tolist() == [-1.0, 0.0, 1.0]
    assert canvas.panels["histogram"].artist.get_data().values.tolist() == [1, 2]
    assert canvas.panels["histogram"].ax.get_title() == "4 values, 1 outside the bins"


NO_GUARD = """
import sys, torch, fwdtrace
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU())
rec = fwdtrace.Recorder(sys.argv[1], timeout=300)
rec.track(model, "0.Linear")
for _ in range(3):
    model(torch.randn(2, 4))
print(len(rec.stop()), rec.dropped)
"""


def test_a_script_without_a_main_guard_records_and_exits_0(tmp_path: Path) -> None:
    # multiprocessing's spawn re-imported this script in the worker, which made a Recorder while
    # bootstrapping and failed with RuntimeError; the worker now never imports it.
    script = tmp_path / "train.py"
    script.write_text(NO_GUARD)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "out")], capture_output=True, text=True,
                          env=CHECKOUT_ENV, timeout=2 * SLOW)
    assert done.returncode == 0, done.stderr
    assert "bootstrapping" not in done.stderr
    files, dropped = map(int, done.stdout.split())
    assert files == 2 and len(frames_of(tmp_path / "out" / "0.Linear.forward.mp4")) == 3 - dropped


# -- a diverging run: every frame drawn, or counted ------------------------------------------------


def test_a_run_that_diverges_by_1e19_gets_every_frame_drawn_and_no_traceback(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    model, x = mlp(), torch.randn(4, 8)
    with fwdtrace.Recorder(tmp_path, timeout=SLOW, views=("histogram",)) as rec:
        rec.track(model, "0.Linear")
        for step in range(6):
            if step == 3:
                with torch.no_grad():
                    model[0].weight.mul_(1e20)  # the outputs jump from about 1 to about 1e20
            model(x)
    stats = rec.stats()["0.Linear.forward"]
    assert (stats["not_drawn"], stats["error"]) == (0, "")
    assert len(frames_of(tmp_path / "0.Linear.forward.mp4")) == stats["sent"] >= 1
    assert "Traceback" not in capfd.readouterr().err


def test_a_frame_the_worker_cannot_draw_is_counted_with_its_reason_not_printed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    from multiprocessing import Pipe

    from fwdtrace.recorder import worker

    monkeypatch.setattr(worker.signal, "signal", lambda *args: None)  # the worker's own settings, not this process's
    monkeypatch.setattr(worker.os, "nice", lambda increment: 0)
    ours, theirs = Pipe()
    for _ in range(3):
        ours.send(("bad", "a title", None, ("histogram",)))  # no payload to draw
    ours.send(worker.STOP)
    worker.run(theirs, os.getppid(), str(tmp_path), ".mp4", 10.0, SLOW)  # "the parent": this process's own
    messages = [ours.recv_bytes() for _ in range(4)]
    assert messages[:3] == [worker.CREDIT] * 3  # the sender's credits come back all the same
    report = json.loads(messages[3])
    assert report["frames"] == 0 and report["not_drawn"] == {"bad": 3}
    assert report["errors"]["bad"].startswith("TypeError") or report["errors"]["bad"].startswith("AttributeError")
    assert "Traceback" not in capfd.readouterr().err
