"""Figures, not a test: the GH200 cell (cu130-hopper-aarch64) built for real on this x86 host under QEMU through the
tool's own path (lock, build, push, report), beside the x86_64 build of the same cell, then `doctor` and `selftest`
run in each image (aarch64 under QEMU).

    python benchmarks/gh200_image.py [--json OUT] [--arch aarch64 --arch x86_64] [--emulated-bytecode skip] [--build-only]
                                                                                      (`make gh200-image`)

The test matrix variant of `make test-gpu-image` (tests/gpuvariant.py: python 3.11 on the debootstrapped bookworm
base of `python -m devenv.bases`, Hopper on SDPA because FA3's wheel index is not reachable here; nothing compiled).
Each arch is its own build run, so its build and push seconds are its own; both push to the local registry, whose
stored bytes the report gives for the two together. The images stay in the engine (`docker rmi` them after).
An emulated build installs the venv natively (the template's host-base stage, which the tool picks under QEMU), so
it compiles bytecode as a native one does; --emulated-bytecode skip (--build-arg COMPILE_BYTECODE=) is there to
compare with the builds before that (2026-12-03: the venv stage under QEMU, where the compile took 13 min).
--build-only: the build figures alone, no doctor or selftest in the images (each takes 5-20 min under QEMU).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import enginefix  # noqa: E402
from builder import engine as eng, render  # noqa: E402
from builder.matrix import load_matrix  # noqa: E402
from builder.options import BuildOptions  # noqa: E402
from builder.pipeline import build_cells  # noqa: E402
from gpuvariant import write_test_matrix  # noqa: E402

CELL = "cu130-hopper"


def _in_image(ref: str, platform: str, *args: str, timeout: float) -> dict:
    """One command in the image, no network (the selftest's "no download" is then checked, not trusted)."""
    cmd = ["docker", "run", "--rm", "--network", "none", "--platform", platform, ref, *args]
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"cmd": " ".join(args), "rc": None, "seconds": round(time.monotonic() - t0, 1), "tail": "timed out"}
    return {"cmd": " ".join(args), "rc": r.returncode, "seconds": round(time.monotonic() - t0, 1),
            "stdout": r.stdout[-6000:], "stderr_tail": r.stderr[-2000:]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json")
    p.add_argument("--arch", action="append", choices=["x86_64", "aarch64"],
                   help="the arches to build, in order (default: x86_64 then aarch64)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds for each in-image command")
    p.add_argument("--emulated-bytecode", choices=["skip", "compile"], default="compile",
                   help="uv's bytecode compile in an emulated build (skip: COMPILE_BYTECODE empty)")
    p.add_argument("--build-only", action="store_true", help="no doctor or selftest in the built images")
    a = p.parse_args()
    arches = a.arch or ["x86_64", "aarch64"]
    info = enginefix.engine_info()
    enginefix.install_certs()
    registry = f"{info['registry']}/gh200"
    out: dict = {"host": eng.host_arch(), "cell": CELL, "cells": []}
    with tempfile.TemporaryDirectory(prefix="trainbox-gh200-") as tmp:
        ctx = eng.snapshot_context(Path(tmp))
        m = load_matrix(write_test_matrix(ctx))
        for arch in arches:
            cell = m.select([f"{CELL}-{arch}"])[0]
            render.write_cells([cell], root=ctx)
            report = ctx / f"report-{arch}.json"
            emulated = arch != eng.host_arch()
            skip = emulated and a.emulated_bytecode == "skip"
            opts = BuildOptions(output_dir=ctx, registry=registry, report=str(report),
                                bases={cell.base_image: enginefix.base_ref()},
                                build_args={"COMPILE_BYTECODE": ""} if skip else {})
            t0 = time.monotonic()
            rc = build_cells([cell], opts)
            seconds = round(time.monotonic() - t0, 1)    # lock + build + push, the whole run
            rep = json.loads(report.read_text())
            row = {k: rep["cells"][0].get(k) for k in ("tag", "seconds", "size", "layers", "pushed_bytes",
                                                        "push_seconds")}
            row.update(arch=arch, emulated=emulated, compile_bytecode=not skip, run_seconds=seconds, rc=rc,
                       registry=rep["registry"])
            ref = rep["cells"][0]["refs"][0]
            if a.build_only:
                out["cells"].append(row)
                print(json.dumps(row, indent=2), flush=True)
                continue
            row["doctor"] = _in_image(ref, cell.platform, "doctor", timeout=a.timeout)
            # children get the whole budget under QEMU (an emulated import of torch alone takes minutes)
            row["selftest"] = _in_image(ref, cell.platform, "selftest", "--json", "--timeout",
                                        str(int(a.timeout if row["emulated"] else 170)), timeout=a.timeout)
            out["cells"].append(row)
            print(json.dumps(row, indent=2), flush=True)
    text = json.dumps(out, indent=2) + "\n"
    print(text)
    if a.json:
        Path(a.json).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
