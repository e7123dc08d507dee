"""Chapter 2 in a real browser: JupyterLab in headless Chromium, driven by Playwright.

Run by `make test-browser` (not by `make test`: it needs Debian's `chromium` and the `playwright`
Python package; the file name keeps plain `pytest tests` from collecting it):

    python -m pytest tests/browser/browser_ch02.py

It copies the solutions notebook to a temporary folder, starts JupyterLab there (token, free port,
`--LabApp.expose_app_in_browser=True` so the page exposes `window.jupyterapp`), opens the notebook,
waits for the kernel, runs all cells, checks that no cell shows an error, then moves every slider
(and picks another entry of every menu) of every interactive view and checks that the view's
figure changes. Screenshots go to $BROWSER_SCREENSHOTS (default build/browser-screenshots/).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "solutions" / "ch02_qk_norm.ipynb"
CHROMIUM = os.environ.get("CHROMIUM", shutil.which("chromium") or "/usr/bin/chromium")
SHOTS = Path(os.environ.get("BROWSER_SCREENSHOTS", ROOT / "build" / "browser-screenshots"))
RUN_ALL_TIMEOUT = float(os.environ.get("BROWSER_RUN_TIMEOUT", 900))  # seconds, a loaded machine
ARGS = [
    "--no-sandbox",
    "--headless",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lab")
    shutil.copy(NOTEBOOK, folder / NOTEBOOK.name)
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, PYTHONPATH=str(ROOT), QWEN_MINI_CHECKS="solutions", HF_HUB_OFFLINE="1")
    env.pop("QWEN_MINI_WEIGHTS", None)  # the stand-ins, as in CI
    cmd = [
        sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
        f"--ServerApp.token={token}", f"--ServerApp.root_dir={folder}",
        "--LabApp.expose_app_in_browser=True", "--ServerApp.disable_check_xsrf=True",
    ]  # fmt: skip
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(folder / "jupyter.log", "w")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(120):
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            break
        except OSError:
            if server.poll() is not None:
                raise RuntimeError((folder / "jupyter.log").read_text()) from None
            time.sleep(1)
    else:
        server.kill()
        raise RuntimeError("JupyterLab did not start within 120 s")
    yield f"{url}/lab/tree/{NOTEBOOK.name}?token={token}"
    server.terminate()
    try:
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        server.kill()
    log.close()


READY = """() => {
  const app = window.jupyterapp;
  const w = app && app.shell.currentWidget;
  const s = w && w.sessionContext && w.sessionContext.session;
  return !!(s && s.kernel && s.kernel.status === 'idle' && w.content && w.content.widgets.length);
}"""

DONE = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  const busy = w.sessionContext.session.kernel.status !== 'idle';
  const cells = w.content.model.cells;
  let pending = 0;
  for (let i = 0; i < cells.length; i++) {
    const c = cells.get(i);
    if (c.type === 'code' && c.executionCount === null && c.sharedModel.source.trim()) pending++;
  }
  const prompts = [...document.querySelectorAll('.jp-InputPrompt')];
  const running = prompts.some(p => p.textContent.includes('*'));
  return !busy && !running && pending === 0;
}"""

ERRORS = """() => {
  const cells = window.jupyterapp.shell.currentWidget.content.model.cells;
  const found = [];
  for (let i = 0; i < cells.length; i++) {
    const c = cells.get(i);
    if (c.type !== 'code') continue;
    for (const o of c.outputs.toJSON()) {
      if (o.output_type === 'error') found.push(`cell ${i}: ${o.ename}: ${o.evalue}`);
    }
  }
  return found;
}"""


def _figure(view) -> str | None:
    img = view.query_selector(".widget-output img")
    return img.get_attribute("src") if img else None


def _wait_change(page, view, before: str, timeout: float = 120.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        now = _figure(view)
        if now and now != before:
            # let the new image decode before anyone takes a screenshot
            view.wait_for_selector(".widget-output img", state="visible")
            page.wait_for_function(
                "el => [...el.querySelectorAll('.widget-output img')].every("
                "i => i.complete && i.naturalWidth > 0)",
                arg=view,
            )
            return True
        page.wait_for_timeout(250)
    return False


def _step_key(handle) -> str:
    """One step down, or up for a slider already at its lowest value (a key that moves nothing
    redraws nothing)."""
    now, low = (float(handle.get_attribute(a)) for a in ("aria-valuenow", "aria-valuemin"))
    return "ArrowRight" if now <= low else "ArrowLeft"


def _settled_images(page, view, timeout: float = 60.0) -> int:
    """The number of figures the view shows once its redraws are over: a key press can queue
    more than one redraw, and each clears the output before drawing, so wait until the same
    figures stay for a second."""
    end, last, since = time.monotonic() + timeout, None, time.monotonic()
    while time.monotonic() < end:
        now = [i.get_attribute("src") for i in view.query_selector_all(".widget-output img")]
        if now != last:
            last, since = now, time.monotonic()
        elif now and time.monotonic() - since >= 1.0:
            break
        page.wait_for_timeout(250)
    return len(last or [])


def test_chapter2_runs_and_every_slider_redraws(lab):
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), f"no Chromium at {CHROMIUM}: apt-get install -y chromium"
    SHOTS.mkdir(parents=True, exist_ok=True)
    print(f"screenshots in {SHOTS}")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(lab)
        page.wait_for_function(READY, timeout=180_000, polling=500)
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
        page.wait_for_timeout(2000)
        page.wait_for_function(DONE, timeout=RUN_ALL_TIMEOUT * 1000, polling=1000)
        page.screenshot(path=str(SHOTS / "ch02-after-run-all.png"))
        errors = page.evaluate(ERRORS)
        assert errors == [], errors
        assert not page.query_selector(".jp-OutputArea-output [data-mime-type*='error']")

        views = [v for v in page.query_selector_all(".widget-vbox") if _figure(v)]
        assert len(views) >= 3, f"expected 3 interactive views with a figure, found {len(views)}"
        moved = 0
        for n, view in enumerate(views):
            view.scroll_into_view_if_needed()
            view.screenshot(path=str(SHOTS / f"ch02-view{n}-before.png"))
            for k, handle in enumerate(view.query_selector_all(".noUi-handle")):
                before = _figure(view)
                handle.focus()
                page.keyboard.press(_step_key(handle))
                assert _wait_change(page, view, before), f"view {n}, slider {k}: no redraw"
                moved += 1
                view.screenshot(path=str(SHOTS / f"ch02-view{n}-slider{k}.png"))
            for k, select in enumerate(view.query_selector_all("select")):
                before = _figure(view)
                options = select.eval_on_selector_all("option", "os => os.map(o => o.value)")
                current = select.input_value()
                select.select_option(next(o for o in options if o != current))
                assert _wait_change(page, view, before), f"view {n}, menu {k}: no redraw"
                moved += 1
                view.screenshot(path=str(SHOTS / f"ch02-view{n}-menu{k}.png"))
            # the view still shows exactly one figure: redrawn in place, not appended
            assert _settled_images(page, view) == 1
        assert moved >= 7
        assert page.evaluate(ERRORS) == []
        page.screenshot(path=str(SHOTS / "ch02-end.png"), full_page=True)
        browser.close()
