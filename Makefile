# Everything is set up by these targets on a fresh machine: `make book`, `make test`.
# Tested versions are pinned in constraints.txt; pyproject.toml holds the ranges.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
LABS   ?= $(wildcard labs/[0-9]*.ipynb)

.PHONY: help install static book test test-gpu-image lab refresh clean

help:
	@echo "make book     build the HTML book into _build/html (offline: math served locally)"
	@echo "make test     every test: gpulab units, structure, book build, browser, all labs under nbval"
	@echo "make test-gpu-image  unit tests and all labs again with the GPU machine's transformers, peft, triton"
	@echo "make lab      open JupyterLab on the labs"
	@echo "make refresh  re-execute labs in place to refresh stored outputs (LABS=labs/01-....ipynb for one)"

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[lab,book,test]'
	touch $@

install: $(STAMP)

# --- a second environment with the lent GPU machine's library versions (constraints-gpu-image.txt
# replaces those lines of constraints.txt); torch stays the CPU build of constraints.txt. A third one
# adds the GPU machine's torch 2.11 (PyPI's CUDA build, about 4.5 GB, which runs on a CPU; not in CI):
#   make test-gpu-image GPU_VENV=.venv-gpu-torch GPU_CONSTRAINTS="constraints-gpu-image.txt constraints-gpu-torch.txt"
# A fourth has the newest torch and transformers (constraints-latest.txt; PyPI's CUDA build too; not in CI):
#   make test-gpu-image GPU_VENV=.venv-latest GPU_CONSTRAINTS=constraints-latest.txt
# (--no-cache-dir: a cached copy of those wheels would double that on disk)
GPU_VENV        ?= .venv-gpu-image
GPU_CONSTRAINTS ?= constraints-gpu-image.txt
GPU_STAMP       := $(GPU_VENV)/.installed

$(GPU_STAMP): pyproject.toml constraints.txt $(GPU_CONSTRAINTS)
	$(PYTHON) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install -q --upgrade pip
	names=$$(cat $(GPU_CONSTRAINTS) | grep -v '^#' | cut -d= -f1 | paste -sd'|'); \
	  { grep -viE "^($$names)==" constraints.txt; cat $(GPU_CONSTRAINTS) | grep -v '^#'; } > $(GPU_VENV)/constraints.txt
	$(GPU_VENV)/bin/python -m pip install -q --no-cache-dir -c $(GPU_VENV)/constraints.txt -e '.[lab,test]'
	touch $@

# --- static: the JavaScript the book serves itself, so pages render offline (no CDN) ----------
# Pinned npm packages, fetched once with `npm pack` (npm checks each tarball against the registry's
# integrity hash; published versions are immutable). File targets: nothing is fetched again while
# the files exist, and a new version is a new path. The same paths appear in _config.yml.
NPM                 ?= npm
VENDOR              := _static/vendor
MATHJAX_VERSION     := 3.2.2
REQUIREJS_VERSION   := 2.3.8
HTMLMANAGER_VERSION := 1.0.15
PYODIDE_VERSION     := 0.29.5
# tex-svg-full: one self-contained file (all TeX extensions, glyphs as SVG paths, no web fonts)
MATHJAX_JS          := $(VENDOR)/mathjax@$(MATHJAX_VERSION)/tex-svg-full.js
REQUIRE_JS          := $(VENDOR)/requirejs@$(REQUIREJS_VERSION)/require.js
WIDGETS_JS          := $(VENDOR)/html-manager@$(HTMLMANAGER_VERSION)/embed-amd.js
PYODIDE_JS          := $(VENDOR)/pyodide@$(PYODIDE_VERSION)/pyodide.js
VENDOR_FILES        := $(MATHJAX_JS) $(REQUIRE_JS) $(WIDGETS_JS) $(PYODIDE_JS)

# $(call npm-files,package@version,file,more files): from the npm tarball of that package, copy
# package/<file> to $@ and any package/<more files> (globs) next to it. $@ is written last, through
# $@.part, so an interrupted fetch never leaves a target that looks complete.
define npm-files
	@command -v $(NPM) >/dev/null || { echo "make static needs npm (e.g. apt-get install npm)" >&2; exit 1; }
	@echo "fetch $(1): $(2) $(3) -> $(@D)/"
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	  (cd "$$tmp" && $(NPM) pack --silent --loglevel=error $(1) >/dev/null) && \
	  tar -xzf "$$tmp"/*.tgz -C "$$tmp" && mkdir -p $(@D) && \
	  for f in $(addprefix "$$tmp"/package/,$(3)); do cp "$$f" $(@D)/ || exit 1; done && \
	  cp "$$tmp/package/$(2)" $@.part && mv $@.part $@
endef

$(MATHJAX_JS):
	$(call npm-files,mathjax@$(MATHJAX_VERSION),es5/tex-svg-full.js)

$(REQUIRE_JS):
	$(call npm-files,requirejs@$(REQUIREJS_VERSION),require.js)

# embed-amd.js bundles the built-in widgets; the woff2 fonts are its icons (older formats unused)
$(WIDGETS_JS):
	$(call npm-files,@jupyter-widgets/html-manager@$(HTMLMANAGER_VERSION),dist/embed-amd.js,dist/*.woff2)

# the memory calculator's page runs gpulab.memory in Pyodide (_ext/memory_calculator.py): the
# loader, the interpreter (wasm and its JS glue), the standard library and the package index the
# loader reads at start-up; about 12 MB, fetched by the browser only when that page is served
$(PYODIDE_JS):
	$(call npm-files,pyodide@$(PYODIDE_VERSION),pyodide.js,pyodide.asm.js pyodide.asm.wasm python_stdlib.zip pyodide-lock.json)

static: $(VENDOR_FILES)

book: install static
	$(BIN)/jupyter-book build . -W -n --keep-going
	@echo "open _build/html/index.html"

test: install static
	$(BIN)/python -m pytest --nbval tests labs

# the book's build and browser checks (book, calculator page) do not depend on these versions: they run
# in `make test`
test-gpu-image: $(GPU_STAMP)
	$(GPU_VENV)/bin/python -m pytest --nbval tests labs --ignore=tests/test_book.py \
	    --ignore=tests/test_calculator_page.py

lab: install
	$(BIN)/jupyter lab labs/

refresh: install
	$(BIN)/jupyter nbconvert --to notebook --execute --inplace \
	    --ExecutePreprocessor.timeout=1200 --ExecutePreprocessor.kernel_name=python3 $(LABS)
	$(BIN)/python tools/sync_repo_url.py  # the install cell ran silently: store it without a count

clean:
	rm -rf _build
