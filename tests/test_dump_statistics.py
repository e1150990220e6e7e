"""Statistics dumps: per tensor its statistics instead of the tensor, equal to torch's, compared like full dumps."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from stats_reference import assert_summary, reference, rounding
from torch import nn

import fwdtrace
from fwdtrace import FwdtraceError, dump
from fwdtrace.statistics import sample_positions, summarize, summarize_blocks


class _NanInf(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NaN where the first half is negative, -inf where the second is
        return torch.cat([x[:, :4].sqrt(), x[:, 4:].relu().log()], 1)


def _model(nudge: float = 1.0) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    with torch.no_grad():
        model[2].weight.mul_(nudge)
    return model


def _dump(tmp_path: Path, name: str, model: nn.Module, values: str, x: torch.Tensor) -> Path:
    with fwdtrace.Dumper(tmp_path / name, values=values) as dumper:
        dumper.register(model)
        model(x).logsumexp(1).sum().backward()
    return dumper.paths[0]


def test_statistics_equal_torchs_on_the_dumped_tensors(tmp_path: Path) -> None:
    torch.manual_seed(1)
    x = torch.randn(6, 4)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), _NanInf())
    full = _dump(tmp_path, "full", model, "tensors", x)
    stats = _dump(tmp_path, "stats", model, "statistics", x)
    tensors = fwdtrace.read_dump(full, show=False, values=True)["groups"]
    summaries = fwdtrace.read_dump(stats, show=False)["groups"]
    assert list(summaries) == list(tensors)
    seen_nan = seen_inf = 0
    for gname, group in tensors.items():
        assert set(summaries[gname]["datasets"]) == set(group["datasets"])
        for dname, entry in group["datasets"].items():
            got = summaries[gname]["datasets"][dname]
            assert (got["shape"], got["dtype"]) == (entry["shape"], entry["dtype"])
            ref, stat = reference(entry["value"]), got["statistics"]
            seen_nan += ref["nans"]
            seen_inf += ref["infs"]
            assert_summary(stat, entry["value"], what=(gname, dname))
    assert seen_nan and seen_inf  # the model made both, so both counts were checked


def test_a_statistics_dump_stores_a_few_hundred_bytes_per_tensor(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(256, 256))
    path = _dump(tmp_path, "stats", model, "statistics", torch.randn(64, 256))
    tree = fwdtrace.read_dump(path, show=False)
    entry = tree["groups"]["001_Linear"]["datasets"]["output0"]
    assert entry["shape"] == [64, 256] and entry["statistics"]["count"] == 64 * 256
    assert path.stat().st_size < 64 * 256 * 4  # less than one of its tensors


@pytest.mark.parametrize("values_a, values_b", [("statistics", "statistics"), ("statistics", "tensors"),
                                                ("tensors", "statistics")])
def test_a_nudged_layer_is_the_first_divergence_by_statistics(tmp_path: Path, values_a: str, values_b: str) -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    a = _dump(tmp_path, "a", _model(), values_a, x)
    same = _dump(tmp_path, "same", _model(), values_b, x)
    nudged = _dump(tmp_path, "nudged", _model(1.001), values_b, x)
    report = fwdtrace.compare_dumps(a, same)
    assert report.equal and report.first_divergence is None, report.to_text()
    assert all(r.note.startswith("by statistics") for r in report.rows)
    report = fwdtrace.compare_dumps(a, nudged)
    assert report.first_divergence == "2", report.to_text()
    # the layers before it agree, as they do by values
    by_values = fwdtrace.compare_dumps(_dump(tmp_path, "fa", _model(), "tensors", x),
                                       _dump(tmp_path, "fb", _model(1.001), "tensors", x))
    assert [r.allclose for r in report.rows if r.name.startswith("output")] == \
        [r.allclose for r in by_values.rows if r.name.startswith("output")]


def test_differing_nan_counts_are_a_divergence(tmp_path: Path) -> None:
    v = summarize(torch.tensor([1.0, float("nan"), 3.0]))
    w = summarize(torch.tensor([1.0, 2.0, 3.0]))
    agreement = fwdtrace.precision.Agreement(1e-5, 1e-8)
    note = dump.compare._by_statistics(agreement, v, w)
    assert not agreement.close and "nans 1 vs 0" in note


def test_blocks_give_the_statistics_of_the_whole() -> None:
    t = torch.randn(1000, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    whole = summarize(t)
    blocks = summarize_blocks(lambda: iter(t.split(77)), t.numel())
    assert torch.allclose(whole, blocks, rtol=1e-12, atol=1e-12)


def test_dumper_checks_values(tmp_path: Path) -> None:
    with pytest.raises(FwdtraceError, match=r"^Dumper expected values as one of 'tensors', 'statistics', got 'stats'"):
        fwdtrace.Dumper(tmp_path, values="stats")


def test_a_tensor_two_calls_share_is_summarised_once_and_again_after_an_in_place_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer's output is the next layer's input (one reduction for both); ReLU(inplace=True) writes into its
    input, so its output, the same tensor, is summarised again: each equals torch's statistics of it then."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 3))
    x = torch.randn(5, 4)
    with torch.no_grad():
        hidden = model[0](x)
    reductions: list[int] = []
    summarize_ = dump.record.summarize_later

    def counted(t: torch.Tensor) -> object:
        reductions.append(t.numel())
        return summarize_(t)

    monkeypatch.setattr(dump.record, "summarize_later", counted)
    with fwdtrace.Dumper(tmp_path, values="statistics") as dumper:
        dumper.register(model, grads=False)
        model(x)
    groups = fwdtrace.read_dump(dumper.paths[0], show=False)["groups"]
    written = sum(len(g["datasets"]) for g in groups.values())
    # root in/out, Linear in/out, ReLU in/out, Linear in/out: x, hidden before and after the ReLU, the output
    assert written == 8 and reductions == [20, 40, 40, 15]
    stats = {(g, d): e["statistics"] for g, group in groups.items() for d, e in group["datasets"].items()}
    before, after = hidden.clone(), hidden.relu()
    for (group, dname), ref in ((("001_Linear", "output0"), before), (("002_ReLU", "input0"), before),
                                (("002_ReLU", "output0"), after), (("003_Linear", "input0"), after)):
        assert_summary(stats[group, dname], ref, what=(group, dname))


class _Views(nn.Module):
    """Views, a residual sum whose gradient autograd accumulates from two paths, and an in-place write through a
    view: the tensors a dump sees share memory in every way a statistics cache could get wrong."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = h + self.b(h)  # h feeds two paths: its gradient is summed
        heads = h.view(3, 2, 4).transpose(0, 1)  # a view, then a strided one of the same memory
        flat = heads.reshape(6, 4)  # a copy (not contiguous before)
        y = self.c(flat.view(3, 8))
        y.view(-1)[::2].mul_(2.0)  # written through a view: every tensor on y's memory changes
        return (y * h).tanh()


