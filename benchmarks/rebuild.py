"""Cold build vs warm rebuild after an entrypoints-only change, for one cell: time, layers rebuilt, bytes re-pushed.

    python benchmarks/rebuild.py [--cell smoke] [--arch x86_64] [--skip-cold] [--json OUT]

Starts the engine and registry (`devenv.engine up`) and uses the debootstrapped test base, like the tests.
Works on a copy of the build context, so the working tree is never touched. Prints numbers; asserts nothing about
speed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from builder import engine as eng, report  # noqa: E402
from builder.matrix import load_matrix  # noqa: E402
from builder.options import parse_bases, parse_secrets  # noqa: E402
import enginefix  # noqa: E402


def run(cell, ctx: Path, repo: str, no_cache: bool, label: str) -> dict:
    args = enginefix.build_args(cell)
    builder = eng.choose_builder(args.builder)
    t0 = time.monotonic()
    res = eng.build_cell(cell, builder=builder, context=ctx, registry=repo, bases=parse_bases(args.base),
                         wheelhouse=args.wheelhouse, secrets=parse_secrets(args.secret), no_cache=no_cache,
                         quiet=True)
    built = time.monotonic() - t0
    eng.push_result(res, builder, quiet=True)
    return {"run": label, "build_s": round(built, 1), "push_s": res.push_seconds, "steps": res.steps,
            "steps_rebuilt": res.steps - res.cached_steps, "layers": res.layers,
            "layers_pushed": res.pushed_layers, "bytes_pushed": res.pushed_bytes, "image_bytes": res.size,
            "digest": res.digest, "result": res}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cell", default="smoke")
    p.add_argument("--arch", default="x86_64")
    p.add_argument("--skip-cold", action="store_true", help="start from the build cache (no --no-cache build)")
    p.add_argument("--json", help="also write the figures here")
    a = p.parse_args(argv)
    info = enginefix.engine_info()
    enginefix.install_certs()
    cells = [c for c in load_matrix(ROOT / "matrix.toml").select([a.cell], arch=[a.arch])]
    if len(cells) != 1:
        print(f"error: no single cell {a.cell} for {a.arch}", file=sys.stderr)
        return 2
    cell = cells[0]
    repo = f"{info['registry']}/trainbox-bench-{uuid.uuid4().hex[:6]}"
    rows = []
    with tempfile.TemporaryDirectory(prefix="trainbox-bench-") as tmp:
        ctx = eng.snapshot_context(Path(tmp) / "ctx")
        rows.append(run(cell, ctx, repo, no_cache=not a.skip_cold, label="cold" if not a.skip_cold else "cached"))
        with open(ctx / "entrypoints" / "__init__.py", "a") as f:
            f.write(f"\n# benchmark change {uuid.uuid4().hex}\n")
        rows.append(run(cell, ctx, repo, no_cache=False, label="warm (entrypoints changed)"))
    print(f"cell {cell.tag}, registry {repo}, builder {rows[0]['result'].builder}")
    print(report.table([r["result"] for r in rows]))
    print()
    cols = ["run", "build_s", "push_s", "steps", "steps_rebuilt", "layers", "layers_pushed", "bytes_pushed",
            "image_bytes"]
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(r[c]).ljust(w) for c, w in zip(cols, widths)))
    if a.json:
        report.write_json(a.json, {"cell": cell.tag, "rows": [{k: v for k, v in r.items() if k != "result"}
                                                               for r in rows]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
