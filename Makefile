# The two commands a fresh clone needs (see README.md):
#   make lab    create the environment on first use, then open the course in JupyterLab
#   make test   create the environment on first use, then run every check CI runs
# and an optional third, make test-browser (below).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Installed first. From PyPI alone, on Linux, this is the multi-GB CUDA build; it is the CPU
# build only when PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu is set for the first
# `make` (pip then takes 2.13.0+cpu from that index).
TORCH  ?= torch==2.13.0
# JupyterLab's own options for `make lab`, e.g. LAB_ARGS="--port 9999 --ip 0.0.0.0 --no-browser"
LAB_ARGS ?=

.PHONY: lab test test-browser browser-deps grading-deps site test-site build bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Each extra is installed into the environment as an editable install of this folder, built
# with the environment's own setuptools (installed with torch; pyproject.toml's build-system
# asks for >=68) rather than a fresh copy in a build environment of its own: the same package,
# 2 to 4 s sooner each time (measured on a 2-core machine).
EDITABLE := $(BIN)/pip install --no-build-isolation -e

$(VENV)/.course: pyproject.toml | $(BIN)/python
	$(BIN)/pip install "$(TORCH)" "setuptools>=68"
	$(EDITABLE) ".[course]"
	touch $@

# The test tools share the environment with the course; nbgrader's JupyterLab menus and server
# extensions are turned off in it, so `make lab` shows the course only.
$(VENV)/.dev: pyproject.toml scripts/hide_test_tools.py $(VENV)/.course
	$(EDITABLE) ".[course,dev]"
	$(BIN)/python scripts/hide_test_tools.py
	touch $@

# Jupyter refuses to start as root unless told; containers and lab machines often run as root.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root)

lab: $(VENV)/.course
	$(BIN)/jupyter lab --notebook-dir=course $(ROOT_FLAG) $(LAB_ARGS)

# Two test processes (pytest-xdist), one per core of the 2-core machines the course is tested on,
# each with one torch thread (tests/conftest.py; OMP_NUM_THREADS=1 for the notebooks' kernels);
# a test file marked with an xdist_group (its module fixtures grade a corpus once) stays in one
# of them, a notebook's cells in one kernel.
# PARALLEL=-n0 runs everything in one process.
PARALLEL ?= -n 2

# Notebooks run on the embedded stand-in weights, whatever weights this machine may hold, and
# never on a learner's kept pieces (an empty QWEN_MINI_HOME of the run's own).
NB_ENV := env -u QWEN_MINI_WEIGHTS -u QWEN_MINI_DOWNLOAD HF_HUB_OFFLINE=1 HF_HUB_CACHE=$(CURDIR)/$(VENV)/empty-hf-cache QWEN_MINI_HOME=$(CURDIR)/build/nb-home

# What CI checks about course/ is the committed learner copies (the build's --check compares
# them; a learner's answers, outputs and backups there are theirs): ruff and the notebook run use the
# copies as the build makes them, written to build/learner-copies, never course/'s working copies.
LEARNER_COPIES := build/learner-copies
# The later chapters run longest (chapter 7 about 35 s, chapter 0 about 5): they start first, so
# that neither process is left running a long notebook alone at the end.
SOLUTIONS_LAST_FIRST = $(shell ls -r solutions/*.ipynb)

test: $(VENV)/.dev grading-deps
	rm -rf $(LEARNER_COPIES)
	$(BIN)/python -m qwen_mini.course.build --learner-copies $(LEARNER_COPIES)
	$(BIN)/ruff check . $(LEARNER_COPIES)
	$(BIN)/ruff format --check . $(LEARNER_COPIES)
	$(BIN)/python -m qwen_mini.course.build --check
	$(BIN)/python -m pytest $(PARALLEL) --dist loadgroup --durations=15 tests
	mkdir -p $(VENV)/empty-hf-cache
	$(NB_ENV) QWEN_MINI_CHECKS=solutions OMP_NUM_THREADS=1 $(BIN)/python -m pytest $(PARALLEL) --dist loadfile \
	    --nbval-lax --no-loadscope-reorder $(SOLUTIONS_LAST_FIRST)
	$(NB_ENV) QWEN_MINI_CHECKS=course $(BIN)/python -m qwen_mini.course.site --run-only --course $(LEARNER_COPIES)

# The grader runs every submission in a bubblewrap jail (README: "What is guaranteed"); its
# tests need Debian's `bubblewrap`, installed here as browser-deps installs Chromium.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

grading-deps:
	command -v bwrap >/dev/null || ($(SUDO) apt-get update && $(SUDO) apt-get install -y bubblewrap)

# Optional third command: chapter 2 in JupyterLab in headless Chromium (Debian's package, driven
# by Playwright's Python package; no browser download). Installs what it needs.

$(VENV)/.browser: pyproject.toml $(VENV)/.dev
	$(EDITABLE) ".[course,browser]"
	touch $@

browser-deps: $(VENV)/.browser
	command -v chromium >/dev/null || ($(SUDO) apt-get update && $(SUDO) apt-get install -y chromium)

test-browser: browser-deps
	mkdir -p $(VENV)/empty-hf-cache
	$(NB_ENV) $(BIN)/python -m pytest -s tests/browser/browser_ch02.py

# The course as a static site in build/site/ (open build/site/index.html): the learner notebooks
# (as the build makes them: course/'s committed copies, never a learner's answers) run on the
# stand-in, rendered by Sphinx with MyST-NB (README: "The course as a website").
$(VENV)/.site: pyproject.toml $(VENV)/.course
	$(EDITABLE) ".[course,site]"
	touch $@

site: $(VENV)/.site
	mkdir -p $(VENV)/empty-hf-cache
	rm -rf $(LEARNER_COPIES)
	$(BIN)/python -m qwen_mini.course.build --learner-copies $(LEARNER_COPIES)
	$(NB_ENV) QWEN_MINI_CHECKS=course $(BIN)/python -m qwen_mini.course.site --out build/site --course $(LEARNER_COPIES)

# Every page of build/site/ in headless Chromium, and no solution in it (run `make site` first).
test-site: browser-deps
	$(BIN)/python -m pytest tests/browser/browser_site.py

# Leaves alone every course/ notebook that holds a learner's work (it says which, and how to proceed).
build: $(VENV)/.dev
	$(BIN)/python -m qwen_mini.course.build

bench: $(VENV)/.dev
	$(BIN)/python bench/bench_vs_transformers.py

clean:
	rm -rf $(VENV)
