"""The live page in a real headless Chromium (Debian's chromium and chromium-driver, driven by Selenium).

It loads, shows the graph, a click on a node arms sampling (the server says so), and a
histogram panel appears and updates while a model trains in a thread of this process.
The screenshot lands in ``$FWDTRACE_ARTIFACTS`` (default ``tests/artifacts/``).
``make test`` installs the browser where apt is available; with ``CI=true`` a missing
browser fails the test, elsewhere it skips saying what is missing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import zoo
from test_live import KeyNet, Net, request

import fwdtrace
import fwdtrace.live

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
ARTIFACTS = Path(os.environ.get("FWDTRACE_ARTIFACTS", Path(__file__).parent / "artifacts"))


def _browser() -> object:
    missing = [p for p in (CHROMIUM, DRIVER) if not os.access(p, os.X_OK)]
    try:
        from selenium import webdriver
    except ImportError:
        missing.append("selenium (pip install -e '.[dev]')")
    if missing:
        why = f"the page test needs {', '.join(missing)} (apt-get install chromium chromium-driver)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,900"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service(executable_path=DRIVER))


def _wait(condition, timeout: float = 20.0, what: str = "") -> object:  # type: ignore[no-untyped-def]
    from selenium.common.exceptions import StaleElementReferenceException

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = condition()
        except StaleElementReferenceException:  # the page redrew the element between find and read: look again
            value = None
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _drag_back(driver: object, view: str) -> int:
    """Drag the range control of ``view`` (a panel or a scalar chart), once it spans 9 steps on disk, to 2 steps
    after the first step kept; that first step."""
    from selenium.webdriver.common.by import By

    find = driver.find_elements  # type: ignore[attr-defined]
    back, first = _wait(lambda: [(e, int(e.get_attribute("min"))) for e in find(By.CSS_SELECTOR, view + " input.back")
                                 if e.is_displayed() and int(e.get_attribute("max")) - int(e.get_attribute("min")) >= 8],
                        what=f"the range control of {view} over 9 steps")[0]
    driver.execute_script(  # type: ignore[attr-defined]
        "arguments[0].value = arguments[1]; arguments[0].dispatchEvent(new Event('input'))", back, first + 2)
    return int(first)


def _charted(panels: list[Any]) -> list[str]:
    """The roles of the histogram charts with samples in ``panels`` (one panel, or none yet), sorted."""
    from selenium.webdriver.common.by import By

    return sorted(e.get_attribute("data-role") for p in panels for e in p.find_elements(By.CSS_SELECTOR, "svg.fw-hist")
                  if int(e.get_attribute("data-samples")) >= 1)


def _shown(driver: object, titles: str) -> list[tuple[int, str]]:
    """The step and the rest of each hover title ``titles`` selects: 'step 7: loss=0.25' is (7, 'loss=0.25')."""
    from selenium.webdriver.common.by import By

    found = driver.find_elements(By.CSS_SELECTOR, titles)  # type: ignore[attr-defined]
    return [(int(m[1]), m[2]) for m in (re.fullmatch(r"step (\d+): (.*)", t.get_attribute("textContent")) for t in found)
            if m]


def test_page_shows_the_graph_and_a_click_arms_sampling(tmp_path: Path) -> None:
    """The graph loads, a click arms sampling (forward, weight, weight_grad), the panel updates, the panels and the
    loss curve scroll back over the history on disk; reopened, the run shows the same, read-only."""
    driver = _browser()
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    torch.manual_seed(0)
    model = Net()
    # the parameters of body.0 and body.2 (the same names), one series and chart each in a weight panel
    parameters = sorted(name for name, _ in model.body[2].named_parameters())
    assert parameters == sorted(name for name, _ in model.body[0].named_parameters())
    stop = threading.Event()
    losses: dict[int, float] = {}  # what the loop logged, by step: the reference for the page's hover titles

    def training() -> None:
        while not stop.is_set():
            loss = model(torch.randn(5, 8)).pow(2).mean()
            zoo.sgd_step(model, loss)
            losses[len(losses)] = float(loss.detach())
            fwdtrace.live.log_scalar("loss", loss.detach(), step=len(losses) - 1)
            time.sleep(0.02)

    def scroll_loss_back() -> None:
        """The loss chart's range control, dragged back, shows the points logged at the first steps kept on disk."""
        loss = 'div.chart.scalar[data-name="loss"]'
        first = _drag_back(driver, loss)
        steps = list(range(first, first + 3))

        def window() -> list[tuple[int, str]] | None:  # read once: the page redraws the chart at every poll
            shown = _shown(driver, loss + " circle.point title")
            return shown if [s for s, _ in shown] == steps else None

        shown = _wait(window, what=f"the loss chart of steps {steps}")
        # the values the loop logged at those steps, six digits shown
        assert [float(t.removeprefix("loss=")) for _, t in shown] == pytest.approx([losses[s] for s in steps], rel=1e-5)
        _wait(lambda: driver.find_elements(By.CSS_SELECTOR, loss + " .window")[0].text  # type: ignore[attr-defined]
              == f"points up to step {first + 2}", what=f"the label 'points up to step {first + 2}'")

    trainer = threading.Thread(target=training, daemon=True)
    try:
        with fwdtrace.serve(model, example_inputs=torch.randn(2, 8), port=0, ring=4, logdir=tmp_path) as server:
            server.sampler.scalars.points = 8  # the in-memory log keeps 8 points per name: scrolling back reads the disk
            trainer.start()
            driver.get(server.url + "?poll=300")  # type: ignore[attr-defined]
            find = driver.find_elements  # type: ignore[attr-defined]
            nodes = _wait(lambda: find(By.CSS_SELECTOR, "#graph g.node[data-key]"), what="the graph")
            assert sorted(n.get_attribute("data-key") for n in nodes) == ["body.0.Linear", "body.1.ReLU", "body.2.Linear"]
            assert find(By.CSS_SELECTOR, '#graph g.cluster[data-key="body.Sequential"]')
            _wait(lambda: int(driver.find_element(By.ID, "step").text or 0) > 0, what="the step")  # type: ignore[attr-defined]
            assert driver.find_element(By.ID, "rank").text == "0 / 1"  # type: ignore[attr-defined]

            target = next(n for n in nodes if n.get_attribute("data-key") == "body.2.Linear")
            ActionChains(driver).move_to_element(target).click().perform()  # type: ignore[arg-type]

            # The click armed forward sampling: the server says so, independently of the page.
            _wait(lambda: any(a["key"] == "body.2.Linear" and a["armed"]
                              for a in request(server, "GET", "/api/status")[1]["arms"]), what="the arm")
            chart = 'div.panel[data-key="body.2.Linear"] svg.fw-hist[data-role="output"]'
            _wait(lambda: [e for e in find(By.CSS_SELECTOR, chart) if int(e.get_attribute("data-samples")) >= 2],
                  what="a histogram panel with samples")
            counts = 'div.panel[data-key="body.2.Linear"] .counts'
            first = find(By.CSS_SELECTOR, counts)[0].text
            _wait(lambda: find(By.CSS_SELECTOR, counts)[0].text != first, what="the panel to update")
            bins = find(By.CSS_SELECTOR, chart + " rect.bin")
            assert len(bins) >= 2
            table = 'div.panel[data-key="body.2.Linear"] table tr'  # read whole: each poll redraws it
            _wait(lambda: [r.text.split()[0] for r in find(By.CSS_SELECTOR, table)[1:]] == ["input", "output"],
                  what="the table's rows input and output")

            # The weight kinds, chosen next to forward/grad, arm the parameters of the clicked layer: a histogram
            # per parameter (weight_grad: of its gradient).
            from selenium.webdriver.support.select import Select

            for kind, key in (("weight", "body.0.Linear"), ("weight_grad", "body.2.Linear")):
                Select(driver.find_element(By.ID, "kind")).select_by_value(kind)  # type: ignore[attr-defined]
                target = next(n for n in nodes if n.get_attribute("data-key") == key)
                ActionChains(driver).move_to_element(target).click().perform()  # type: ignore[arg-type]
                _wait(lambda kind=kind, key=key: any((a["key"], a["kind"], a["armed"]) == (key, kind, True)
                                                     for a in request(server, "GET", "/api/status")[1]["arms"]),
                      what=f"the {kind} arm of {key}")
                panel = f'div.panel[data-key="{key}"][data-kind="{kind}"]'
                _wait(lambda panel=panel: _charted(find(By.CSS_SELECTOR, panel)) == parameters,
                      what=f"a {kind} histogram per parameter {parameters}")
            panel = 'div.panel[data-key="body.0.Linear"][data-kind="weight"]'
            first_text = lambda css: next((t.get_attribute("textContent") for t in find(By.CSS_SELECTOR, css)), None)  # noqa: E731
            last_text = lambda css: next((t.get_attribute("textContent") for t in find(By.CSS_SELECTOR, css)[::-1]), None)  # noqa: E731
            # read inside the wait, one element: the page redraws its charts at every poll
            title = _wait(lambda: first_text(f'{panel} svg.fw-hist[data-role="bias"] rect.bin title'), what="a bin's title")
            assert re.fullmatch(r"step \d+: \d+ in \[\S+, \S+\)", title), title

            # log_scalar's curve, with hover titles giving the value logged at each step.
            curve = 'div.chart.scalar[data-name="loss"] svg.fw-scalar circle.point title'
            text = _wait(lambda: last_text(curve), what="the loss curve")
            step, value = re.fullmatch(r"step (\d+): loss=(\S+)", text).groups()
            assert float(value) == pytest.approx(losses[int(step)], rel=1e-5)

            # The health toggle arms the gradient norm on the whole model; its curve appears.
            driver.find_element(By.ID, "health").click()  # type: ignore[attr-defined]
            root = request(server, "GET", "/api/status")[1]["root"]
            _wait(lambda: find(By.CSS_SELECTOR, f'div.chart.scalar[data-name="{root}/grad_norm"] circle.point'),
                  what="the gradient norm's curve")
            assert any(a["kind"] == "health" and a["key"] == root and a["armed"]
                       for a in request(server, "GET", "/api/status")[1]["arms"])
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(str(ARTIFACTS / "live_page.png"))  # type: ignore[attr-defined]

            # Scroll back: the ring keeps 4 samples, the range control reaches the first steps kept on disk.
            panel = 'div.panel[data-key="body.2.Linear"][data-kind="forward"]'
            chart = panel + ' svg.fw-hist[data-role="output"]'
            first = _drag_back(driver, panel)
            on_disk = request(server, "GET", f"/api/samples?key=body.2.Linear&kind=forward&before={first + 3}")[1]
            want = [s["step"] for s in on_disk["samples"]]
            assert want and want[0] == first and want[-1] <= first + 2
            titles = lambda: [t.get_attribute("textContent") for t in find(By.CSS_SELECTOR, chart + " circle title")]  # noqa: E731
            _wait(lambda: [int(t.split(":")[0].split()[1]) for t in titles()] == want, what=f"the chart of steps {want}")
            _wait(lambda: find(By.CSS_SELECTOR, chart)[0].get_attribute("data-samples") == str(len(want)),
                  what=f"the chart's data-samples {len(want)}")
            ring = request(server, "GET", "/api/samples?key=body.2.Linear&kind=forward")[1]["samples"]
            assert ring[0]["step"] > first + 2  # beyond what memory holds
            # the label follows at the page's next poll of the history
            _wait(lambda: find(By.CSS_SELECTOR, panel + " .window")[0].text == f"samples up to step {first + 2}",
                  what=f"the label 'samples up to step {first + 2}'")
            scroll_loss_back()
            assert request(server, "GET", "/api/scalars")[1]["scalars"]["loss"]["steps"][0] > 2  # beyond what memory holds
            stop.set()
            trainer.join()

        # The finished run reopened from its logdir: graph, a panel per series armed, the loss curve, read-only.
        with fwdtrace.live.reopen(tmp_path, port=0) as reopened:
            driver.get(reopened.url + "?poll=300")  # type: ignore[attr-defined]
            nodes = _wait(lambda: find(By.CSS_SELECTOR, "#graph g.node[data-key]"), what="the reopened graph")
            assert sorted(n.get_attribute("data-key") for n in nodes) == ["body.0.Linear", "body.1.ReLU", "body.2.Linear"]
            armed = {("body.2.Linear", "forward"): ["input", "output"], ("body.0.Linear", "weight"): parameters,
                     ("body.2.Linear", "weight_grad"): parameters}

            _wait(lambda: {(p.get_attribute("data-key"), p.get_attribute("data-kind")): _charted([p])
                           for p in find(By.CSS_SELECTOR, "div.panel")} == armed,
                  what=f"a panel with its charts per series armed, {armed}")
            assert not any(b.is_displayed() for b in find(By.CSS_SELECTOR, "div.panel h3 button"))  # nothing to disarm
            assert "reopened from" in driver.find_element(By.ID, "model").text  # type: ignore[attr-defined]
            text = _wait(lambda: last_text(curve), what="the reopened loss curve")
            step, value = re.fullmatch(r"step (\d+): loss=(\S+)", text).groups()
            assert int(step) == max(losses) and float(value) == pytest.approx(losses[int(step)], rel=1e-5)

            target = next(n for n in nodes if n.get_attribute("data-key") == "body.1.ReLU")
            ActionChains(driver).move_to_element(target).click().perform()  # type: ignore[arg-type]
            _wait(lambda: driver.find_element(By.ID, "message").text.startswith(  # type: ignore[attr-defined]
                "this is a finished run reopened read-only"), what="the page saying the run is read-only")
            assert request(reopened, "POST", "/api/sample", {"key": "body.1.ReLU", "kind": "forward"})[0] == 409
            assert not find(By.CSS_SELECTOR, 'div.panel[data-key="body.1.ReLU"]')
            scroll_loss_back()
            driver.save_screenshot(str(ARTIFACTS / "live_page_reopened.png"))  # type: ignore[attr-defined]
    finally:
        stop.set()
        driver.quit()  # type: ignore[attr-defined]


