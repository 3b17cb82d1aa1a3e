"""The book: a strict build with every page of the table of contents, and pages that render offline.

One build (`jupyter-book build -W -n --keep-going`) into a temporary folder serves every test. The
browser test opens the built pages from file:// in Debian's chromium through Playwright, blocks and
records every http(s) request, and checks that MathJax typeset the math, that plots and widgets
appeared, and that the console stayed free of errors; then what a reader sees: every image loaded,
no raw pipe table or MyST markup in the text, one search box, a course map of every page, progress
bars as one line each, and lines wider than the text column only inside boxes that scroll and show it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from course import toc_docnames

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
IN_CI = bool(os.environ.get("CI"))
BROWSER_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run"]
REMOTE = re.compile(r"^(https?:)?//", re.IGNORECASE)  # http://, https:// and protocol-relative //


# ---------------------------------------------------------------------------------------------
# What the book should contain


def vendored_files() -> list[Path]:
    """The static files _config.yml loads from _static (MathJax, the widget scripts)."""
    config = yaml.safe_load((ROOT / "_config.yml").read_text())["sphinx"]["config"]
    uris = [config["mathjax_path"], *config.get("nb_ipywidgets_js", {})]
    assert not [u for u in uris if REMOTE.match(u)], f"web URLs in _config.yml: {uris}"
    return [ROOT / "_static" / u for u in uris]


# ---------------------------------------------------------------------------------------------
# Fixtures: the static files, one build


@pytest.fixture(scope="module")
def static_files() -> list[Path]:
    missing = [p for p in vendored_files() if not p.is_file()]
    if missing:  # fetch them as `make book` would (needs npm and the npm registry)
        proc = subprocess.run(["make", "static"], cwd=ROOT, capture_output=True, text=True)
        missing = [p for p in vendored_files() if not p.is_file()]
        if proc.returncode or missing:
            pytest.fail(f"vendored JavaScript missing ({', '.join(map(str, missing))}): run `make static`"
                        f" (needs npm)\n{proc.stdout}{proc.stderr}")
    return vendored_files()


@pytest.fixture(scope="module")
def build(tmp_path_factory, static_files):
    """(exit status, log, html folder) of one strict build into a temporary folder."""
    out = tmp_path_factory.mktemp("book")
    exe = Path(sys.executable).with_name("jupyter-book")
    cmd = [str(exe) if exe.exists() else shutil.which("jupyter-book") or "jupyter-book",
           "build", str(ROOT), "-W", "-n", "--keep-going", "--path-output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    return proc.returncode, proc.stdout + proc.stderr, out / "_build" / "html"


@pytest.fixture(scope="module")
def html(build) -> Path:
    status, log, folder = build
    assert (folder / "index.html").is_file(), f"no HTML written:\n{log[-5000:]}"
    return folder


# ---------------------------------------------------------------------------------------------
# The build


def test_build_has_no_warnings(build):
    status, log, _ = build
    problems = [line for line in log.splitlines() if re.search(r"WARNING|ERROR|CRITICAL", line)]
    assert status == 0 and not problems, "jupyter-book build -W -n failed:\n" + "\n".join(
        problems or log.splitlines()[-40:])


def test_every_toc_page_is_built(html):
    missing = [name for name in toc_docnames() if not (html / f"{name}.html").is_file()]
    assert not missing, f"pages in _toc.yml without HTML: {missing}"


class _Resources(HTMLParser):
    """The URLs a page makes the browser fetch: scripts, stylesheets and other linked files,
    images, frames, media, plus the html-manager's CDN setting."""

    FETCHED_LINKS = {"stylesheet", "preload", "modulepreload", "prefetch", "preconnect",
                     "dns-prefetch", "icon", "manifest"}

    def __init__(self):
        super().__init__()
        self.urls: list[tuple[str, str]] = []  # (what, url)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "script" and a.get("src"):
            self.urls.append(("script", a["src"]))
        if tag == "link" and a.get("href") and self.FETCHED_LINKS & set((a.get("rel") or "").split()):
            self.urls.append((f"link rel={a['rel']}", a["href"]))
        if tag in {"img", "iframe", "embed", "source", "audio", "video", "track", "input"} and a.get("src"):
            self.urls.append((tag, a["src"]))
        if a.get("data-jupyter-widgets-cdn"):
            self.urls.append(("data-jupyter-widgets-cdn", a["data-jupyter-widgets-cdn"]))


