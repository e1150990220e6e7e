"""The conformance suite over real models: every public entry point on torchvision and timm.

    python benchmarks/conformance_real.py run [--family torchvision-detection ...] [--start 0 --stop 20]
        [--only NAME ...] [--entry trace --entry to_onnx ...] [--out out/conformance_real.jsonl] [--again]
        [--jobs N]
    python benchmarks/conformance_real.py table [--out out/conformance_real.jsonl]

``run --corpus`` runs ``make test``'s own rows (tests/corpus.py's ``CORPUS``) the same way, for a
table of them. A row of an entry ``numeric[x]`` also keeps the numeric check's one-line answer
(``lead``: where a divergence starts, or that none was found), which ``table`` lists.

The models are ``tests/corpus.py``'s :func:`real_cases` (built from their constructors with
random weights: nothing is downloaded) and the entry points and invariants are that module's
``ENTRIES``, the ones ``make test`` runs on the small corpus: one implementation of both.
``run`` appends one JSON line per (model, entry point) to ``--out`` as it goes and skips
the pairs already there (``--again`` runs them anew), so a long run can go in chunks;
``table`` writes the Markdown summary beside it (``.md``) and prints it: per family and
entry point, how many models pass, fail an invariant or raise, then every failing cell
with its message. Each entry point gets ``--entry-timeout`` seconds (a timeout is a row).
``--jobs N`` runs each model in a child process of its own, N at a time (one torch thread each): a
machine with many cores gets through the table in a fraction of the time, and a model whose
process dies (a crash in a native library, the memory killer) leaves a row saying so instead of
ending the run.

Needs torchvision and timm beside fwdtrace: ``make bench-real`` sets up ``.venv-real``
(torch 2.14.1 with torchvision 0.29.1, whose wheel runs on this CPU) and runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import corpus  # noqa: E402
import torch  # noqa: E402

import fwdtrace  # noqa: E402
from fwdtrace.onnx.export import _cause_chain  # noqa: E402

OUT = Path("out/conformance_real.jsonl")


class EntryTimeout(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    def expire(signum: int, frame: Any) -> None:
        raise EntryTimeout(f"over {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _done(path: Path) -> set[tuple[str, str]]:
    if not path.exists():
        return set()
    with path.open() as f:
        return {(row["model"], row["entry"]) for row in map(json.loads, f)}


def run_case(case: corpus.Case, entries: list[str], out: Path, timeout: int) -> None:
    with tempfile.TemporaryDirectory() as workdir:
        run = corpus.Run(case, Path(workdir))
        for entry in entries:
            start = time.perf_counter()
            row: dict[str, Any] = {"model": case.name, "family": case.family, "entry": entry}
            try:
                with _time_limit(timeout):
                    corpus.run_entry(run, entry)
            except AssertionError as e:
                row.update(status="FAIL", message=str(e)[:600])
            except EntryTimeout as e:
                row.update(status="timeout", message=str(e))
            except fwdtrace.FwdtraceError as e:  # an exporter that cannot export the model is not fwdtrace's defect
                # a limit that fired inside an export or a layout, said in fwdtrace's words, is still a timeout
                status = ("timeout" if any(isinstance(c, EntryTimeout) for c in _cause_chain(e)) else
                          "exporter failed" if "ONNX exporter failed" in str(e) else "error")
                row.update(status=status, message=f"FwdtraceError: {e}"[:600])
            except Exception as e:
                row.update(status="error", message=f"{type(e).__name__}: {e}"[:600])
            else:
                row["status"] = "pass"
            row["seconds"] = round(time.perf_counter() - start, 2)
            lead = corpus.numeric_lead(run, entry)
            if lead:  # the numeric check's answer, pass or not: where a divergence is, it says where it starts
                row["lead"] = lead[:600]
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{case.name:50s} {entry:26s} {row['status']:15s} {row['seconds']:7.1f}s "
                  f"{row.get('message', '')[:140]!r}", flush=True)
    del run
    gc.collect()


def run_in_children(cases: list[corpus.Case], entries: list[str], argv: list[str], out: Path, jobs: int) -> None:
    """Each case by a child process ``run --only NAME`` with the same options, ``jobs`` at a time.

    A child that dies leaves one ``error`` row for the entry point it was on (the first it had not
    written), so that the table shows it and a resumed run goes on past it.
    """
    pending = list(cases)
    running: dict[subprocess.Popen[bytes], corpus.Case] = {}
    try:
        while pending or running:
            while pending and len(running) < jobs:
                case = pending.pop(0)
                command = [sys.executable, __file__, "run", *argv, *(f"--entry={e}" for e in entries),
                           "--only", case.name, "--jobs", "1"]
                running[subprocess.Popen(command, preexec_fn=_die_with_parent)] = case
            child = next((p for p in running if p.poll() is not None), None)
            if child is None:
                time.sleep(0.5)
                continue
            case = running.pop(child)
            if child.returncode != 0:
                written = {e for m, e in _done(out) if m == case.name}
                entry = next((e for e in entries if e not in written), entries[0])
                how = f"signal {-child.returncode}" if child.returncode < 0 else f"exit status {child.returncode}"
                row = {"model": case.name, "family": case.family, "entry": entry, "status": "error",
                       "message": f"the process running this model died ({how})", "seconds": 0.0}
                with out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(f"{case.name:50s} {entry:26s} died ({how})", flush=True)
    finally:  # Ctrl-C or an error here: no model goes on running without the run that started it
        for child in running:
            child.kill()
            child.wait()


def _die_with_parent() -> None:
    """In a child, before it runs: the kernel ends it when this process dies, even by SIGKILL (Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def table(path: Path) -> str:
    latest: dict[tuple[str, str], dict[str, Any]] = {}
    with path.open() as f:
        for row in map(json.loads, f):
            latest[row["model"], row["entry"]] = row
    rows = list(latest.values())
    statuses = ("pass", "FAIL", "error", "timeout", "exporter failed")
    lines = [f"{len({r['model'] for r in rows})} models, {len(rows)} cells: "
             + ", ".join(f"{sum(r['status'] == s for r in rows)} {s}" for s in statuses), "",
             "| family | entry point | models | pass | FAIL | error | timeout | exporter failed |",
             "|---|---|---|---|---|---|---|---|"]
    for family in dict.fromkeys(r["family"] for r in rows):
        for entry in corpus.ENTRIES:
            cells = [r for r in rows if r["family"] == family and r["entry"] == entry]
            if cells:
                lines.append(f"| {family} | {entry} | {len(cells)} | "
                             + " | ".join(str(sum(r["status"] == s for r in cells)) for s in statuses) + " |")
    lines += ["", "Cells that do not pass (an exporter's own failure aside):", ""]
    for r in rows:
        if r["status"] not in ("pass", "exporter failed"):
            message = " ".join(r.get("message", "").split())[:240].replace("|", "\\|")
            lines.append(f"- {r['model']} `{r['entry']}` {r['status']}: {message}")
    answers = [r for r in rows if r.get("lead")]
    if answers:
        lines += ["", "The numeric check's answers:", "", "| model | entry point | cell | answer |", "|---|---|---|---|"]
        for r in answers:
            lead = r["lead"][:300].replace("|", "\\|")
            lines.append(f"| {r['model']} | {r['entry']} | {r['status']} | {lead} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run")
    run.add_argument("--family", action="append", help="torchvision-detection, torchvision-segmentation, "
                                                       "torchvision, timm (default: all)")
    run.add_argument("--only", nargs="*", default=None, help="model names, with or without the family prefix")
    run.add_argument("--start", type=int, default=0)
    run.add_argument("--stop", type=int, default=None)
    run.add_argument("--entry", action="append", choices=list(corpus.ENTRIES))
    run.add_argument("--entry-timeout", type=int, default=600)
    run.add_argument("--again", action="store_true", help="run pairs already in --out again")
    run.add_argument("--out", type=Path, default=OUT)
    run.add_argument("--corpus", action="store_true",
                     help="the rows of make test's corpus (tests/corpus.py's CORPUS) instead of the real models")
    run.add_argument("--jobs", type=int, default=1,
                     help="models run at once, each in a child process (default 1: in this process)")
    tab = sub.add_parser("table")
    tab.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    if args.command == "table":
        text = table(args.out)
        args.out.with_suffix(".md").write_text(text + "\n")
        print(text)
        return 0
    torch.set_num_threads(int(os.environ.get("FWDTRACE_BENCH_THREADS", "1")))  # the machine is shared
    cases = [c for c in (corpus.CORPUS if args.corpus else corpus.real_cases()) if not args.family or c.family in args.family]
    if args.only:
        cases = [c for c in cases if c.name in args.only or c.name.split("/", 1)[-1] in args.only]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    done = set() if args.again else _done(args.out)
    todo = [c for c in cases[args.start:args.stop]
            if any((c.name, e) not in done for e in args.entry or corpus.ENTRIES)]
    if args.jobs > 1:
        passed = [f"--entry-timeout={args.entry_timeout}", f"--out={args.out}", *(["--again"] if args.again else []),
                  *(["--corpus"] if args.corpus else [])]
        run_in_children(todo, list(args.entry or corpus.ENTRIES), passed, args.out, args.jobs)
        return 0
    for case in todo:
        entries = [e for e in args.entry or corpus.ENTRIES if (case.name, e) not in done]
        run_case(case, entries, args.out, args.entry_timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