@pytest.mark.parametrize("batch", [3, 256])
def test_tensors_on_the_same_memory_are_summarised_once_and_each_equals_torchs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, batch: int) -> None:
    """A view, a ``detach()`` and the tensor objects each gradient hook is handed hold their base's values: the
    dump summarises them once, and again after an in-place write. Every statistic of every call and gradient of
    a function-level dump equals torch's statistics of the tensor dump's copy of the same tensor, with the
    histograms binned every 3 summaries during the step or all at its end."""
    monkeypatch.setattr(dump.packed._Packed, "BATCH", batch)
    torch.manual_seed(5)
    model, x = _Views(), torch.randn(3, 8, requires_grad=True)
    reductions: list[int] = []
    summarize_ = dump.record.summarize_later

    def counted(t: torch.Tensor) -> object:
        reductions.append(t.numel())
        return summarize_(t)

    paths = {}
    for values in ("tensors", "statistics"):
        with monkeypatch.context() as m:
            m.setattr(dump.record, "summarize_later", counted)
            with fwdtrace.Dumper(tmp_path / values, values=values, calls="all") as dumper:
                dumper.register(model)
                model(x).sum().backward()
        paths[values] = dumper.paths[0]
    tensors = fwdtrace.read_dump(paths["tensors"], show=False, values=True)["groups"]
    summaries = fwdtrace.read_dump(paths["statistics"], show=False)["groups"]
    assert list(summaries) == list(tensors)
    checked = 0
    for gname, group in tensors.items():
        for dname, entry in group["datasets"].items():
            assert_summary(summaries[gname]["datasets"][dname]["statistics"], entry["value"], what=(gname, dname))
            checked += 1
    grads = [d for g in tensors.values() for d in g["datasets"] if d.startswith("grad_")]
    assert grads and checked > 40
    assert len(reductions) < checked * 2 // 3  # views, detached gradients and next calls' inputs: summarised once


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int32])
def test_a_tensor_over_several_cpu_blocks_has_torchs_statistics(dtype: torch.dtype) -> None:
    """Summarised block by block in a reused workspace: NaN and Inf in both blocks, the extremes in the second."""
    n = fwdtrace.statistics.BLOCK + 1000
    t = (torch.randn(n, generator=torch.Generator().manual_seed(5)) * 10).to(dtype)
    if dtype.is_floating_point:
        t[[3, n - 2]] = float("nan")
        t[[7, n - 5]] = float("inf")
        t[n - 9] = -float("inf")
    t[n - 3], t[n - 4] = 1000, -1000
    assert_summary(fwdtrace.statistics.as_dict(summarize(t)), t, what=dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_statistics_dump_on_a_writer_thread_equals_the_cpus(tmp_path: Path) -> None:
    """On CUDA with background=True each vector goes to the host without waiting: the writer waits for it."""
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(7))
    paths = []
    for device in ("cpu", "cuda"):
        model = _model().to(device)
        with fwdtrace.Dumper(tmp_path / device, values="statistics", background=True) as dumper:
            dumper.register(model)
            model(x.to(device)).logsumexp(1).sum().backward()
        paths += dumper.paths
    report = fwdtrace.compare_dumps(*paths, rtol=1e-4, atol=1e-6)
    assert report.agree and len(report.rows) > 10, report.to_text()