def built_pages(html: Path) -> list[Path]:
    """The HTML pages (not the theme's template fragments that sit in _static/)."""
    return sorted(p for p in html.rglob("*.html") if "_static" not in p.relative_to(html).parts)


def page_resources(page: Path) -> list[tuple[str, str]]:
    parser = _Resources()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser.urls


def test_no_page_loads_from_the_web(html):
    remote = [f"{page.relative_to(html)}: <{what}> {url}"
              for page in built_pages(html) for what, url in page_resources(page)
              if REMOTE.match(url)]
    assert not remote, "pages load resources from the web:\n" + "\n".join(remote)


def test_local_resources_exist(html):
    """Every script, stylesheet and image a page names is in the build (e.g. the vendored MathJax
    whose version is in both the Makefile and _config.yml)."""
    broken = []
    for page in built_pages(html):
        for what, url in page_resources(page):
            parts = urlsplit(url)
            if parts.scheme or REMOTE.match(url) or what == "data-jupyter-widgets-cdn" or not parts.path:
                continue
            if not (page.parent / parts.path).resolve().is_file():
                broken.append(f"{page.relative_to(html)}: <{what}> {url}")
    assert not broken, "missing files:\n" + "\n".join(broken)


def test_vendored_scripts_only_where_needed(html, static_files):
    """On the pages of the table of contents, MathJax is loaded (by Sphinx) once exactly where a page has
    math, and the widget scripts (by myst-nb) once each exactly where it stores widget state, which
    every page with a widget view must."""
    mathjax, *widgets = [p.name for p in static_files]  # tex-svg-full.js, then widgets-offline.js and co.
    wrong, with_math, with_widgets = [], 0, 0
    for name in toc_docnames():
        page = html / f"{name}.html"
        text = page.read_text(encoding="utf-8")
        scripts = [Path(urlsplit(url).path).name for what, url in page_resources(page) if what == "script"]
        math = 'class="math notranslate nohighlight"' in text  # Sphinx's markup for $...$ and $$...$$
        state = 'type="application/vnd.jupyter.widget-state+json"' in text
        views = 'type="application/vnd.jupyter.widget-view+json"' in text
        if scripts.count(mathjax) != int(math):
            wrong.append(f"{name}: has math: {math}, loads {mathjax} {scripts.count(mathjax)} times")
        if [scripts.count(w) for w in widgets] != [int(state)] * len(widgets) or (views and not state):
            wrong.append(f"{name}: widget state: {state}, views: {views}, scripts: {scripts}")
        with_math += math
        with_widgets += state
    assert not wrong, "\n".join(wrong)
    # some pages have each and some not, so both "where needed" and "never on all" were checked
    assert 0 < with_math < len(toc_docnames()) and 0 < with_widgets < len(toc_docnames())


# ---------------------------------------------------------------------------------------------
# A real browser, offline


@pytest.fixture(scope="module")
def browser():
    reason = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as err:  # pragma: no cover - playwright is in the test extra
        reason = f"playwright is not installed ({err})"
    if reason is None and not CHROMIUM.exists():
        reason = f"{CHROMIUM} not found (apt-get install chromium)"
    if reason:
        if IN_CI:
            pytest.fail(f"browser test cannot run in CI: {reason}")
        pytest.skip(reason)
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=BROWSER_ARGS)
        yield chromium
        chromium.close()


