"""HDF5 dumps: one group per module call (counted by plain hooks), values as torch computed them."""

from __future__ import annotations

import errno
import math
import os
import re
import signal
import socket
import time
import zlib
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
import zoo
from torch import nn

import fwdtrace
from fwdtrace import FwdtraceError, dump
from fwdtrace.cli import build_parser

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")


def _dump_diff(*argv: str) -> int:
    """``fwdtrace dump-diff ARGV``'s exit code (the lead's cli.main maps FwdtraceError to 2)."""
    return dump.run_cli(build_parser().parse_args(["dump-diff", *argv]))


def _group_names(f: h5py.File) -> list[str]:
    return [name for name, item in f.items() if isinstance(item, h5py.Group)]


def _count_calls(model: nn.Module, run) -> int:
    """The reference: plain forward hooks on every module."""
    calls = []
    handles = [m.register_forward_hook(lambda *a: calls.append(1)) for m in model.modules()]
    run()
    for h in handles:
        h.remove()
    return len(calls)


def _train_step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).logsumexp(1).sum()
    loss.backward()
    return loss


def _keep_grad(store: list[torch.Tensor]):
    """A forward hook that keeps each output and its gradient (returns None: changes nothing)."""

    def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        output.retain_grad()
        store.append(output)

    return hook


def _resnet() -> tuple[nn.Module, torch.Tensor]:
    model, _ = zoo.resnetish()
    # zoo's example input is drawn before the zoo seeds; draw one of our own, reproducibly
    return model.train(), torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))


def _dump_step(directory: Path, perturb: str | None = None, step: int = 0) -> Path:
    model, x = _resnet()
    model.train()
    if perturb:
        with torch.no_grad():
            model.get_submodule(perturb).weight.mul_(1.01)
    dumper = fwdtrace.Dumper(directory)
    dumper.register(model, epoch=1, step=step)
    _train_step(model, x)
    (path,) = dumper.remove()
    return path


def test_a_resnet_training_step_has_one_group_per_module_call(tmp_path: Path) -> None:
    model, x = _resnet()
    expected = _count_calls(model, lambda: model(x))
    logits: list[torch.Tensor] = []
    model.fc.register_forward_hook(_keep_grad(logits))
    dumper = fwdtrace.Dumper(tmp_path)
    dumper.register(model, epoch=0, step=3)
    _train_step(model, x)
    model(x)  # a second forward is not dumped
    paths = dumper.remove()
    model.fc._forward_hooks.clear()
    assert paths == [tmp_path / "0-epoch_3-step_dump.hdf5"]
    with h5py.File(paths[0]) as f:
        names = _group_names(f)
        assert len(names) == expected
        assert names[0] == "000_ResNetish" and "002_Conv2d" in names
        stem_bn = f["003_BatchNorm2d"]
        assert (stem_bn.attrs["module_key"], stem_bn.attrs["module_path"], stem_bn.attrs["call_index"]) == (
            "stem.1.BatchNorm2d", "stem.1", 0)
        assert torch.equal(torch.from_numpy(f["000_ResNetish"]["input0"][()]), x)
        fc = next(f[n] for n in names if f[n].attrs["module_path"] == "fc")
        assert torch.equal(torch.from_numpy(fc["output0"][()]), logits[0].detach())
        assert torch.equal(torch.from_numpy(fc["grad_output0"][()]), logits[0].grad)
        conv = f["002_Conv2d"]
        assert set(conv) == {"input0", "output0", "grad_output0"}  # the image needs no gradient
        assert all("grad_input0" in f[n] for n in names if f[n].attrs["module_path"].startswith("blocks."))
    # no hook stays behind
    assert all(not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks for m in model.modules())


def test_shared_module_calls_get_their_own_gradients(tmp_path: Path) -> None:
    model, (x,) = zoo.shared_weights()
    outputs: list[torch.Tensor] = []
    handle = model.shared.register_forward_hook(_keep_grad(outputs))
    dumper = fwdtrace.Dumper(tmp_path)
    dumper.register(model)
    model(x).sum().backward()
    handle.remove()
    tree = fwdtrace.read_dump(dumper.remove()[0], show=False, values=True)
    calls = [g for g in tree["groups"].values() if g["attrs"]["module_path"] == "shared"]
    assert [c["attrs"]["call_index"] for c in calls] == [0, 1]
    for call, out in zip(calls, outputs, strict=True):
        assert torch.equal(call["datasets"]["output0"]["value"], out.detach())
        assert torch.equal(call["datasets"]["grad_output0"]["value"], out.grad)


def test_two_identical_seeded_runs_compare_equal(tmp_path: Path) -> None:
    a = _dump_step(tmp_path / "a")
    b = _dump_step(tmp_path / "b")
    report = fwdtrace.compare_dumps(a, b)
    assert report.equal and report.first_divergence is None
    with h5py.File(a) as f:
        assert len(report.rows) == sum(len(f[g]) for g in _group_names(f)) == len(f["execution_order"])
    assert all(r.cosine == pytest.approx(1.0) and r.max_abs == 0.0 for r in report.rows)
    assert _dump_diff(str(a), str(b)) == 0


