"""``fwdtrace dump-diff``: the comparison from a shell."""

from __future__ import annotations

import argparse

from ..errors import FwdtraceError
from .compare import compare_dumps
from .overflow import find_overflow
from .ranks import compare_ranks
from .report import DumpReport


def run_cli(args: argparse.Namespace) -> int:
    """Print the comparison table; 0 when the dumps agree (allclose, or within what the runs' rounding
    explains), 1 when they differ, FwdtraceError (exit 2) when a dump is incomplete or unreadable: a
    cut-short run is not a difference between runs. With ``--overflow``: where inf/NaN first appear in each
    dump given, 1 where they do. Two runs' folders of per-rank dumps are compared rank by rank; ``--ranks``
    compares one run's ranks with its lowest."""
    if getattr(args, "overflow", False):
        found = [find_overflow(path) for path in (args.a, args.b) if path is not None]
        print("\n".join(o.to_text() for o in found))
        return 1 if any(o.found for o in found) else 0
    if getattr(args, "ranks", False):
        if args.b is not None:
            raise FwdtraceError(f"dump-diff --ranks expected one run's folder, got {args.a!r} and {args.b!r}")
        report: DumpReport = compare_ranks(args.a, rtol=args.rtol, atol=args.atol)
    elif args.b is None:
        raise FwdtraceError("fwdtrace dump-diff expected two dumps to compare (or --overflow with one, or --ranks "
                            "with one run's folder), got one")
    else:
        report = compare_dumps(args.a, args.b, rtol=args.rtol, atol=args.atol)
    print(report.to_text(only_diverged=args.only_diverged))
    if args.picture is not None:
        print(f"picture: {report.render(args.picture)}")
    if args.model_explorer is not None:
        files = report.to_model_explorer(args.model_explorer)
        print(f"Model Explorer: {files.graph}, node data {', '.join(files.node_data.values())}")
    if report.incomplete:
        raise FwdtraceError("; ".join(f"{p} is {status}" for p, status in report.incomplete.items()))
    return 0 if report.agree else 1
