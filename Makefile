# The README's commands: `make setup` (once), `make test` (the whole suite; CI runs it through .ci/run).
SHELL := /bin/bash
PY ?= .venv/bin/python
PIP ?= .venv/bin/pip

.PHONY: setup test test-fast engine engine-stop render

setup: ## create .venv with the host package, the test tools and the smoke cell's training stack (CPU torch)
	python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,train]'

test: ## everything: unit, rendered files, real images (starts the engine itself), Slurm
	$(PY) -m pytest -ra tests

test-fast: ## no engine, no Slurm
	$(PY) -m pytest -ra -m "not engine and not slurm" tests

render: ## re-render every cell's Dockerfile into images/
	$(PY) build.py --dry-run --quiet

# --- engine (owned by builder/setup_engine.py) ---
engine: ## start (or reuse) a Docker engine, a local registry on 127.0.0.1, QEMU binfmt for arm64
	$(PY) -m builder.setup_engine up

engine-stop: ## stop what `make engine` started
	$(PY) -m builder.setup_engine down
