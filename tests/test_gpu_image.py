"""A real CUDA 13 image, built here from the default package index alone (several GB): `make test-gpu-image`.

Not in `make test` (conftest deselects the `gpuimage` marker unless -m names it). What it builds: the cu130 x86_64
cells of the GPU stack through the tool's own path (render, automatic lock, build, push, report), with two
substitutions that this machine forces and nothing else:
- the CUDA `base` image (not pullable here) is the debootstrapped bookworm base (`make bases`): the CUDA libraries
  come with the torch/vLLM wheels anyway; bookworm's python is 3.11, so the test's copy of the matrix says 3.11 for
  CUDA 13.0 and the venv is locked for it (the real cells: Ubuntu 24.04, 3.12);
- Hopper's FA3 wheel lives on PyTorch's index (not reachable here), so the test's Hopper cell uses SDPA: the two cells
  then differ in their image record and labels only, which is what the registry-bytes check below measures against.
Figures (build time, size, layers, registry bytes) go to $TRAINBOX_CACHE/gpu-image-figures.json and the output.
"""
from __future__ import annotations

import json
import subprocess
import time
from types import SimpleNamespace

import pytest

from builder import engine as eng, lock, render
from builder.matrix import load_matrix
from builder.options import BuildOptions
from builder.pipeline import build_cells
from devenv import engine as devengine
from enginefix import BUILD_TIMEOUT, ROOT, base_ref, docker, engine_info, install_certs
from gpuvariant import write_test_matrix

pytestmark = [pytest.mark.gpuimage, pytest.mark.engine, pytest.mark.timeout(BUILD_TIMEOUT)]
CELLS = ("cu130-blackwell-x86_64", "cu130-hopper-x86_64")
IMPORTS = ("torch", "vllm", "transformers", "trl", "peft", "bitsandbytes", "accelerate", "liger_kernel")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    info = engine_info()
    install_certs()
    ctx = eng.snapshot_context(tmp_path_factory.mktemp("gpu-ctx"))
    m = load_matrix(write_test_matrix(ctx))
    cells = m.select(list(CELLS))
    render.write_cells(cells, root=ctx)
    assert not lock.is_fresh(cells[0], ctx)     # missing or stale (python 3.11 here): the build must lock it
    registry = f"{info['registry']}/gpuimage"
    # output_dir=ctx: the build locks into ctx and builds from the repository with ctx's images/ and locks/ laid over
    args = BuildOptions(output_dir=ctx, registry=registry, report=str(ctx / "report.json"),
                        bases={cells[0].base_image: base_ref()})
    t0 = time.monotonic()
    assert build_cells(cells, args) == 0
    seconds = time.monotonic() - t0
    report = json.loads((ctx / "report.json").read_text())
    figures = {"seconds_total": round(seconds, 1), "cells": [
        {k: r[k] for k in ("tag", "seconds", "size", "layers", "pushed_bytes", "push_seconds")}
        for r in report["cells"]], "registry": report["registry"]}
    out = devengine.cache_dir() / "gpu-image-figures.json"
    out.write_text(json.dumps(figures, indent=2) + "\n")
    print(json.dumps(figures, indent=2))
    return SimpleNamespace(ctx=ctx, cells=cells, report=report, refs={r["tag"]: r["refs"][0] for r in report["cells"]})


def _run(ref: str, *args: str, entrypoint: str | None = None, timeout: float = 900):
    cmd = ["run", "--rm", "--network", "none"] + (["--entrypoint", entrypoint] if entrypoint else []) + [ref, *args]
    return docker(*cmd, check=False, timeout=timeout)


def test_lock_was_made_by_the_build_and_installed_with_hashes(built):
    cell = built.cells[0]
    text = (built.ctx / cell.lock).read_text()
    assert lock.is_fresh(cell, built.ctx)
    assert "\ntorch==2.13.0 \\" in text and "\nvllm==0.31.0 \\" in text and "+cu" not in text.split("torch==")[1][:10]
    assert "nvidia-cudnn-cu13==" in text and "--hash=sha256:" in text


def test_pip_check_is_clean_and_the_stack_imports(built):
    ref = built.refs[CELLS[0]]
    r = _run(ref, "-m", "pip", "check", entrypoint="python")
    assert r.returncode == 0 and "No broken requirements found" in r.stdout, r.stdout + r.stderr
    code = f"import importlib; [importlib.import_module(m) for m in {IMPORTS!r}]; import torch; print(torch.__version__, torch.version.cuda)"
    r = _run(ref, "-c", code, entrypoint="python")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.split()[-2:] == ["2.13.0+cu130", "13.0"] or r.stdout.split()[-2:] == ["2.13.0", "13.0"], r.stdout


def test_the_fabric_is_there_for_nccl(built):
    """NCCL dlopens libibverbs.so.1 for its IB/RoCE transport: the image has it (matrix.toml [fabric]) and asks
    enroot's mellanox hook for the node's HCAs."""
    ref = built.refs[CELLS[0]]
    r = _run(ref, "-p", entrypoint="ldconfig")
    assert "libibverbs.so.1" in r.stdout and "librdmacm.so.1" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    env = json.loads(docker("inspect", "--format", "{{json .Config.Env}}", ref).stdout)
    assert "MELLANOX_VISIBLE_DEVICES=all" in env and not any(e.startswith("NCCL_") for e in env), env


def test_doctor_reports_no_gpu_and_every_version(built):
    cell = built.cells[0]
    r = _run(built.refs[cell.tag], "doctor", timeout=1200)
    assert r.returncode == 3, r.stdout[-3000:] + r.stderr[-3000:]   # EXIT_NO_GPU: the image is fine, no GPU here
    for pkg in ("torch", "vllm", "transformers", "trl", "peft", "bitsandbytes", "accelerate", "liger-kernel"):
        assert f"{pkg}=={cell.pins[pkg]}" in r.stdout, pkg
    assert "VERDICT: no-gpu" in r.stdout
    assert "FAIL" not in r.stdout, r.stdout


def test_labels_carry_the_commit_and_the_cell(built):
    cell = built.cells[0]
    labels = json.loads(docker("inspect", "--format", "{{json .Config.Labels}}", built.refs[cell.tag]).stdout)
    rev = labels["org.opencontainers.image.revision"]   # the checkout's commit when the build ran
    assert len(rev) == 40 and subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{rev}^{{commit}}"]).returncode == 0
    assert labels["io.trainbox.min_driver"] == "580.65.06" and labels["io.trainbox.version.torch"] == "2.13.0"


def test_two_cells_of_one_venv_cost_the_registry_little_more_than_one(built):
    s = built.report["registry"]
    sizes = sorted(sum(r["blobs"].values()) for r in built.report["cells"])
    assert s["images"] == 2 and s["stored_bytes"] <= 1.1 * sizes[-1], s
    a, b = (built.report["cells"][i]["blobs"] for i in (0, 1))
    shared = set(a) & set(b)
    # everything but the per-cell record/labels layer and the trainbox package (same content, same layer) is shared
    assert sum(a[d] for d in shared) >= 0.99 * sum(a.values())
