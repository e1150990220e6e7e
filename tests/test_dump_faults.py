"""Dumps under faults, each in a process of its own: a write the disk refuses (a size limit, a full disk) at any
byte, Ctrl-C at any line of attaching and detaching, SIGKILL mid-write. The process survives, nothing is left
running, hooked or patched, and the file left behind is gone or reads back as incomplete."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import fwdtrace

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