def test_a_sum_past_float64s_range_is_summarised() -> None:
    """Finite values whose sum overflows float64 (not their mean): counted, bounded and binned, with a NaN and an Inf;
    mean, std and norm taken on the values scaled by a power of two."""
    t = torch.tensor([1.5e308, 1.5e308, -1.0, float("nan"), float("inf")], dtype=torch.float64)
    stat = fwdtrace.statistics.as_dict(summarize(t))
    assert (stat["count"], stat["finite"], stat["nans"], stat["infs"]) == (5, 3, 1, 1)
    assert (stat["min"], stat["max"]) == (-1.0, 1.5e308)
    assert stat["mean"] == pytest.approx(1e308, rel=1e-15)  # (3e308 - 1) / 3
    assert stat["norm"] == pytest.approx(math.sqrt(2) * 1.5e308, rel=1e-15)  # past float64: stored as inf
    assert_summary(stat, t)
    assert sum(stat["histogram"]) == 3


def test_finite_values_spanning_past_float64s_range_are_binned_by_their_true_offsets() -> None:
    """max - min overflows to inf: each value still lands in the power-of-two bin its exact value names."""
    t = torch.tensor([1e308, -1e308, 0.0, 0.5e308, -0.3e308], dtype=torch.float64)
    for with_nan in (t, torch.cat([t, torch.tensor([math.nan])])):
        assert_summary(fwdtrace.statistics.as_dict(summarize(with_nan)), with_nan)


def _unpacked(packed: Path, path: Path) -> Path:
    """``packed`` rewritten in the layout of one group per call and one dataset per tensor (statistics dumps
    written before the packed layout), with h5py alone."""
    import json

    import h5py

    with h5py.File(packed, "r") as src, h5py.File(path, "w", track_order=True) as dst:
        dst.attrs.update(src.attrs)
        index = json.loads(bytes(src["statistics_index"][()]))
        matrix = src["statistics"][()]
        for name, attrs in index["calls"]:
            dst.create_group(name, track_order=True).attrs.update(attrs)
        for (gname, dname, shape, dtype), row in zip(index["rows"], matrix, strict=True):
            n = len(sample_positions(math.prod(shape)))
            dst[gname].create_dataset(dname, data=row[:len(row) - 8 + n]).attrs.update(
                {"tensor_shape": shape, "tensor_dtype": dtype})
        dst.create_dataset("execution_order", data=[f"{g}/{d}" for g, d, _, _ in index["rows"]],
                           dtype=h5py.string_dtype())
    return path


