"""No blame by proxy: a layer whose weights differ is the call the report names and outlines, in every mode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import fwdtrace


class TwoResiduals(nn.Module):
    """Two Linear layers, each followed by an ``add``: the two adds share the key ``add``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.a(x)
        return x + self.b(x)


def _runs(tmp_path: Path, calls: str, values: str) -> tuple[fwdtrace.DumpReport, list[tuple[torch.Tensor, torch.Tensor]]]:
    paths, outputs = [], []
    for name, nudge in (("a", 0.0), ("b", 0.1)):
        torch.manual_seed(0)
        model = TwoResiduals()
        with torch.no_grad():
            model.b.weight[0, 0] += nudge  # the known place: layer b, run b
        seen: list[torch.Tensor] = []
        handles = [m.register_forward_hook(lambda m, i, o, seen=seen: seen.append(o.detach().clone())) for m in (model.a, model.b)]
        with fwdtrace.Dumper(tmp_path / name, calls=calls, values=values) as dumper:
            dumper.register(model, grads=False)
            model(torch.linspace(-1, 1, 8).reshape(2, 4))
        for h in handles:
            h.remove()
        paths += dumper.paths
        outputs.append(seen)
    return fwdtrace.compare_dumps(*paths), list(zip(*outputs, strict=True))


@pytest.mark.parametrize("values", ["tensors", "statistics"])
@pytest.mark.parametrize("calls", ["functions", "all"])
def test_a_changed_linear_is_named_and_alone_outlined(tmp_path: Path, calls: str, values: str) -> None:
    report, (out_a, out_b) = _runs(tmp_path, calls, values)
    # the reference, by plain hooks: layer a's outputs equal in both runs, layer b's not
    assert torch.equal(*out_a) and not torch.allclose(*out_b)
    # named itself in both: a call of the dump, or one it does not hold, read where the add takes its output in
    assert report.first_divergence == "b" and report.first_call == ("b.Linear", 0)
    if calls == "all":
        assert report.starts_inside is None
    else:  # a Linear is no call of a dump of function calls: the report says the difference starts inside it
        assert report.starts_inside == ("b.Linear", 0)
        assert "starts inside b.Linear (call 0)" in report.to_text()
        # its row is its output as the add read it; the add's other input, layer a's output, is equal
        (row,) = [r for r in report.rows if r.key == "b.Linear"]
        assert row.read_as.endswith("/input1") and not row.agrees
        assert [r.allclose for r in report.rows if r.key == "a.Linear"] == [True]
    files = report.to_model_explorer(tmp_path / "me")
    nodes = json.loads(Path(files.graph).read_text())["graphs"][0]["nodes"]
    assert report.graph is not None
    id2call = {str(n.id): (n.key, n.call_index) for n in report.graph.nodes}
    assert [id2call[n["id"]] for n in nodes if "style" in n] == [("b.Linear", 0)]
    assert report.render(tmp_path / "diff.svg").endswith(".svg")
