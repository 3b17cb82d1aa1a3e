/* The memory calculator's page: `python -m gpulab.memory` in the browser.
 *
 * No formula lives here. The script starts Pyodide from the book's own static files (vendored by
 * `make static`), writes the repository's gpulab.memory sources and bridge.py (copied into the
 * build by _ext/memory_calculator.py) into Pyodide's file system, and on every change of the form
 * calls bridge.run, which calls gpulab.memory.estimate; it only shows what comes back.
 *
 * Browsers start Pyodide only on pages served over http (fetching the .wasm is refused on file://),
 * so a page opened from disk says how to serve it instead. The container's data-status tells the
 * book's tests where it is: static (no script), file, loading, ready or failed.
 */
"use strict";

(() => {
  const script = document.currentScript;
  const assets = new URL("./", script.src); // _static/memory-calculator/
  const staticRoot = new URL("../", assets); // _static/
  const bookRoot = new URL("../", staticRoot);
  const pyodideURL = new URL(script.dataset.pyodide, staticRoot);
  const pyodideVersion = script.dataset.pyodideVersion;
  const sources = script.dataset.sources.split(/\s+/).filter(Boolean);
  const HOME = "/home/pyodide/memory-calculator"; // where the sources go in Pyodide's file system
  const EXAMPLE = "python -m gpulab.memory --model llama3-8b --seq 4096";

  function make(tag, props = {}, ...children) {
    const node = Object.assign(document.createElement(tag), props);
    node.append(...children);
    return node;
  }

  function code(text) {
    const inner = make("span", { className: "pre", textContent: text });
    return make("code", { className: "docutils literal notranslate" }, inner);
  }

  function block(text) {
    return make("div", { className: "highlight" }, make("pre", {}, text));
  }

  function admonition(kind, title, ...body) {
    const heading = make("p", { className: "admonition-title", textContent: title });
    return make("div", { className: `admonition ${kind}` }, heading, ...body);
  }

  function say(root, ...content) {
    root.querySelector(".mc-message").replaceChildren(...content);
  }

  // --- opened from disk -------------------------------------------------------------------

  function servedOnly(root) {
    let folder = decodeURIComponent(bookRoot.pathname).replace(/\/$/, "");
    if (/^\/[A-Za-z]:\//.test(folder)) folder = folder.slice(1); // file:///C:/... on Windows
    const quoted = /[\s"'$]/.test(folder) ? `"${folder}"` : folder;
    const page = location.href.split(/[?#]/)[0].slice(bookRoot.href.length);
    const served = `http://localhost:8000/${page}`;
    root.dataset.status = "file";
    say(root, admonition("warning", "Serve the book to use this calculator",
      make("p", {}, "This page was opened from disk (file://). The calculator runs the course's own Python code, ",
        code("gpulab.memory"), ", in your browser with Pyodide, and browsers only start Pyodide on pages served over " +
        "http. Serve the book from a terminal:"),
      block(`python -m http.server -d ${quoted}`),
      make("p", {}, "then open ", make("a", { href: served, textContent: served }),
        ". Or compute on the command line, in the course's environment: ", code(EXAMPLE),
        " (the same numbers; ", code("--help"), " lists every option).")));
  }

  // --- starting Python --------------------------------------------------------------------

  function loadScript(url) {
    return new Promise((resolve, reject) => {
      const tag = make("script", { src: url.href });
      tag.onload = resolve;
      tag.onerror = () => reject(new Error(`could not load ${url.href}`));
      document.head.append(tag);
    });
  }

  async function boot() {
    if (typeof globalThis.loadPyodide !== "function") await loadScript(new URL("pyodide.js", pyodideURL));
    // packageBaseUrl: packages (none are loaded) would come from here, never from Pyodide's CDN
    const py = await globalThis.loadPyodide({ indexURL: pyodideURL.href, packageBaseUrl: pyodideURL.href });
    const files = await Promise.all(sources.map(async (name) => {
      const response = await fetch(new URL(name, assets), { cache: "no-cache" });
      if (!response.ok) throw new Error(`${name}: HTTP ${response.status} ${response.statusText}`);
      return [name, await response.text()];
    }));
    for (const [name, text] of files) {
      const path = `${HOME}/${name}`;
      py.FS.mkdirTree(path.slice(0, path.lastIndexOf("/")));
      py.FS.writeFile(path, text);
    }
    py.runPython(`import sys\nsys.path.insert(0, ${JSON.stringify(HOME)})`);
    const bridge = py.pyimport("bridge");
    return {
      run: (request) => JSON.parse(bridge.run(JSON.stringify(request))),
      python: py.runPython("import sys; sys.version.split()[0]"),
    };
  }

  // --- the form ---------------------------------------------------------------------------

  function syncForm(root, form) {
    const count = form.elements.model.value === "params";
    for (const row of form.querySelectorAll(".mc-row")) {
      const off = row.hasAttribute("data-needs-shape") ? count : row.contains(form.elements.params) && !count;
      row.classList.toggle("mc-off", off);
      for (const control of row.querySelectorAll("input, select")) control.disabled = off;
    }
    for (const name of ["precision", "optimizer"]) {
      const hint = root.querySelector(`#mc-${name}-hint`);
      hint.textContent = root.getAttribute(`data-${name}-${form.elements[name].value}`) || "";
    }
  }

  function readForm(form) {
    const fields = {}, labels = {};
    for (const control of form.elements) {
      if (!control.name || control.matches(":disabled")) continue; // left out: the calculator's default
      fields[control.name] = control.type === "checkbox" ? control.checked : control.value;
      const label = form.querySelector(`label[for="${control.id}"]`);
      labels[control.name] = label ? label.textContent.trim() : control.name;
    }
    return { fields, labels };
  }

  function render(root, out) {
    const error = root.querySelector(".mc-error");
    const result = root.querySelector(".mc-result");
    const command = root.querySelectorAll(".mc-command, .mc-command-line");
    root.querySelector(".mc-output").hidden = false;
    error.hidden = !out.error;
    result.hidden = Boolean(out.error);
    command.forEach((node) => { node.hidden = Boolean(out.error); });
    root.dataset.result = out.error ? "error" : "ok";
    if (out.error) {
      error.querySelector(".mc-error-text").textContent = out.error;
      return;
    }
    root.querySelector(".mc-table tbody").replaceChildren(...out.rows.map((row) => {
      const tr = make("tr", { className: row.part === "total" || row.part === "peak" ? "mc-total" : "" },
        make("th", { scope: "row", textContent: row.label }),
        make("td", { className: "mc-num mc-gb", textContent: row.gb }),
        make("td", { className: "mc-num mc-gib", textContent: row.gib }),
        make("td", { className: "mc-num mc-bytes", textContent: row.bytes_text }));
      tr.dataset.part = row.part;
      return tr;
    }));
    root.querySelector(".mc-trainable").textContent = `Trainable parameters: ${out.trainable_params}.`;
    const notes = root.querySelector(".mc-notes");
    notes.replaceChildren(...out.notes.map((note) => make("li", { textContent: note })));
    notes.hidden = out.notes.length === 0;
    root.querySelector(".mc-command code").textContent = out.command;
  }

  function compute(root, form, calculator) {
    syncForm(root, form);
    let out;
    try {
      out = calculator.run(readForm(form));
    } catch (err) { // not a ValueError: the last line of the Python traceback
      out = { error: `the calculator failed: ${String(err.message || err).trim().split("\n").pop()}` };
    }
    render(root, out);
  }

  async function start(root) {
    const form = root.querySelector(".mc-form");
    form.addEventListener("submit", (event) => event.preventDefault()); // Enter must not reload the page
    if (location.protocol === "file:") {
      servedOnly(root);
      return;
    }
    root.dataset.status = "loading";
    say(root, make("p", { className: "mc-loading" },
      `Starting Python in your browser (Pyodide ${pyodideVersion}, about 12 MB the first time)…`));
    let calculator;
    try {
      calculator = await boot();
    } catch (err) {
      root.dataset.status = "failed";
      say(root, admonition("error", "The calculator could not start",
        make("p", { textContent: String(err && err.message ? err.message : err) }),
        make("p", {}, "It needs Pyodide in the book's static files (", code("make static"),
          " before the build) and a page served over http (", code("python -m http.server -d _build/html"),
          " serves it). On the command line ", code(EXAMPLE), " gives the same numbers.")));
      return;
    }
    say(root, make("p", { className: "mc-loading" }, "Running ", code("gpulab.memory"),
      ` from this build of the book, in Python ${calculator.python} (Pyodide ${pyodideVersion}).`));
    root.querySelector(".mc-fields").disabled = false;
    const update = () => compute(root, form, calculator);
    form.addEventListener("input", update);
    form.addEventListener("change", update);
    update();
    root.dataset.status = "ready";
  }

  function startAll() {
    document.querySelectorAll(".memory-calculator").forEach((root) => { start(root); });
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", startAll);
  else startAll();
})();
