"""The axis tables of matrix.toml checked: [arch], [cuda], [gpu], [torch_variant], [attention] and [index], each
against its schema and against the others it names."""
from __future__ import annotations

import re

from builder.errors import UserError
from builder.matrix.grammar import PYTHON, grammar
from builder.matrix.schema import (
    ARCH_KEYS,
    ATTENTION_KEYS,
    CUDA_KEYS,
    GPU_KEYS,
    INDEX_NAMES,
    REQUIRED_ARCH,
    REQUIRED_CUDA,
    REQUIRED_GPU,
    REQUIRED_VARIANT,
    VARIANT_KEYS,
    check_table,
    str_list,
    str_table,
)


def check_axes(f: str, data: dict) -> None:
    """Every axis table's keys, types and cross-references (a GPU's attention backend, a variant's CUDA...)."""
    arches = data["arch"]
    if not arches:
        raise UserError("no arch defined", where=f"{f}: arch")
    for name, t in arches.items():
        check_table(f"{f}: arch.{name}", t, ARCH_KEYS, REQUIRED_ARCH)
    cudas = data.get("cuda", {})
    for name, t in cudas.items():
        check_table(f"{f}: cuda.{name!r}", t, CUDA_KEYS, REQUIRED_CUDA)
        _version(f"{f}: cuda.{name!r}", name)
        grammar(f"{f}: cuda.{name!r}", "python", t["python"], PYTHON, "a Python version like 3.12")  # unused too
    gpus = data["gpu"]
    for name, t in gpus.items():
        w = f"{f}: gpu.{name}"
        check_table(w, t, GPU_KEYS, REQUIRED_GPU)
        for sm in str_list(f"{w}.sm", t["sm"]):
            _version(f"{w}.sm", sm)
        _version(f"{w}.min_cuda", t["min_cuda"])
        if t["attention"] not in data["attention"]:
            raise UserError(f"unknown attention backend {t['attention']!r}", where=f"{w}.attention",
                            fix=f"define [attention.{t['attention']}] or choose one of "
                                f"{', '.join(sorted(data['attention']))}")
    variants = data["torch_variant"]
    for name, t in variants.items():
        w = f"{f}: torch_variant.{name}"
        check_table(w, t, VARIANT_KEYS, REQUIRED_VARIANT)
        str_table(f"{w}.arch_list", t["arch_list"])
        for a in t["arch_list"]:
            if a not in arches:
                raise UserError(f"unknown arch {a!r}", where=f"{w}.arch_list", fix=f"choose one of {', '.join(arches)}")
        if t.get("vllm") and "cuda" not in t:
            raise UserError("vllm = true needs a CUDA variant", where=f"{w}.vllm")
        if "cuda" in t and t["cuda"] not in cudas:
            raise UserError(f"unknown CUDA version {t['cuda']!r}", where=f"{w}.cuda",
                            fix=f"define [cuda.{t['cuda']!r}] or choose one of {', '.join(cudas)}")
    for name, t in data["attention"].items():
        w = f"{f}: attention.{name}"
        check_table(w, t, ATTENTION_KEYS, ("gpus",))
        str_list(f"{w}.gpus", t["gpus"], gpus)
        str_table(f"{w}.build_env", t.get("build_env", {}))
        if "max_jobs" in t and t["max_jobs"] < 1:
            raise UserError("max_jobs must be >= 1", where=f"{w}.max_jobs")
        for arch, table in t.get("prebuilt", {}).items():
            if arch not in arches:
                raise UserError(f"unknown arch {arch!r}", where=f"{w}.prebuilt", fix=f"choose one of {', '.join(arches)}")
            for var, fvar in str_table(f"{w}.prebuilt.{arch}", table).items():
                if var not in variants or fvar not in variants:
                    raise UserError(f"unknown torch variant in {var} = {fvar!r}", where=f"{w}.prebuilt.{arch}",
                                    fix=f"choose from {', '.join(variants)}")
        for arch in (str_list(f"{w}.probe", t["probe"], arches) if "probe" in t else []):
            if arch not in t.get("prebuilt", {}) or not t.get("source"):
                raise UserError(f"probe lists {arch!r}, which needs a prebuilt.{arch} entry and a source to fall back "
                                "to", where=f"{w}.probe", fix=f"add prebuilt.{arch} and source, or drop {arch!r}")
        if t.get("source") and not re.fullmatch(r"git\+\S+@[0-9a-f]{40}", t["source"]):
            raise UserError(f"source {t['source']!r} is not pinned to a commit", where=f"{w}.source",
                            fix="write git+URL@<40-hex commit>: a tag or branch can move, a commit is the source's "
                                "hash (git ls-remote URL TAG prints a tag's commit)")
        if t.get("package") and not (t.get("version") and (t.get("prebuilt") or t.get("source"))):
            raise UserError("a backend with a package needs a version and a prebuilt table or a source",
                            where=w)
    index = data.get("index", {})
    check_table(f"{f}: index", index, {n: str for n in INDEX_NAMES})


def _version(where: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.split("."))
    except ValueError:
        raise UserError(f"{text!r} is not a version like 12.9", where=where) from None