def open_page(browser, url: str, problems: list[str]):
    """A page with every http(s) request aborted and recorded, and console errors recorded."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})

    def block(route):
        problems.append(f"request to the web: {route.request.url}")
        route.abort()

    context.route(re.compile(r"^(https?|wss?)://", re.IGNORECASE), block)
    page = context.new_page()
    page.set_default_timeout(30_000)
    page.on("console", lambda m: m.type == "error" and problems.append(f"console error: {m.text}"))
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"failed to load {r.url}: {r.failure}"))
    page.goto(url, wait_until="load")
    return page


MATHJAX_DONE = """async () => {
  const mj = window.MathJax;
  if (!mj || !mj.startup || !mj.startup.promise) return false;
  await mj.startup.promise;
  return true;
}"""

# Text a reader sees outside code: raw TeX left there means MathJax did not run.
VISIBLE_TEXT = """() => {
  const body = document.querySelector("main") || document.body;
  const copy = body.cloneNode(true);
  copy.querySelectorAll("pre, code, script, style, mjx-container, .highlight").forEach(e => e.remove());
  return copy.textContent;
}"""

WIDGETS = """() => ({
  state: document.querySelectorAll('script[type="application/vnd.jupyter.widget-state+json"]').length,
  views: document.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]').length,
  rendered: document.querySelectorAll(".widget-subarea .jupyter-widgets, .widget-subarea .lm-Widget").length,
})"""

OUTPUT_IMAGES = """() => [...document.querySelectorAll(".cell_output img, .output img")]
  .map(img => ({src: img.getAttribute("src").slice(0, 80), width: img.naturalWidth}))"""

# Every <img> once it has loaded or failed (lazy ones are made eager, else off-screen ones never load).
ALL_IMAGES = """async () => {
  const images = [...document.images];
  images.forEach(img => { img.loading = "eager"; });
  await Promise.all(images.map(img => img.complete ? null
    : new Promise(done => { img.addEventListener("load", done); img.addEventListener("error", done); })));
  return images.map(img => ({src: (img.getAttribute("src") || "").slice(0, 80), width: img.naturalWidth}));
}"""

# pydata-sphinx-theme's search fields and buttons that a reader can see at this width.
SEARCH_BOXES = """() => [...document.querySelectorAll(".search-button__button, .bd-search, input[type=search]")]
  .filter(e => !e.closest("dialog:not([open])") && e.checkVisibility({checkVisibilityCSS: true})
               && e.getBoundingClientRect().width > 0).length"""

COURSE_MAP_LINKS = """() => [...document.querySelectorAll("table.course-map a")].map(a => a.href)"""

# The text of every stdout/stderr block of a cell's output (myst-nb: pre in .output.stream/.stderr).
STREAM_TEXTS = """() => [...document.querySelectorAll(".output.stream pre, .output.stderr pre")]
  .map(pre => pre.textContent)"""

# At the window's width (1280 px), every fold opened (folded sources and outputs are read too):
# elements of the text column that stick out of it and are not inside a box that scrolls sideways
# (overflow-x auto or scroll, scrollWidth > clientWidth) within the column; and boxes that scroll
# but do not show it (_static/scroll-boxes.css: edge shadows).
OVERFLOW = """() => {
  document.querySelectorAll("details").forEach(d => { d.open = true; });
  const column = document.querySelector("article.bd-article") || document.querySelector("main");
  const box = column.getBoundingClientRect(), style = getComputedStyle(column);
  const left = box.left + parseFloat(style.paddingLeft) - 1, right = box.right - parseFloat(style.paddingRight) + 1;
  const scrolls = e => ["auto", "scroll"].includes(getComputedStyle(e).overflowX) && e.scrollWidth > e.clientWidth;
  const describe = e => `<${e.tagName.toLowerCase()} class="${e.getAttribute("class") || ""}">`
    + ` ${(e.textContent || "").trim().slice(0, 60)}`;
  const wide = [], silent = [];
  for (const e of column.querySelectorAll("*")) {
    const r = e.getBoundingClientRect();
    if (!r.width || !r.height || !e.checkVisibility({checkVisibilityCSS: true})) continue;  // hidden
    if (scrolls(e) && !getComputedStyle(e).backgroundImage.includes("gradient")) silent.push(describe(e));
    if (r.left >= left && r.right <= right) continue;
    let inside = false;
    for (let a = e; a && a !== column; a = a.parentElement) {
      const ar = a.getBoundingClientRect();
      if (scrolls(a) && ar.left >= left && ar.right <= right) { inside = true; break; }
    }
    if (!inside) wide.push(`${describe(e)} (${Math.round(r.left)}-${Math.round(r.right)} px,`
                          + ` column ${Math.round(left)}-${Math.round(right)})`);
  }
  return {wide: wide.slice(0, 10), silent: silent.slice(0, 10)};
}"""

# Markup that reached the reader unrendered: a pipe table's separator row (the typographer turns
# --- into an em dash), a MyST directive fence, an inline role.
RAW_MARKUP = re.compile(r"\|\s*:?(?:-{3,}|[—–]+):?\s*\||:::\{|```\{|\{[a-z][\w:-]*\}`")


def check_page(page, problems: list[str], name: str) -> dict:
    """Wait for MathJax and widgets, then report what the page shows."""
    has_math = page.evaluate("() => document.querySelectorAll('.math').length") > 0
    if has_math:
        assert page.evaluate(MATHJAX_DONE), f"{name}: has math but MathJax did not load"
    text = page.evaluate(VISIBLE_TEXT)
    raw = [tex for tex in ("$$", "\\(", "\\[", "\\begin{") if tex in text]
    assert not raw, f"{name}: raw TeX left in the page ({raw}): MathJax did not typeset it"
    widgets = page.evaluate(WIDGETS)
    if widgets["views"] and not widgets["state"]:
        problems.append(f"{name}: {widgets['views']} widget views but no widget state in the notebook "
                        "(save it with its widget state, e.g. nbconvert --ExecutePreprocessor.store_widget_state=True)")
    elif widgets["views"]:
        try:  # the html-manager draws each view into a .widget-subarea after the load event
            page.wait_for_function("n => document.querySelectorAll('.widget-subarea > *').length >= n",
                                   arg=widgets["views"], timeout=15_000)
        except Exception:  # noqa: BLE001 - a Playwright timeout: say what is missing
            problems.append(f"{name}: widgets not drawn: {page.evaluate(WIDGETS)}")
    return {
        "math": page.evaluate("() => document.querySelectorAll('mjx-container').length"),
        "images": page.evaluate(OUTPUT_IMAGES),
        "all_images": page.evaluate(ALL_IMAGES),
        "widgets": widgets,
        "raw_markup": sorted({m.group(0) for m in RAW_MARKUP.finditer(text)}),
        "search_boxes": page.evaluate(SEARCH_BOXES),
        "course_map": page.evaluate(COURSE_MAP_LINKS),
        "streams": page.evaluate(STREAM_TEXTS),
        "overflow": page.evaluate(OVERFLOW),
    }


@pytest.fixture(scope="module")
def rendered(html, browser) -> tuple[dict, list[str]]:
    """What every page of the table of contents shows, keyed by docname, and the problems seen
    while loading them. Home is opened through index.html, which redirects to it."""
    problems: list[str] = []
    names = toc_docnames()
    seen = {}
    for name in names:
        if not (html / f"{name}.html").is_file():
            continue  # reported by test_every_toc_page_is_built
        start = html / ("index.html" if name == names[0] else f"{name}.html")
        page = open_page(browser, start.as_uri(), problems)
        page.wait_for_url(f"**/{name}.html")
        seen[name] = check_page(page, problems, name)
        page.context.close()
    return seen, problems


def test_pages_render_offline(rendered):
    """Home, every chapter and lab: math typeset, plots loaded, widgets drawn, no console errors
    and not one request to the web."""
    seen, problems = rendered
    names = toc_docnames()
    assert not problems, "\n".join(problems)
    assert seen[names[0]]["math"] > 0, "the home page's math was not typeset (no mjx-container)"
    labs = {n: s for n, s in seen.items() if n.startswith("labs/")}
    chapters = [n for n in seen if n.startswith("chapters/") and n != names[0]]
    assert chapters, f"no chapter page besides the home page in _toc.yml: {names}"
    assert labs, f"no lab page in _toc.yml: {names}"
    assert any(img["width"] > 0 for s in labs.values() for img in s["images"]), \
        f"no lab page shows a plot: {labs}"


def test_every_image_loads(rendered):
    seen, _ = rendered
    broken = [(n, img["src"]) for n, s in seen.items() for img in s["all_images"] if img["width"] == 0]
    assert not broken, f"images that did not load: {broken}"


def test_no_raw_markup_in_the_text(rendered):
    """Tables stored as text/markdown render as tables, MyST directives and roles as what they make."""
    seen, _ = rendered
    raw = {n: s["raw_markup"] for n, s in seen.items() if s["raw_markup"]}
    assert not raw, f"unrendered markup in the text a reader sees: {raw}"


def test_one_search_box(rendered):
    seen, _ = rendered
    counts = {n: s["search_boxes"] for n, s in seen.items() if s["search_boxes"] != 1}
    assert not counts, f"pages without exactly one search box: {counts}"


def test_course_map_lists_every_page(html, rendered):
    """The home page's course map links every page of _toc.yml but itself, in the book's order."""
    seen, _ = rendered
    names = toc_docnames()
    linked = [Path(urlsplit(url).path).relative_to(html).with_suffix("").as_posix()
              for url in seen[names[0]]["course_map"]]
    assert linked == names[1:], f"course map links {linked}, _toc.yml has {names[1:]}"


# A tqdm bar: "description:  42%|████      | 84/200 [...]" (the description is optional)
BAR_STATE = re.compile(r"^(?P<desc>.*?)\s*(?P<pct>\d{1,3})%\|")


def test_progress_bars_show_one_line(rendered):
    """A tqdm bar is stored as every state it drew ("\\r  0%|..." then "\\r100%|..."): the book shows
    its last one (_ext/stream_outputs.py), and no carriage return reaches the page."""
    seen, _ = rendered
    problems, bars = [], 0
    for name, s in seen.items():
        for text in s["streams"]:
            if "\r" in text:
                problems.append(f"{name}: a raw carriage return in {text[:80]!r}")
            previous = None
            for line in text.splitlines():
                state = BAR_STATE.match(line)
                bars += bool(state)
                if state and previous and state["desc"] == previous["desc"] \
                        and int(state["pct"]) > int(previous["pct"]):
                    problems.append(f"{name}: two states of one bar: {previous.string[:60]!r} then {line[:60]!r}")
                previous = state
    assert not problems, "\n".join(problems)
    assert bars, "no progress bar on any page: is the check still looking at the outputs?"


def test_wide_lines_scroll_in_their_box(rendered):
    """Code, outputs, tables and display math wider than the text column scroll inside their box,
    which shows that it does; nothing else sticks out of the column."""
    seen, _ = rendered
    wide = {n: s["overflow"]["wide"] for n, s in seen.items() if s["overflow"]["wide"]}
    assert not wide, f"wider than the text column and not in a scroll box: {wide}"
    silent = {n: s["overflow"]["silent"] for n, s in seen.items() if s["overflow"]["silent"]}
    assert not silent, f"boxes that scroll but do not show it (_static/scroll-boxes.css): {silent}"


def _stream_outputs():
    spec = importlib.util.spec_from_file_location("stream_outputs", ROOT / "_ext" / "stream_outputs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_stream_text_as_a_terminal_shows_it():
    """The extension's rewrite, without a build: carriage returns applied, a bar's last state kept,
    two runs of a bar with the same description kept apart."""
    tidy = _stream_outputs().tidy_stream
    stored = ("\rtrain:   0%|          | 0/200 [00:00<?, ?it/s]\n"
              "\rtrain:  50%|#####     | 100/200 [00:06<00:06, 15.0it/s]\n"
              "\rtrain: 100%|##########| 200/200 [00:13<00:00, 14.7it/s]\n"
              "loss 2.31\n"
              "\rtrain:   0%|          | 0/200 [00:00<?, ?it/s]\rtrain: 100%|##########| 200/200 [00:12<00:00]\n"
              "eval:   0%|          | 0/1.5k [00:00<?, ?it/s]\n"
              "eval: 100%|##########| 1.5k/1.5k [00:01<00:00]\r\n"
              "done\n")
    assert tidy(stored) == ("train: 100%|##########| 200/200 [00:13<00:00, 14.7it/s]\n"
                            "loss 2.31\n"
                            "train: 100%|##########| 200/200 [00:12<00:00]\n"
                            "eval: 100%|##########| 1.5k/1.5k [00:01<00:00]\n"
                            "done\n")
    assert tidy("a: 100%|#| 5/5\na:   0%| | 0/5\n") == "a: 100%|#| 5/5\na:   0%| | 0/5\n"