def test_a_version_4_statistics_dump_reads_in_todays_layout(tmp_path: Path) -> None:
    """Before format 5 a vector held 9 fields and a histogram over [min, max]: read as today's vector, the fields
    it lacks (zeros, the bins' placement) NaN, and compared with a dump of today by the fields both hold."""
    import shutil

    import h5py

    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(11))
    today = _dump(tmp_path, "today", _model(), "statistics", x)
    old = shutil.copy(today, tmp_path / "v4.hdf5")
    fields = fwdtrace.statistics.FIELDS
    v4_fields = ("count", "finite", "nans", "infs", "mean", "std", "min", "max", "norm")
    with h5py.File(old, "r+") as f:
        matrix = f["statistics"][()]
        rows = [[row[fields.index(name)] for name in v4_fields] + [0.0] * 16 + list(row[-8:]) for row in matrix]
        del f["statistics"]
        f.create_dataset("statistics", data=rows)
        f.attrs["fwdtrace_dump"] = 4
    groups_old = fwdtrace.read_dump(old, show=False)["groups"]
    groups_new = fwdtrace.read_dump(today, show=False)["groups"]
    for gname, group in groups_new.items():
        for dname, entry in group["datasets"].items():
            got, want = groups_old[gname]["datasets"][dname]["statistics"], entry["statistics"]
            assert [got[k] for k in v4_fields] == [want[k] for k in v4_fields], (gname, dname)
            assert math.isnan(got["zeros"]) and got["bin_edges"] == [] and got["samples"] == want["samples"]
    report = fwdtrace.compare_dumps(old, today)
    assert report.equal and len(report.rows) == sum(len(g["datasets"]) for g in groups_new.values())


def test_a_statistics_dump_is_one_matrix_and_one_index_read_as_calls_and_tensors(tmp_path: Path) -> None:
    """HDF5 holds two datasets, whatever the number of calls; read back, the calls, their attributes and tensors
    are a full dump's, and the layout of one dataset per tensor still reads the same."""
    import h5py

    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(8))
    full = _dump(tmp_path, "full", _model(), "tensors", x)
    stats = _dump(tmp_path, "stats", _model(), "statistics", x)
    with h5py.File(stats, "r") as f:
        assert sorted(f) == ["statistics", "statistics_index"]
        assert f["statistics"].shape == (sum(len(g["datasets"]) for g in
                                              fwdtrace.read_dump(full, show=False)["groups"].values()),
                                             fwdtrace.statistics.width())
    tensors = fwdtrace.read_dump(full, show=False)
    packed = fwdtrace.read_dump(stats, show=False)
    assert packed["status"] == tensors["status"] == "complete"
    assert [(g, e["attrs"], {d: (v["shape"], v["dtype"]) for d, v in e["datasets"].items()})
            for g, e in packed["groups"].items()] == \
        [(g, e["attrs"], {d: (v["shape"], v["dtype"]) for d, v in e["datasets"].items()})
         for g, e in tensors["groups"].items()]
    assert fwdtrace.read_dump(_unpacked(stats, tmp_path / "unpacked.hdf5"), show=False)["groups"] == packed["groups"]
    report = fwdtrace.compare_dumps(stats, _unpacked(stats, tmp_path / "unpacked2.hdf5"))
    assert report.equal and len(report.rows) == len(fwdtrace.compare_dumps(full, full).rows)


def _edited_index(src: Path, dst: Path, edit) -> Path:  # noqa: ANN001
    import json
    import shutil

    import h5py

    shutil.copy(src, dst)
    with h5py.File(dst, "r+") as f:
        index = json.loads(bytes(f["statistics_index"][()]))
        del f["statistics_index"]
        text = edit(index)
        f.create_dataset("statistics_index", data=list((text if isinstance(text, str) else json.dumps(text)).encode()),
                         dtype="u1")
    return dst


