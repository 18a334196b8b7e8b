"""The GitHub Actions workflow that builds and publishes every cell, generated from matrix.toml so it cannot drift.

`python -m builder.workflow` rewrites .github/workflows/build.yml; `--check` exits 1 (with a diff) when the committed
file differs from what the matrix gives. One job per venv (CUDA x arch x stack) on a native runner of that arch
(arm64 on GitHub's arm64 runners: nothing is emulated, and a FlashAttention source build runs natively); the job
builds that venv's cells one after another, so they share the venv layer byte for byte. It pushes with the registry
credentials from repository secrets; then one job per multi-arch cell joins its arches into a manifest list
(`python -m builder.engine manifest`, which refuses when an arch is missing from the registry), and one job joins
every venv job's report into the whole matrix's registry storage (`python -m builder.report`). Index URLs are
matrix.toml's (build.py reads them); repository variables TRAINBOX_INDEX_<NAME> replace them (a mirror).
The registry comes from the repository variable TRAINBOX_REGISTRY (HOST[:PORT]/NAMESPACE), so no host is baked in.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

import yaml

from entrypoints import atomic
from builder.errors import UserError, reports_user_errors
from builder.matrix import DEFAULT_MATRIX, INDEX_NAMES, load_matrix

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "build.yml"
RUNNERS = {"x86_64": "ubuntu-24.04", "aarch64": "ubuntu-24.04-arm"}
PYTHON = "3.11"
HEADER = ("# GENERATED from matrix.toml by `python -m builder.workflow`; do not edit by hand.\n"
          "# Needs: repository variable TRAINBOX_REGISTRY (e.g. HOST/NAMESPACE), secrets REGISTRY_USERNAME and\n"
          "# REGISTRY_PASSWORD. Pull requests build without pushing.\n")

REGISTRY_EXPR = "${{ vars.TRAINBOX_REGISTRY }}"
PUSHING = "github.event_name != 'pull_request'"


def _login_step() -> dict:
    return {
        "name": "Log in to the registry",
        "if": PUSHING,
        "env": {"REGISTRY": REGISTRY_EXPR, "REGISTRY_USERNAME": "${{ secrets.REGISTRY_USERNAME }}",
                "REGISTRY_PASSWORD": "${{ secrets.REGISTRY_PASSWORD }}"},
        # --password-stdin: the password never appears in a process list or a log
        "run": 'printf \'%s\' "$REGISTRY_PASSWORD" | docker login "${REGISTRY%%/*}" -u "$REGISTRY_USERNAME" '
               "--password-stdin",
    }


def _setup_steps() -> list[dict]:
    return [
        {"uses": "actions/checkout@v4"},
        {"uses": "actions/setup-python@v5", "with": {"python-version": PYTHON}},
        {"name": "Install the builder", "run": "python -m pip install -e ."},
    ]


def workflow_dict(matrix_path: str | Path = DEFAULT_MATRIX) -> dict:
    matrix = load_matrix(matrix_path)
    cells = sorted(matrix.cells, key=lambda c: (c.name, c.arch))
    for c in cells:
        if c.arch not in RUNNERS:
            raise UserError(f"cell {c.tag}: no GitHub runner known for arch {c.arch!r}", where=str(matrix_path),
                            fix=f"add it to RUNNERS in builder/workflow.py ({', '.join(RUNNERS)})")
    groups: dict[str, list] = {}
    for c in cells:
        groups.setdefault(c.venv, []).append(c)
    include = [{"venv": venv, "arch": g[0].arch, "cells": " ".join(c.name for c in g), "runner": RUNNERS[g[0].arch]}
               for venv, g in sorted(groups.items())]
    multi = sorted({c.name for c in cells if sum(1 for d in cells if d.name == c.name) > 1})
    build = {
        "name": "build ${{ matrix.venv }}",
        "runs-on": "${{ matrix.runner }}",
        "timeout-minutes": 360,
        "strategy": {"fail-fast": False, "matrix": {"include": include}},
        "steps": [
            *_setup_steps(),
            {"name": "Free disk space (a GPU venv is several GB, twice while it is copied into the runtime)",
             "run": "sudo rm -rf /usr/share/dotnet /usr/local/lib/android /opt/ghc /opt/hostedtoolcache/CodeQL"},
            {"uses": "docker/setup-buildx-action@v3"},
            _login_step(),
            {"name": "Lock (where needed), build (and push) ${{ matrix.venv }}",
             "env": {"CELLS": "${{ matrix.cells }}", "ARCH": "${{ matrix.arch }}", "VENV": "${{ matrix.venv }}",
                     "REGISTRY": REGISTRY_EXPR, "PUSH": "${{ " + PUSHING + " }}",
                     **{f"TRAINBOX_INDEX_{n.upper()}": "${{ vars.TRAINBOX_INDEX_" + n.upper() + " }}"
                        for n in INDEX_NAMES}},
             "run": "\n".join([
                 'read -r -a cells <<< "$CELLS"',
                 'args=("${cells[@]}" --arch "$ARCH" --report "report-$VENV.json")',
                 'if [ "$PUSH" = "true" ]; then args+=(--push --registry "$REGISTRY/trainbox"); fi',
                 'python build.py "${args[@]}"',
             ]) + "\n"},
            {"uses": "actions/upload-artifact@v4", "if": "always()",
             "with": {"name": "report-${{ matrix.venv }}", "path": "report-${{ matrix.venv }}.json\nlocks/\n",
                      "if-no-files-found": "ignore"}},
        ],
    }
    jobs: dict = {"build": build}
    if multi:
        jobs["manifest"] = {
            "name": "manifest list ${{ matrix.cell }}",
            "needs": "build",
            "if": PUSHING,
            "runs-on": "ubuntu-24.04",
            "strategy": {"fail-fast": False, "matrix": {"cell": multi}},
            "steps": [
                *_setup_steps(),
                _login_step(),
                {"name": "Join the arches of ${{ matrix.cell }}",
                 "env": {"CELL": "${{ matrix.cell }}", "REGISTRY": REGISTRY_EXPR},
                 "run": 'python -m builder.engine manifest --registry "$REGISTRY/trainbox" "$CELL"\n'},
            ],
        }
    # The whole matrix's registry storage: every venv job's report together (each blob once vs the images' sum).
    jobs["storage"] = {
        "name": "registry storage of the whole matrix",
        "needs": "build",
        "if": PUSHING,
        "runs-on": "ubuntu-24.04",
        "steps": [
            *_setup_steps(),
            {"uses": "actions/download-artifact@v4",
             "with": {"pattern": "report-*", "merge-multiple": True, "path": "reports"}},
            {"name": "Stored bytes vs the sum of image sizes",
             "run": "python -m builder.report reports/report-*.json\n"},
        ],
    }
    return {
        "name": "build images",
        "on": {"push": {"branches": ["main"], "tags": ["v*"], "paths-ignore": ["**.md"]},
               "pull_request": {"paths-ignore": ["**.md"]},
               "workflow_dispatch": {}},
        "permissions": {"contents": "read", "packages": "write"},
        "concurrency": {"group": "build-${{ github.ref }}", "cancel-in-progress": True},
        "jobs": jobs,
    }


def render(matrix_path: str | Path = DEFAULT_MATRIX) -> str:
    text = yaml.safe_dump(workflow_dict(matrix_path), sort_keys=False, width=120, default_flow_style=False)
    # PyYAML quotes the key `on` (a YAML 1.1 boolean); GitHub reads either, keep the usual spelling.
    text = text.replace("'on':", "on:", 1)
    return HEADER + text


def write(path: Path = WORKFLOW, matrix_path: str | Path = DEFAULT_MATRIX) -> None:
    atomic.write_text(path, render(matrix_path))


def check(path: Path = WORKFLOW, matrix_path: str | Path = DEFAULT_MATRIX) -> str:
    """'' when PATH is what the matrix gives, else a unified diff."""
    want = render(matrix_path)
    have = path.read_text() if path.exists() else ""
    return "".join(difflib.unified_diff(have.splitlines(True), want.splitlines(True), str(path), "generated"))


@reports_user_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m builder.workflow", description=__doc__.splitlines()[0])
    p.add_argument("--matrix", default=str(DEFAULT_MATRIX))
    p.add_argument("--output", default=str(WORKFLOW))
    p.add_argument("--check", action="store_true", help="exit 1 with a diff if the file is stale")
    a = p.parse_args(argv)
    if a.check:
        diff = check(Path(a.output), a.matrix)
        if diff:
            sys.stdout.write(diff)
            print(f"{a.output} is stale: run `python -m builder.workflow`", file=sys.stderr)
            return 1
        return 0
    write(Path(a.output), a.matrix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
