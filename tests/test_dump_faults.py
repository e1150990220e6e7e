"""Dumps under faults, each in a process of its own: a write the disk refuses (a size limit, a full disk) at any
byte, Ctrl-C at any line of attaching and detaching, SIGKILL mid-write. The process survives, nothing is left
running, hooked or patched, and the file left behind is gone or reads back as incomplete."""

from __future__ import annotations

import dis
import json
import linecache
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from process_groups import world_of_one
from torch import nn

import fwdtrace
from fwdtrace.patching import call_dispatch_active, patched_functions
from fwdtrace.tracer import active_tracer

ORIGINAL_CALL = nn.Module.__dict__["__call__"]

ROOT = Path(fwdtrace.__file__).parent.parent

# Every kind of dump, each written until a file size limit (RLIMIT_FSIZE: a write past it fails with EFBIG) cuts it
# at several byte counts, then, where a small file system is at hand, until the disk is full (ENOSPC); then the limit
# is lifted (the space freed) and the next dump of the same process must be whole. Each case prints a JSON line.
WRITE_FAULTS = r'''
import gc, json, os, resource, signal, sys, threading, torch, fwdtrace
from torch import nn
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
folder, disk = sys.argv[1], sys.argv[2]  # disk: "", or a folder on a small file system
KINDS = {"tensors": {}, "statistics": {"values": "statistics"}, "functions": {"calls": "functions"},
         "statistics-all-background": {"values": "statistics", "calls": "all", "background": True},
         "tensors-background": {"background": True, "queue_bytes": 1 << 12}}
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
x = torch.randn(32, 16)
HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")

def dump(where, kind, step):
    with fwdtrace.Dumper(where, **KINDS[kind]) as dumper:
        dumper.register(model, step=step)
        model(x).sum().backward()
    return dumper.paths[0]

def left():
    gc.collect()
    return {"hooks": sum(len(getattr(m, h)) for m in model.modules() for h in HOOKS),
            "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("fwdtrace"))}

def limit(n):
    resource.setrlimit(resource.RLIMIT_FSIZE, (n, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

def cut_short(kind, where, cut, full):
    os.makedirs(where)
    if full:  # the disk keeps `cut` bytes free (to its pages)
        free = os.statvfs(where).f_bavail * os.statvfs(where).f_frsize
        with open(full, "wb") as f:
            f.write(b"\0" * max(0, free - cut))
    else:
        limit(cut)
    errors = []
    for step in (1, 2):  # twice: the second dump on a full disk must fail as cleanly
        try:
            dump(where, kind, step)
        except fwdtrace.FwdtraceError as e:
            errors.append(str(e))
    files = sorted(os.listdir(where))
    if full:
        os.remove(full)
    else:
        limit(resource.RLIM_INFINITY)
    again = fwdtrace.read_dump(dump(where, kind, 3), show=False)["status"]
    return {"errors": errors, "files": files, "again": again, **left()}

for kind in KINDS:
    size = os.path.getsize(dump(os.path.join(folder, kind), kind, 0))
    cuts = [(cut, "") for cut in (size // 3, size * 2 // 3, size - 1)] + ([(size // 2, disk)] if disk else [])
    for n, (cut, full) in enumerate(cuts):
        case = cut_short(kind, os.path.join(full and disk or folder, f"{kind}-{n}"), cut, full and disk + "/filler")
        print(json.dumps({"kind": kind, "cut": cut, "size": size, "full": bool(full), **case}), flush=True)
'''


