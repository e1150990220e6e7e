"""HDF5 dumps of every module call in one training step, and their comparison.

Layout (one file per registration): ``{directory}/{epoch}-epoch_{step}-step_dump.hdf5``
(``..._rank{r}_dump.hdf5`` under ``torch.distributed``), one group per module call named
``{NNN}_{ClassName}`` in call order, holding datasets ``input0``, ``output0``,
``grad_input0``, ``grad_output0``, ... Each tensor is written when its hook fires, never
gathered in memory first. h5py is imported only here, when a dump is made or read.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ._tree import dtype_name, iter_tensors
from .errors import FwdtraceError, describe
from .keys import key2module

__all__ = ["Dumper", "read_dump", "compare_dumps", "DumpReport", "DumpRow", "configure_parser", "run_cli"]

FORMAT_ATTR = "fwdtrace_dump"
FORMAT_VERSION = 1
ORDER_DATASET = "execution_order"
_GROUP_RE = re.compile(r"^(\d+)_(\w+)$")

# dtypes HDF5 has no type for: stored as the integer bit pattern of the same size.
_BITS_AS: dict[torch.dtype, torch.dtype] = {torch.bfloat16: torch.int16}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _BITS_AS[getattr(torch, _name)] = torch.uint8
_STR2DTYPE = {dtype_name(d): d for d in _BITS_AS}


def _h5py() -> Any:
    try:
        import h5py
    except ImportError as e:  # pragma: no cover - h5py is a dependency
        raise FwdtraceError("HDF5 dumps need h5py: pip install h5py") from e
    return h5py


@dataclass
class _Call:
    """One module call's group, with its name (asking HDF5 for a group's name is slow)."""

    name: str
    group: Any


class _Recording:
    """One registration: the open file, the hooks, and the call bookkeeping."""

    def __init__(
        self, path: Path, model: torch.nn.Module, epoch: int, step: int, rank: int | None, grads: bool
    ) -> None:
        h5py = _h5py()
        self.path = path
        self.file = h5py.File(path, "w", track_order=True)
        self.file.attrs[FORMAT_ATTR] = FORMAT_VERSION
        self.file.attrs["model"] = type(model).__name__
        self.file.attrs["epoch"] = epoch
        self.file.attrs["step"] = step
        if rank is not None:
            self.file.attrs["rank"] = rank
        self.order: list[str] = []  # "group/dataset" of every tensor, in the order written
        self.calls = 0
        self.path2calls: dict[str, int] = {}
        self.module2calls: dict[int, list[_Call]] = {}  # calls not yet through backward, per module
        self.open_calls: dict[int, list[_Call]] = {}  # calls whose forward is running, per module
        self.skipped: list[str] = []
        self.forward_handles: list[Any] = []
        self.backward_handles: list[Any] = []
        self.forward_done = False
        self._register(model, grads)

    def _register(self, model: torch.nn.Module, grads: bool) -> None:
        root = model
        for key, module in key2module(model).items():
            path = key[: -len(type(module).__name__) - 1] if module is not root else ""
            self.forward_handles.append(
                module.register_forward_pre_hook(self._pre_hook(key, path), with_kwargs=True)
            )
            self.forward_handles.append(
                module.register_forward_hook(self._post_hook(module is root), with_kwargs=True)
            )
            if grads:
                self.backward_handles.append(module.register_full_backward_hook(self._grad_hook))

    def _write(self, call: _Call, name: str, t: torch.Tensor) -> None:
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        store_as = _BITS_AS.get(t.dtype)
        if store_as is not None:
            arr = t.contiguous().view(store_as).numpy()
        else:
            arr = t.resolve_conj().resolve_neg().contiguous().numpy()
        ds = call.group.create_dataset(name, data=arr)
        if store_as is not None:
            # Lossless: the raw bits; read_dump/compare_dumps view them back as this dtype.
            ds.attrs["torch_dtype"] = dtype_name(t.dtype)
        self.order.append(f"{call.name}/{name}")

    def _write_all(self, call: _Call, prefix: str, obj: Any) -> None:
        for i, (_, t) in enumerate(iter_tensors(obj, prefix)):
            self._write(call, f"{prefix}{i}", t)

    def _note_skipped(self, call: _Call, output: Any) -> None:
        # Non-tensor results (None, ints, strings) get no dataset: say so in the attributes.
        parts = list(enumerate(output)) if isinstance(output, (tuple, list)) else [(None, output)]
        notes = [
            f"output{'' if j is None else f'[{j}]'}: {describe(part)}"
            for j, part in parts
            if part is not None and not isinstance(part, torch.Tensor) and not any(True for _ in iter_tensors(part))
        ] + [f"output[{j}]: None" for j, part in parts if part is None]
        if notes:
            call.group.attrs["skipped"] = "; ".join(notes)
            self.skipped += [f"{call.name} {n}" for n in notes]

    def _pre_hook(self, key: str, path: str) -> Any:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if self.forward_done:
                return
            call_index = self.path2calls.get(path, 0)
            self.path2calls[path] = call_index + 1
            name = f"{self.calls:03d}_{type(module).__name__}"
            call = _Call(name, self.file.create_group(name, track_order=True))
            call.group.attrs["module_key"] = key
            call.group.attrs["module_path"] = path
            call.group.attrs["call_index"] = call_index
            self.calls += 1
            self._write_all(call, "input", (args, kwargs) if kwargs else args)
            self.open_calls.setdefault(id(module), []).append(call)

        return hook

    def _post_hook(self, is_root: bool) -> Any:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, result: Any) -> None:
            stack = self.open_calls.get(id(module))
            if self.forward_done or not stack:
                return
            call = stack.pop()
            self._write_all(call, "output", result)
            self._note_skipped(call, result)
            self.module2calls.setdefault(id(module), []).append(call)
            if is_root:
                # The step's forward is over. The backward hooks of the calls recorded stay
                # attached to their autograd graph; later forwards get none.
                self.forward_done = True
                for h in self.forward_handles + self.backward_handles:
                    h.remove()

        return hook

    def _grad_hook(self, module: torch.nn.Module, grad_input: tuple, grad_output: tuple) -> None:
        calls = self.module2calls.get(id(module))
        if not calls or not self.file:
            return
        call = calls.pop()  # backward visits a module's calls last first
        for prefix, grads in (("grad_output", grad_output), ("grad_input", grad_input)):
            for i, g in enumerate(grads):
                if isinstance(g, torch.Tensor):
                    self._write(call, f"{prefix}{i}", g)

    def close(self) -> None:
        for h in self.forward_handles + self.backward_handles:
            h.remove()
        if self.file:
            self.file.attrs["calls"] = self.calls
            # One dataset at the end instead of an attribute per tensor: attributes cost more
            # than small datasets. Without it (a file never closed) group order is used.
            self.file.create_dataset(ORDER_DATASET, data=self.order, dtype=_h5py().string_dtype())
            if self.skipped:
                self.file.attrs["skipped"] = "\n".join(self.skipped)
            self.file.close()


class Dumper:
    """Dump every module call's inputs, outputs and gradients of one training step to HDF5.

    >>> import tempfile, torch, fwdtrace
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> dumper = fwdtrace.Dumper(tempfile.mkdtemp())
    >>> dumper.register(model, epoch=0, step=3)
    >>> model(torch.ones(1, 2)).sum().backward()
    >>> [p.name for p in dumper.remove()]
    ['0-epoch_3-step_dump.hdf5']

    The next forward after :meth:`register` and its backward are dumped; later
    forwards are not. :meth:`remove` takes the hooks off, closes the files and
    returns their paths. Gradients of a module called several times are matched to
    its calls last first, the order backward visits them.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        if not isinstance(directory, (str, os.PathLike)):
            raise FwdtraceError(f"Dumper expected a directory path, got {describe(directory)}")
        self.directory = Path(directory)
        self._recordings: list[_Recording] = []
        self._written: list[Path] = []

    def register(self, model: torch.nn.Module, epoch: int = 0, step: int = 0, grads: bool = True) -> None:
        """Hook ``model`` so its next forward and backward are written to this step's file.

        Gradients come from ``register_full_backward_hook``, which torch refuses for a module
        whose output a later module changes in place (``ReLU(inplace=True)``); dump such a
        model with ``grads=False`` (inputs and outputs only).
        """
        if not isinstance(model, torch.nn.Module):
            raise FwdtraceError(f"Dumper.register() expected a torch.nn.Module, got {describe(model)}")
        rank = None
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
        suffix = f"_rank{rank}" if rank is not None else ""
        path = self.directory / f"{epoch}-epoch_{step}-step{suffix}_dump.hdf5"
        self._check_writable()
        if any(r.path == path for r in self._recordings):
            raise FwdtraceError(f"Dumper.register() expected a new epoch/step, got {path.name} which is still open")
        try:
            recording = _Recording(path, model, epoch, step, rank, grads)
        except OSError as e:
            raise FwdtraceError(f"Dumper.register() could not create {path}: {e}") from e
        self._recordings.append(recording)

    def _check_writable(self) -> None:
        # Fail here, before a training step runs, rather than in the middle of a hook.
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=self.directory):
                pass
        except OSError as e:
            raise FwdtraceError(
                f"Dumper.register() expected a writable directory, got {str(self.directory)!r}: {e.strerror or e}"
            ) from e

    def remove(self) -> list[Path]:
        """Remove the hooks, close the files and return the paths written (by this dumper, so far)."""
        while self._recordings:
            recording = self._recordings.pop(0)
            recording.close()
            self._written.append(recording.path)
        return list(self._written)

    def __enter__(self) -> Dumper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