def test_compare_dumps_compares_on_one_intra_op_thread_and_restores_the_callers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Block by block on the caller's thread pool, a loaded machine made a comparison 20x slower: each block
    runs on one thread, and the caller's setting is back after, also when the comparison raises."""
    a, b = _dump_step(tmp_path / "a"), _dump_step(tmp_path / "b", perturb="blocks.0.c2")
    threads_seen: list[int] = []
    add = fwdtrace.precision.Agreement.add

    def spy(self: Any, x: torch.Tensor, y: torch.Tensor) -> None:
        threads_seen.append(torch.get_num_threads())
        add(self, x, y)

    monkeypatch.setattr(fwdtrace.precision.Agreement, "add", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        report = fwdtrace.compare_dumps(a, b)
        assert torch.get_num_threads() == 3
        with pytest.raises(FwdtraceError, match=r"^compare_dumps\(\) expected rtol"):
            fwdtrace.compare_dumps(a, b, rtol=-1)
        with pytest.raises(FwdtraceError, match=r"^compare_dumps\(\) expected an HDF5 dump file"):
            fwdtrace.compare_dumps(a, tmp_path / "missing.hdf5")
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
    assert report.first_divergence == "blocks.0.c2"
    assert threads_seen and set(threads_seen) == {1}


def test_a_perturbed_conv_is_the_first_divergence(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _dump_step(tmp_path / "a")
    b = _dump_step(tmp_path / "b", perturb="blocks.0.c2")
    report = fwdtrace.compare_dumps(a, b)
    assert report.first_divergence == "blocks.0.c2"
    # every output written before that conv's agrees: the divergence really starts there
    first_bad = next(i for i, r in enumerate(report.rows) if not r.allclose)
    assert report.rows[first_bad].module_path == "blocks.0.c2" and report.rows[first_bad].name == "output0"
    assert report.rows[first_bad].max_abs > 0 and report.rows[first_bad].cosine == pytest.approx(1.0, abs=1e-3)
    assert _dump_diff(str(a), str(b)) == 1
    out = capsys.readouterr().out
    assert "first divergence: blocks.0.c2" in out and "max_abs" in out.splitlines()[0]


def test_dtypes_are_preserved_and_bf16_is_lossless(tmp_path: Path) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    outputs = {}
    for dtype in (torch.bfloat16, torch.float64):
        model = nn.Sequential(nn.Linear(4, 2)).to(dtype)
        model[0].register_forward_hook(lambda m, i, o, d=dtype: outputs.__setitem__(d, o.detach()))
        dumper = fwdtrace.Dumper(tmp_path / str(dtype))
        dumper.register(model)
        model(x.to(dtype))
        tree = fwdtrace.read_dump(dumper.remove()[0], show=False, values=True)
        value = tree["groups"]["001_Linear"]["datasets"]["output0"]
        assert value["dtype"] == str(dtype).removeprefix("torch.")
        assert value["value"].dtype == dtype
        assert torch.equal(value["value"].view(torch.int16 if dtype == torch.bfloat16 else torch.int64),
                           outputs[dtype].view(torch.int16 if dtype == torch.bfloat16 else torch.int64))


def test_non_tensor_outputs_are_noted(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = zoo.EncoderLayer(8, 2)  # attn returns (output, None) with need_weights=False
    dumper = fwdtrace.Dumper(tmp_path)
    dumper.register(model)
    model(torch.randn(1, 3, 8))
    path = dumper.remove()[0]
    tree = fwdtrace.read_dump(path, show=False)
    attn = next(g for g in tree["groups"].values() if g["attrs"]["module_path"] == "attn")
    assert attn["attrs"]["skipped"] == "output[1]: None"
    assert "attn" not in tree["attrs"].get("skipped", "") and "MultiheadAttention output[1]: None" in tree["attrs"]["skipped"]
    assert "output1" not in attn["datasets"]


def test_read_dump_prints_and_returns_the_tree(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _dump_step(tmp_path)
    tree = fwdtrace.read_dump(path)
    printed = capsys.readouterr().out
    with h5py.File(path) as f:
        assert list(tree["groups"]) == _group_names(f)
        for name in _group_names(f):
            for dname, ds in f[name].items():
                assert tree["groups"][name]["datasets"][dname] == {"shape": list(ds.shape), "dtype": str(ds.dtype)}
    assert printed.startswith(f"{path.name}: {len(tree['groups'])} module calls")
    assert tree["attrs"]["epoch"] == 1


def test_an_unwritable_directory_fails_at_register(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    dumper = fwdtrace.Dumper(blocker / "dumps")
    with pytest.raises(FwdtraceError, match=r"^Dumper.register\(\) expected a writable directory, got '.*dumps'"):
        dumper.register(nn.Linear(1, 1))


def test_truncated_foreign_and_missing_files_are_named(tmp_path: Path) -> None:
    good = _dump_step(tmp_path)
    truncated = tmp_path / "truncated.hdf5"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    foreign = tmp_path / "foreign.hdf5"
    with h5py.File(foreign, "w") as f:
        f.create_dataset("weights", data=[1, 2])
    text = tmp_path / "text.hdf5"
    text.write_text("hello")
    for path, message in [
        (truncated, r"^read_dump\(\) expected an HDF5 dump file, got '.*truncated.hdf5', which HDF5 cannot open"),
        (text, r"^read_dump\(\) expected an HDF5 dump file, got '.*text.hdf5', which HDF5 cannot open"),
        (foreign, r"^read_dump\(\) expected a dump with groups named NNN_ClassName, got '.*foreign.hdf5'"),
        (tmp_path / "nope.hdf5", r"^read_dump\(\) expected an HDF5 dump file, got '.*nope.hdf5', which does not exist"),
    ]:
        with pytest.raises(FwdtraceError, match=message):
            fwdtrace.read_dump(path)
    with pytest.raises(FwdtraceError, match=r"^compare_dumps\(\) expected a dump with groups named NNN_ClassName"):
        _dump_diff(str(good), str(foreign))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_worker(rank: int, port: int, directory: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(rank)
        model = nn.Sequential(nn.Linear(3, 2))
        dumper = fwdtrace.Dumper(directory)
        dumper.register(model, epoch=2, step=5)
        model(torch.full((1, 3), float(rank))).sum().backward()
        dumper.remove()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_each_rank_writes_its_own_file(tmp_path: Path) -> None:
    mp.spawn(_rank_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    assert sorted(os.listdir(tmp_path)) == ["2-epoch_5-step_rank0_dump.hdf5", "2-epoch_5-step_rank1_dump.hdf5"]
    for rank in (0, 1):
        tree = fwdtrace.read_dump(tmp_path / f"2-epoch_5-step_rank{rank}_dump.hdf5", show=False, values=True)
        assert tree["attrs"]["rank"] == rank
        assert torch.equal(tree["groups"]["000_Sequential"]["datasets"]["input0"]["value"], torch.full((1, 3), float(rank)))


def test_inplace_models_dump_forward_only_with_values_before_the_change(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(inplace=True))
    x = torch.randn(3, 4)
    expected = model[0](x).detach().clone()  # Linear's output, before ReLU overwrites it
    dumper = fwdtrace.Dumper(tmp_path)
    dumper.register(model, grads=False)
    model(x).sum()
    tree = fwdtrace.read_dump(dumper.remove()[0], show=False, values=True)
    assert torch.equal(tree["groups"]["001_Linear"]["datasets"]["output0"]["value"], expected)
    assert torch.equal(tree["groups"]["002_ReLU"]["datasets"]["output0"]["value"], expected.relu())


# -- completeness ---------------------------------------------------------------------------------
def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


class _Boom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")


def _clean_dump(directory: Path) -> Path:
    model = _mlp()
    with fwdtrace.Dumper(directory) as dumper:
        dumper.register(model)
        model(torch.ones(2, 4)).sum().backward()
    return dumper.paths[0]


def test_a_complete_step_says_so_and_backward_is_recorded(tmp_path: Path) -> None:
    path = _clean_dump(tmp_path)
    assert os.listdir(tmp_path) == [path.name]  # no temporary file left
    tree = fwdtrace.read_dump(path, show=False)
    assert tree["status"] == "complete"
    attrs = tree["attrs"]
    assert (attrs["complete"], attrs["forward_finished"], attrs["backward_finished"], attrs["calls"]) == (True, True, True, 4)


def test_a_step_that_raises_after_its_forward_is_incomplete(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    whole = _clean_dump(tmp_path / "whole")
    model = _mlp()
    with pytest.raises(ValueError, match="bad loss"), fwdtrace.Dumper(tmp_path / "cut") as dumper:
        dumper.register(model)
        model(torch.ones(2, 4))
        raise ValueError("bad loss")
    (cut,) = dumper.paths
    status = "incomplete: stopped after 003_Linear (the backward did not run; the step raised ValueError: bad loss)"
    assert fwdtrace.read_dump(cut, show=False)["status"] == status
    for a, b in ((cut, whole), (whole, cut)):
        report = fwdtrace.compare_dumps(a, b)
        assert not report.equal and report.incomplete == {str(cut): status}
        # the gradients only the whole run has are rows of their own, whichever side it is on
        missing = [r for r in report.rows if r.note.startswith("missing in")]
        assert missing and all(r.name.startswith("grad_") for r in missing)
        assert report.first_divergence is not None
        assert status in report.to_text()
    with pytest.raises(FwdtraceError, match=rf"^{re.escape(str(cut))} is {re.escape(status)}"):
        _dump_diff(str(cut), str(whole))
    assert "cut" not in capsys.readouterr().err


def test_a_forward_that_raises_is_incomplete_and_names_the_call(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), _Boom(), nn.Linear(4, 2))
    dumper = fwdtrace.Dumper(tmp_path)
    dumper.register(model)
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.ones(1, 4))
    tree = fwdtrace.read_dump(dumper.remove()[0], show=False)
    assert tree["status"] == "incomplete: stopped after 002__Boom (the forward raised in 002__Boom: RuntimeError: boom)"
    assert list(tree["groups"]) == ["000_Sequential", "001_Linear", "002__Boom"]
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_a_caught_failed_batch_and_lone_submodule_calls_do_not_pollute_the_step(tmp_path: Path) -> None:
    whole = _clean_dump(tmp_path / "whole")
    model = _mlp()
    with fwdtrace.Dumper(tmp_path / "noisy") as dumper:
        dumper.register(model)
        model[0](torch.ones(1, 4))  # a submodule on its own: not the step
        try:
            model(torch.ones(3, 5))  # a failed batch the training loop catches
        except RuntimeError:
            pass
        model(torch.ones(2, 4)).sum().backward()
    (noisy,) = dumper.paths
    report = fwdtrace.compare_dumps(whole, noisy)
    assert report.equal, report.to_text()
    assert len(report.rows) == sum(1 for r in report.rows if r.allclose) > 0
    assert fwdtrace.read_dump(noisy, show=False)["attrs"]["discarded_forwards"] == 1


def test_an_existing_dump_is_not_overwritten_silently(tmp_path: Path) -> None:
    first = _clean_dump(tmp_path)
    before = first.read_bytes()
    model = nn.Sequential(nn.Linear(4, 2))
    dumper = fwdtrace.Dumper(tmp_path)
    with pytest.raises(FwdtraceError, match=r"^Dumper.register\(\) expected a new file, got '.*0-epoch_0-step_dump.hdf5', "
                       r"which exists; pass overwrite=True to replace it"):
        dumper.register(model)
    assert first.read_bytes() == before and all(not m._forward_pre_hooks for m in model.modules())
    with fwdtrace.Dumper(tmp_path, overwrite=True) as dumper:
        dumper.register(model, grads=False)
        model(torch.ones(1, 4))
    assert list(fwdtrace.read_dump(first, show=False)["groups"]) == ["000_Sequential", "001_Linear"]


def test_a_symlink_at_the_target_name_is_replaced_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "dumps").mkdir()
    (tmp_path / "dumps" / "0-epoch_0-step_dump.hdf5").symlink_to(victim)
    model = nn.Sequential(nn.Linear(4, 2))
    with pytest.raises(FwdtraceError, match=r"^Dumper.register\(\) expected a new file, got .*which exists"):
        fwdtrace.Dumper(tmp_path / "dumps").register(model)
    with fwdtrace.Dumper(tmp_path / "dumps", overwrite=True) as dumper:
        dumper.register(model, grads=False)
        model(torch.ones(1, 4))
    target = dumper.paths[0]
    assert victim.read_text() == "keep me"
    assert not target.is_symlink() and fwdtrace.read_dump(target, show=False)["status"] == "complete"


@pytest.mark.parametrize("fail_at", [2, 3, 10])  # an input, an output in the forward; a gradient in the backward
def test_a_failed_write_raises_naming_the_file_with_every_hook_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_at: int
) -> None:
    """A full disk, simulated by a dataset write that fails as HDF5 does (OSError ENOSPC)."""
    written = []
    create = h5py.Group.create_dataset

    def create_dataset(self: h5py.Group, name: str, *args, **kwargs):  # noqa: ANN202
        written.append(name)
        if len(written) == fail_at:
            raise OSError(errno.ENOSPC, "No space left on device")
        return create(self, name, *args, **kwargs)

    monkeypatch.setattr(h5py.Group, "create_dataset", create_dataset)
    model = _mlp()
    with pytest.raises(FwdtraceError, match=r"^Dumper could not write '.*0-epoch_0-step_dump.hdf5' \(\d{3}_\w+/\w+\): "
                       r"No space left on device; the dump was dropped and its hooks removed"), \
            fwdtrace.Dumper(tmp_path) as dumper:
        dumper.register(model)
        model(torch.ones(2, 4)).sum().backward()
    assert written[-1].startswith({2: "input", 3: "output", 10: "grad_"}[fail_at])
    assert os.listdir(tmp_path) == []  # no partial file under any name
    assert all(not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks for m in model.modules())
    monkeypatch.undo()
    model(torch.ones(2, 4)).sum().backward()  # the model runs on, unhooked


def _killed_writer(directory: str, ready: Any) -> None:
    """A training step whose dump is half written when the process is killed."""
    torch.set_num_threads(1)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)], nn.Identity())

    def stall(module: nn.Module, inputs: tuple) -> None:
        ready.set()
        time.sleep(120)

    model[-1].register_forward_pre_hook(stall)
    dumper = fwdtrace.Dumper(directory)
    dumper.register(model)
    model(torch.randn(512, 256))


def _kill_at_its_stall(target: Any, directory: Path) -> None:
    """Run ``target(directory, ready)`` in a process of its own, SIGKILLed once it sets ``ready``."""
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    child = ctx.Process(target=target, args=(str(directory), ready))
    child.start()
    try:
        assert ready.wait(120), "the child never reached its stall"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.join(30)
    assert child.exitcode == -signal.SIGKILL


def test_a_dump_killed_mid_write_is_named_as_such(tmp_path: Path) -> None:
    _kill_at_its_stall(_killed_writer, tmp_path)
    (left,) = os.listdir(tmp_path)  # under a temporary name: never the final one
    assert left.startswith("0-epoch_0-step_dump.hdf5.partial-")
    partial = tmp_path / left
    assert partial.stat().st_size > 8 * 256 * 256 * 4  # several MB were written before the kill
    try:
        status = fwdtrace.read_dump(partial, show=False)["status"]
    except FwdtraceError as e:
        assert re.match(r"^read_dump\(\) (expected an HDF5 dump file, got '.*', which HDF5 cannot open|could not read '.*') "
                        r"\(incomplete: it was cut short while being written", str(e)), str(e)
    else:
        assert status.startswith("incomplete: ") and "never closed" in status, status
    with pytest.raises(FwdtraceError, match=r"^(compare_dumps\(\) .*|.*\.partial-\w+ is )incomplete"):
        _dump_diff(str(partial), str(partial))


def _killed_run(directory: str, ready: Any) -> None:
    """A training loop dumping the statistics of every step, killed in its seventh step's forward."""
    torch.set_num_threads(1)
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def stall(module: nn.Module, inputs: tuple) -> None:
        if step == 6:
            ready.set()
            time.sleep(120)

    model[-1].register_forward_pre_hook(stall)
    with fwdtrace.Dumper(directory, values="statistics") as dumper:
        for step in range(10):
            dumper.register(model, step=step)
            model(torch.randn(5, 4)).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()


def test_a_run_killed_mid_step_keeps_every_step_before_it_whole(tmp_path: Path) -> None:
    # Each step's file is closed and named at the next register(): a kill loses the step being written, not the run.
    _kill_at_its_stall(_killed_run, tmp_path)
    names = sorted(os.listdir(tmp_path))
    assert names[:6] == [f"0-epoch_{s}-step_dump.hdf5" for s in range(6)]
    assert len(names) == 7 and names[6].startswith("0-epoch_6-step_dump.hdf5.partial-")
    for name in names[:6]:
        tree = fwdtrace.read_dump(tmp_path / name, show=False)
        assert tree["status"] == "complete" and tree["attrs"]["backward_finished"], name


# -- two-sided comparison ---------------------------------------------------------------------------
class _Twice(nn.Module):
    def __init__(self, repeats: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(3, 3)
        self.repeats = repeats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.repeats):
            x = self.fc(x)
        return x


def test_compare_dumps_is_two_sided(tmp_path: Path) -> None:
    paths = {}
    for repeats in (1, 2):
        model = _Twice(repeats)
        with fwdtrace.Dumper(tmp_path / str(repeats)) as dumper:
            dumper.register(model, grads=False)
            model(torch.ones(1, 3))
        paths[repeats] = dumper.paths[0]
    short, long = paths[1], paths[2]
    for a, b, side in ((short, long, "a"), (long, short, "b")):
        report = fwdtrace.compare_dumps(a, b)
        assert not report.equal and report.first_divergence is not None
        only = [r for r in report.rows if r.note == f"missing in {side}"]
        # the second fc call's input and output are in one dump only
        assert [(r.group, r.name, r.shape) for r in only] == [("002_Linear", "input0", [1, 3]), ("002_Linear", "output0", [1, 3])]
    with h5py.File(long) as f:
        assert len(fwdtrace.compare_dumps(short, long).rows) == len(f["execution_order"])


# -- argument validation ----------------------------------------------------------------------------
BAD_REGISTER = [
    ({"epoch": None}, r"^Dumper.register\(\) expected epoch as a non-negative int, got NoneType None"),
    ({"epoch": "../../escaped"}, r"^Dumper.register\(\) expected epoch as a non-negative int, got str '../../escaped'"),
    ({"step": -1}, r"^Dumper.register\(\) expected step as a non-negative int, got -1"),
    ({"step": 1.5}, r"^Dumper.register\(\) expected step as a non-negative int, got float 1.5"),
    ({"epoch": True}, r"^Dumper.register\(\) expected epoch as a non-negative int, got bool True"),
    ({"grads": "yes"}, r"^Dumper.register\(\) expected grads as a bool, got str"),
]


@pytest.mark.parametrize("kwargs, message", BAD_REGISTER)
def test_register_checks_its_arguments(tmp_path: Path, kwargs: dict, message: str) -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(FwdtraceError, match=message):
        fwdtrace.Dumper(tmp_path / "dumps").register(model, **kwargs)
    assert not model._forward_pre_hooks
    assert not (tmp_path / "dumps").exists() or os.listdir(tmp_path / "dumps") == []
    assert sorted(p.name for p in tmp_path.iterdir()) in ([], ["dumps"])  # nothing escaped the folder


def test_bad_reading_arguments_say_what_was_expected(tmp_path: Path) -> None:
    good = _clean_dump(tmp_path)
    for call, message in [
        (lambda: fwdtrace.read_dump(None), r"^read_dump\(\) expected a dump file path \(str or os.PathLike\), got NoneType"),
        (lambda: fwdtrace.read_dump(tmp_path), r"^read_dump\(\) expected an HDF5 dump file, got '.*', which is a folder"),
        (lambda: fwdtrace.read_dump(good, max_bytes=-1), r"^read_dump\(\) expected max_bytes as a non-negative int, got -1"),
        (lambda: fwdtrace.compare_dumps(good, good, rtol=-1), r"^compare_dumps\(\) expected rtol as a finite number >= 0, got -1"),
        (lambda: fwdtrace.compare_dumps(good, good, atol=float("nan")), r"^compare_dumps\(\) expected atol as a finite number >= 0, got nan"),
    ]:
        with pytest.raises(FwdtraceError, match=message):
            call()


def test_a_class_name_cannot_nest_groups(tmp_path: Path) -> None:
    evil = type("Block/../../x", (nn.Linear,), {})
    model = nn.Sequential(evil(2, 2))
    with fwdtrace.Dumper(tmp_path) as dumper:
        dumper.register(model, grads=False)
        model(torch.ones(1, 2))
    tree = fwdtrace.read_dump(dumper.paths[0], show=False)
    assert list(tree["groups"]) == ["000_Sequential", "001_Block_______x"]
    assert tree["groups"]["001_Block_______x"]["attrs"]["class_name"] == "Block/../../x"
    with h5py.File(dumper.paths[0]) as f:
        assert list(f) == ["000_Sequential", "001_Block_______x", "execution_order"]


# -- files from elsewhere ---------------------------------------------------------------------------
def _crafted(path: Path, build) -> Path:  # noqa: ANN001
    """A dump as fwdtrace writes it, then changed by ``build(file, group)``."""
    with h5py.File(path, "w") as f:
        f.attrs["fwdtrace_dump"] = 2
        f.attrs["complete"] = True
        g = f.create_group("000_Linear")
        g.create_dataset("input0", data=[[1.0, 2.0]])
        build(f, g)
    return path


def test_crafted_files_are_refused_before_anything_outside_them_is_read(tmp_path: Path) -> None:
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"private!" * 4)
    other = _crafted(tmp_path / "other.hdf5", lambda f, g: None)

    def external_storage(f: h5py.File, g: h5py.Group) -> None:
        g.create_dataset("output0", shape=(4,), dtype="<f8", external=[(str(secret), 0, 32)])

    def virtual(f: h5py.File, g: h5py.Group) -> None:
        layout = h5py.VirtualLayout(shape=(1, 2), dtype="f8")
        layout[:] = h5py.VirtualSource(str(other), "000_Linear/input0", shape=(1, 2))
        g.create_virtual_dataset("output0", layout)

    cases = [
        (external_storage, r"where '000_Linear/output0' keeps its data in external files \('.*secret.bin'\), not read"),
        (lambda f, g: g.__setitem__("output0", h5py.ExternalLink(str(other), "000_Linear/input0")),
         r"where '000_Linear/output0' is an external link to '.*other.hdf5' \(000_Linear/input0\), not followed"),
        (lambda f, g: f.__setitem__("001_Linear", h5py.ExternalLink(str(other), "000_Linear")),
         r"where '001_Linear' is an external link to '.*other.hdf5' \(000_Linear\), not followed"),
        (lambda f, g: g.__setitem__("output0", h5py.SoftLink("/000_Linear/input0")),
         r"where '000_Linear/output0' is a SoftLink to '/000_Linear/input0', not followed"),
        (virtual, r"where '000_Linear/output0' is a virtual dataset \(data from other files\), not read"),
        (lambda f, g: g.create_dataset("output0", data=["text"], dtype=h5py.string_dtype()),
         None),  # refused when its values are read
    ]
    for i, (build, message) in enumerate(cases):
        path = _crafted(tmp_path / f"crafted{i}.hdf5", build)
        if message is None:
            with pytest.raises(FwdtraceError, match=r"^read_dump\(\) expected a self-contained fwdtrace dump, got .*"
                               r"where '000_Linear/output0' holds object, not numbers"):
                fwdtrace.read_dump(path, show=False, values=True)
            continue
        for call, caller in ((lambda p: fwdtrace.read_dump(p, show=False, values=True), "read_dump"),
                             (lambda p: fwdtrace.compare_dumps(p, other), "compare_dumps")):
            with pytest.raises(FwdtraceError, match=rf"^{caller}\(\) expected a self-contained fwdtrace dump, got "
                               rf"'.*crafted{i}.hdf5', {message}"):
                call(path)