def _small_disk(folder: Path) -> bool:
    """A 4 MiB tmpfs mounted at ``folder`` (Linux, as root), for a real ENOSPC; False where none can be."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return False
    folder.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(folder)],
                          capture_output=True).returncode == 0


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs POSIX file size limits")
def test_every_dump_kind_survives_a_refused_write_at_any_byte(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    mounted = _small_disk(disk)
    try:
        done = subprocess.run([sys.executable, "-c", WRITE_FAULTS, str(tmp_path), str(disk) if mounted else ""],
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=True)
    # no crash at exit (HDF5's clean-up after a refused write was a SIGSEGV), nothing printed by h5py's clean-up
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]
    cases = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(cases) == (20 if mounted else 15)
    for case in cases:
        reason = "No space left on device" if case["full"] else "File too large"
        # each dump cut short says so once, with fwdtrace's error naming its file
        for step, error in zip((1, 2), case["errors"], strict=False):
            assert re.match(rf"^Dumper(\.register\(\))? could not (write|create) '.*0-epoch_{step}-step_dump\.hdf5'"
                            rf"( \(.+\))?: {reason}", error), (case, error)
        assert len(case["errors"]) == 2, case
        # nothing left: no partial file, no hook on the model, no writer thread; the next dump is whole
        assert (case["files"], case["hooks"], case["threads"], case["again"]) == ([], 0, [], "complete"), case


# -- Ctrl-C at every line -----------------------------------------------------------------------------------
PACKAGE = str(Path(fwdtrace.__file__).parent)
HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks")


def _ctrl_c_at(line: int, run: Callable[[], object]) -> int:
    """Run ``run`` with a Ctrl-C at the ``line``-th line of fwdtrace's own code it runs (0: none); the lines run.

    The SIGINT handler installed then (fwdtrace's guard in a critical section, else Python's) gets the signal with
    the frame of that line, as the interpreter would give it: what it holds back is delivered where it would be.
    """
    seen = [0]
    delivered: list[int] = []

    def local(frame: FrameType, event: str, arg: object) -> Any:
        if event == "line":
            seen[0] += 1
            if seen[0] >= line > 0 and not delivered and not _at_a_with_exit(frame):
                delivered.append(frame.f_lineno)
                signal.getsignal(signal.SIGINT)(signal.SIGINT, frame)
        return local

    def calls(frame: FrameType, event: str, arg: object) -> Any:
        return local if frame.f_code.co_filename.startswith(PACKAGE) else None

    sys.settrace(calls)
    try:
        run()
    finally:
        sys.settrace(None)
    return seen[0]


def _at_a_with_exit(frame: FrameType) -> bool:
    """Whether a line event is a ``with`` block's exit: CPython gives it the ``with`` line and then calls
    ``__exit__``. A signal never lands between (none is checked before a C ``__exit__`` such as
    ``DisableTorchFunction``'s is called), but a trace function can raise there and leave the context
    entered for every later test: such a Ctrl-C goes to the next line instead."""
    at = next((i for i in dis.get_instructions(frame.f_code) if i.offset == frame.f_lasti), None)
    source = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return at is not None and at.opname == "LOAD_CONST" and at.argval is None and source.startswith("with ")


def _nothing_left(model: nn.Module) -> None:
    assert [t.name for t in threading.enumerate() if t.name.startswith("fwdtrace")] == []
    assert [(name, h) for m in model.modules() for h in HOOKS if (name := type(m).__name__) and getattr(m, h)] == []
    assert nn.Module.__dict__["__call__"] is ORIGINAL_CALL and not call_dispatch_active()
    assert patched_functions() == [] and active_tracer() is None
    assert torch._C._is_torch_function_enabled()  # no DisableTorchFunction left entered


Prepared = tuple[Callable[[], object], Callable[[], object]]


def _every_line(prepare: Callable[[], Prepared], model: nn.Module, folder: Path | None = None, most: int = 60) -> int:
    """Ctrl-C at each line fwdtrace runs in the call ``prepare()`` gives (at ``most`` lines spread over them, each
    prepared afresh, untraced), then its second callable (what the user's code does next, untraced): a
    KeyboardInterrupt or a finished call, and nothing left either way; the number of calls interrupted."""
    run, after = prepare()
    lines = _ctrl_c_at(0, run)
    after()
    assert lines > 0
    interrupted = 0
    for line in sorted({1 + i * lines // most for i in range(most)} if lines > most else range(1, lines + 1)):
        run, after = prepare()
        try:
            _ctrl_c_at(line, run)
        except KeyboardInterrupt:
            interrupted += 1
        after()
        _nothing_left(model)
        if folder is not None:  # a dump cut short is dropped, or named
            assert not [p.name for p in folder.iterdir() if ".partial-" in p.name], (line, lines)
    return interrupted


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


@pytest.mark.parametrize("calls", ["modules", "functions", "all"])
@pytest.mark.parametrize("background", [False, True])
def test_ctrl_c_anywhere_in_register_and_remove_leaves_nothing_running_or_hooked(
        tmp_path: Path, calls: str, background: bool) -> None:
    model, x = _model(), torch.ones(2, 4)
    steps = iter(range(10_000))

    def register() -> Prepared:
        def run() -> None:
            with fwdtrace.Dumper(tmp_path, calls=calls, background=background) as dumper:
                dumper.register(model, step=next(steps))
        return run, lambda: None

    def remove() -> Prepared:
        # register(), the step, then remove() interrupted; a Ctrl-C before it began leaves the dumper open, as a
        # Ctrl-C before the call would: the user's next remove() closes it
        dumper = fwdtrace.Dumper(tmp_path, calls=calls, background=background)
        dumper.register(model, step=next(steps))
        model(x).sum().backward()
        return dumper.remove, dumper.remove

    def register_next() -> Prepared:
        # the next step's register() closes and names the finished step's file first, then hooks the model
        dumper = fwdtrace.Dumper(tmp_path, calls=calls, background=background)
        dumper.register(model, step=next(steps))
        model(x).sum().backward()
        step = next(steps)
        return lambda: dumper.register(model, step=step), dumper.remove

    assert _every_line(register, model, tmp_path) > 0
    assert _every_line(remove, model, tmp_path) > 0
    assert _every_line(register_next, model, tmp_path) > 0
    # what was written reads back: whole dumps complete, none cut short named complete
    for path in tmp_path.iterdir():
        status = fwdtrace.read_dump(path, show=False)["status"]
        assert status == "complete" or status.startswith("incomplete"), path


def test_ctrl_c_anywhere_in_a_compiled_models_attachment_leaves_nothing_hooked(tmp_path: Path) -> None:
    model = _model()
    compiled = torch.compile(model, backend="eager")  # attached and detached only: nothing is compiled
    steps = iter(range(10_000))

    def attach() -> Prepared:
        def run() -> None:
            with fwdtrace.Dumper(tmp_path, background=True) as dumper:
                dumper.register(compiled, step=next(steps), grads=False)  # the route inside compiled code
        return run, lambda: None

    assert _every_line(attach, model, tmp_path, most=20) > 0
    assert not compiled._forward_hooks and not compiled._forward_pre_hooks


def test_ctrl_c_anywhere_in_a_trace_through_accelerates_hooks_leaves_nothing_patched() -> None:
    accelerate = pytest.importorskip("accelerate")
    model = accelerate.cpu_offload(_model(), torch.device("cpu"))
    hooks = {name: dict(m._forward_pre_hooks) for name, m in model.named_modules()}

    def trace() -> Prepared:
        return lambda: fwdtrace.trace(model, torch.ones(2, 4)), lambda: None

    assert _every_line(trace, model) > 0
    assert {name: dict(m._forward_pre_hooks) for name, m in model.named_modules()} == hooks  # accelerate's own



def test_ctrl_c_anywhere_in_a_trace_through_fsdp2s_unshard_leaves_nothing_patched() -> None:
    """FSDP2 (world size 1, gloo): a trace draws each unit's unshard by patching FSDP's methods; a Ctrl-C at any
    line of fwdtrace's code leaves nothing patched or running, and FSDP's own hooks as they were."""
    with world_of_one():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = _model()
        mesh = init_device_mesh("cpu", (1,))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        drawn = [n.target for n in fwdtrace.trace(model, torch.ones(2, 4)).nodes]
        assert drawn.count("fsdp.unshard") == 2  # the patches were on: one node per unit
        hooks = {(name, h): dict(getattr(m, h)) for name, m in model.named_modules() for h in HOOKS}  # FSDP's own

        def trace() -> Prepared:
            return lambda: fwdtrace.trace(model, torch.ones(2, 4)), lambda: None

        # nothing patched or running after each (FSDP's own hooks are on the model: compared after)
        assert _every_line(trace, nn.Module(), most=40) > 0
        # (a forward cut short leaves FSDP's own state as any Ctrl-C in its forward would: not compared)
        assert {(name, h): dict(getattr(m, h)) for name, m in model.named_modules() for h in HOOKS} == hooks


# -- SIGKILL mid-write -------------------------------------------------------------------------------------
# A background dump in a forked process, SIGKILLed once the step has run `moment` hooks (its writer busy with the
# tensors queued); then what is left is read and compared. Each moment prints one JSON line.
KILLED = r'''
import json, os, signal, sys, torch, fwdtrace
from torch import nn
torch.set_num_threads(1)
folder = sys.argv[1]
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])
x = torch.randn(512, 256)
for values in ("tensors", "statistics"):
    for moment in (2, 9):
        where = os.path.join(folder, f"{values}-{moment}")
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            tell = lambda *args: os.write(w, b"x") and None
            for layer in model:
                layer.register_forward_hook(tell)
                layer.register_full_backward_hook(tell)
            with fwdtrace.Dumper(where, values=values, background=True) as dumper:
                dumper.register(model)
                model(x).sum().backward()
            os.write(w, b"d" * 100)
            signal.pause()
        os.close(w)
        seen = b""
        while len(seen) < moment:
            seen += os.read(r, moment - len(seen))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
        (name,) = os.listdir(where)
        path = os.path.join(where, name)
        try:
            status = fwdtrace.read_dump(path, show=False)["status"]
        except fwdtrace.FwdtraceError as e:
            status = "error: " + str(e)
        try:
            report = fwdtrace.compare_dumps(path, path)
            compared = "incomplete" if report.incomplete and not report.equal else "whole"
        except fwdtrace.FwdtraceError as e:
            compared = "error: " + str(e)
        print(json.dumps({"values": values, "moment": moment, "name": name, "status": status,
                          "compared": compared}), flush=True)
'''


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks the killed writer")
def test_a_background_dump_killed_mid_write_reads_back_as_incomplete(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", KILLED, str(tmp_path)], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    cases = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(cases) == 4
    for case in cases:
        assert ".partial-" in case["name"], case  # never under the dump's own name
        # read back as incomplete, or refused with fwdtrace's error saying it was cut short; never complete
        assert case["status"].startswith("incomplete") or re.match(
            r"^error: read_dump\(\) .*\(incomplete: it was cut short while being written", case["status"]), case
        assert case["compared"] == "incomplete" or re.match(r"^error: compare_dumps\(\) .*incomplete",
                                                            case["compared"]), case
