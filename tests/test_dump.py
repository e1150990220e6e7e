"""HDF5 dumps: one group per module call (counted by plain hooks), values as torch computed them."""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path

import h5py
import pytest
import torch
import torch.multiprocessing as mp
import zoo
from torch import nn

import fwdtrace
from fwdtrace import FwdtraceError, dump

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")


def _dump_diff(*argv: str) -> int:
    """``fwdtrace dump-diff ARGV``'s exit code (the lead's cli.main maps FwdtraceError to 2)."""
    parser = argparse.ArgumentParser()
    dump.configure_parser(parser)
    return dump.run_cli(parser.parse_args(argv))


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
