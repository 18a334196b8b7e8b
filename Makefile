# The README's commands: `make setup` (once), `make test` (the whole suite; CI runs it through .ci/run).
SHELL := /bin/bash
PY ?= .venv/bin/python
PIP ?= .venv/bin/pip

.PHONY: setup system-deps test test-fast test-gpu-image engine engine-stop render lock bases workflow slurm slurm-stop bench

# Debian packages the real-image, .sqsh, Slurm, browser (chromium) and compose (docker-compose) tests use (root;
# a no-op when all are present).
SYSTEM_PACKAGES := docker.io docker-registry skopeo squashfs-tools squashfuse qemu-user-static binfmt-support \
	debootstrap slurm-wlm munge umoci iproute2 curl chromium docker-compose

setup: ## create .venv with the host package, the test tools and the smoke cell's training stack (CPU torch)
	python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev,train]'

system-deps: ## install the Debian packages above (needs root; CI calls it)
	@missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then echo "installing: $$missing"; apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; fi

test: ## everything: unit, rendered files, real images (starts the engine itself), Slurm
	$(PY) -m pytest -ra tests

test-fast: ## no engine, no Slurm
	$(PY) -m pytest -ra -m "not engine and not slurm" tests

test-gpu-image: ## build a real CUDA 13 image from the default index (several GB, ~30 min; not part of `make test`)
	$(PY) -m pytest -ra -s -m gpuimage tests/test_gpu_image.py

render: ## re-render every cell's Dockerfile into images/
	$(PY) build.py --dry-run --quiet

lock: ## re-lock what can be locked from the default index alone (cu129 cells need PyTorch's and vLLM's indexes)
	$(PY) build.py --lock smoke
	$(PY) build.py --lock --cuda 13.0 --gpu blackwell

# --- engine (owned by builder/devengine.py) ---
engine: ## start (or reuse) a Docker engine, a local registry on 127.0.0.1, QEMU binfmt for arm64
	$(PY) -m devenv.engine up

engine-stop: ## stop what `make engine` started
	$(PY) -m devenv.engine down

bases: ## debootstrapped bookworm bases (amd64 + arm64) in the local registry, and a --config file mapping to them
	$(PY) -m devenv.bases --write-config .cache/bases.toml

workflow: ## regenerate .github/workflows/build.yml from matrix.toml
	$(PY) -m builder.workflow

# --- Slurm (owned by builder/devslurm.py) ---
slurm: ## start (or reuse) a one-node Slurm + munge on this machine
	$(PY) -m devenv.slurm up

slurm-stop: ## stop what `make slurm` started
	$(PY) -m devenv.slurm down

bench: ## figures, not tests: cold/warm rebuild and re-push, .sqsh export time and size
	$(PY) benchmarks/rebuild.py
	$(PY) benchmarks/sqsh_export.py trainbox:smoke-x86_64
