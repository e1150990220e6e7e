"""Comparing the per-rank dumps of distributed runs: two runs rank by rank, or one run's replicas with each other."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import FwdtraceError
from .layout import MAX_TENSOR_BYTES
from .report import DumpReport

# what Dumper.register names a rank's dump under torch.distributed
_RANK_FILE_RE = re.compile(r"^(\d+)-epoch_(\d+)-step_rank(\d+)_dump\.hdf5$", re.ASCII)


@dataclass
class RanksReport(DumpReport):
    """:func:`compare_ranks`'s result: one :class:`DumpReport` per rank and the rank whose run parts first.

    ``rows`` are every rank's rows (each report's, rank by rank), ``first_divergence`` is the first
    divergence of ``first_rank``, the rank that parts first; ``reference`` is the rank the others
    were compared with in one run (None when two runs were compared). :meth:`render` and
    :meth:`to_model_explorer` draw ``first_rank``'s comparison.
    """

    by_rank: dict[int, DumpReport] = field(default_factory=dict)
    first_rank: int | None = None
    reference: int | None = None

    def render(self, path: str | os.PathLike[str], depth: int | str | None = "auto", **options: Any) -> str:
        return self._shown().render(path, depth, **options)

    def to_model_explorer(self, folder: str | os.PathLike[str]) -> Any:
        return self._shown().to_model_explorer(folder)

    def _shown(self) -> DumpReport:
        return self.by_rank[self.first_rank if self.first_rank is not None else min(self.by_rank)]

    def to_text(self, only_diverged: bool = False) -> str:
        """Each rank's table under a heading, then which rank parts first."""
        lines = []
        for rank, report in self.by_rank.items():
            what = f"rank {rank} against rank {self.reference}" if self.reference is not None else f"rank {rank}"
            lines += [f"== {what}: {Path(report.path_a).name} vs {Path(report.path_b).name}",
                      report.to_text(only_diverged)]
        if self.first_rank is None:
            lines.append("every rank agrees" if self.agree else "no rank parts, but a dump is incomplete")
        elif self.reference is not None:
            lines.append(f"rank {self.first_rank} parts from rank {self.reference} first, at {self.first_divergence}")
        else:
            lines.append(f"rank {self.first_rank} parts first, at {self.first_divergence}")
        return "\n".join(lines)


def _rank_files(folder: Path, caller: str) -> dict[int, Path]:
    """rank -> its dump in ``folder``, which holds one step's per-rank dumps."""
    if not folder.is_dir():
        raise FwdtraceError(f"{caller} expected a folder of per-rank dumps, got {str(folder)!r}, which is not a folder")
    found: dict[tuple[int, int], dict[int, Path]] = {}
    for p in sorted(folder.iterdir()):
        m = _RANK_FILE_RE.match(p.name)
        if m:
            found.setdefault((int(m[1]), int(m[2])), {})[int(m[3])] = p
    if not found:
        raise FwdtraceError(f"{caller} expected a folder of per-rank dumps (E-epoch_S-step_rankR_dump.hdf5, written "
                            f"under torch.distributed), got {str(folder)!r}, which holds none")
    if len(found) > 1:
        steps = ", ".join(f"epoch {e} step {s}" for e, s in sorted(found))
        raise FwdtraceError(f"{caller} expected one step's per-rank dumps in {str(folder)!r}, got several ({steps}): "
                            "compare one step's files with compare_dumps(), or keep each step in its own folder")
    return dict(sorted(next(iter(found.values())).items()))


def _parts_at(report: DumpReport) -> int | None:
    """Where in its run a report's first divergence is: the index of its first differing row."""
    d = report.divergence
    if d is None:
        return None
    return next((i for i, r in enumerate(report.rows) if r.group == d.group), len(report.rows))


def compare_ranks(
    a: str | os.PathLike[str], b: str | os.PathLike[str] | None = None, rtol: float = 1e-5, atol: float = 1e-8,
    max_bytes: int = MAX_TENSOR_BYTES, reference: int | None = None,
) -> RanksReport:
    """Compare two distributed runs rank by rank, or one run's ranks with each other.

    >>> report = fwdtrace.compare_ranks("run")  # doctest: +SKIP
    >>> report.first_rank, report.first_divergence  # doctest: +SKIP
    (1, 'blocks.2.mlp')

    ``a`` and ``b`` are folders of one step's per-rank dumps (``Dumper`` names them
    ``{epoch}-epoch_{step}-step_rank{r}_dump.hdf5`` under ``torch.distributed``). With both,
    each rank of ``a`` is compared with the same rank of ``b`` by :func:`compare_dumps` (the two
    runs must hold the same ranks). With ``a`` alone, every rank is compared with ``reference``
    (the lowest rank by default): replicas that should agree (data parallel ranks fed the same
    batch) and do not are found. ``first_rank`` is the rank whose comparison parts earliest in
    its step (the earliest first differing row; the lower rank on a tie), ``first_divergence``
    its call; ``by_rank`` holds each rank's :class:`DumpReport`. ``compare_dumps`` and
    ``fwdtrace dump-diff`` given two folders compare them so; ``fwdtrace dump-diff --ranks RUN``
    compares one run's ranks.
    """
    caller = "compare_ranks()"
    from .compare import compare_dumps

    files_a = _rank_files(Path(a), caller)
    if b is None:
        ref = min(files_a) if reference is None else reference
        if ref not in files_a or len(files_a) < 2:
            raise FwdtraceError(f"{caller} expected a run of two ranks or more holding reference rank {ref}, got ranks "
                                f"{sorted(files_a)} in {str(a)!r}")
        pairs = {r: (files_a[ref], p) for r, p in files_a.items() if r != ref}
    else:
        if reference is not None:
            raise FwdtraceError(f"{caller} expected reference= with one run's folder only, got two runs' folders")
        files_b = _rank_files(Path(b), caller)
        if set(files_a) != set(files_b):
            raise FwdtraceError(f"{caller} expected the same ranks in both runs, got ranks {sorted(files_a)} in "
                                f"{str(a)!r} and {sorted(files_b)} in {str(b)!r}")
        pairs = {r: (files_a[r], files_b[r]) for r in files_a}
        ref = None
    out = RanksReport(str(a), str(b if b is not None else a), rtol, atol, reference=ref)
    for rank, (pa, pb) in pairs.items():
        report = compare_dumps(pa, pb, rtol=rtol, atol=atol, max_bytes=max_bytes)
        out.by_rank[rank] = report
        out.rows += report.rows
        out.incomplete.update(report.incomplete)
        out.math.update(report.math)
        out.without_graph += [p for p in report.without_graph if p not in out.without_graph]
    parted = {r: at for r, rep in out.by_rank.items() if (at := _parts_at(rep)) is not None}
    if parted:
        out.first_rank = min(parted, key=lambda r: (parted[r], r))
        out.divergence = out.by_rank[out.first_rank].divergence
        out.first_divergence = out.by_rank[out.first_rank].first_divergence
        out.graph = out.by_rank[out.first_rank].graph
    else:
        out.graph = next((rep.graph for rep in out.by_rank.values() if rep.graph is not None), None)
    return out
