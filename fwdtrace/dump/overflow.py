"""One run alone: where inf and NaN first appear in a dump, forward and backward (``find_overflow``)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..statistics import as_dict
from .layout import MAX_TENSOR_BYTES
from .reader import _attr, _max_bytes, _Reader


@dataclass(frozen=True)
class Overflow:
    """The call where inf or NaN first appear in one pass of a run, and in which of its tensors.

    ``name`` is as :attr:`fwdtrace.DumpReport.first_divergence` names a call (a module by its path,
    a function call by its key); ``key`` and ``call_index`` say which call of that key it is.
    ``source`` is False where no call makes them from finite tensors (the step's own inputs, or the
    pass's first gradient, already hold them): the call named is then the first to hold them.
    """

    name: str
    key: str
    call_index: int
    group: str
    tensor: str  # "output0", "grad_input1"
    infs: int
    nans: int
    count: int  # the tensor's elements
    source: bool = True

    def __str__(self) -> str:
        how = "from finite inputs" if self.source else "already in what it was given"
        return (f"{self.name} (call {self.call_index} of {self.key}): {self.tensor} holds {self.infs} inf and "
                f"{self.nans} NaN of {self.count} ({how})")


@dataclass
class OverflowReport:
    """Where inf and NaN first appear in one dump: :func:`find_overflow`'s answer."""

    path: str
    forward: Overflow | None = None
    backward: Overflow | None = None

    @property
    def found(self) -> bool:
        """Whether the run holds inf or NaN anywhere it was dumped."""
        return self.forward is not None or self.backward is not None

    def to_text(self) -> str:
        """What ``fwdtrace dump-diff --overflow`` prints."""
        name = Path(self.path).name
        if not self.found:
            return f"{name}: no inf or NaN in any tensor dumped"
        return "\n".join(f"{name}: {label}: {'none' if o is None else o}"
                         for label, o in (("forward", self.forward), ("backward", self.backward)))

    def __str__(self) -> str:
        return self.to_text()


def _nonfinite(reader: _Reader, gname: str, dname: str) -> tuple[int, int]:
    """(infs, nans) of one tensor: counted block by block from its values, or read from its statistics."""
    if reader.statistics:
        stats = as_dict(reader.summary(gname, dname))
        return int(stats["infs"]), int(stats["nans"])
    infs = nans = 0
    for block in reader.blocks(gname, dname):
        if block.is_floating_point() or block.is_complex():
            infs += int(torch.isinf(block).sum())
            nans += int(torch.isnan(block).sum())
    return infs, nans


def find_overflow(path: str | os.PathLike[str], max_bytes: int = MAX_TENSOR_BYTES) -> OverflowReport:
    """Where inf or NaN first appear in one dump, in its forward and in its backward.

    >>> import tempfile, torch, fwdtrace
    >>> d = fwdtrace.Dumper(tempfile.mkdtemp(), calls="all")
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Softplus()); d.register(model, grads=False)
    >>> _ = torch.nn.init.constant_(model[0].weight, 3e38); _ = model(torch.ones(1, 2))
    >>> fwdtrace.find_overflow(d.remove()[0]).forward.name
    '0'

    Forward: the earliest call to finish whose inputs are finite and whose outputs hold inf or NaN
    (the overflowing ``q @ k.T``, not the mask applied after it). Backward: the earliest call of the
    backward pass whose incoming gradients (``grad_output``) are finite and whose outgoing ones
    (``grad_input``) are not. Where no call makes them from finite tensors, the first call that
    holds them, with ``source`` False. A full dump's tensors are counted block by block, a
    statistics dump's read from their NaN and inf counts. ``fwdtrace dump-diff --overflow A``
    prints the same.
    """
    max_bytes = _max_bytes(max_bytes, "find_overflow()")
    report = OverflowReport(str(path))
    with _Reader(path, "find_overflow()", max_bytes) as reader:
        order = reader.order()
        counts = {(g, d): _nonfinite(reader, g, d) for g, d in order}
        report.forward = _first(reader, order, counts, "input", "output")
        report.backward = _first(reader, order, counts, "grad_output", "grad_input")
    return report


def _first(reader: _Reader, order: list[tuple[str, str]], counts: dict[tuple[str, str], tuple[int, int]],
           given: str, made: str) -> Overflow | None:
    """The first call (by when its ``made`` tensors were written) whose ``given`` tensors are finite and whose
    ``made`` ones are not; else the first ``made`` tensor that holds inf or NaN."""
    made_first: dict[str, int] = {}
    for i, (g, d) in enumerate(order):
        if _is(d, made):
            made_first.setdefault(g, i)
    group2names: dict[str, list[str]] = {}
    for g, d in order:
        group2names.setdefault(g, []).append(d)
    fallback = None
    for g in sorted(made_first, key=made_first.__getitem__):
        names = group2names[g]
        bad = [d for d in names if _is(d, made) and any(counts[g, d])]
        if not bad:
            continue
        source = not any(any(counts[g, d]) for d in names if _is(d, given))
        found = _overflow(reader, g, bad[0], counts[g, bad[0]], source)
        if source:
            return found
        fallback = fallback or found
    return fallback


def _is(dname: str, prefix: str) -> bool:
    """Whether a tensor's name is of ``prefix``'s kind: ``input0`` is an input, ``grad_input0`` is not."""
    return dname.startswith(prefix) and (prefix.startswith("grad") or not dname.startswith("grad"))


def _overflow(reader: _Reader, gname: str, dname: str, counts: tuple[int, int], source: bool) -> Overflow:
    attrs = reader.name2group[gname].attrs
    key = str(_attr(attrs.get("module_key", gname)))
    path = str(_attr(attrs.get("module_path", "")))
    name = key if "function" in attrs else path or key
    return Overflow(name, key, int(_attr(attrs.get("call_index", 0))), gname, dname, counts[0], counts[1],
                    math.prod(reader.shape(gname, dname)), source)
