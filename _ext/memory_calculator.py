"""The ``{memory-calculator}`` directive: `python -m gpulab.memory` as a form in the book, run offline.

The page does not re-implement the calculator in JavaScript. It runs the repository's own modules
(``SOURCES``) in the browser with Pyodide, which ``make static`` vendors into ``_static/vendor``:

- the directive writes the form; its choices (models, precisions, optimizers, quantizations) come
  from ``gpulab.memory`` itself, read at build time from this repository's sources;
- at the end of the build, ``SOURCES`` are copied into the site next to the page's script
  (``_static/memory-calculator/``), so the page loads exactly the code the build saw;
- ``_static/memory-calculator/calculator.js`` boots Pyodide from the vendored files, writes those
  sources and ``bridge.py`` into Pyodide's file system and calls ``gpulab.memory.estimate``.

The script and its stylesheet are added only to pages that use the directive (Jupyter Book adds
every ``*.js`` and ``*.css`` under ``_static/`` to every page). Warnings, errors under ``-W``: a
missing Pyodide file (``make static`` has not run), and a shipped module that imports something the
page does not ship (e.g. ``gpulab.memory.measure``, which needs torch).
"""

from __future__ import annotations

import ast
import html
import shutil
import sys
from pathlib import Path

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.config import Config
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)

# What the page runs, relative to the repository root; nothing here may import torch.
SOURCES = (
    "gpulab/__init__.py",
    "gpulab/memory/__init__.py",
    "gpulab/memory/calculator.py",
    "gpulab/memory/policy.py",
    "gpulab/memory/shapes.py",
)
ASSETS = "memory-calculator/"  # under _static: calculator.js, calculator.css, bridge.py, and SOURCES
SCRIPT = ASSETS + "calculator.js"
STYLESHEET = ASSETS + "calculator.css"
BRIDGE = "bridge.py"  # the page's side: form fields in, parts out (no formula)
# the files Pyodide needs to start with its standard library (the Makefile fetches the same list)
PYODIDE_FILES = ("pyodide.js", "pyodide.asm.js", "pyodide.asm.wasm", "python_stdlib.zip", "pyodide-lock.json")
DEFAULT_SEQ_LEN = 4096  # the page opens on a case with activations; the CLI's default is 0 (none)


class memory_calculator(nodes.General, nodes.Element):
    """The form; written by the HTML visitor, skipped by other builders."""


# ---------------------------------------------------------------------------------------------
# The form


def _gpulab_memory(srcdir: str):
    """gpulab.memory as this repository has it (the build's source folder first on the path)."""
    if srcdir not in sys.path:
        sys.path.insert(0, srcdir)
    import gpulab.memory as memory

    return memory


def _options(choices: list[tuple[str, str]], selected: str) -> str:
    return "".join(
        f'<option value="{html.escape(value)}"{" selected" if value == selected else ""}>{html.escape(text)}</option>'
        for value, text in choices
    )


def _row(name: str, label: str, control: str, hint: str = "", needs_shape: bool = True) -> str:
    """One labelled control. `needs_shape`: only for a model shape, off for a bare parameter count."""
    shape = " data-needs-shape" if needs_shape else ""
    hint_html = f'<span class="mc-hint" id="mc-{name}-hint">{html.escape(hint)}</span>' if hint else ""
    return (f'<div class="mc-row"{shape}><label for="mc-{name}">{html.escape(label)}</label>'
            f'<div class="mc-control">{control}{hint_html}</div></div>')


def _select(name: str, choices: list[tuple[str, str]], selected: str, **attrs: str) -> str:
    extra = "".join(f' {k.replace("_", "-")}="{html.escape(v)}"' for k, v in attrs.items())
    return f'<select id="mc-{name}" name="{name}"{extra}>{_options(choices, selected)}</select>'


