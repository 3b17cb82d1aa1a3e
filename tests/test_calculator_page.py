"""The memory calculator's page gives, in a browser and offline, what `python -m gpulab.memory` gives.

The book is built once (test_book.py's strict-build fixture) and served by http.server on 127.0.0.1
from a thread. Debian's chromium, driven by Playwright as in test_book.py, opens the page and waits
for Pyodide to start; each case then sets the form as a reader would and reads the table. The CLI
runs with the same settings in a subprocess, and the page must agree to the byte (`--json`), in GB
as the CLI's table prints them, in its notes, and in the command line it shows. Settings the
calculator refuses must show its own message. Every request that does not go to the local server
is aborted and recorded: there must be none. Opened from file://, the page must say how to serve it.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import test_book
import yaml
from test_book import built_pages, open_page, vendored_files

# test_book.py's fixtures, used here by name: its strict build (with the static_files below) and chromium
build, html, browser = test_book.build, test_book.html, test_book.browser

ROOT = Path(__file__).resolve().parents[1]
PAGE = "chapters/memory-calculator"
BOOT_TIMEOUT_MS = 90_000  # Pyodide starts in ~5 s; a loaded CI machine is slower


def _extension():
    spec = importlib.util.spec_from_file_location("memory_calculator", ROOT / "_ext" / "memory_calculator.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXT = _extension()


def pyodide_files() -> list[Path]:
    folder = yaml.safe_load((ROOT / "_config.yml").read_text())["sphinx"]["config"]["memory_calculator_pyodide"]
    return [ROOT / "_static" / folder / name for name in EXT.PYODIDE_FILES]


# ---------------------------------------------------------------------------------------------
# Fixtures: the static files (Pyodide too), one build, a local server, the page with Python started


@pytest.fixture(scope="module")
def static_files() -> list[Path]:
    """As test_book.py's, with Pyodide: fetched by `make static` when missing."""
    needed = [*vendored_files(), *pyodide_files()]
    if [p for p in needed if not p.is_file()]:
        proc = subprocess.run(["make", "static"], cwd=ROOT, capture_output=True, text=True)
        missing = [str(p) for p in needed if not p.is_file()]
        if proc.returncode or missing:
            pytest.fail(f"vendored files missing ({', '.join(missing)}): run `make static` (needs npm)\n"
                        f"{proc.stdout}{proc.stderr}")
    return needed


@pytest.fixture(scope="module")
def server(html):
    """The built book over http on 127.0.0.1 (a free port), as `python -m http.server` serves it."""

    class Handler(SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(html), **kwargs)

        def do_GET(self):
            if self.path == "/favicon.ico":  # chromium asks every server for one; the book has none
                self.send_response(204)
                self.end_headers()
                return
            super().do_GET()

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def calculator(browser, server):
    """(page, problems, seconds Pyodide took to start). Requests outside the server are aborted and,
    with console errors, page errors and failed loads, recorded in problems."""
    problems: list[str] = []
    context = browser.new_context(viewport={"width": 1280, "height": 900})

    def only_local(route):
        if route.request.url.startswith(server + "/"):
            route.continue_()
        else:
            problems.append(f"request outside the book's server: {route.request.url}")
            route.abort()

    context.route("**/*", only_local)
    page = context.new_page()
    page.set_default_timeout(30_000)
    page.on("console", lambda m: m.type == "error" and problems.append(f"console error: {m.text}"))
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"failed to load {r.url}: {r.failure}"))
    start = time.monotonic()
    page.goto(f"{server}/{PAGE}.html", wait_until="load")
    root = page.locator(".memory-calculator")
    page.wait_for_function("() => ['ready', 'failed'].includes(document.querySelector('.memory-calculator')"
                           "?.dataset.status)", timeout=BOOT_TIMEOUT_MS)
    seconds = time.monotonic() - start
    assert root.get_attribute("data-status") == "ready", \
        f"the calculator did not start:\n{page.locator('.mc-message').inner_text()}\n" + "\n".join(problems)
    yield page, problems, seconds
    context.close()