def test_sizes_are_checked_before_allocating(tmp_path: Path) -> None:
    # 1 GiB declared, nothing stored: a file of a few kB
    bomb = _crafted(tmp_path / "bomb.hdf5", lambda f, g: g.create_dataset("output0", shape=(2**28,), dtype="f4"))
    assert bomb.stat().st_size < 20_000
    with pytest.raises(FwdtraceError, match=r"^compare_dumps\(\) expected a self-contained fwdtrace dump, got '.*bomb.hdf5', "
                       r"where '000_Linear/output0' declares 1073741824 bytes but stores 0 in the file"):
        fwdtrace.compare_dumps(bomb, bomb)
    good = _clean_dump(tmp_path / "good")
    with pytest.raises(FwdtraceError, match=r"^read_dump\(\) expected a self-contained fwdtrace dump, got .*, "
                       r"where '000_Sequential/input0' holds 32 bytes, over the cap of 16 \(max_bytes=\)"):
        fwdtrace.read_dump(good, show=False, values=True, max_bytes=16)
    assert fwdtrace.read_dump(good, show=False, values=True, max_bytes=64)["status"] == "complete"


def _unwritten(written: int):  # noqa: ANN202
    """A gzip dataset declaring 256 MiB in 64 chunks, ``written`` of them in the file."""

    def build(f: h5py.File, g: h5py.Group) -> None:
        ds = g.create_dataset("output0", shape=(2**26,), dtype="<f4", chunks=(2**20,), compression="gzip")
        ones = zlib.compress(np.ones(2**20, "<f4").tobytes())
        for i in range(written):
            ds.id.write_direct_chunk((i * 2**20,), ones)

    return build


