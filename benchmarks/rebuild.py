"""Build time of one cell three ways: cold, warm (nothing changed), and after a one-package lock change.

    python benchmarks/rebuild.py [--cell smoke-x86_64 | --gpu-test-cell] [--bump tqdm] [--deps-stage-from REV]
                                 [--cold-mounts] [--skip-cold] [--push] [--json OUT]

cold: `--no-cache` (BuildKit's cache mounts, e.g. uv's download cache, persist: `--cold-mounts` first removes the
engine's cache mounts, everyone's, so that run downloads everything again). warm: the same build again. lock: one
package of the cell's lock moved to its previous release (its hashes from `uv pip compile`), the way a reviewed pin
bump lands, then built again. `--gpu-test-cell`: the cu130 cell tests/test_gpu_image.py builds (tests/gpuvariant.py's
substitutions, the debootstrapped base), several GB from the default index. Starts the engine and registry
(`devenv.engine up`); works on a copy of the build context (the working tree is never touched); removes its images at
the end. Prints numbers; asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import enginefix  # noqa: E402
from builder import engine as eng, lock, render, report  # noqa: E402
from builder.matrix import load_matrix  # noqa: E402
from builder.options import parse_bases, parse_secrets  # noqa: E402
from gpuvariant import write_test_matrix  # noqa: E402

GPU_TEST_CELL = "cu130-blackwell-x86_64"


def previous_release(cell, lock_path: Path, package: str) -> tuple[str, str]:
    """(old block, new block) of LOCK_PATH: PACKAGE's pinned lines, and the release before it with its hashes."""
    text = lock_path.read_text()
    m = re.search(rf"^{re.escape(package)}==(\S+) \\\n(?:    .*\n)*?(?=\S|\Z)", text, re.M)
    if not m:
        raise SystemExit(f"error: {package} is not in {lock_path}; choose another --bump")
    r = subprocess.run([lock.uv_binary(), "pip", "compile", "-", "--quiet", "--generate-hashes", "--no-header",
                        "--no-deps", "--no-annotate", "--python-version", cell.python,
                        "--python-platform", cell.uv_platform], input=f"{package}<{m.group(1)}\n",
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"error: uv pip compile {package}<{m.group(1)}: {r.stderr.strip()[-300:]}")
    new = r.stdout.strip() + "\n"
    return m.group(0), new


def cache_records(cli: str) -> dict[str, int]:
    """The engine's build-cache records: id -> bytes."""
    out = subprocess.run([cli, "system", "df", "-v", "--format", "{{json .BuildCache}}"], capture_output=True,
                         text=True, check=True).stdout
    units = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
    recs = {}
    for r in json.loads(out or "[]"):
        m = re.match(r"([\d.]+)([kMGT]?B)", r["Size"])
        recs[r["ID"].rstrip("*")] = int(float(m.group(1)) * units[m.group(2)]) if m else 0
    return recs


def drop_own_venvs(cli: str, before: dict[str, int], refs: list[str], min_bytes: int = 5_000_000_000) -> None:
    """Free what this benchmark's builds added: its images, then the build-cache records made since BEFORE that are
    venv-sized (a GPU venv is ~10 GB twice: the deps stage and the runtime's copy; other people's records are left
    alone). Without this, the lock run's second venv would not fit next to the first on a ~40 GB disk."""
    subprocess.run([cli, "image", "rm", *refs], capture_output=True)
    for rid, size in cache_records(cli).items():
        if rid not in before and size >= min_bytes:
            subprocess.run([cli, "builder", "prune", "-f", "--filter", f"id={rid}"], capture_output=True)


def with_old_deps_stage(dockerfile: Path, rev: str, cell) -> None:
    """Put the deps stage of images/TAG/Dockerfile as committed at REV into DOCKERFILE (the rest stays as rendered
    now): the 'before' of a change to the venv install, everything else equal. The committed stage checks the python
    it was rendered for; a cell whose python differs (--gpu-test-cell: 3.11) gets its own in that check."""
    old = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:images/{cell.tag}/Dockerfile"],
                         capture_output=True, text=True, check=True).stdout
    stage = lambda t: t[t.index("FROM base AS deps"):t.index("\n# ---- ", t.index("FROM base AS deps"))]  # noqa: E731
    committed = re.search(r"assert v == '([0-9.]+)'", stage(old)).group(1)   # the python it was rendered for
    old_stage = stage(old).replace(f"'{committed}'", f"'{cell.python}'").replace(f"for {committed}'",
                                                                                f"for {cell.python}'")
    new = dockerfile.read_text()
    dockerfile.write_text(new.replace(stage(new), old_stage, 1))