# ---------------------------------------------------------------------------------------------
# Setting the form, reading the page, running the CLI


def set_form(page, settings: dict) -> None:
    """Back to the form's initial values, then each setting as a reader makes it (model first: it
    turns the controls that need a model shape on or off)."""
    page.evaluate("""() => {
        const form = document.querySelector('.memory-calculator form');
        form.reset();
        form.dispatchEvent(new Event('input', {bubbles: true}));
    }""")
    for name, value in sorted(settings.items(), key=lambda item: item[0] != "model"):
        control = page.locator(f'.memory-calculator [name="{name}"]')
        if isinstance(value, bool):
            control.set_checked(value)
        elif control.evaluate("e => e.tagName") == "SELECT":
            control.select_option(str(value))
        else:
            control.fill(str(value))


READ = """() => {
  const root = document.querySelector('.memory-calculator');
  const visible = (sel) => root.querySelector(sel).checkVisibility();
  return {
    result: root.dataset.result,
    error: visible('.mc-error') ? root.querySelector('.mc-error-text').innerText : null,
    table: visible('.mc-table'),
    rows: [...root.querySelectorAll('.mc-table tbody tr')].map(tr =>
      ({part: tr.dataset.part, cells: [...tr.cells].map(c => c.innerText.trim())})),
    notes: [...root.querySelectorAll('.mc-notes li')].map(li => li.innerText.trim()),
    command: root.querySelector('.mc-command code').innerText.trim(),
  };
}"""


