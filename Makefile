# Everything is set up by these targets on a fresh machine: `make book`, `make test`.
# Tested versions are pinned in constraints.txt; pyproject.toml holds the ranges.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
LABS   ?= $(wildcard labs/[0-9]*.ipynb)

.PHONY: help install static book test lab refresh clean

help:
	@echo "make book     build the HTML book into _build/html (offline: math served locally)"
	@echo "make test     every test: gpulab units, structure, book build, browser, all labs under nbval"
	@echo "make lab      open JupyterLab on the labs"
	@echo "make refresh  re-execute labs in place to refresh stored outputs (LABS=labs/01-....ipynb for one)"

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[lab,book,test]'
	touch $@

install: $(STAMP)

static: $(STAMP)

book: install static
	$(BIN)/jupyter-book build . -W -n --keep-going
	@echo "open _build/html/index.html"

test: install static
	$(BIN)/python -m pytest --nbval tests labs

lab: install
	$(BIN)/jupyter lab labs/

refresh: install
	$(BIN)/jupyter nbconvert --to notebook --execute --inplace \
	    --ExecutePreprocessor.timeout=1200 --ExecutePreprocessor.kernel_name=python3 $(LABS)

clean:
	rm -rf _build