def _number(name: str, value: int, minimum: int) -> str:
    return (f'<input id="mc-{name}" name="{name}" type="number" inputmode="numeric" step="1" '
            f'min="{minimum}" value="{value}">')


def _checkbox(name: str, checked: bool) -> str:
    return f'<input id="mc-{name}" name="{name}" type="checkbox"{" checked" if checked else ""}>'


def form_html(srcdir: str) -> str:
    memory = _gpulab_memory(srcdir)
    from gpulab.memory.calculator import QUANT_BITS
    from gpulab.memory.policy import OPTIMIZERS, PRECISIONS

    d = memory.TrainingSetup()  # the calculator's defaults, which are also the CLI's
    models = [(name, f"{name} ({shape.num_params / 1e9:.1f}B)")
              for name, shape in memory.KNOWN_SHAPES.items()]
    models.append(("params", "a parameter count"))
    default_model = "llama3-8b" if "llama3-8b" in memory.KNOWN_SHAPES else models[0][0]
    precisions = [(p.name, p.name) for p in PRECISIONS.values()]
    optimizers = [(o.name, o.name) for o in OPTIMIZERS.values()]
    describe = {f"precision-{p.name}": p.description for p in PRECISIONS.values()}
    describe |= {f"optimizer-{o.name}": o.description for o in OPTIMIZERS.values()}
    data = "".join(f' data-{k}="{html.escape(v)}"' for k, v in describe.items())
    zero = [("0", "0: no sharding"), ("1", "1: optimizer states"), ("2", "2: + gradients"),
            ("3", "3: + parameters")]
    attention = [("sdpa", "sdpa (fused)"), ("eager", "eager (keeps the probabilities)")]
    quant = [("", "none"), *((k, k) for k in QUANT_BITS)]

    groups = {
        "Model and precision": [
            _row("model", "Model", _select("model", models, default_model), needs_shape=False),
            _row("params", "Parameter count",
                 '<input id="mc-params" name="params" type="text" inputmode="decimal" value="7e9" '
                 'spellcheck="false" aria-describedby="mc-params-hint">',
                 "e.g. 7e9; for Model “a parameter count”", needs_shape=False),
            _row("precision", "Precision", _select("precision", precisions, d.precision,
                                                   aria_describedby="mc-precision-hint"),
                 PRECISIONS[d.precision].description, needs_shape=False),
            _row("optimizer", "Optimizer", _select("optimizer", optimizers, d.optimizer,
                                                   aria_describedby="mc-optimizer-hint"),
                 OPTIMIZERS[d.optimizer].description, needs_shape=False),
        ],
        "Parallelism": [
            _row("zero_stage", "ZeRO stage", _select("zero_stage", zero, str(d.zero_stage)), needs_shape=False),
            _row("world_size", "GPUs", _number("world_size", d.world_size, 1), "data-parallel", needs_shape=False),
            # tensor parallelism, where the calculator models it
            *([_row("tp_degree", "Tensor parallel", _number("tp_degree", d.tp_degree, 1),
                    "GPUs per layer; 1: none", needs_shape=False),
               _row("sequence_parallel", "Sequence parallel", _checkbox("sequence_parallel", d.sequence_parallel),
                    "with tensor parallel above 1", needs_shape=False)]
              if hasattr(d, "tp_degree") else []),
        ],
        "Activations (per GPU)": [
            _row("batch_size", "Micro-batch", _number("batch_size", d.batch_size, 1)),
            *([_row("grad_accumulation", "Accumulation", _number("grad_accumulation", d.grad_accumulation, 1),
                    "micro-batches per optimizer step")] if hasattr(d, "grad_accumulation") else []),
            _row("seq_len", "Sequence length", _number("seq_len", DEFAULT_SEQ_LEN, 0), "0: activations not counted"),
            _row("attention", "Attention", _select("attention", attention, d.attention)),
            _row("checkpointing", "Checkpointing", _checkbox("checkpointing", d.checkpointing)),
            _row("checkpoint_every", "Layers per segment", _number("checkpoint_every", d.checkpoint_every, 1),
                 "with checkpointing; 1: every layer"),
            _row("padding_mask", "Padded batches", _checkbox("padding_mask", d.padding_mask)),
            *([_row("loss_chunk_tokens", "Loss chunk", _number("loss_chunk_tokens", d.loss_chunk_tokens, 0),
                    "tokens per cross-entropy chunk; 0: all at once")] if hasattr(d, "loss_chunk_tokens") else []),
        ],
        "Fine-tuning": [
            _row("lora_rank", "LoRA rank", _number("lora_rank", d.lora_rank, 0), "0: full fine-tuning"),
            _row("quantization", "Quantized base", _select("quantization", quant, d.quantization or ""),
                 "QLoRA: needs a LoRA rank"),
            _row("double_quant", "Double quant", _checkbox("double_quant", d.double_quant),
                 "4-bit: quantize the scales too"),
        ],
        "KV cache (inference)": [
            _row("kv_cache_len", "Tokens", _number("kv_cache_len", d.kv_cache_len, 0), "0: none"),
            _row("kv_cache_batch", "Sequences", _number("kv_cache_batch", d.kv_cache_batch, 1)),
        ],
    }
    # two columns of about equal height; one column, in this order, on a narrow screen
    columns = (("Model and precision", "Activations (per GPU)"),
               ("Parallelism", "Fine-tuning", "KV cache (inference)"))
    fieldsets = "".join(
        '<div class="mc-column">' + "".join(
            f'<fieldset class="mc-group"><legend>{html.escape(title)}</legend>{"".join(groups[title])}</fieldset>'
            for title in column) + "</div>"
        for column in columns)
    return f"""
<div class="memory-calculator" data-status="static"{data}>
<div class="mc-message" role="status">
<noscript><p>This calculator needs JavaScript. <code>python -m gpulab.memory</code> gives the same numbers
on the command line.</p></noscript>
</div>
<form class="mc-form" autocomplete="off" novalidate>
<fieldset class="mc-fields" disabled>{fieldsets}</fieldset>
</form>
<div class="mc-output" aria-live="polite" hidden>
<div class="mc-error admonition error" role="alert" hidden><p class="admonition-title">These settings are refused</p>
<p class="mc-error-text"></p></div>
<div class="mc-result">
<div class="pst-scrollable-table-container">
<table class="table mc-table">
<caption>Memory per GPU, by part (GB = 10<sup>9</sup> bytes, GiB = 2<sup>30</sup> bytes)</caption>
<thead><tr><th scope="col">part</th><th scope="col" class="mc-num">GB</th>
<th scope="col" class="mc-num">GiB</th><th scope="col" class="mc-num">bytes</th></tr></thead>
<tbody></tbody>
</table>
</div>
<p class="mc-trainable"></p>
<ul class="mc-notes"></ul>
</div>
<p class="mc-command-line">The same on the command line:</p>
<pre class="mc-command"><code></code></pre>
</div>
</div>
"""