@pytest.mark.parametrize("edit, message", [
    (lambda i: "{", r"whose 'statistics_index' is not JSON"),
    (lambda i: {**i, "rows": i["rows"][:-1]}, r"whose 'statistics' is a float64 array of shape \(\d+, 38\), not \d+ rows"),
    (lambda i: {**i, "calls": i["calls"][1:]}, r"whose 'statistics_index' puts '000_Sequential/input0' in no call"),
    (lambda i: {**i, "rows": [[r[0], "../x", r[2], r[3]] for r in i["rows"]]}, r"whose 'statistics_index' has a row"),
    (lambda i: {**i, "calls": [[c[0], {"module_key": [1]}] for c in i["calls"]]}, r"whose 'statistics_index' has a call"),
])
def test_a_crafted_statistics_index_is_refused(tmp_path: Path, edit, message: str) -> None:  # noqa: ANN001
    stats = _dump(tmp_path, "stats", _model(), "statistics", torch.randn(2, 4))
    crafted = _edited_index(stats, tmp_path / "crafted.hdf5", edit)
    with pytest.raises(FwdtraceError, match=r"^read_dump\(\) expected a self-contained fwdtrace dump, got "
                                            rf"'.*crafted.hdf5', {message}"):
        fwdtrace.read_dump(crafted, show=False)


def test_texts_read_deflated_or_as_the_hdf5_strings_earlier_dumps_wrote(tmp_path: Path) -> None:
    import shutil

    import h5py

    model = _model()
    with fwdtrace.Dumper(tmp_path / "d", values="statistics", calls="all") as dumper:
        dumper.register(model, grads=False)
        model(torch.randn(2, 4))
    with dump.reader._Reader(dumper.paths[0], "test", 1 << 30) as r:
        graph, order = r.graph(), r.order()
    assert graph is not None and len(order) > 10
    as_string = shutil.copy(dumper.paths[0], tmp_path / "as_string.hdf5")
    with h5py.File(as_string, "r+") as f:
        for name in ("trace_graph", "statistics_index"):
            text = bytes(f[name][()]).decode()
            del f[name]
            f.create_dataset(name, data=text, dtype=h5py.string_dtype())
    with dump.reader._Reader(as_string, "test", 1 << 30) as r:
        assert r.graph().to_json() == graph.to_json() and r.order() == order


@pytest.mark.parametrize("offset", [0.0, 2.0, 3.0, 1e4])
def test_std_is_torchs_on_either_side_of_the_one_pass_formulas_reach(offset: float) -> None:
    """Within 2.6 std of 0 the spread comes from the sums (a pass fewer), farther from the deviations: torch's
    std either way, on the CPU's shorter route, the general route and in blocks."""
    t = torch.randn(5000, generator=torch.Generator().manual_seed(9)) + offset
    want = float(t.double().std(correction=0))
    for vector in (summarize(t), summarize_blocks(lambda: iter((t,)), t.numel()),
                   summarize_blocks(lambda: iter(t.split(777)), t.numel())):
        # to float32's rounding (its sums), relative to the spread, whatever the offset: the second pass about the
        # mean corrects the mean too, so block summaries merge without the offset's rounding
        assert fwdtrace.statistics.as_dict(vector)["std"] == pytest.approx(want, rel=32 * rounding(torch.float32))


def test_a_packed_step_is_the_same_written_by_the_writer_thread_or_after_a_failed_forward(tmp_path: Path) -> None:
    """The step kept in memory: the writer thread writes the same file, and a forward that raised leaves no row."""
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10))

    def step(name: str, background: bool, fail_first: bool) -> dict:
        model = _model()
        with fwdtrace.Dumper(tmp_path / name, values="statistics", background=background) as dumper:
            dumper.register(model)
            if fail_first:
                with pytest.raises(RuntimeError):
                    model(torch.randn(5, 3))  # the wrong width: the first Linear raises
            model(x).logsumexp(1).sum().backward()
        return fwdtrace.read_dump(dumper.paths[0], show=False)

    plain = step("plain", False, False)
    assert len(plain["groups"]) == 6 and plain["status"] == "complete"  # the root and its five layers
    for name, background, fail_first in (("thread", True, False), ("failed", False, True), ("both", True, True)):
        tree = step(name, background, fail_first)
        assert tree["groups"] == plain["groups"], name
        assert tree["attrs"]["discarded_forwards"] == fail_first and tree["status"] == "complete"