def test_chunks_never_written_are_refused_before_reading(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fwdtrace.cli import main

    for written in (0, 1, 63):
        path = _crafted(tmp_path / f"unwritten{written}.hdf5", _unwritten(written))
        if written == 0:
            assert path.stat().st_size < 20_000  # 256 MiB declared in a few kB
        message = (rf"where '000_Linear/output0' declares 268435456 bytes in 64 chunks but stores {written} of them: "
                   "a crafted or incomplete file")
        with pytest.raises(FwdtraceError, match=r"^read_dump\(\) expected a self-contained fwdtrace dump, got "
                           rf"'.*unwritten{written}.hdf5', {message}"):
            fwdtrace.read_dump(path, show=False, values=True)
        with pytest.raises(FwdtraceError, match=rf"^compare_dumps\(\) expected .*, {message}"):
            fwdtrace.compare_dumps(path, path)
        assert main(["dump-diff", str(path), str(path)]) == 2  # an unreadable dump, not a difference
        assert re.match(rf"^fwdtrace dump-diff: error: compare_dumps\(\) expected .*, {message}$",
                        capsys.readouterr().err.strip())
    huge_chunks = _crafted(tmp_path / "huge_chunks.hdf5", lambda f, g: g.create_dataset(
        "output0", shape=(2**25,), dtype="f4", chunks=(2**25,), compression="gzip"))
    with pytest.raises(FwdtraceError, match=r"^read_dump\(\) expected .*, where '000_Linear/output0' has chunks of "
                       r"134217728 bytes, over the 67108864 read at once"):
        fwdtrace.read_dump(huge_chunks, show=False, values=True)


BOUNDED_COMPARE = """
import resource, sys, torch
torch.set_num_threads(1)
import fwdtrace
warm_a, warm_b, a, b = sys.argv[1:]
fwdtrace.compare_dumps(warm_a, warm_b)  # imports, gzip and first-use allocations before the baseline
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
row = fwdtrace.compare_dumps(a, b).rows[-1]
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((peak - before) * 1024, row.name, row.allclose, repr(row.max_abs), repr(row.max_rel), repr(row.cosine))
"""


def _ones_but_last(path: Path, n: int, last: float) -> Path:
    """A dump whose output0 is ``n`` float32 ones but the last, gzip, every chunk written (directly: fast)."""
    chunk = 2**18
    ones = np.ones(chunk, "<f4")
    full = zlib.compress(ones.tobytes())
    ones[-1] = last

    def build(f: h5py.File, g: h5py.Group) -> None:
        ds = g.create_dataset("output0", shape=(n,), dtype="<f4", chunks=(chunk,), compression="gzip")
        for i in range(n // chunk):
            ds.id.write_direct_chunk((i * chunk,), zlib.compress(ones.tobytes()) if i == n // chunk - 1 else full)

    return _crafted(path, build)


def test_compare_dumps_reads_in_blocks_with_bounded_memory(tmp_path: Path) -> None:
    """Two real 32 MiB tensors (every chunk written, gzip): compared with less memory than one of them
    (reading both whole and comparing in float64 took 550 MiB)."""
    import subprocess
    import sys

    n = 2**23
    paths = [_ones_but_last(tmp_path / f"{name}.hdf5", size, last)
             for name, size, last in (("warm_a", 2**18, 1.0), ("warm_b", 2**18, 2.0), ("a", n, 1.0), ("b", n, 2.0))]
    assert paths[2].stat().st_size < 1_000_000
    done = subprocess.run([sys.executable, "-c", BOUNDED_COMPARE, *map(str, paths)], capture_output=True, text=True,
                          timeout=300, cwd=Path(fwdtrace.__file__).parent.parent)
    assert done.returncode == 0, done.stderr
    grown, name, allclose, max_abs, max_rel, cosine = done.stdout.split()
    assert int(grown) < n * 4, f"{int(grown) / 2**20:.0f} MiB more memory to compare two {n * 4 // 2**20} MiB tensors"
    # the reference: ones against ones with one 2.0, by hand
    assert (name, allclose, float(max_abs), float(max_rel)) == ("output0", "False", 1.0, 0.5)
    assert float(cosine) == pytest.approx((n + 1) / math.sqrt(n * (n + 3)), rel=1e-12)


def test_a_damaged_execution_order_is_named(tmp_path: Path) -> None:
    path = _crafted(tmp_path / "order.hdf5",
                    lambda f, g: f.create_dataset("execution_order", data=["000_Linear/nothing"], dtype=h5py.string_dtype()))
    with pytest.raises(FwdtraceError, match=r"^compare_dumps\(\) expected a self-contained fwdtrace dump, got .*, "
                       r"whose 'execution_order' names '000_Linear/nothing', which is not in the file"):
        fwdtrace.compare_dumps(path, path)


REAL_WRITE_FAILURE = '''
import os, resource, signal, sys, torch, fwdtrace
from torch import nn
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])
resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, resource.RLIM_INFINITY))
try:
    with fwdtrace.Dumper(sys.argv[1]) as dumper:
        dumper.register(model)
        model(torch.randn(256, 256)).sum().backward()
except fwdtrace.FwdtraceError as e:
    print(e)
print(sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules()))
'''


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs POSIX file size limits")
def test_a_real_write_failure_past_a_file_size_limit(tmp_path: Path) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", REAL_WRITE_FAILURE, str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    message, hooks = done.stdout.strip().splitlines()
    assert re.match(r"^Dumper could not write '.*0-epoch_0-step_dump.hdf5' \(\d{3}_Linear/\w+\): File too large; "
                    r"the dump was dropped and its hooks removed$", message), message
    assert hooks == "0" and os.listdir(tmp_path) == []


# -- gradients beside in-place ops, and of models returning a ModelOutput ------------------------------


def _groups_by_key(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    with h5py.File(path) as f:
        assert f.attrs["complete"], f.attrs["status"]
        return {f[n].attrs["module_key"]: {d: torch.from_numpy(f[n][d][()]) for d in f[n]} for n in _group_names(f)}


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # the reference's, as expected
def test_backward_dumps_work_beside_in_place_relu_and_match_torch_full_backward_hooks(tmp_path: Path) -> None:
    model, reference = zoo.inplace_mlp()
    seen, _ = zoo.full_backward_grads(reference)
    for step, x in enumerate(zoo.inplace_batches()):
        dumper = fwdtrace.Dumper(tmp_path)
        dumper.register(model, step=step)
        zoo.sgd_step(model, model(x).square().mean())  # raised RuntimeError from BackwardHookFunction before
        (path,) = dumper.remove()
        zoo.sgd_step(reference, reference(x).square().mean())
        groups = _groups_by_key(path)
        for key in zoo.INPLACE_KEYS:
            grad_input, grad_output = seen[key][step]
            torch.testing.assert_close(groups[key]["grad_output0"], grad_output[0], rtol=0, atol=0)
            if grad_input[0] is None:  # 0.Linear's input is the batch: it needs no gradient
                assert "grad_input0" not in groups[key]
            else:
                torch.testing.assert_close(groups[key]["grad_input0"], grad_input[0], rtol=0, atol=0)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_a_transformers_model_returning_a_model_output_gets_its_backward(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50, n_positions=16)
    config.attn_pdrop = config.resid_pdrop = config.embd_pdrop = 0.0
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(0))
    # The reference: plain tensor hooks keep the gradient of the root's logits and of the last block's output
    kept: dict[str, torch.Tensor] = {}

    def keep(name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            t = output.logits if name == "root" else output[0] if isinstance(output, tuple) else output
            t.register_hook(lambda g: kept.__setitem__(name, g.clone()))

        return hook

    handles = [model.register_forward_hook(keep("root")), model.lm_head.register_forward_hook(keep("lm_head")),
               model.transformer.ln_f.register_forward_hook(keep("ln_f"))]
    dumper = fwdtrace.Dumper(tmp_path)
    dumper.register(model)
    model(ids).logits.sum().backward()
    (path,) = dumper.remove()
    for h in handles:
        h.remove()
    with h5py.File(path) as f:
        assert (bool(f.attrs["complete"]), f.attrs["status"], bool(f.attrs["backward_finished"])) == (
            True, "complete", True)  # read "incomplete: the backward did not run" before
    groups = _groups_by_key(path)
    root = groups["GPT2LMHeadModel"]
    torch.testing.assert_close(root["grad_output0"], kept["root"], rtol=0, atol=0)  # output0 is the logits
    torch.testing.assert_close(root["output0"], model(ids).logits.detach())
    lm_head = next(v for k, v in groups.items() if k.startswith("lm_head."))
    torch.testing.assert_close(lm_head["grad_output0"], kept["lm_head"], rtol=0, atol=0)
    ln_f = next(v for k, v in groups.items() if k.startswith("transformer.ln_f."))
    torch.testing.assert_close(ln_f["grad_output0"], kept["ln_f"], rtol=0, atol=0)
    torch.testing.assert_close(lm_head["grad_input0"], kept["ln_f"], rtol=0, atol=0)  # ln_f's output feeds only lm_head


def test_a_dumper_given_a_file_is_refused_at_construction(tmp_path: Path) -> None:
    a_file = tmp_path / "a_file.txt"
    a_file.write_text("notes")
    with pytest.raises(FwdtraceError, match=r"^Dumper expected a folder path for its dumps .*, got '.*a_file\.txt', "
                       r"an existing file$"):
        fwdtrace.Dumper(a_file)
    with pytest.raises(FwdtraceError, match=r"^Dumper expected a folder path .*, got 'dump\.hdf5', a file name$"):
        fwdtrace.Dumper("dump.hdf5")
    assert a_file.read_text() == "notes" and not Path("dump.hdf5").exists()
    fwdtrace.Dumper(tmp_path / "run.v1")  # a folder with a dot in its name is a folder
    (tmp_path / "dumps.h5").mkdir()
    assert fwdtrace.Dumper(tmp_path / "dumps.h5").directory.is_dir()  # ...and so is an existing one named .h5


def test_a_dumpers_repr_shows_its_folder_and_settings(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    dumper = fwdtrace.Dumper(tmp_path / "run", values="statistics", keys="0.*", steps=[3, 1])
    assert repr(dumper) == (f"Dumper({str(tmp_path / 'run')!r}, values='statistics', calls='modules', "
                            "keys=('0.*',), steps=[1, 3], 0 written, 0 open)")
    with dumper:
        dumper.register(model, step=3)
        assert repr(dumper).endswith(", 0 written, 1 open)")
        model(torch.ones(1, 2)).sum().backward()
    assert repr(dumper).endswith(f", {len(dumper.paths)} written, 0 open)") and len(dumper.paths) == 1


def test_a_dump_of_every_step_holds_one_file_open_and_each_step_is_whole(tmp_path: Path) -> None:
    # A training loop that registers every step: each step's file is closed, named and complete once the next
    # register() finds it over, not held open (one descriptor, the step's memory) until the loop ends.
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fds = Path(f"/proc/{os.getpid()}/fd")
    opened, outputs = [], []
    with fwdtrace.Dumper(tmp_path, values="statistics") as dumper:
        for step in range(40):
            dumper.register(model, step=step)
            assert len(dumper.paths) == step and repr(dumper).endswith(f", {step} written, 1 open)")
            opened.append(len(list(fds.iterdir())) if fds.exists() else 0)
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
            out = model(x)
            outputs.append(out.detach().clone())
            out.square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert [p.name for p in dumper.paths] == [f"0-epoch_{s}-step_dump.hdf5" for s in range(40)]
    assert max(opened) == opened[0]  # no descriptor more per step
    for step in (0, 17, 39):
        tree = fwdtrace.read_dump(dumper.paths[step], show=False)
        assert tree["status"] == "complete"
        (group,) = [g for g in tree["groups"].values() if g["attrs"]["module_path"] == ""]
        stats = group["datasets"]["output0"]["statistics"]
        assert stats["mean"] == pytest.approx(outputs[step].mean().item(), rel=1e-6)
        assert stats["max"] == outputs[step].max().item()


def test_a_step_whose_backward_runs_after_the_next_register_keeps_its_gradients(tmp_path: Path) -> None:
    # Two steps' forwards before either backward (micro-batches): the first stays open until its backward ran.
    model = _mlp()
    x = torch.randn(5, 4)
    with fwdtrace.Dumper(tmp_path) as dumper:
        dumper.register(model, step=0)
        first = model(x).sum()
        dumper.register(model, step=1)
        second = model(x * 2).sum()
        assert len(dumper.paths) == 0
        first.backward()
        second.backward()
    for path in dumper.paths:
        tree = fwdtrace.read_dump(path, show=False)
        assert tree["status"] == "complete" and tree["attrs"]["backward_finished"]


def test_a_folder_removed_mid_run_is_named_and_the_dump_goes_on_once_it_is_back(tmp_path: Path) -> None:
    import shutil

    model = _mlp()
    folder = tmp_path / "run"
    dumper = fwdtrace.Dumper(folder, values="statistics")
    dumper.register(model, step=0)
    model(torch.randn(5, 4)).sum().backward()
    shutil.rmtree(folder)
    with pytest.raises(FwdtraceError, match=r"Dumper.register\(\) could not write .*0-epoch_0-step_dump.hdf5.*No such file"):
        dumper.register(model, step=1)  # the finished step's file cannot be named
    with pytest.raises(FwdtraceError, match=r"Dumper.register\(\) could not create a file in .*run.*No such file"):
        dumper.register(model, step=1)
    assert repr(dumper).endswith("0 written, 0 open)")
    folder.mkdir()
    dumper.register(model, step=2)
    model(torch.randn(5, 4)).sum().backward()
    (path,) = dumper.remove()
    assert fwdtrace.read_dump(path, show=False)["status"] == "complete"


@pytest.mark.parametrize("values", ["tensors", "statistics"])
def test_a_second_backward_through_the_step_is_not_dumped_again(tmp_path: Path, values: str) -> None:
    # A gradient penalty or a second loss: the step's graph is run backward twice (retain_graph=True). The dump
    # holds the first backward's gradients; it wrote every call's twice before (a tensor dump failed on the
    # second, a statistics dump's index named each gradient twice and did not read back).
    model = _mlp()
    x = torch.randn(5, 4)
    with fwdtrace.Dumper(tmp_path, values=values) as dumper:
        dumper.register(model, step=0)
        out = model(x)
        seen = []
        out.register_hook(lambda g: seen.append(g.clone()))
        out.square().sum().backward(retain_graph=True)
        (3 * out).sum().backward()
        dumper.register(model, step=1)  # the finished step is closed here
        assert len(dumper.paths) == 1
    tree = fwdtrace.read_dump(dumper.paths[0], show=False, values=values == "tensors")
    assert tree["status"] == "complete"
    (root,) = [g for g in tree["groups"].values() if g["attrs"]["module_path"] == ""]
    entry = root["datasets"]["grad_output0"]
    if values == "tensors":
        assert torch.equal(entry["value"], seen[0])
    else:
        assert entry["statistics"]["mean"] == pytest.approx(seen[0].mean().item(), rel=1e-6)


def test_a_backward_that_raises_midway_is_not_a_finished_backward(tmp_path: Path) -> None:
    # The root's inputs need no gradient: its output's gradient is the first to arrive, before the layers'. A
    # backward that raises after it (a hook, an out-of-memory error) leaves the step incomplete, not complete.
    model = _mlp()

    def boom(grad: torch.Tensor) -> None:
        raise RuntimeError("out of memory (a stand-in)")

    with fwdtrace.Dumper(tmp_path) as dumper:
        dumper.register(model, step=0)
        out = model(torch.randn(5, 4))
        model[0].weight.register_hook(boom)
        with pytest.raises(RuntimeError, match="a stand-in"):
            out.sum().backward()
    tree = fwdtrace.read_dump(dumper.paths[0], show=False)
    assert tree["status"].startswith("incomplete: ") and "the backward did not run" in tree["status"]
    assert not tree["attrs"]["backward_finished"]
