"""Every notebook in notebooks/ runs top to bottom; a failing cell fails the test."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path: Path, tmp_path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    # Run in a scratch folder so written pictures and dumps do not land in the repo.
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()


# notebooks that draw: their saved outputs hold the pictures, so GitHub shows them
DRAWN = {"01_hook_forward_and_graph", "02_onnx_crosscheck", "05_live", "06_recorder"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_saved_with_its_outputs(path: Path) -> None:
    """Saved from one top-to-bottom run (notebooks/execute.py), outputs and pictures included."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1))
    outputs = [o for c in code for o in c.outputs]
    assert outputs and not [o for o in outputs if o.output_type == "error"]
    pictures = [o for o in outputs if {"image/png", "image/svg+xml"} & set(o.get("data", {}))]
    assert bool(pictures) == (path.stem in DRAWN)
    # a reader's run writes elsewhere: no scratch folder of the run that saved it
    shown = json.dumps([o for o in outputs if o.output_type != "display_data"])
    assert not re.findall(r"/tmp/\w+|" + re.escape(tempfile.gettempdir() + os.sep), shown)