# -- reading --------------------------------------------------------------------------------------
def _open(path: str | os.PathLike[str], caller: str) -> Any:
    h5py = _h5py()
    p = Path(path)
    if not p.is_file():
        raise FwdtraceError(f"{caller} expected an HDF5 dump file, got {str(p)!r}, which does not exist")
    try:
        f = h5py.File(p, "r")
    except OSError as e:
        raise FwdtraceError(f"{caller} expected an HDF5 dump file, got {str(p)!r}, which HDF5 cannot open: {e}") from e
    if not any(_GROUP_RE.match(name) for name in f) and FORMAT_ATTR not in f.attrs:
        f.close()
        raise FwdtraceError(
            f"{caller} expected a dump with groups named NNN_ClassName, got {str(p)!r}, an HDF5 file "
            "in another layout"
        )
    return f


def _groups(f: Any) -> list[tuple[str, Any]]:
    """The call groups in call order (numeric prefix; the name alone sorts wrong past 999)."""
    found = [(name, f[name]) for name in f if _GROUP_RE.match(name)]
    return sorted(found, key=lambda item: int(item[0].split("_", 1)[0]))


def _execution_order(f: Any) -> list[tuple[str, str]]:
    """(group, dataset) of every tensor in the order the run wrote them."""
    if ORDER_DATASET in f:
        return [tuple(s.decode().split("/", 1)) for s in f[ORDER_DATASET][()]]
    return [(gname, dname) for gname, group in _groups(f) for dname in group]


