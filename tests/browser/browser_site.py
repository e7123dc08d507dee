"""The course site (`make site`, in build/site/) in headless Chromium, and a check that it holds
no solution.

Run by `make test-site` after `make site` (Debian's `chromium`, the `playwright` Python package):

    python -m pytest tests/browser/browser_site.py

Serves the site on a local port and opens every page: no console error, no failed request and no
request leaving the machine, every image drawn (naturalWidth > 0), every internal link (and its
#fragment) found; each chapter page shows its diagrams, has the search box and links to every
other chapter, and a search for a word of a chapter returns that chapter. Then, without a
browser: no line from inside a `### BEGIN SOLUTION` region of any solution notebook appears in
the site's text. $SITE_DIR replaces build/site.
"""

from __future__ import annotations

import functools
import html
import http.server
import os
import re
import threading
from pathlib import Path
from urllib.parse import urldefrag, urlparse

import pytest
from browser_ch02 import ARGS, CHROMIUM

from qwen_mini.course import build
from qwen_mini.course import notebooks as nbs

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(os.environ.get("SITE_DIR", ROOT / "build" / "site"))
CHAPTERS = sorted(p.stem for p in (ROOT / "solutions").glob("ch*.ipynb"))
SEARCH = ("RMSNorm", "ch00_foundations")  # a word, and a chapter page it is on


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def site_url():
    if not (SITE / "index.html").is_file():
        pytest.fail(f"no site in {SITE}: run `make site` first")
    handler = functools.partial(_Quiet, directory=str(SITE))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


def _pages() -> list[str]:
    """The pages (the theme's template fragments in _static/ are not pages)."""
    pages = SITE.rglob("*.html")
    return sorted(p.relative_to(SITE).as_posix() for p in pages if "_static" not in p.parts)


def _ids(path: Path) -> set[str]:
    return set(re.findall(r'\sid="([^"]+)"', path.read_text(encoding="utf-8")))


def test_the_site_has_a_page_per_chapter():
    assert (SITE / "index.html").is_file(), "run `make site` first"
    for chapter in CHAPTERS:
        assert (SITE / f"{chapter}.html").is_file(), chapter


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_a_chapter_page_shows_its_diagrams(chapter):
    """Each diagram of assets/diagrams/ is on its chapter's page (the test above checks that
    every image of a page is drawn)."""
    prefix = chapter.split("_")[0]
    page = (SITE / f"{chapter}.html").read_text(encoding="utf-8")
    for path in sorted((ROOT / "assets" / "diagrams").glob(f"{prefix}_*.svg")):
        assert re.search(rf'<img [^>]*src="_images/{re.escape(path.name)}"', page), (
            f"{chapter}.html does not show {path.name}"
        )
        assert (SITE / "_images" / path.name).read_bytes() == path.read_bytes(), path.name


@pytest.mark.parametrize("page", _pages() if SITE.is_dir() else ["index.html"])
def test_page_loads_with_its_images_and_links(page, site_url, browser):
    tab = browser.new_page()
    problems = []

    def console(message):
        if message.type == "error":
            problems.append(f"console error: {message.text}")

    tab.on("console", console)
    tab.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    tab.on("requestfailed", lambda r: problems.append(f"request failed: {r.url} ({r.failure})"))

    def local_only(route):
        if urlparse(route.request.url).hostname == "127.0.0.1":
            route.continue_()
        else:
            problems.append(f"request leaves the machine: {route.request.url}")
            route.abort()

    tab.route("**/*", local_only)
    tab.goto(site_url + page, wait_until="networkidle")
    images = tab.eval_on_selector_all(
        "img", "els => els.map(e => [e.getAttribute('src'), e.complete && e.naturalWidth > 0])"
    )
    problems += [f"image not drawn: {src}" for src, ok in images if not ok]
    hrefs = tab.eval_on_selector_all("a[href]", "els => els.map(e => e.href)")
    for href in hrefs:
        url, fragment = urldefrag(href)
        if not url.startswith(site_url):
            continue
        rel = url[len(site_url) :] or "index.html"
        target = SITE / (rel + "index.html" if rel.endswith("/") else rel)
        if not target.is_file():
            problems.append(f"broken link: {href}")
        elif fragment and target.suffix == ".html" and fragment not in _ids(target):
            problems.append(f"broken link: {href} (no id {fragment!r} there)")
    if Path(page).stem in CHAPTERS:
        assert tab.locator("input[name='q']").count() > 0, f"{page}: no search box"
        linked = {Path(urlparse(h).path).stem for h in hrefs if h.startswith(site_url)}
        missing = [c for c in CHAPTERS if c not in linked and c != Path(page).stem]
        problems += [f"no link to {c}" for c in missing]
    tab.close()
    assert not problems, f"{page}:\n" + "\n".join(problems)


def test_search_finds_a_chapter(site_url, browser):
    word, chapter = SEARCH
    tab = browser.new_page()
    tab.goto(f"{site_url}search.html?q={word}", wait_until="networkidle")
    results = tab.locator("#search-results ul.search li a")
    results.first.wait_for(timeout=30_000)
    hrefs = [results.nth(i).get_attribute("href") for i in range(results.count())]
    tab.close()
    assert any(h.split("#")[0].split("?")[0].endswith(f"{chapter}.html") for h in hrefs), hrefs


# --- no solution on the site ---------------------------------------------------------------------


def _site_text() -> str:
    """The text of every page (tags removed, entities decoded, whitespace collapsed), and of
    the search index."""
    parts = []
    for path in sorted(SITE.rglob("*")):
        if path.suffix in (".html", ".js", ".txt", ".ipynb") and "_static" not in path.parts:
            raw = path.read_text(encoding="utf-8", errors="replace")
            parts.append(html.unescape(re.sub(r"<[^>]+>", "", raw)))
    return " ".join(" ".join(parts).split())


def _learner_text() -> str:
    # the learner copies as the site is built from them (as committed in course/)
    cells = [c for p in CHAPTERS for c in build.learner_copy(ROOT, f"{p}.ipynb")["cells"]]
    return " ".join(" ".join(nbs.source(c).split()) for c in cells)


def _solution_lines(chapter: str) -> list[str]:
    """Lines from inside the chapter's solution regions that no learner notebook shows (some
    code is an exercise in one chapter and given in a later one)."""
    learner = _learner_text()
    found = []
    for cell in nbs.load(ROOT / "solutions" / f"{chapter}.ipynb")["cells"]:
        inside = False
        for line in nbs.source(cell).splitlines():
            if line.strip() in (nbs.BEGIN_SOLUTION, nbs.END_SOLUTION):
                inside = line.strip() == nbs.BEGIN_SOLUTION
                continue
            text = " ".join(line.split())
            if inside and len(text) >= 12 and text not in learner:
                found.append(text)
    return found


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_no_solution_on_the_site(chapter):
    lines = _solution_lines(chapter)
    assert lines, f"{chapter}: no distinctive solution line to look for"
    text = _site_text()
    # the search works: a line of the learner copy's code is found in the highlighted pages
    assert "from qwen_mini.course import check, use" in text
    leaked = [line for line in lines if line in text]
    assert not leaked, f"{chapter}: solution lines on the site:\n" + "\n".join(leaked[:10])