class MemoryCalculator(SphinxDirective):
    def run(self):
        for source in SOURCES:  # rebuild the page when the calculator changes
            self.env.note_dependency(str(Path(self.env.srcdir, source)))
        node = memory_calculator()
        node["html"] = form_html(str(self.env.srcdir))
        return [node]


def visit_html(self, node: memory_calculator) -> None:
    self.body.append(node["html"])
    raise nodes.SkipNode


def skip(self, node: memory_calculator) -> None:
    raise nodes.SkipNode


# ---------------------------------------------------------------------------------------------
# The page's script, the vendored Pyodide, the shipped sources


def drop_from_every_page(app: Sphinx, config: Config) -> None:
    def keep(entry) -> bool:
        name = entry[0] if isinstance(entry, (tuple, list)) else entry
        return not name.startswith(ASSETS)

    config.html_js_files = [e for e in config.html_js_files if keep(e)]
    config.html_css_files = [e for e in config.html_css_files if keep(e)]


def add_to_calculator_pages(app: Sphinx, pagename: str, templatename: str, context: dict, doctree) -> None:
    if doctree is None or next(iter(doctree.findall(memory_calculator)), None) is None:
        return
    pyodide = app.config.memory_calculator_pyodide
    app.add_css_file(STYLESHEET)
    app.add_js_file(SCRIPT, loading_method="defer", **{
        "data-pyodide": pyodide,  # relative to _static, like the script's own path
        "data-pyodide-version": pyodide.rstrip("/").rpartition("@")[2],
        "data-sources": " ".join([BRIDGE, *SOURCES]),  # relative to _static/memory-calculator/
    })


