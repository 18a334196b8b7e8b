"""Figures, not a test: one aarch64 GPU cell (cu130-blackwell, no compile step) built on this x86 host under QEMU
from the default index: how long the emulated path takes where every heavy wheel is prebuilt.

    python benchmarks/aarch64_emulated.py [--json OUT]

Uses the test matrix variant (tests/gpuvariant.py: python 3.11, the debootstrapped arm64 bookworm base) on a copy of
the build context. Nothing is pushed. Compare with the x86_64 figures of `make test-gpu-image`.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import enginefix  # noqa: E402
from builder import engine as eng, lock, render  # noqa: E402
from builder.matrix import load_matrix  # noqa: E402
from gpuvariant import write_test_matrix  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    a = p.parse_args()
    enginefix.engine_info()
    enginefix.install_certs()
    with tempfile.TemporaryDirectory(prefix="trainbox-arm64-") as tmp:
        ctx = eng.snapshot_context(Path(tmp))
        cell = load_matrix(write_test_matrix(ctx)).select(["cu130-blackwell-aarch64"])[0]
        render.write_cells([cell], root=ctx)
        t0 = time.monotonic()
        lock.ensure([cell], root=ctx, quiet=True)
        locked = time.monotonic() - t0
        builder = eng.choose_builder("auto")
        t0 = time.monotonic()
        res = eng.build_cell(cell, builder=builder, context=ctx, bases={cell.base_image: enginefix.base_ref()},
                             quiet=True)
        out = {"cell": cell.tag, "host": eng.host_arch(), "emulated": cell.arch != eng.host_arch(),
               "lock_s": round(locked, 1), "build_s": round(time.monotonic() - t0, 1), "image_bytes": res.size,
               "layers": res.layers, "steps": res.steps}
    print(json.dumps(out, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
