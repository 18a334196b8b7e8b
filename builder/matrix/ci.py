"""[ci]: what the generated workflow needs beyond the cells: `gpu_runners`, the self-hosted runners that test a pushed
GPU image (`trainbox selftest --json` on a real GPU) before its manifest list and tags are published.

    [ci]
    gpu_runners = { hopper = ["self-hosted", "gpu", "h100"] }              # hopper's x86_64 images
    gpu_runners = { hopper = { x86_64 = ["self-hosted", "h100"], aarch64 = ["self-hosted", "gh200"] } }

A key is a [gpu] generation; its value the runner's labels (`runs-on`) for that generation's x86_64 images, or a
table of [arch] -> labels. None by default: every GPU image is then published untested, and the publish log says so.
The labels go into the workflow's YAML: plain label characters only.
"""
from __future__ import annotations

import re

from builder.errors import UserError
from builder.matrix.grammar import grammar
from builder.matrix.schema import CI_KEYS, check_table, str_list

LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", re.ASCII)
DEFAULT_ARCH = "x86_64"   # a generation's list without a table: its x86_64 images


def gpu_runners(f: str, data: dict) -> dict[tuple[str, str], tuple[str, ...]]:
    """(generation, arch) -> runner labels, checked: every generation in [gpu], every arch in [arch]."""
    ci = data.get("ci", {})
    w = f"{f}: ci"
    check_table(w, ci, CI_KEYS)
    table = ci.get("gpu_runners", {})
    out: dict[tuple[str, str], tuple[str, ...]] = {}
    for gen, value in table.items():
        gw = f"{w}.gpu_runners.{gen}"
        if gen not in data.get("gpu", {}):
            raise UserError(f"unknown GPU generation {gen!r}", where=gw,
                            fix=f"choose one of {', '.join(sorted(data.get('gpu', {})))}")
        if not isinstance(value, (dict, list)):
            raise UserError(f"must be an array of runner labels or a table of arch -> labels, got "
                            f"{type(value).__name__}", where=gw)
        by_arch = value if isinstance(value, dict) else {DEFAULT_ARCH: value}
        for arch, labels in by_arch.items():
            aw = gw if value is labels else f"{gw}.{arch}"
            if arch not in data.get("arch", {}):
                raise UserError(f"unknown arch {arch!r}", where=aw,
                                fix=f"choose one of {', '.join(sorted(data['arch']))}")
            if not isinstance(labels, list):
                raise UserError(f"must be an array of runner labels, got {type(labels).__name__}", where=aw)
            for label in str_list(aw, labels):
                grammar(aw, "runner label", label, LABEL, "letters, digits, '.', '_', '-' (a runs-on label)")
            out[(gen, arch)] = tuple(labels)
    return out
