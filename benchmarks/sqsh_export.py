"""Export time and size of an image's .sqsh per compression setting (prints a table; no assertions).

`python benchmarks/sqsh_export.py IMAGE [--settings enroot-import lzo zstd zstd:1M ...] [--dir DIR]`. Each setting is
COMPRESSION[:BLOCK_SIZE] through builder.enroot (zstd is its default; lzo is enroot's `-comp lzo -noD`), or
`enroot-import`: the real `enroot import dockerd://IMAGE` with enroot's own defaults (needs enroot on PATH; skipped
otherwise). Our exports include the sidecars (SBOM: one `docker run` of the image; sha256 of the file); the `sbom`
row times the SBOM alone. SOURCE_DATE_EPOCH is fixed so every run produces the same bytes; the rootfs is unpacked
afresh for each setting (that is part of an export).
"""

from __future__ import annotations

import argparse
import os
import shutil
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
    p.add_argument("--settings", nargs="+", default=["enroot-import", "lzo", "zstd", "zstd:1M", "sbom"])
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
                if s == "sbom":
                    from builder import sbom

                    sbom.generate(a.image)
                    print(f"{s:<14}{time.monotonic() - t0:>9.1f}{'-':>10}{'-':>12}", flush=True)
                    continue
                if s == "enroot-import":
                    if not shutil.which("enroot"):
                        print(f"{s:<14}  skipped: enroot is not on PATH", flush=True)
                        continue
                    env = dict(os.environ, TTY_OFF="y", ENROOT_TEMP_PATH=d)
                    env.pop("SOURCE_DATE_EPOCH", None)  # enroot's dockerd:// path ignores it anyway
                    subprocess.run(["enroot", "import", "-o", str(dest), f"dockerd://{a.image}"], env=env, check=True,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                else:
                    export_image(a.image, dest, compression=comp, block_size=block or None, progress=False)
            except UserError as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            except subprocess.CalledProcessError as e:
                print(f"error: enroot import failed (exit {e.returncode})", file=sys.stderr)
                return 1
            dt = time.monotonic() - t0
            mib = dest.stat().st_size / 2**20
            pct = f"{100 * dest.stat().st_size / size:.0f}%" if size else "-"
            print(f"{s:<14}{dt:>9.1f}{mib:>10.1f}{pct:>12}", flush=True)
            for f in Path(d).glob(f"{dest.name}*"):
                f.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
