"""Run the notebooks top to bottom and save them with their outputs, as GitHub shows them.

Run from the repository root: ``.venv/bin/python notebooks/execute.py [notebooks/01_*.ipynb ...]``
(all of them by default). Each runs in a scratch folder, as tests/test_notebooks.py runs them,
so written pictures and dumps stay out of the repository. No timing metadata is kept, and a
cell's printed lines are one output, so that a second run changes only what is measured
(latencies) and nothing else; 05_live samples a training thread on a free port, so its
outputs differ from run to run.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).parent


def execute(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as scratch:
        # coalesce_streams: a cell's printed lines in one output, however the kernel flushed them
        NotebookClient(nb, timeout=300, kernel_name="python3", record_timing=False, coalesce_streams=True,
                       resources={"metadata": {"path": scratch}}).execute()
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, path)


def main(argv: list[str]) -> None:
    paths = [Path(a) for a in argv] or sorted(HERE.glob("*.ipynb"))
    for path in paths:
        print(f"executing {path}", flush=True)
        execute(path)


if __name__ == "__main__":
    main(sys.argv[1:])
