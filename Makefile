# The README's two commands (each installs what it needs first; quick when it is there):
#   make build   the main job on this machine: the smoke cell (both arches) from debootstrapped local bases, pushed
#                to the local registry with its manifest list
#   make test    the whole suite (what CI's .ci/run calls)
SHELL := /bin/bash
PY ?= .venv/bin/python
PIP ?= .venv/bin/pip
REGISTRY ?= 127.0.0.1:$(or $(TRAINBOX_REGISTRY_PORT),5555)/trainbox

.PHONY: help build setup system-deps lint test test-fast test-gpu-image gh200-image engine engine-stop render lock bases workflow pins \
	slurm slurm-stop bench

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:[^#]*## /\t/' | expand -t 16

# Debian packages: python3-venv for .venv; engine, registry, skopeo, QEMU binfmt and debootstrap for the builds and the
# real-image tests; squashfs for .sqsh; Slurm + munge, umoci, chromium, docker-compose for their tests. apt-get clean
# drops the downloaded .debs after them (2.5 GB): the suite's images and temp files need the room.
SYSTEM_PACKAGES := python3-venv docker.io docker-registry skopeo squashfs-tools squashfuse qemu-user-static \
	binfmt-support debootstrap slurm-wlm munge umoci iproute2 curl chromium docker-compose tini

build: system-deps setup engine bases ## install what is missing, then build + push the smoke cell here
	$(PY) -m devenv.buildinputs --wheelhouse .cache/wheels
	$(PY) build.py --cell smoke --config .cache/bases.toml --wheelhouse .cache/wheels --push --registry $(REGISTRY)

# Two workers (TEST_WORKERS=0: one process): the modules that need the engine or Slurm run in order on one, all the
# others on the other, while the session images build in the background (tests/conftest.py, tests/enginefix.py).
TEST_WORKERS ?= 2

test: system-deps setup lint ## everything: unit, rendered files, real images (starts the engine itself), Slurm
	$(PY) -m pytest -ra --durations=40 -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder tests

# Before the suite: an undefined name or a stray import fails here in a second, not in a 40-minute run.
lint: setup ## Python lint: ruff check, pyproject.toml's [tool.ruff] (pyflakes, syntax, import order, 3.11 upgrades)
	$(PY) -m ruff check

system-deps: ## the Debian packages above (root; a no-op when all are present)
	@missing=$$(for p in $(SYSTEM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" != 0 ]; then echo "error: missing Debian packages:" $$missing "(run make as root, or" \
	    "apt-get install -y" $$missing")" >&2; exit 2; fi; \
	  echo "installing:" $$missing; apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing && apt-get clean; fi

setup: .venv/.installed ## .venv: the host package, the test tools and the smoke cell's training stack (CPU torch)

# The CPU build of torch (the smoke cell's): a wheel pip already has locally (its configured find-links, PIP_FIND_LINKS:
# a wheelhouse) is taken as is; else it comes from PyTorch's CPU index, matrix.toml's [index] torch for variant `cpu`
# (TORCH_INDEX=URL: a mirror). Never from the default index, whose torch is the CUDA build with several GB of nvidia-*.
TORCH_PIN := $(shell python3 -c 'import tomllib; print(next(r.split("==")[1] for r in tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["train"] if r.startswith("torch==")))')
TORCH_INDEX ?= $(shell python3 -c 'import tomllib; print(tomllib.load(open("matrix.toml", "rb"))["index"]["torch"].format(variant="cpu"))')

# Re-run only when the package's dependencies change.
.venv/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	@if $(PIP) install -q --no-index --no-deps torch==$(TORCH_PIN) 2>/dev/null; then \
	  echo "torch $(TORCH_PIN): a local wheel (pip's find-links)"; \
	else \
	  echo "torch $(TORCH_PIN)+cpu from $(TORCH_INDEX) (about 200 MB; TORCH_INDEX=URL for a mirror)"; \
	  $(PIP) install -q --index-url $(TORCH_INDEX) torch==$(TORCH_PIN)+cpu; \
	fi
	$(PIP) install -q -e '.[dev,train]'
	$(PY) -c 'import torch, sys; sys.exit(0 if torch.version.cuda is None else "error: .venv has a CUDA torch build: remove .venv and run make setup again")'
	touch $@

test-fast: setup lint ## no engine, no Slurm
	$(PY) -m pytest -ra -m "not engine and not slurm" tests

test-gpu-image: setup ## a real CUDA 13 image from the default index (several GB, ~30 min; not in `make test`)
	$(PY) -m pytest -ra -s -m gpuimage tests/test_gpu_image.py

gh200-image: engine ## the GH200 cell (cu130-hopper-aarch64) under QEMU beside its x86_64 build: figures, doctor, selftest
	@# QEMU 10+ from <release>-backports (devenv/qemu.py: torch's aarch64 import segfaults under bookworm's 7.2), its
	@# qemu-aarch64 binfmt handler registered again; a warning when not root. Here, not in system-deps: `make test`'s
	@# arm64 smoke image has no torch and builds under 7.2, and the tests' QEMU stays the one CI has run.
	@if [ "$$(id -u)" = 0 ]; then python3 -m devenv.qemu ensure; else python3 -m devenv.qemu version; fi
	$(PY) benchmarks/gh200_image.py --json $(or $(TRAINBOX_CACHE),$(HOME)/.cache/trainbox)/gh200-image-figures.json

render: setup ## re-render every cell's Dockerfile into images/
	$(PY) build.py --dry-run --quiet

lock: setup ## re-lock what the default index alone can lock (cu129 cells need PyTorch's and vLLM's indexes)
	$(PY) build.py --lock smoke
	$(PY) build.py --lock --cuda 13.0 --gpu blackwell

workflow: setup ## regenerate .github/workflows/ (build, lock, pins) from matrix.toml
	$(PY) -m builder.workflow

pins: setup ## which pins could move and what blocks them, [facts] against the index (WRITE=1 refreshes [facts])
	$(PY) -m builder.pins $(if $(WRITE),--write)

# --- the test machine (devenv/): engine, registry, bases, Slurm ---
engine: setup ## start (or reuse) a Docker engine, a local registry on 127.0.0.1, QEMU binfmt for arm64
	$(PY) -m devenv.engine up

engine-stop: setup ## stop what `make engine` started
	$(PY) -m devenv.engine down

bases: engine ## debootstrapped bookworm bases (amd64 + arm64) in the local registry; .cache/bases.toml maps to them
	$(PY) -m devenv.bases --write-config .cache/bases.toml

slurm: setup ## start (or reuse) a one-node Slurm + munge on this machine
	$(PY) -m devenv.slurm up

slurm-stop: setup ## stop what `make slurm` started
	$(PY) -m devenv.slurm down

bench: engine ## figures, not tests: cold, warm and one-package-lock-change build (+ push), .sqsh export time and size
	$(PY) benchmarks/rebuild.py --push
	$(PY) benchmarks/sqsh_export.py trainbox:smoke-x86_64