def test_a_click_on_a_closed_leaf_layer_arms_that_layer() -> None:
    """A layer written with functions is one box on the page; clicking it arms its module key."""
    driver = _browser()
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    torch.manual_seed(0)
    try:
        with fwdtrace.serve(KeyNet(), example_inputs=torch.randn(2, 4, 8), port=0) as server:
            driver.get(server.url + "?poll=300")  # type: ignore[attr-defined]
            find = driver.find_elements  # type: ignore[attr-defined]
            boxes = _wait(lambda: find(By.CSS_SELECTOR, '#graph g.node[data-key="scale.Scale"]'), what="the graph")
            assert [b.get_attribute("data-kind") for b in boxes] == ["layer", "layer"]  # called twice, drawn closed
            ActionChains(driver).move_to_element(boxes[0]).click().perform()  # type: ignore[arg-type]
            _wait(lambda: [a["key"] for a in request(server, "GET", "/api/status")[1]["arms"] if a["armed"]]
                  == ["scale.Scale"], what="the arm")
            _wait(lambda: find(By.CSS_SELECTOR, '#graph g.node.armed[data-key="scale.Scale"]'), what="the box marked")
    finally:
        driver.quit()  # type: ignore[attr-defined]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_model_explorer_renders_a_bert_graph(tmp_path: Path) -> None:
    """fwdtrace.view() in a child process serves a small BERT's graph; Model Explorer's page lays it out."""
    import subprocess
    import sys

    if importlib.util.find_spec("model_explorer") is None:
        why = "the Model Explorer page test needs pip install ai-edge-model-explorer (make test installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    transformers = pytest.importorskip("transformers")
    driver = _browser()
    from selenium.webdriver.common.by import By

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=16)
    model = transformers.BertModel(config).eval()
    graph = fwdtrace.trace(model, torch.randint(0, 100, (1, 8)))
    (tmp_path / "bert.json").write_text(graph.to_json())
    # each leaf layer's parameters: all of BERT's live in its leaf layers, so Model Explorer's sum is the model's
    params = {n.module_key: sum(p.numel() for p in model.get_submodule(n.module_path).parameters())
              for n in graph.nodes if n.kind == "module"}
    (tmp_path / "params.json").write_text(json.dumps(params))
    port = _free_port()
    script = (
        "import json, sys, fwdtrace\n"
        f"g = fwdtrace.Graph.from_json(open({str(tmp_path / 'bert.json')!r}).read())\n"
        f"fwdtrace.view(g, node_data={{'params': json.load(open({str(tmp_path / 'params.json')!r}))}}, "
        f"folder={str(tmp_path)!r}, port={port}, open_browser=False)\n"
    )
    root = Path(__file__).parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    server = subprocess.Popen([sys.executable, "-u", "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env, cwd=tmp_path)
    lines: list[str] = []
    url_seen = threading.Event()

    def read() -> None:
        assert server.stdout is not None
        for line in server.stdout:
            lines.append(line)
            if line.startswith(f"http://127.0.0.1:{port}/"):
                url_seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if not url_seen.wait(60):
            raise AssertionError("Model Explorer's server did not start:\n" + "".join(lines))
        url = next(line.strip() for line in lines if line.startswith(f"http://127.0.0.1:{port}/"))
        driver.get(url)  # type: ignore[attr-defined]
        body = lambda: driver.find_element(By.TAG_NAME, "body").text  # type: ignore[attr-defined]  # noqa: E731
        # The side panel, filled once the page has read and laid out the graph: every traced call is an op
        # node, every module call around one a layer, BERT's children the root-level layers.
        _wait(lambda: "op node count" in body() and "Root-level nodes stats" in body(), what="the graph info")
        text = body()
        assert re.search(rf"op node count\s+{len(graph.nodes)}\b", text), text
        # Model Explorer counts the layers with more than one thing inside (it folds a GELUActivation
        # around its one gelu into that call)
        children: dict[tuple, set] = {}
        for n in graph.nodes:
            for i in range(len(n.scope)):
                children.setdefault(n.scope[:i + 1], set()).add(n.scope[:i + 2] if i + 1 < len(n.scope) else n.id)
        layers = [k for k, inside in children.items() if len(inside) > 1]
        assert 0 < len(layers) < len(children)
        assert re.search(rf"layer count\s+{len(layers)}\b", text), text
        for child in ("embeddings", "encoder", "pooler"):
            assert re.search(rf"^\d+\s+{child}\b", text, re.M) or f"\n{child}\n" in text, child
        total = sum(p.numel() for p in model.parameters())
        _wait(lambda: re.search(rf"Sum\s+{total}\b", body()), what=f"the node data's sum {total}")
        canvas = _wait(lambda: [c for c in driver.find_elements(By.TAG_NAME, "canvas")  # type: ignore[attr-defined]
                                if c.size["width"] > 200 and c.size["height"] > 200], what="the WebGL canvas")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shot = ARTIFACTS / "model_explorer_bert.png"
        driver.save_screenshot(str(shot))  # type: ignore[attr-defined]
        # drawn, not blank: the boxes and edges of the graph cover part of the canvas
        from PIL import Image

        c = canvas[0]
        box = (c.location["x"], c.location["y"], c.location["x"] + c.size["width"], c.location["y"] + c.size["height"])
        with Image.open(shot) as img:
            pixels = list(img.convert("L").crop(box).getdata())
        assert sum(p < 200 for p in pixels) > 0.005 * len(pixels)
    finally:
        driver.quit()  # type: ignore[attr-defined]
        server.terminate()
        server.wait(10)
