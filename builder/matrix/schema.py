"""The schema of matrix.toml: every table's allowed keys and their types, and the checks of a table, a list of strings
and a table of strings against it. Unknown keys are errors (typos must not pass silently). A table a cell draws values
from (model.CELL_TABLES) lists only its own keys here; the keys Cell fields are copied from join them from model.py."""
from __future__ import annotations

from typing import Any

from builder.errors import UserError
from builder.matrix.model import table_keys


def cell_table(table: str, own: dict, required: tuple) -> tuple[dict, tuple]:
    """TABLE's allowed keys and required keys: its OWN (structural, read by the checks and rules) and, after them, those
    a Cell field comes from (model.from_table)."""
    copied = table_keys(table)
    both = set(own) & set(copied)
    if both:
        raise ValueError(f"[{table}] keys declared twice (schema.py and a Cell field): {', '.join(sorted(both))}")
    return ({**own, **{k: t.type for k, t in copied.items()}},
            (*required, *(k for k, t in copied.items() if t.required)))


TOP_KEYS = {"schema": int, "naming": dict, "arch": dict, "cuda": dict, "gpu": dict, "torch_variant": dict,
            "attention": dict, "stack": dict, "facts": dict, "expand": dict, "cell": list, "rule": list, "index": dict,
            "fabric": dict, "flavour": dict, "extras": dict, "ci": dict}
REQUIRED_TOP = ("schema", "naming", "arch", "gpu", "torch_variant", "attention", "stack", "rule")
NAMING_KEYS, REQUIRED_NAMING = cell_table("naming", {"tag": str, "cell_name": str, "version_tags": list,
                                                     "flavour_cell_name": str, "flavour_tag": str},
                                          ("tag", "cell_name", "version_tags"))
# A flavour's names when [naming] doesn't give them: cu130-hopper-unsloth, tag cu130-hopper-x86_64-unsloth.
FLAVOUR_CELL_NAME = "{name}-{flavour}"
FLAVOUR_TAG = "{tag}-{flavour}"
ARCH_KEYS, REQUIRED_ARCH = cell_table("arch", {}, ())
CUDA_KEYS, REQUIRED_CUDA = cell_table("cuda", {"glibc": str}, ())
GPU_KEYS, REQUIRED_GPU = cell_table("gpu", {"sm": list, "attention": str, "min_cuda": str},
                                    ("sm", "attention", "min_cuda"))
VARIANT_KEYS, REQUIRED_VARIANT = cell_table("torch_variant", {"cuda": str, "arch_list": dict, "vllm": bool},
                                            ("arch_list",))
# Wheel indexes: NAME -> URL template; the build arg each one becomes (see builder/indexes.py).
INDEX_NAMES = ("default", "torch", "vllm", "flash")
ATTENTION_KEYS = {"package": str, "version": str, "source": str, "source_subdir": str, "build_env": dict,
                  "max_jobs": int, "gpus": list, "prebuilt": dict, "probe": list}
STACK_KEYS = {"packages": dict, "extends": str}
# [facts]: the tables the registered rules read (rules.RULE_FACTS) and those a facts rule names ([[rule]] facts).
# [flavour.NAME]: a named stack on top of some cells' stacks, built FROM the cell's image (templates/Flavour.j2).
FLAVOUR_KEYS = {"description": str, "cells": list, "packages": dict, "remove": list, "rules": list, "files": dict,
                "cmd": list, "sdists": list}
EXPAND_KEYS = {"arch": list, "cuda": list, "gpu": list, "stack": str}
CELL_KEYS, REQUIRED_CELL = cell_table("cell", {"name": str, "arch": (str, list), "cuda": str, "gpu": str,
                                               "torch_variant": str, "attention": str, "stack": (str, dict),
                                               "fabric_plugin": str}, ("name", "arch", "stack"))
# [[rule]]: a registered check's reason (a template: rules.reason_fields), or a facts rule: `facts = "TABLE"` holds a
# flavour's pins to [facts] TABLE, the Requires-Dist of `packages` (default [TABLE]; several: shipped together).
RULE_KEYS = {"id": str, "reason": str, "facts": str, "packages": list}
FABRIC_KEYS = {"packages": list, "env": dict, "plugins": dict}
# [fabric.plugins.NAME]: a NCCL net plugin a cell opts into (`fabric_plugin = "NAME"`), compiled from pinned sources
# in its own stage on the CUDA devel image (native builders only) and copied into the runtime as its install prefix.
PLUGIN_KEYS = {"description": str, "builds": list, "build_packages": list, "packages": list, "env": dict,
               "prefix": str, "library": str, "max_jobs": int}
PLUGIN_BUILD_KEYS = {"name": str, "source": str, "sha256": str, "configure": list}
# [ci]: the generated workflow's own settings (ci.py): GPU runners that test pushed images before they are published.
CI_KEYS = {"gpu_runners": dict}
_TYPE_NAMES = {str: "a string", int: "an integer", list: "an array", dict: "a table", bool: "a boolean"}


def check_table(where: str, table: Any, schema: dict, required: tuple = ()) -> dict:
    if not isinstance(table, dict):
        raise UserError("must be a table", where=where)
    for key, value in table.items():
        if key not in schema:
            raise UserError(f"unknown key {key!r}", where=where,
                            fix=f"allowed keys: {', '.join(sorted(schema))}")
        want = schema[key]
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            names = " or ".join(_TYPE_NAMES[t] for t in (want if isinstance(want, tuple) else (want,)))
            raise UserError(f"{key} must be {names}, got {type(value).__name__}", where=where)
    for key in required:
        if key not in table:
            raise UserError(f"missing required key {key!r}", where=where)
    return table


def str_list(where: str, value: list, allowed=None) -> list[str]:
    if not value:
        raise UserError("must not be empty", where=where)
    for v in value:
        if not isinstance(v, str):
            raise UserError(f"entries must be strings, got {type(v).__name__}", where=where)
        if allowed is not None and v not in allowed:
            raise UserError(f"unknown value {v!r}", where=where, fix=f"choose one of {', '.join(sorted(allowed))}")
    if len(set(value)) != len(value):
        raise UserError("duplicate entries", where=where)
    return list(value)


def str_table(where: str, value: dict) -> dict[str, str]:
    if not isinstance(value, dict):
        raise UserError(f"must be a table, got {type(value).__name__}", where=where)
    for k, v in value.items():
        if not isinstance(v, str):
            raise UserError(f"{k} must be a string, got {type(v).__name__}", where=where)
    return dict(value)