def _imports(path: Path, source: str) -> list[str]:
    """Absolute names of the modules the file at `path` imports at run time (relative imports
    resolved against its repository path `source`; `if TYPE_CHECKING:` blocks left out)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), source)
    package = list(Path(source).with_suffix("").parts[:-1])
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(block.test) for n in ast.walk(block)}
    names = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from package import name`: name may be a submodule
            names += [module, *(f"{module}.{alias.name}" for alias in node.names if alias.name != "*")]
    return names


def check_files(app: Sphinx) -> None:
    if app.builder.format != "html":
        return
    pyodide = app.config.memory_calculator_pyodide
    folder = Path(app.srcdir, "_static", pyodide)
    if not pyodide or "://" in pyodide:
        logger.warning("memory_calculator: set memory_calculator_pyodide to a folder under _static "
                       "(vendored by `make static`), got %r", pyodide)
    else:
        for name in PYODIDE_FILES:
            if not (folder / name).is_file():
                logger.warning("memory_calculator: _static/%s%s is missing: run `make static`", pyodide, name)
    for problem in source_problems(Path(app.srcdir)):
        logger.warning("memory_calculator: %s", problem)


def source_problems(srcdir: Path) -> list[str]:
    """What would stop SOURCES from importing in Pyodide: a missing file, an import of a gpulab module
    the page does not ship, an import from outside the standard library."""
    shipped = {".".join(Path(s).with_suffix("").parts).removesuffix(".__init__") for s in SOURCES}
    problems = []
    for source in SOURCES:
        path = srcdir / source
        if not path.is_file():
            problems.append(f"{source} is missing")
            continue
        for name in _imports(path, source):
            top = name.split(".")[0]
            module = srcdir.joinpath(*name.split("."))
            is_module = module.with_suffix(".py").is_file() or (module / "__init__.py").is_file()
            if top == "gpulab" and name not in shipped and is_module:
                problems.append(f"{source} imports {name}, which the calculator page does not ship (add it to "
                                "SOURCES in _ext/memory_calculator.py if it imports nothing outside the "
                                "standard library)")
            elif top != "gpulab" and top not in sys.stdlib_module_names:
                problems.append(f"{source} imports {name}, which is not in Python's standard library")
    return problems


def copy_sources(app: Sphinx, exception: Exception | None) -> None:
    if exception is not None or app.builder.format != "html":
        return
    target = Path(app.outdir, "_static", ASSETS)
    for source in SOURCES:
        (target / source).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(app.srcdir, source), target / source)


def setup(app: Sphinx) -> dict:
    app.add_config_value("memory_calculator_pyodide", "", "html", types=[str])
    app.add_node(memory_calculator, html=(visit_html, None), latex=(skip, None), text=(skip, None),
                 man=(skip, None), texinfo=(skip, None))
    app.add_directive("memory-calculator", MemoryCalculator)
    app.connect("config-inited", drop_from_every_page, priority=900)
    app.connect("builder-inited", check_files)
    app.connect("html-page-context", add_to_calculator_pages)
    app.connect("build-finished", copy_sources)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