def cli(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpulab.memory", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def cli_json(args: list[str]) -> dict[str, int]:
    proc = cli([*args, "--json"])
    assert proc.returncode == 0, f"python -m gpulab.memory {shlex.join(args)}: {proc.stderr}"
    return json.loads(proc.stdout)


# (form settings, the same settings as CLI arguments)
CASES = {
    "llama3-8b-zero3-8gpus-ckpt": (
        {"model": "llama3-8b", "precision": "bf16", "optimizer": "adamw", "zero_stage": "3", "world_size": 8,
         "batch_size": 1, "seq_len": 4096, "checkpointing": True},
        ["--model", "llama3-8b", "--dtype", "bf16", "--optimizer", "adamw", "--zero", "3", "--gpus", "8",
         "--batch", "1", "--seq", "4096", "--checkpointing"]),
    "7e9-params-fp32-sgd": (
        {"model": "params", "params": "7e9", "precision": "fp32", "optimizer": "sgd"},
        ["--params", "7e9", "--dtype", "fp32", "--optimizer", "sgd"]),
    "llama3-70b-qlora-nf4-r16": (
        {"model": "llama3-70b", "lora_rank": 16, "quantization": "nf4", "seq_len": 2048, "checkpointing": True},
        ["--model", "llama3-70b", "--lora-rank", "16", "--quant", "nf4", "--seq", "2048", "--checkpointing"]),
    "llama3-1b-8bit-adam-zero2-eager-padded-kv": (
        {"model": "llama3-1b", "precision": "bf16-autocast", "optimizer": "adamw-8bit", "zero_stage": "2",
         "world_size": 4, "batch_size": 4, "seq_len": 1024, "attention": "eager", "padding_mask": True,
         "checkpointing": True, "checkpoint_every": 4, "kv_cache_len": 8192, "kv_cache_batch": 2},
        ["--model", "llama3-1b", "--dtype", "bf16-autocast", "--optimizer", "adamw-8bit", "--zero", "2",
         "--gpus", "4", "--batch", "4", "--seq", "1024", "--attention", "eager", "--padded", "--checkpointing",
         "--checkpoint-every", "4", "--kv-context", "8192", "--kv-batch", "2"]),
    "llama3-3b-lomo-int8-lora-no-seq": (
        {"model": "llama3-3b", "optimizer": "lomo", "lora_rank": 8, "quantization": "int8", "seq_len": 0,
         "zero_stage": "1"},
        ["--model", "llama3-3b", "--optimizer", "lomo", "--lora-rank", "8", "--quant", "int8", "--zero", "1"]),
    "llama3-70b-tp8-sp-zero3": (
        {"model": "llama3-70b", "tp_degree": 8, "sequence_parallel": True, "zero_stage": "3", "world_size": 8,
         "seq_len": 4096, "checkpointing": True},
        ["--model", "llama3-70b", "--tp", "8", "--sp", "--zero", "3", "--gpus", "8", "--seq", "4096",
         "--checkpointing"]),
    "llama3-1b-accumulation": (
        {"model": "llama3-1b", "optimizer": "adamw", "seq_len": 2048, "grad_accumulation": 4},
        ["--model", "llama3-1b", "--optimizer", "adamw", "--seq", "2048", "--grad-accum", "4"]),
    "7e9-params-tp4": ({"model": "params", "params": "7e9", "tp_degree": 4}, ["--params", "7e9", "--tp", "4"]),
}


# ---------------------------------------------------------------------------------------------
# The tests


def test_page_ships_the_repository_code(html):
    """The page loads the repository's current calculator, byte for byte, and only that page loads
    the calculator's script."""
    folder = html / "_static" / EXT.ASSETS
    for source in EXT.SOURCES:
        assert (folder / source).read_bytes() == (ROOT / source).read_bytes(), f"{source} differs from the build's copy"
    assert not (folder / "gpulab/memory/measure.py").exists(), "measure.py (torch) must not be shipped"
    with_script = [p.relative_to(html).as_posix() for p in built_pages(html) if EXT.SCRIPT in p.read_text()]
    assert with_script == [f"{PAGE}.html"], f"pages that load the calculator's script: {with_script}"


@pytest.mark.parametrize("case", CASES, ids=str)
def test_page_matches_the_cli(calculator, case):
    page, problems, _ = calculator
    settings, args = CASES[case]
    set_form(page, settings)
    shown = page.evaluate(READ)
    assert shown["result"] == "ok" and shown["error"] is None and shown["table"], shown

    expected = cli_json(args)
    moment = expected.pop("peak_moment", None)  # shown in the peak row's label
    rows = {row["part"]: row["cells"] for row in shown["rows"]}
    if moment is not None:
        assert rows["peak"][0] == f"peak ({moment})", rows["peak"]
    assert list(rows) == list(expected), f"parts on the page {list(rows)}, from the CLI {list(expected)}"
    for part, value in expected.items():
        label, gb, gib, count = rows[part]
        assert int(count.replace(",", "")) == value, f"{part}: page {count} bytes, CLI {value}"
        assert (gb, gib) == (f"{value / 1e9:.3f}", f"{value / 2**30:.3f}"), f"{part}: {gb} GB, {gib} GiB"

    # the CLI's own table: the same GB figures and the same notes
    text = cli(args)
    assert text.returncode == 0, text.stderr
    table = dict(re.findall(r"^(\w+)\s+([\d.]+)$", text.stdout, flags=re.M))
    assert {p: rows[p][1] for p in expected} == table, f"page GB {rows}, CLI table {table}"
    notes = [line.removeprefix("note: ") for line in text.stdout.splitlines() if line.startswith("note: ")]
    assert shown["notes"] == notes

    # the command the page shows gives the same numbers
    command = shlex.split(shown["command"])
    assert command[:3] == ["python", "-m", "gpulab.memory"], shown["command"]
    assert cli_json(command[3:]) == {**expected, **({"peak_moment": moment} if moment else {})}, \
        f"the page's command {shown['command']!r} gives other numbers"
    assert not problems, "\n".join(problems)


# (form settings, the same settings as CLI arguments, a setting that puts it right)
INVALID = {
    "nf4-without-lora": ({"model": "llama3-8b", "quantization": "nf4", "lora_rank": 0},
                         ["--model", "llama3-8b", "--seq", "4096", "--quant", "nf4"], {"lora_rank": 16}),
    "zero-gpus": ({"model": "llama3-8b", "zero_stage": "3", "world_size": 0},
                  ["--model", "llama3-8b", "--seq", "4096", "--zero", "3", "--gpus", "0"], {"world_size": 2}),
    "negative-params": ({"model": "params", "params": "-7e9"}, ["--params", "-7e9"], {"params": "7e9"}),
}


@pytest.mark.parametrize("case", INVALID, ids=str)
def test_invalid_settings_show_the_calculators_message(calculator, case):
    page, problems, _ = calculator
    settings, args, fix = INVALID[case]
    set_form(page, settings)
    shown = page.evaluate(READ)
    assert shown["result"] == "error" and shown["error"] and not shown["table"], shown
    proc = cli(args)
    assert proc.returncode == 2, f"the CLI accepted {shlex.join(args)}"
    if case != "negative-params":  # the CLI checks a count's range itself, with its option's name
        assert proc.stderr.strip() == f"python -m gpulab.memory: error: {shown['error']}", (proc.stderr, shown)
    assert page.get_by_role("alert").is_visible()

    for name, value in fix.items():  # put right, the table is back
        page.locator(f'.memory-calculator [name="{name}"]').fill(str(value))
    shown = page.evaluate(READ)
    assert shown["result"] == "ok" and shown["error"] is None and shown["table"], shown
    assert not problems, "\n".join(problems)


def test_a_count_that_is_not_a_number(calculator):
    page, problems, _ = calculator
    set_form(page, {"model": "params", "params": "seven billion"})
    shown = page.evaluate(READ)
    assert shown["result"] == "error" and "seven billion is not a number" in shown["error"], shown
    assert cli(["--params", "seven billion"]).returncode == 2
    assert not problems, "\n".join(problems)


def test_started_quickly_and_offline(calculator):
    """Pyodide started from the book's server, in under a minute, with nothing fetched elsewhere."""
    page, problems, seconds = calculator
    assert seconds < 60, f"Pyodide took {seconds:.1f} s to start"
    fetched = page.evaluate("() => performance.getEntriesByType('resource').map(e => e.name)")
    assert any("pyodide.asm.wasm" in url for url in fetched), fetched
    assert not problems, "\n".join(problems)


def test_from_disk_the_page_says_how_to_serve_it(html, browser):
    problems: list[str] = []
    page = open_page(browser, (html / f"{PAGE}.html").as_uri(), problems)  # blocks and records http(s)
    try:
        page.wait_for_function("() => document.querySelector('.memory-calculator')?.dataset.status === 'file'")
        message = page.locator(".memory-calculator .mc-message")
        assert message.is_visible()
        text = message.inner_text()
        assert f"python -m http.server -d {html}" in text, text
        assert f"http://localhost:8000/{PAGE}.html" in text, text
        assert "python -m gpulab.memory" in text, text
        fetched = page.evaluate("() => performance.getEntriesByType('resource').map(e => e.name)")
        assert not [url for url in fetched if "pyodide" in url], f"Pyodide fetched from disk: {fetched}"
        assert not problems, "\n".join(problems)
    finally:
        page.context.close()


def test_the_build_refuses_code_the_page_cannot_run(tmp_path):
    """The build warns (an error under -W) when a shipped module imports one the page does not ship,
    such as measure.py (torch), or a package outside the standard library."""
    for source in EXT.SOURCES:
        (tmp_path / source).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / source).write_text((ROOT / source).read_text())
    assert EXT.source_problems(tmp_path) == []
    (tmp_path / "gpulab/memory/measure.py").write_text("import torch\n")
    init = tmp_path / "gpulab/memory/__init__.py"
    init.write_text(init.read_text() + "from gpulab.memory import measure\nfrom .measure import measure\n")
    (tmp_path / "gpulab/memory/shapes.py").write_text("from typing import TYPE_CHECKING\nimport numpy\n"
                                                      "if TYPE_CHECKING:\n    import torch\n")
    problems = EXT.source_problems(tmp_path)
    assert len(problems) == 3, problems
    assert sum("gpulab.memory.measure, which the calculator page does not ship" in p for p in problems) == 2
    assert "gpulab/memory/shapes.py imports numpy" in problems[2]