def _open_or_refuse(reference: Path, damaged: Path) -> str:
    """Read and compare ``damaged``: "ok", or "refused" with one FwdtraceError naming it; its peak memory bounded."""
    import tracemalloc

    tracemalloc.start()
    try:
        fwdtrace.read_dump(damaged, show=False)
        fwdtrace.compare_dumps(reference, damaged).to_text()
        outcome = "ok"
    except FwdtraceError as e:
        assert str(damaged) in str(e), str(e)
        outcome = "refused"
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 32 << 20, (damaged.name, peak)  # the file is ~10 KiB: nothing it declares is allocated beyond that
    return outcome


def test_damaged_packed_statistics_dumps_open_or_fail_with_one_error_naming_them(tmp_path: Path) -> None:
    import random

    import h5py
    import numpy as np

    model = _model()
    with fwdtrace.Dumper(tmp_path / "d", values="statistics", calls="all") as dumper:
        dumper.register(model, grads=False)
        model(torch.randn(2, 4))
    reference = next((tmp_path / "d").glob("*.hdf5"))
    data = reference.read_bytes()
    rng = random.Random(0)
    outcomes = []
    for i in range(40):  # a flipped bit anywhere
        flipped = bytearray(data)
        offset = rng.randrange(len(data))
        flipped[offset] ^= 1 << rng.randrange(8)
        (tmp_path / f"flip{i}.hdf5").write_bytes(bytes(flipped))
        outcomes.append(_open_or_refuse(reference, tmp_path / f"flip{i}.hdf5"))
    for n in range(0, len(data), len(data) // 12):  # cut short anywhere
        (tmp_path / f"cut{n}.hdf5").write_bytes(data[:n])
        assert _open_or_refuse(reference, tmp_path / f"cut{n}.hdf5") == "refused"

    def call_index(index: dict, value: object) -> dict:
        index["calls"][0][1]["call_index"] = value
        return index

    def shapes(index: dict, shape: list[int]) -> dict:
        index["rows"] = [[*r[:2], shape, r[3]] for r in index["rows"]]
        return index

    edits = {  # what the index declares, as a crafted file would
        "huge_shape": (lambda i: shapes(i, [2 ** 62, 2 ** 62]), "ok"),
        "many_dims": (lambda i: shapes(i, [2] * 500), "ok"),
        "call_index_str": (lambda i: call_index(i, "x"), "refused"),
        "call_index_huge": (lambda i: call_index(i, 10 ** 40), "refused"),
        "key_not_str": (lambda i: {**i, "calls": [[c[0], {**c[1], "module_key": 7}] for c in i["calls"]]}, "refused"),
    }
    for name, (edit, expected) in edits.items():
        crafted = _edited_index(reference, tmp_path / f"{name}.hdf5", edit)
        assert _open_or_refuse(reference, crafted) == expected, name
    # An index deflated from 64 MiB of zeros: 64 KiB of file declaring what no dump of its size holds.
    bomb = tmp_path / "bomb.hdf5"
    bomb.write_bytes(data)
    with h5py.File(bomb, "r+") as f:
        del f["statistics_index"]
        f.create_dataset("statistics_index", data=np.zeros(64 << 20, np.uint8), chunks=(1 << 22,), compression="gzip")
    assert _open_or_refuse(reference, bomb) == "refused"  # in bounded memory: it was 2 bytes of Python per byte
    with pytest.raises(FwdtraceError, match=r"where 'statistics_index' declares 67108864 bytes but stores \d+ in the "
                                            r"file, over 256 times as many: a crafted file"):
        fwdtrace.read_dump(bomb, show=False)
    assert outcomes.count("refused") >= 1  # a flip in the file's structure is refused, by name


def test_two_packed_statistics_dumps_are_judged_in_one_pass_as_row_by_row(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """compare_dumps compares two packed statistics dumps' matrices at once; every row as the row-by-row way has it."""
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(2))
    a = _dump(tmp_path, "a", _model(), "statistics", x)
    nudged = _dump(tmp_path, "nudged", _model(1.001), "statistics", x)
    at_once = fwdtrace.compare_dumps(a, nudged)
    monkeypatch.setattr(dump.reader._Reader, "packs_statistics", property(lambda self: False))
    row_by_row = fwdtrace.compare_dumps(a, nudged)
    assert [repr(r) for r in at_once.rows] == [repr(r) for r in row_by_row.rows]
    assert at_once.first_divergence == row_by_row.first_divergence == "2"