def run(cell, ctx: Path, repo: str, label: str, *, no_cache: bool, push: bool, bases, wheelhouse, secrets) -> dict:
    builder = eng.choose_builder("auto")
    t0 = time.monotonic()
    res = eng.build_cell(cell, builder=builder, context=ctx, registry=repo, bases=bases, wheelhouse=wheelhouse,
                         secrets=secrets, no_cache=no_cache, quiet=True)
    built = time.monotonic() - t0
    if push:
        from builder import publish
        publish.push_result(res, builder, quiet=True)
    # each run's figures as soon as it ends: a 10 GB cell takes many minutes a run on a shared 2-core host
    print(f"{label}: {built:.1f} s, {res.steps - res.cached_steps} of {res.steps} steps rebuilt", flush=True)
    return {"run": label, "build_s": round(built, 1), "push_s": res.push_seconds, "steps": res.steps,
            "steps_rebuilt": res.steps - res.cached_steps, "layers": res.layers,
            "layers_pushed": res.pushed_layers, "bytes_pushed": res.pushed_bytes, "image_bytes": res.size,
            "result": res}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cell", default="smoke-x86_64", help="a cell tag of matrix.toml")
    p.add_argument("--gpu-test-cell", action="store_true", help=f"{GPU_TEST_CELL} as tests/test_gpu_image.py builds it")
    p.add_argument("--bump", default="tqdm", help="the package the lock run moves (default: tqdm, small, pure Python)")
    p.add_argument("--cold-mounts", action="store_true", help="empty the engine's cache mounts before the cold run")
    p.add_argument("--deps-stage-from", metavar="REV", help="build with the deps stage committed at REV (a 'before')")
    p.add_argument("--skip-cold", action="store_true", help="no cold run: warm (from whatever the cache holds), lock")
    p.add_argument("--push", action="store_true", help="also push each build (time, layers and bytes sent)")
    p.add_argument("--json", help="also write the figures here")
    a = p.parse_args(argv)
    info = enginefix.engine_info()
    enginefix.install_certs()
    tag = GPU_TEST_CELL if a.gpu_test_cell else a.cell
    repo = f"{info['registry']}/trainbox-bench-{uuid.uuid4().hex[:6]}"
    rows = []
    with tempfile.TemporaryDirectory(prefix="trainbox-bench-") as tmp:
        ctx = eng.snapshot_context(Path(tmp) / "ctx")
        matrix = write_test_matrix(ctx) if a.gpu_test_cell else ctx / "matrix.toml"
        cells = load_matrix(matrix).select([tag])
        if len(cells) != 1:
            print(f"error: no single cell {tag}", file=sys.stderr)
            return 2
        cell = cells[0]
        render.write_cells(cells, root=ctx)
        if a.deps_stage_from:
            with_old_deps_stage(ctx / cell.dockerfile, a.deps_stage_from, cell)
        lock.ensure(cells, root=ctx, quiet=True)    # not timed: a stale lock (python 3.11 here) is resolved first
        if a.gpu_test_cell:
            bases, wheelhouse, secrets = {cell.base_image: enginefix.base_ref()}, None, []
        else:
            args = enginefix.build_args(cell)
            bases, wheelhouse, secrets = parse_bases(args.base), args.wheelhouse, parse_secrets(args.secret)
        kw = dict(push=a.push, bases=bases, wheelhouse=wheelhouse, secrets=secrets)
        cli = eng.choose_builder("auto").cli
        before = cache_records(cli)
        try:
            if a.cold_mounts:
                subprocess.run([cli, "builder", "prune", "-f", "--filter", "type=exec.cachemount"], check=True,
                               capture_output=True)
            if not a.skip_cold:
                rows.append(run(cell, ctx, repo, "cold (--no-cache)", no_cache=True, **kw))
            rows.append(run(cell, ctx, repo, "warm (no change)", no_cache=False, **kw))
            lock_path = ctx / "locks" / f"{cell.venv}.txt"
            old, new = previous_release(cell, lock_path, a.bump)
            lock_path.write_text(lock_path.read_text().replace(old, new, 1))
            if a.gpu_test_cell:   # the old venv is no longer needed: the new one must fit on the disk
                drop_own_venvs(cli, before, rows[-1]["result"].refs)
            rows.append(run(cell, ctx, repo, f"lock: {new.split()[0]} (was {old.split()[0]})", no_cache=False, **kw))
        finally:
            drop_own_venvs(cli, before, [ref for r in rows for ref in r["result"].refs])
    print(f"cell {cell.tag}, registry {repo}, builder {rows[0]['result'].builder}")
    cols = ["run", "build_s", "steps", "steps_rebuilt", "layers", "image_bytes"]
    if a.push:
        cols += ["push_s", "layers_pushed", "bytes_pushed"]
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
