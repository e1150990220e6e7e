"""The live page in a real headless Chromium (Debian's chromium and chromium-driver, driven by Selenium).

It loads, shows the graph, a click on a node arms sampling (the server says so), and a
histogram panel appears and updates while a model trains in a thread of this process.
The screenshot lands in ``$FWDTRACE_ARTIFACTS`` (default ``tests/artifacts/``).
``make test`` installs the browser where apt is available; with ``CI=true`` a missing
browser fails the test, elsewhere it skips saying what is missing.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from test_live import Net, request, train_steps

import fwdtrace

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


def test_page_shows_the_graph_and_a_click_arms_sampling() -> None:
    driver = _browser()
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    torch.manual_seed(0)
    model = Net()
    stop = threading.Event()

    def training() -> None:
        while not stop.is_set():
            train_steps(model, 1)
            time.sleep(0.02)

    trainer = threading.Thread(target=training, daemon=True)
    try:
        with fwdtrace.serve(model, example_inputs=torch.randn(2, 8), port=0) as server:
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
            table = find(By.CSS_SELECTOR, 'div.panel[data-key="body.2.Linear"] table tr')
            assert [r.text.split()[0] for r in table[1:]] == ["input", "output"]
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(str(ARTIFACTS / "live_page.png"))  # type: ignore[attr-defined]
            stop.set()
            trainer.join()
    finally:
        stop.set()
        driver.quit()  # type: ignore[attr-defined]