def _load(ds: Any) -> torch.Tensor:
    import numpy as np

    arr = np.asarray(ds[()])
    t = torch.from_numpy(arr.copy()) if arr.ndim else torch.tensor(arr)
    dtype = _STR2DTYPE.get(str(ds.attrs.get("torch_dtype", "")))
    return t.view(dtype) if dtype is not None else t


def _attr(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def read_dump(path: str | os.PathLike[str], show: bool = True, values: bool = False) -> dict[str, Any]:
    """Print the tree of a dump and return it as a dict.

    >>> import tempfile, torch, fwdtrace
    >>> d = fwdtrace.Dumper(tempfile.mkdtemp()); model = torch.nn.Linear(2, 1)
    >>> d.register(model); _ = model(torch.ones(1, 2))
    >>> tree = fwdtrace.read_dump(d.remove()[0], show=False)
    >>> tree["groups"]["000_Linear"]["datasets"]["output0"]
    {'shape': [1, 1], 'dtype': 'float32'}

    ``{"attrs": {...}, "groups": {name: {"attrs": {...}, "datasets": {name: {"shape", "dtype"}}}}}``;
    with ``values=True`` each dataset also holds its tensor under ``"value"``.
    """
    with _open(path, "read_dump()") as f:
        tree: dict[str, Any] = {"attrs": {k: _attr(v) for k, v in f.attrs.items()}, "groups": {}}
        lines = [f"{Path(path).name}: {len(_groups(f))} module calls"]
        for name, group in _groups(f):
            datasets: dict[str, Any] = {}
            for dname, ds in group.items():
                dtype = str(ds.attrs.get("torch_dtype", ds.dtype))
                entry: dict[str, Any] = {"shape": list(ds.shape), "dtype": dtype}
                if values:
                    entry["value"] = _load(ds)
                datasets[dname] = entry
            attrs = {k: _attr(v) for k, v in group.attrs.items()}
            tree["groups"][name] = {"attrs": attrs, "datasets": datasets}
            lines.append(f"{name}  {attrs.get('module_key', '')}")
            lines += [f"    {d:<14} {e['dtype']}{e['shape']}" for d, e in datasets.items()]
    if show:
        print("\n".join(lines))
    return tree


# -- comparing ------------------------------------------------------------------------------------
@dataclass
class DumpRow:
    """One tensor of dump ``a`` against the same tensor of dump ``b``."""

    group: str
    key: str
    module_path: str
    name: str
    shape: list[int]
    cosine: float | None
    max_abs: float | None
    max_rel: float | None
    allclose: bool
    note: str = ""


@dataclass
class DumpReport:
    """The rows of :func:`compare_dumps`, in execution order, and where the runs first differ."""

    path_a: str
    path_b: str
    rtol: float
    atol: float
    rows: list[DumpRow] = field(default_factory=list)
    first_divergence: str | None = None

    @property
    def equal(self) -> bool:
        return all(r.allclose for r in self.rows)

    def to_text(self, only_diverged: bool = False) -> str:
        """The table the ``fwdtrace dump-diff`` command prints."""
        header = ("#", "group", "key", "name", "shape", "cosine", "max_abs", "max_rel", "allclose")
        body = []
        for i, r in enumerate(self.rows):
            if only_diverged and r.allclose:
                continue
            body.append((
                str(i), r.group, r.key, r.name, "x".join(map(str, r.shape)) or "scalar",
                _num(r.cosine), _num(r.max_abs), _num(r.max_rel), ("yes" if r.allclose else "NO") + (f" ({r.note})" if r.note else ""),
            ))
        widths = [max(len(h), *(len(row[j]) for row in body)) if body else len(h) for j, h in enumerate(header)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [header, *body]]
        if self.equal:
            lines.append(f"equal: {len(self.rows)} tensors allclose (rtol={self.rtol:g}, atol={self.atol:g})")
        else:
            bad = sum(not r.allclose for r in self.rows)
            lines.append(f"{bad} of {len(self.rows)} tensors differ; first divergence: {self.first_divergence}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_text()


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}"


def _compare(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> tuple[float, float, float, bool]:
    if a.is_complex() or b.is_complex():
        a, b = torch.view_as_real(a.to(torch.complex128)), torch.view_as_real(b.to(torch.complex128))
    a, b = a.to(torch.float64).reshape(-1), b.to(torch.float64).reshape(-1)
    close = bool(torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True))
    if a.numel() == 0:
        return 1.0, 0.0, 0.0, close
    diff = (a - b).abs()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    diff = torch.where(same, torch.zeros_like(diff), diff)  # inf == inf and nan vs nan are no difference
    scale = torch.maximum(a.abs(), b.abs())
    rel = torch.where(diff == 0, torch.zeros_like(diff), diff / scale)
    na, nb = a.norm(), b.norm()
    if na == 0 and nb == 0:
        cosine = 1.0
    elif na == 0 or nb == 0 or not (torch.isfinite(na) and torch.isfinite(nb)):
        cosine = 1.0 if close else math.nan
    else:
        cosine = float((a @ b) / (na * nb))
    return cosine, float(diff.max()), float(rel.max()), close


def compare_dumps(
    a: str | os.PathLike[str], b: str | os.PathLike[str], rtol: float = 1e-5, atol: float = 1e-8
) -> DumpReport:
    """Compare two dumps tensor by tensor, in the order the first run wrote them.

    >>> import tempfile, torch, fwdtrace
    >>> paths = []
    >>> for scale in (1.0, 2.0):
    ...     d = fwdtrace.Dumper(tempfile.mkdtemp()); model = torch.nn.Sequential(torch.nn.Linear(1, 1))
    ...     _ = torch.nn.init.constant_(model[0].weight, scale); d.register(model); _ = model(torch.ones(1, 1))
    ...     paths += d.remove()
    >>> fwdtrace.compare_dumps(*paths).first_divergence
    '0'

    ``first_divergence`` is the module path of the first module whose outputs differ
    (the root model is named by its class), else of the first whose gradients differ,
    else None. A tensor missing from ``b`` or of another shape is a differing row.
    """
    report = DumpReport(str(a), str(b), rtol, atol)
    with _open(a, "compare_dumps()") as fa, _open(b, "compare_dumps()") as fb:
        for gname, dname in _execution_order(fa):
            ga = fa[gname]
            key = str(_attr(ga.attrs.get("module_key", gname)))
            path = str(_attr(ga.attrs.get("module_path", "")))
            ta = _load(ga[dname])
            row = DumpRow(gname, key, path, dname, list(ta.shape), None, None, None, False)
            if gname not in fb or dname not in fb[gname]:
                row.note = "missing in b"
            else:
                tb = _load(fb[gname][dname])
                if ta.shape != tb.shape:
                    row.note = f"shape {list(tb.shape)} in b"
                else:
                    row.cosine, row.max_abs, row.max_rel, row.allclose = _compare(ta, tb, rtol, atol)
            report.rows.append(row)
        names_a = {name for name, _ in _groups(fa)}
        for gname, group in _groups(fb):
            if gname not in names_a:  # calls that only run b made
                report.rows.append(DumpRow(gname, str(_attr(group.attrs.get("module_key", gname))),
                                           str(_attr(group.attrs.get("module_path", ""))), "*", [],
                                           None, None, None, False, "missing in a"))
    for prefix in ("output", "grad_input", ""):
        row_found = next((r for r in report.rows if not r.allclose and r.name.startswith(prefix)), None)
        if row_found is not None:
            report.first_divergence = row_found.module_path or row_found.key
            break
    return report


# -- command line ---------------------------------------------------------------------------------
def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``fwdtrace dump-diff a.hdf5 b.hdf5``."""
    parser.add_argument("a", help="first dump (.hdf5)")
    parser.add_argument("b", help="second dump (.hdf5)")
    parser.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance (default 1e-5)")
    parser.add_argument("--atol", type=float, default=1e-8, help="absolute tolerance (default 1e-8)")
    parser.add_argument("--only-diverged", action="store_true", help="print only the rows that differ")


def run_cli(args: argparse.Namespace) -> int:
    """Print the comparison table; 0 when the dumps agree, 1 when they differ."""
    report = compare_dumps(args.a, args.b, rtol=args.rtol, atol=args.atol)
    print(report.to_text(only_diverged=args.only_diverged))
    return 0 if report.equal else 1
