# One toolchain, the same locally and in CI. Every target sets itself up.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.stamp-setup
TORCH_VERSION := 2.13.0
PYTEST_ARGS ?=

.PHONY: setup test lint format protos protos-check bench clean

setup: $(STAMP)

# Re-runs only when the dependency list changes. torch goes in first, pinned,
# so that no later requirement drags in a CUDA build.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[all,dev]'
	@touch $@

test: setup protos-check
	$(PY) -m pytest $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check services tests bench tools examples
	$(VENV)/bin/ruff format --check services tests bench tools examples
	$(VENV)/bin/mypy

format: setup
	$(VENV)/bin/ruff check --fix services tests bench tools examples
	$(VENV)/bin/ruff format services tests bench tools examples

protos: setup
	$(PY) tools/gen_protos.py

protos-check: setup
	$(PY) tools/gen_protos.py --check

bench: setup
	$(PY) bench/codec.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
