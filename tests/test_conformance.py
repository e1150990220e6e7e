"""Every public entry point on every model of the corpus (tests/corpus.py), with its invariants.

One case per (model, entry point); a model's build, trace and exports are shared by its cases
(one module-scoped Run per model, the cases of a model kept on one xdist worker).
"""

from __future__ import annotations

from pathlib import Path

import corpus
import pytest

CASES = {case.name: case for case in corpus.CORPUS}


@pytest.fixture(scope="module")
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> corpus.Run:
    case = CASES[request.param]
    return corpus.Run(case, Path(tmp_path_factory.mktemp(case.name)))


@pytest.mark.parametrize("entry", list(corpus.ENTRIES))
@pytest.mark.parametrize("run", [pytest.param(name, marks=pytest.mark.xdist_group(name)) for name in CASES],
                         indirect=True)
def test_entry_point(run: corpus.Run, entry: str) -> None:
    corpus.run_entry(run, entry)
