"""``fwdtrace dump-diff``: the comparison from a shell."""

from __future__ import annotations

import argparse

from ..errors import FwdtraceError
from .compare import compare_dumps
from .ranks import compare_ranks
from .report import DumpReport


def run_cli(args: argparse.Namespace) -> int:
    """Print the comparison table; 0 when the dumps agree (allclose, or within what the runs' rounding
    explains), 1 when they differ, FwdtraceError (exit 2) when a dump is incomplete or unreadable: a
    cut-short run is not a difference between runs."""
    if getattr(args, "ranks", False):
        if args.b is not None:
            raise FwdtraceError(f"dump-diff --ranks expected one run's folder, got {args.a!r} and {args.b!r}")
        report: DumpReport = compare_ranks(args.a, rtol=args.rtol, atol=args.atol)
    elif args.b is None:
        raise FwdtraceError(f"dump-diff expected two dumps (or two runs' folders), got {args.a!r} alone; "
                            "--ranks compares one run's ranks with each other")
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
