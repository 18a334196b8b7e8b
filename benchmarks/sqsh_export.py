"""Export time and size of an image's .sqsh per compression setting (prints a table; no assertions).

`python benchmarks/sqsh_export.py IMAGE [--settings lzo zstd zstd:1M ...] [--dir DIR]`. Each setting is
COMPRESSION[:BLOCK_SIZE]; lzo is enroot's default (`-comp lzo -noD`). SOURCE_DATE_EPOCH is fixed so every run
produces the same bytes; the rootfs is unpacked afresh for each setting (that is part of an export).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from builder.enroot import UserError, export_image  # noqa: E402


def image_size(ref: str) -> int | None:
    from builder.enroot import docker_cli

    r = subprocess.run([docker_cli(), "image", "inspect", "-f", "{{.Size}}", ref], capture_output=True, text=True)
    return int(r.stdout.strip()) if r.returncode == 0 else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("image")
    p.add_argument("--settings", nargs="+", default=["lzo", "zstd", "zstd:1M"])
    p.add_argument("--dir", default=None, help="where to write the files (default: a temp dir, removed)")
    a = p.parse_args(argv)
    os.environ.setdefault("SOURCE_DATE_EPOCH", "1700000000")
    size = image_size(a.image)
    print(f"image {a.image}: {size / 2**20:.1f} MiB uncompressed (docker)" if size else f"image {a.image}")
    print(f"{'setting':<14}{'seconds':>9}{'MiB':>10}{'% of image':>12}  cpus={os.cpu_count()}")
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        for s in a.settings:
            comp, _, block = s.partition(":")
            dest = Path(d) / f"bench-{comp}-{block or 'default'}.sqsh"
            t0 = time.monotonic()
            try:
                export_image(a.image, dest, compression=comp, block_size=block or None, progress=False)
            except UserError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            dt = time.monotonic() - t0
            mib = dest.stat().st_size / 2**20
            pct = f"{100 * dest.stat().st_size / size:.0f}%" if size else "-"
            print(f"{s:<14}{dt:>9.1f}{mib:>10.1f}{pct:>12}", flush=True)
            dest.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
