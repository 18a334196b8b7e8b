"""Build report: one row per built cell (tag, digest, size, layers, build time, pushed bytes) as JSON and a table.

`python -m builder.report report-*.json` joins the reports of several runs (the workflow's one job per venv) into
the whole matrix's registry storage: each blob once against the sum of the images' sizes (the goal is <= 40 %).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from common import atomic

COLUMNS = [  # (header, field, formatter)
    ("cell", "cell", str),
    ("tag", "tag", str),
    ("arch", "arch", str),
    ("builder", "builder", str),
    ("digest", "digest", lambda d: d[:19] if d else "-"),
    ("size MB", "size", lambda b: f"{b / 1e6:.1f}"),
    ("layers", "layers", str),
    ("steps (cached)", "steps", None),
    ("build s", "seconds", lambda s: f"{s:.1f}"),
    ("pushed layers", "pushed_layers", str),
    ("pushed MB", "pushed_bytes", lambda b: f"{b / 1e6:.2f}"),
]


GOAL = 0.40   # issue 9: what a registry stores for the whole matrix, as a share of the images' summed sizes


def storage(results) -> dict | None:
    """What a registry stores for the pushed images (each blob once) against the sum of the images' own sizes (every
    image counted whole, as separate pulls or a registry without shared layers would): shared layers show here."""
    pushed = [r for r in results if getattr(r, "blobs", None)]
    if not pushed:
        return None
    unique: dict[str, int] = {}
    for r in pushed:
        unique.update(r.blobs)
    stored, total = sum(unique.values()), sum(sum(r.blobs.values()) for r in pushed)
    return {"images": len(pushed), "stored_bytes": stored, "images_bytes": total,
            "ratio": round(stored / total, 4) if total else None,
            "largest_image_bytes": max(sum(r.blobs.values()) for r in pushed)}


def to_dict(results, manifest_lists: dict[str, str]) -> dict:
    return {"cells": [dataclasses.asdict(r) for r in results],
            "manifest_lists": [{"ref": ref, "digest": d} for ref, d in manifest_lists.items()],
            "registry": storage(results)}


def table(results, manifest_lists: dict[str, str] | None = None) -> str:
    rows = [[h for h, _, _ in COLUMNS]]
    for r in results:
        row = []
        for _, name, fmt in COLUMNS:
            if name == "steps":
                row.append(f"{r.steps} ({r.cached_steps})")
            else:
                row.append(fmt(getattr(r, name)))
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for ref, digest in (manifest_lists or {}).items():
        lines.append(f"manifest list {ref} {digest}")
    s = storage(results)
    if s:
        lines.append(storage_line(s))
    return "\n".join(lines)


def write_json(path: str | Path, data: dict) -> None:
    atomic.write_text(path, json.dumps(data, indent=2) + "\n")


def emit(results, manifest_lists: dict[str, str], json_path: str | None = None, quiet: bool = False) -> dict:
    """Print the table (and every pushed digest, even with --quiet) and write JSON_PATH if given."""
    data = to_dict(results, manifest_lists)
    if json_path:
        write_json(json_path, data)
    if quiet:
        for r in results:
            if r.digest:
                print(f"{r.tag} {r.pushed_ref}")
        for ref, d in manifest_lists.items():
            print(f"manifest-list {ref}@{d}")
    else:
        print(table(results, manifest_lists), file=sys.stdout, flush=True)
    return data


def storage_line(s: dict) -> str:
    return (f"registry stores {s['stored_bytes'] / 1e6:.1f} MB for {s['images']} image(s) of "
            f"{s['images_bytes'] / 1e6:.1f} MB together ({100 * s['ratio']:.1f} %; the largest image alone: "
            f"{s['largest_image_bytes'] / 1e6:.1f} MB)")


def main(argv: list[str] | None = None) -> int:
    import argparse

    from builder.errors import UserError, reports_user_errors

    p = argparse.ArgumentParser(prog="python -m builder.report",
                                description="The registry storage of several build reports together (whole matrix).")
    p.add_argument("reports", nargs="+", type=Path, metavar="REPORT.json", help="reports written by build.py --report")
    args = p.parse_args(argv)

    @reports_user_errors
    def run() -> int:
        cells = []
        for path in args.reports:
            try:
                cells += [SimpleNamespace(**c) for c in json.loads(path.read_text(encoding="utf-8"))["cells"]]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise UserError(f"not a build report: {e}", where=str(path),
                                fix="pass the JSON files written by build.py --report") from None
        s = storage(cells)
        if not s:
            raise UserError(f"no pushed image in {len(args.reports)} report(s)", fix="build with --push --report")
        print(storage_line(s))
        print(f"goal: at most {100 * GOAL:.0f} % ({'met' if s['ratio'] <= GOAL else 'not met'})")
        return 0

    return run()


if __name__ == "__main__":
    sys.exit(main())
