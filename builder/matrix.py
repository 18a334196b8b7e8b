"""Load and validate matrix.toml, expand it into frozen Cell objects (plus the combinations the rules exclude)."""
from __future__ import annotations

import dataclasses
import itertools
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name

from builder import dockerignore, reference
from builder import rules as rules_mod
from builder import templating
from builder.errors import UserError, shorten

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MATRIX = ROOT / "matrix.toml"

# The schema: every table's allowed keys and their types. Unknown keys are errors (typos must not pass silently).
_TOP = {"schema": int, "naming": dict, "arch": dict, "cuda": dict, "gpu": dict, "torch_variant": dict,
        "attention": dict, "stack": dict, "facts": dict, "expand": dict, "cell": list, "rule": list, "index": dict,
        "fabric": dict, "flavour": dict, "extras": dict}
_REQUIRED_TOP = ("schema", "naming", "arch", "gpu", "torch_variant", "attention", "stack", "rule")
_NAMING = {"repository": str, "tag": str, "cell_name": str, "version_tags": list, "version": str, "source": str,
           "flavour_cell_name": str, "flavour_tag": str}
_REQUIRED_NAMING = ("repository", "tag", "cell_name", "version_tags", "version", "source")
# A flavour's names when [naming] doesn't give them: cu130-hopper-unsloth, tag cu130-hopper-x86_64-unsloth.
FLAVOUR_CELL_NAME = "{name}-{flavour}"
FLAVOUR_TAG = "{tag}-{flavour}"
_ARCH = {"platform": str, "uv_platform": str}
_CUDA = {"base_image": str, "build_image": str, "python": str, "min_driver": str, "glibc": str}
_GPU = {"sm": list, "cuda_arch_list": str, "attention": str, "min_cuda": str}
_VARIANT = {"cuda": str, "arch_list": dict, "vllm": bool, "default_index": bool}
# Wheel indexes: NAME -> URL template; the build arg each one becomes (see builder/indexes.py).
INDEX_NAMES = ("default", "torch", "vllm", "flash")
_ATTN = {"package": str, "version": str, "source": str, "source_subdir": str, "build_env": dict, "max_jobs": int,
         "gpus": list, "prebuilt": dict, "probe": list}
_STACK = {"packages": dict, "extends": str}
# [facts]: the tables the registered rules read (rules.RULE_FACTS) and those a facts rule names ([[rule]] facts).
# [flavour.NAME]: a named stack on top of some cells' stacks, built FROM the cell's image (templates/Flavour.j2).
_FLAVOUR = {"description": str, "cells": list, "packages": dict, "remove": list, "rules": list, "files": dict,
            "cmd": list, "sdists": list}
_EXPAND = {"arch": list, "cuda": list, "gpu": list, "stack": str}
_CELL = {"name": str, "arch": (str, list), "cuda": str, "gpu": str, "torch_variant": str, "base_image": str,
         "python": str, "attention": str, "stack": (str, dict), "fabric_plugin": str}
# [[rule]]: a registered check's reason (a template: rules.reason_fields), or a facts rule: `facts = "TABLE"` holds a
# flavour's pins to [facts] TABLE, the Requires-Dist of `packages` (default [TABLE]; several: shipped together).
_RULE = {"id": str, "reason": str, "facts": str, "packages": list}
_FABRIC = {"packages": list, "env": dict, "plugins": dict}
# [fabric.plugins.NAME]: a NCCL net plugin a cell opts into (`fabric_plugin = "NAME"`), compiled from pinned sources
# in its own stage on the CUDA devel image (native builders only) and copied into the runtime as its install prefix.
_PLUGIN = {"description": str, "builds": list, "build_packages": list, "packages": list, "env": dict, "prefix": str,
           "library": str, "max_jobs": int}
_PLUGIN_BUILD = {"name": str, "source": str, "sha256": str, "configure": list}
_TYPE_NAMES = {str: "a string", int: "an integer", list: "an array", dict: "a table", bool: "a boolean"}


@dataclass(frozen=True)
class Exclusion:
    """A combination the rules leave out, and why."""
    arch: str | None
    cuda: str | None
    gpu: str | None
    attention: str | None
    rule: str
    reason: str

    def describe(self) -> str:
        parts = [f"arch={self.arch or '*'}", f"cuda={self.cuda or '*'}", f"gpu={self.gpu or '*'}"]
        if self.attention:
            parts.append(f"attention={self.attention}")
        return " ".join(parts)


@dataclass(frozen=True)
class Cell:
    """One image: a (cell name, arch) pair with everything the renderer, locker and engine need."""
    name: str
    tag: str
    arch: str
    platform: str
    uv_platform: str
    cuda: str | None
    gpu: str | None
    base_image: str
    build_image: str | None   # the CUDA devel image, for a stage that compiles (never the runtime)
    python: str
    stack: str
    pins: dict = field(hash=False, compare=True)
    torch_variant: str | None
    cuda_arch_list: str
    torch_arch_list: str
    attention_backend: str
    attention: dict = field(hash=False, compare=True)   # the backend's table: package, source, build_env...
    min_driver: str | None
    repository: str
    version: str
    source: str
    version_tags: tuple[str, ...]
    venv: str                 # lock name: cells that share (CUDA, arch, stack, python) share locks/<venv>.txt
    default_index: bool       # torch (and vLLM) come from the default index, no +variant local version
    flash: dict | None = field(default=None, hash=False, compare=True)   # {"how": "index"|"source", ...}
    index_templates: dict = field(default_factory=dict, hash=False, compare=False)
    # [fabric]: GPU cells only (NCCL's InfiniBand/RoCE transport needs the RDMA userspace; CPU cells run no NCCL).
    fabric_packages: tuple[str, ...] = ()
    fabric_env: tuple[tuple[str, str], ...] = ()
    # [fabric.plugins.NAME] a cell opted into: {"name": NAME, **table}; None for every cell that didn't.
    fabric_plugin: dict | None = field(default=None, hash=False, compare=True)
    # A flavour cell ([flavour.NAME]): its flavour's name and the cell it is built FROM (base_image = that cell's
    # image); None for every plain cell.
    flavour: str | None = None
    base: "Cell | None" = field(default=None, hash=False, compare=False, repr=False)
    files: tuple[tuple[str, str], ...] = ()   # (folder in the repository, path in the image)
    cmd: tuple[str, ...] = ()                 # the image's default CMD ('' = the base's)
    sdists: tuple[str, ...] = ()              # the only packages its lock may take as source archives (no wheel)
    # every [gpu] generation -> its SMs (the image record's gpu_generations: doctor names a GPU from the matrix's table)
    gpu_generations: tuple[tuple[str, tuple[str, ...]], ...] = field(default=(), compare=False)

    @property
    def dockerfile(self) -> Path:
        return Path("images") / self.tag / "Dockerfile"

    @property
    def lock(self) -> Path:
        return Path("locks") / f"{self.venv}.txt"

    @property
    def attention_lock(self) -> Path | None:
        """locks/<tag>.attention.txt: the prebuilt FlashAttention wheel, by version and hash (its own small layer)."""
        if self.flavour:  # the attention layer comes with the base image
            return None
        return Path("locks") / f"{self.tag}.attention.txt" if self.flash and self.flash["how"] == "index" else None

    @property
    def has_source_stage(self) -> bool:
        """The Dockerfile has a stage that compiles the attention wheel: a source build, or a probed arch's fallback."""
        return bool(self.flash) and (self.flash["how"] == "source" or bool(self.flash.get("probe")))

    @property
    def has_compile_stage(self) -> bool:
        """Any stage on the CUDA devel image: the attention source build or the fabric-plugin stage."""
        return self.has_source_stage or bool(self.fabric_plugin)

    @property
    def tags(self) -> list[str]:
        return [self.tag, *self.version_tags]

    @property
    def image(self) -> str:
        return f"{self.repository}:{self.tag}"

    def requirement(self, package: str) -> str:
        """`name==version` with the torch wheel variant as the local version (torch==2.13.0+cu129)."""
        version = self.pins[package]
        # CUDA-12 cells need the variant builds of torch and vLLM (the default index has CUDA 13 builds only).
        if self.torch_variant and not self.default_index and (package == "torch" or (package == "vllm" and self.cuda)):
            version = f"{version}+{self.torch_variant}"
        return f"{package}=={version}"

    def requirements(self) -> list[str]:
        return [self.requirement(p) for p in sorted(self.pins)]


@dataclass(frozen=True)
class Matrix:
    path: Path
    cells: tuple[Cell, ...]
    exclusions: tuple[Exclusion, ...]
    rules: dict
    data: dict = field(hash=False, compare=False, repr=False)

    def names(self) -> list[str]:
        return sorted({c.name for c in self.cells})

    def select(self, names=(), arch=None, cuda=None, gpu=None) -> list[Cell]:
        """Cells matching every given filter; names may be cell names or tags. Unknown values are errors."""
        names = list(names or ())
        known = {c.name for c in self.cells} | {c.tag for c in self.cells}
        for n in names:  # flavour cells are cells: `--cell cu130-hopper-unsloth` picks them like any other
            if n not in known:
                raise UserError(f"no cell named {n!r}", where=str(self.path),
                                fix="see `python build.py --list` for cell names and tags")
        for flag, value, pool in (("--arch", arch, self.data["arch"]), ("--gpu", gpu, self.data["gpu"]),
                                  ("--cuda", cuda, self.data.get("cuda", {}))):
            for v in value or ():
                if v not in pool:
                    raise UserError(f"{flag} {v!r} is not in the matrix", where=str(self.path),
                                    fix=f"choose one of {', '.join(sorted(pool))}")
        out = []
        for c in self.cells:
            if names and c.name not in names and c.tag not in names:
                continue
            if arch and c.arch not in arch:
                continue
            if cuda and c.cuda not in cuda:
                continue
            if gpu and c.gpu not in gpu:
                continue
            out.append(c)
        return out


# ------------------------------------------------------------------------------------------------------ loading
def read_document(path: str | Path) -> dict:
    """PATH's TOML as a checked tree (read, UTF-8, syntax, depth): one UserError naming the file, else the dict."""
    path = Path(path)
    where = str(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read the matrix: {e.strerror or e}", where=where,
                        fix="pass an existing file with --matrix") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UserError(f"not UTF-8 text at byte {e.start}", where=where, fix="save the file as UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"TOML syntax error: {e}", where=where, fix="fix the syntax at that line") from None
    except RecursionError:
        raise UserError(f"nested more than Python can parse (over {MAX_DEPTH} levels is never meant)", where=where,
                        fix="a matrix is a few tables deep; see matrix.toml") from None
    _check_tree(where, data)
    return data


def load_matrix(path: str | Path = DEFAULT_MATRIX) -> Matrix:
    path = Path(path)
    where = str(path)
    data = read_document(path)
    matrix = _build(path, data)
    for cell in matrix.cells:
        _check_cell_values(where, cell)
    return matrix


# ------------------------------------------------------------------------------ what may reach a Dockerfile
# Every matrix string ends up in a rendered Dockerfile, a tag or a shell line: a newline would start an instruction
# of the author's choosing, a trailing backslash would swallow the next one, a quote would end a RUN string. So the
# whole tree is checked first (no control characters, bounded depth and length), then each value a cell carries
# against the grammar of where it goes.
MAX_DEPTH = 8
MAX_STRING = 2000
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", re.ASCII)
_PACKAGE = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?", re.ASCII)  # PEP 508 names
_PYTHON = re.compile(r"3\.[0-9]{1,2}", re.ASCII)
_PLATFORM = re.compile(r"linux/(amd64|arm64|ppc64le|s390x|riscv64)(/v[0-9])?", re.ASCII)
_WORD = re.compile(r"[A-Za-z0-9_.+:/@=,;-]+", re.ASCII)  # a URL, a platform tag, an arch list: one shell word
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
_ENV_VALUE = re.compile(r"[A-Za-z0-9_.,:/+=-]*", re.ASCII)
_DEB_PACKAGE = re.compile(r"[a-z0-9][a-z0-9+.-]+", re.ASCII)  # Debian Policy 5.6.1


def _check_tree(where: str, node: Any, path: str = "", depth: int = 0) -> None:
    if depth > MAX_DEPTH:
        raise UserError(f"nested deeper than {MAX_DEPTH} levels at {shorten(path, 80)}", where=where,
                        fix="a matrix is a few tables deep; see matrix.toml")
    if isinstance(node, dict):
        for key, value in node.items():
            _check_string(where, f"{path}.{key}" if path else str(key), key, "key")
            _check_tree(where, value, f"{path}.{key}" if path else str(key), depth + 1)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _check_tree(where, value, f"{path}[{i}]", depth + 1)
    elif isinstance(node, str):
        _check_string(where, path, node, "value")


def _check_string(where: str, path: str, text: str, what: str) -> None:
    m = _CONTROL.search(text)
    if m:
        raise UserError(f"the {what} at {shorten(path, 80)} holds a control character ({m.group(0)!r})",
                        where=where, fix="matrix strings are one line of text: remove it")
    if len(text) > MAX_STRING:
        raise UserError(f"the {what} at {shorten(path, 80)} is {len(text)} characters long", where=where,
                        fix=f"keep it under {MAX_STRING}")


def _grammar(where: str, field: str, value: str, pattern: re.Pattern, what: str) -> None:
    if not pattern.fullmatch(value):
        raise UserError(f"{field} = {shorten(value, 80)!r} is not {what}", where=where)


def _check_cell_values(where: str, c: Cell) -> None:
    """The values a cell renders into its Dockerfile, its tags and its labels, each against its grammar."""
    w = f"{where}: cell {shorten(c.name, 60)}"
    _grammar(w, "name", c.name, _TAG, "usable in an image tag (letters, digits, '_', '.', '-'; 128 at most)")
    _grammar(w, "tag", c.tag, _TAG, "a valid image tag")
    for t in c.version_tags:
        _grammar(w, "naming.version_tags", t, _TAG, "a valid image tag")
    _grammar(w, "naming.version", c.version, _TAG, "usable in an image tag (e.g. 0.4.0)")
    if not reference.is_name(c.repository):
        raise UserError(f"naming.repository = {shorten(c.repository, 80)!r} is not an image repository name",
                        where=w, fix="lower case letters, digits and separators, e.g. trainbox or ghcr.io/org/trainbox")
    _grammar(w, "naming.source", c.source, _WORD, "a URL")
    for field in ("base_image", "build_image"):
        image = getattr(c, field)
        if image is not None and not (reference.REFERENCE.fullmatch(image) and len(image) <= reference.NAME_MAX):
            raise UserError(f"{field} = {shorten(image, 80)!r} is not an image reference", where=w,
                            fix="NAME[:TAG][@DIGEST], e.g. nvidia/cuda:12.9.1-base-ubuntu24.04")
    _grammar(w, "python", c.python, _PYTHON, "a Python version like 3.12")
    _grammar(w, "arch.platform", c.platform, _PLATFORM, "a platform like linux/amd64 or linux/arm64")
    _grammar(w, "arch.uv_platform", c.uv_platform, _WORD, "a platform tag like x86_64-manylinux_2_28")
    for field in ("cuda_arch_list", "torch_arch_list"):
        if getattr(c, field):
            _grammar(w, field, getattr(c, field), re.compile(r"[0-9A-Za-z.+; ]*"),
                     "a list like 9.0a;10.0+PTX")
    for name in c.pins:
        _grammar(w, "package name", name, _PACKAGE, "a package name (PEP 508)")
    a = c.attention
    for key in ("package",):
        if a.get(key):
            _grammar(w, f"attention.{key}", a[key], _PACKAGE, "a package name (PEP 508)")
    for key in ("version", "source", "source_subdir"):
        if a.get(key):
            _grammar(w, f"attention.{key}", a[key], _WORD, "one word (no spaces or quotes)")
    for k, v in (a.get("build_env") or {}).items():
        _grammar(w, "attention.build_env name", k, _ENV_NAME, "an environment variable name")
        _grammar(w, f"attention.build_env.{k}", str(v), _ENV_VALUE, "a plain value")
    for name in c.fabric_packages:
        _grammar(w, "fabric.packages", name, _DEB_PACKAGE, "a Debian package name")
    for k, v in c.fabric_env:
        _grammar(w, "fabric.env name", k, _ENV_NAME, "an environment variable name")
        _grammar(w, f"fabric.env.{k}", v, _ENV_VALUE, "a plain value")
    for name, url in c.index_templates.items():
        _grammar(w, f"index.{name}", url, re.compile(r"[^\s'\"\\`$]*"), "a URL (no spaces, quotes, backslashes or $)")


def _check_table(where: str, table: Any, schema: dict, required: tuple = ()) -> dict:
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


def _str_list(where: str, value: list, allowed=None) -> list[str]:
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


def _str_table(where: str, value: dict) -> dict[str, str]:
    if not isinstance(value, dict):
        raise UserError(f"must be a table, got {type(value).__name__}", where=where)
    for k, v in value.items():
        if not isinstance(v, str):
            raise UserError(f"{k} must be a string, got {type(v).__name__}", where=where)
    return dict(value)


def _version(where: str, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.split("."))
    except ValueError:
        raise UserError(f"{text!r} is not a version like 12.9", where=where) from None


def _format(where: str, template: str, **values) -> str:
    return templating.fill(template, where, **values)


def _build(path: Path, data: dict) -> Matrix:
    f = str(path)
    _check_table(f, data, _TOP, _REQUIRED_TOP)
    if data["schema"] != 1:
        raise UserError(f"schema {data['schema']} is not supported", where=f"{f}: schema", fix="use schema = 1")

    naming = _check_table(f"{f}: naming", data["naming"], _NAMING, _REQUIRED_NAMING)
    vtags = _str_list(f"{f}: naming.version_tags", naming["version_tags"]) if naming["version_tags"] else []

    arches = data["arch"]
    if not arches:
        raise UserError("no arch defined", where=f"{f}: arch")
    for name, t in arches.items():
        _check_table(f"{f}: arch.{name}", t, _ARCH, tuple(_ARCH))
    cudas = data.get("cuda", {})
    for name, t in cudas.items():
        _check_table(f"{f}: cuda.{name!r}", t, _CUDA, ("base_image", "python", "min_driver"))
        _version(f"{f}: cuda.{name!r}", name)
        _grammar(f"{f}: cuda.{name!r}", "python", t["python"], _PYTHON, "a Python version like 3.12")  # unused too
    gpus = data["gpu"]
    for name, t in gpus.items():
        w = f"{f}: gpu.{name}"
        _check_table(w, t, _GPU, tuple(_GPU))
        for sm in _str_list(f"{w}.sm", t["sm"]):
            _version(f"{w}.sm", sm)
        _version(f"{w}.min_cuda", t["min_cuda"])
        if t["attention"] not in data["attention"]:
            raise UserError(f"unknown attention backend {t['attention']!r}", where=f"{w}.attention",
                            fix=f"define [attention.{t['attention']}] or choose one of "
                                f"{', '.join(sorted(data['attention']))}")
    variants = data["torch_variant"]
    for name, t in variants.items():
        w = f"{f}: torch_variant.{name}"
        _check_table(w, t, _VARIANT, ("arch_list",))
        _str_table(f"{w}.arch_list", t["arch_list"])
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
        _check_table(w, t, _ATTN, ("gpus",))
        _str_list(f"{w}.gpus", t["gpus"], gpus)
        _str_table(f"{w}.build_env", t.get("build_env", {}))
        if "max_jobs" in t and t["max_jobs"] < 1:
            raise UserError("max_jobs must be >= 1", where=f"{w}.max_jobs")
        for arch, table in t.get("prebuilt", {}).items():
            if arch not in arches:
                raise UserError(f"unknown arch {arch!r}", where=f"{w}.prebuilt", fix=f"choose one of {', '.join(arches)}")
            for var, fvar in _str_table(f"{w}.prebuilt.{arch}", table).items():
                if var not in variants or fvar not in variants:
                    raise UserError(f"unknown torch variant in {var} = {fvar!r}", where=f"{w}.prebuilt.{arch}",
                                    fix=f"choose from {', '.join(variants)}")
        for arch in (_str_list(f"{w}.probe", t["probe"], arches) if "probe" in t else []):
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
    _check_table(f"{f}: index", index, {n: str for n in INDEX_NAMES})
    _check_fabric(f, data.get("fabric", {}))
    stacks = _resolve_stacks(f, data["stack"])
    check_rule_entries(f, data)
    facts = check_facts_tables(f, data)
    extras_table(f, data)

    rule_table: dict[str, str] = {}
    fields = rules_mod.reason_fields(data, stacks)
    for i, r in enumerate(data["rule"]):   # reasons are templates filled from the tables (no version typed twice)
        rule_table[r["id"]] = _format(f"{f}: rule[{i}].reason", r["reason"], **fields)

    ctx = rules_mod.Context(data=data, stacks=stacks, facts=facts, rules=rule_table, file=f)
    # Stack-level consistency (conflicting pins) is an error, not an exclusion: the file contradicts itself.
    for sname, pins in stacks.items():
        hit = rules_mod.check_stack(ctx, pins)
        if hit:
            rule_id, detail = hit
            raise UserError(f"stack {sname!r} violates rule {rule_id!r}: {detail} — {rule_table[rule_id]}",
                            where=f"{f}: stack.{sname}", fix="make the pins agree")

    cells: list[Cell] = []
    exclusions: list[Exclusion] = []
    expand = data.get("expand")
    if expand is not None:
        w = f"{f}: expand"
        _check_table(w, expand, _EXPAND, tuple(_EXPAND))
        e_arch = _str_list(f"{w}.arch", expand["arch"], arches)
        e_cuda = _str_list(f"{w}.cuda", expand["cuda"], cudas)
        e_gpu = _str_list(f"{w}.gpu", expand["gpu"], gpus)
        if expand["stack"] not in stacks:
            raise UserError(f"unknown stack {expand['stack']!r}", where=f"{w}.stack",
                            fix=f"choose one of {', '.join(stacks)}")
        for arch, cuda, gpu in itertools.product(e_arch, e_cuda, e_gpu):
            attention = gpus[gpu]["attention"]
            variant = rules_mod.variant_for_cuda(ctx, cuda)
            hit = rules_mod.check_cell(ctx, arch=arch, cuda=cuda, gpu=gpu, attention=attention, variant=variant,
                                       stack_pins=stacks[expand["stack"]])
            if hit:
                exclusions.append(Exclusion(arch, cuda, gpu, None, hit[0], f"{rule_table[hit[0]]} ({hit[1]})"))
                continue
            name = _format(f"{f}: naming.cell_name", naming["cell_name"], cuda=cuda,
                           cuda_nodot=cuda.replace(".", ""), gpu=gpu, arch=arch)
            cells.append(_make_cell(f, data, naming, vtags, name=name, arch=arch, cuda=cuda, gpu=gpu,
                                    variant=variant, stack=expand["stack"], pins=stacks[expand["stack"]],
                                    attention=attention, base_image=cudas[cuda]["base_image"],
                                    python=cudas[cuda]["python"],
                                    venv=f"cu{cuda.replace('.', '')}-{expand['stack']}-{arch}"))
        # Non-default attention backends per GPU: what an explicit cell may not ask for, and why.
        for gpu in e_gpu:
            for attention in sorted(data["attention"]):
                if attention == gpus[gpu]["attention"]:
                    continue
                hit = rules_mod.check_attention(ctx, gpu=gpu, attention=attention)
                if hit:
                    exclusions.append(Exclusion(None, None, gpu, attention, hit[0],
                                                f"{rule_table[hit[0]]} ({hit[1]})"))

    # where each cell comes from: one name is one image (a manifest list over its arches), so one source
    origin = {c.tag: f"[expand] cuda {c.cuda} gpu {c.gpu}" for c in cells}
    for i, c in enumerate(data.get("cell", [])):
        made = _explicit_cells(f"{f}: cell[{i}]", f, data, ctx, naming, vtags, stacks, c)
        origin.update({m.tag: f"cell[{i}]" for m in made})
        cells.extend(made)

    for flavours in (False, True):   # the cells' tags first: a flavour names cells by tag
        if flavours:
            cells.extend(_flavour_cells(f, data, ctx, naming, vtags, cells))
        seen: dict[str, str] = {}
        for c in cells:
            if c.tag in seen:
                raise UserError(f"two cells have the tag {c.tag!r}", where=f"{f}: naming.{'flavour_' * flavours}tag",
                                fix="naming.tag must contain {name} and {arch}, naming.flavour_tag {tag} and "
                                    "{flavour}; give explicit cells distinct names")
            seen[c.tag] = c.name
    sources: dict[str, str] = {}
    for c in cells:
        source = f"[flavour.{c.flavour}] on cell {c.base.name}" if c.flavour else origin[c.tag]
        if sources.setdefault(c.name, source) != source:
            raise UserError(f"two cells are named {c.name!r}: {sources[c.name]} and {source}", where=f,
                            fix="give every cell its own name ([[cell]] name; naming.cell_name needs {cuda} and {gpu}, "
                                "naming.flavour_cell_name {name} and {flavour})")
    if not cells:
        raise UserError("the matrix yields no cells", where=f, fix="see `python build.py --explain`")
    return Matrix(path=path, cells=tuple(cells), exclusions=tuple(exclusions), rules=rule_table, data=data)


def _check_fabric(f: str, fabric: dict) -> None:
    """[fabric]: Debian packages and ENV lines every GPU image gets (their grammar: _check_cell_values)."""
    w = f"{f}: fabric"
    _check_table(w, fabric, _FABRIC)
    if "packages" in fabric:
        _str_list(f"{w}.packages", fabric["packages"])
    _str_table(f"{w}.env", fabric.get("env", {}))
    if "plugins" in fabric:
        _check_table(f"{w}.plugins", fabric["plugins"], {k: dict for k in fabric["plugins"]})
    for name, p in fabric.get("plugins", {}).items():
        _check_plugin(f"{w}.plugins.{name}", name, p)


_GIT_SOURCE = re.compile(r"git\+(https://[A-Za-z0-9._~/:@%+-]+)@([0-9a-f]{40})", re.ASCII)
_URL_SOURCE = re.compile(r"https://[A-Za-z0-9._~/:%+-]+\.(tar\.gz|tgz|tar\.bz2|tar\.xz)", re.ASCII)
_PREFIX = re.compile(r"/[A-Za-z0-9_.+-]+(/[A-Za-z0-9_.+-]+)*", re.ASCII)
_REL_PATH = re.compile(r"[A-Za-z0-9_.+-]+(/[A-Za-z0-9_.+-]+)*", re.ASCII)
_CONFIGURE_FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*(=[A-Za-z0-9_./,:+-]*)?", re.ASCII)


def _check_plugin(w: str, name: str, p: Any) -> None:
    """One NCCL net plugin: every value is rendered into a RUN line, so each is checked against its grammar here."""
    _grammar(w, "plugin name", name, re.compile(r"[a-z0-9][a-z0-9-]{0,31}", re.ASCII), "a short lower-case name")
    _check_table(w, p, _PLUGIN, ("builds", "library"))
    if not p["builds"]:
        raise UserError("builds must not be empty", where=f"{w}.builds")
    seen = set()
    for i, b in enumerate(p["builds"]):
        bw = f"{w}.builds[{i}]"
        _check_table(bw, b, _PLUGIN_BUILD, ("name", "source"))
        _grammar(bw, "name", b["name"], re.compile(r"[a-z0-9][a-z0-9._-]{0,63}", re.ASCII), "a short lower-case name")
        if b["name"] in seen:
            raise UserError(f"two builds are named {b['name']!r}", where=f"{bw}.name")
        seen.add(b["name"])
        src = b["source"]
        if src.startswith("git+"):
            if not _GIT_SOURCE.fullmatch(src):
                raise UserError(f"source {shorten(src, 80)!r} is not pinned to a commit", where=f"{bw}.source",
                                fix="write git+https://HOST/PATH@<40-hex commit> (git ls-remote URL TAG prints a "
                                    "tag's commit)")
            if "sha256" in b:
                raise UserError("sha256 is for a tarball source; a git source is pinned by its commit",
                                where=f"{bw}.sha256")
        elif _URL_SOURCE.fullmatch(src):
            if not re.fullmatch(r"[0-9a-f]{64}", b.get("sha256", ""), re.ASCII):
                raise UserError(f"a tarball source needs sha256 = <64 lower-case hex> (got {b.get('sha256')!r})",
                                where=f"{bw}.sha256", fix="sha256sum the release tarball you checked")
        else:
            raise UserError(f"source {shorten(src, 80)!r} is neither git+https://...@<commit> nor an https:// "
                            ".tar.gz/.tgz/.tar.bz2/.tar.xz URL", where=f"{bw}.source")
        for flag in _str_list(f"{bw}.configure", b["configure"]) if "configure" in b else []:
            _grammar(bw, "configure", flag, _CONFIGURE_FLAG, "a configure flag like --with-cuda=/usr/local/cuda")
            if flag.startswith("--prefix"):
                raise UserError("--prefix comes from the plugin's prefix", where=f"{bw}.configure")
    for key in ("build_packages", "packages"):
        for pkg in _str_list(f"{w}.{key}", p[key]) if key in p else []:
            _grammar(w, key, pkg, _DEB_PACKAGE, "a Debian package name")
    for k, v in _str_table(f"{w}.env", p.get("env", {})).items():
        _grammar(w, "env name", k, _ENV_NAME, "an environment variable name")
        _grammar(w, f"env.{k}", v, _ENV_VALUE, "a plain value")
    _grammar(w, "prefix", p.get("prefix", PLUGIN_PREFIX), _PREFIX, "an absolute path like /opt/nccl-net")
    _grammar(w, "library", p["library"], _REL_PATH, "a path inside the prefix like lib/libnccl-net.so")
    if "max_jobs" in p and p["max_jobs"] < 1:
        raise UserError("max_jobs must be >= 1", where=f"{w}.max_jobs")


PLUGIN_PREFIX = "/opt/nccl-net"


def check_rule_entries(f: str, data: dict) -> None:
    """[[rule]] entries: a registered check's id (once), or a facts rule (`facts` names its [facts] table)."""
    if not isinstance(data.get("rule"), list):
        raise UserError("must be an array of tables ([[rule]])", where=f"{f}: rule")
    seen: set[str] = set()
    for i, r in enumerate(data["rule"]):
        w = f"{f}: rule[{i}]"
        _check_table(w, r, _RULE, ("id", "reason"))
        registered = r["id"] in rules_mod.REGISTRY
        if not registered and "facts" not in r:
            raise UserError(f"unknown rule id {r['id']!r}", where=f"{w}.id",
                            fix=f"registered rules: {', '.join(rules_mod.CHECKS)}; or give it facts = \"TABLE\" (a "
                                "flavour's pins held to [facts] TABLE)")
        if registered and ("facts" in r or "packages" in r):
            raise UserError(f"rule {r['id']!r} has its own check; facts/packages are for facts rules",
                            where=f"{w}.facts", fix="drop them, or give the facts rule another id")
        if "facts" in r:
            _grammar(w, "facts", r["facts"], _PACKAGE, "a [facts] table named after its package, like unsloth")
        if "packages" in r:
            package_list(f"{w}.packages", r["packages"])
        if r["id"] in seen:
            raise UserError(f"rule {r['id']!r} is defined twice", where=f"{w}.id")
        seen.add(r["id"])


def check_facts_tables(f: str, data: dict) -> dict:
    """[facts] maps versions to versions ({vllm: torch}) or to version ranges; a facts rule's table is a package's
    own `version` and its Requires-Dist ranges. Each is read with packaging now, so a typo is one error naming its
    key, not a rule that silently never matches. Returns the table."""
    facts = data.get("facts", {})
    named = {r["facts"] for r in rules_mod.facts_rules(data).values()}
    _check_table(f"{f}: facts", facts, {t: dict for t in [*rules_mod.RULE_FACTS, *sorted(named)]})
    for table, entries in facts.items():
        _str_table(f"{f}: facts.{table}", entries)
        kind = rules_mod.RULE_FACTS.get(table)
        for key, value in entries.items():
            if kind is not None:
                rules_mod.version(key, f"{f}: facts.{table}")
            if kind == "version" or (kind is None and key == "version"):
                rules_mod.version(value, f"{f}: facts.{table}.{key}")
            else:
                rules_mod.specifier(value, f"{f}: facts.{table}.{key}")
    return facts


def extras_table(f: str, data: dict) -> dict[str, tuple[str, ...]]:
    """[extras]: package -> the extras the stacks and flavours install it with (trl = ["vllm"]): their requirements
    bind the pins as the package's own do (builder.pins reads them). Canonical names, checked."""
    table = data.get("extras", {})
    _check_table(f"{f}: extras", table, {k: list for k in table})
    out: dict[str, tuple[str, ...]] = {}
    for pkg, extras in table.items():
        _grammar(f"{f}: extras", "package name", pkg, _PACKAGE, "a package name (PEP 508)")
        if canonicalize_name(pkg) in out:
            raise UserError(f"{pkg!r} names a package listed already", where=f"{f}: extras")
        out[canonicalize_name(pkg)] = tuple(package_list(f"{f}: extras.{pkg}", extras))  # extras: PEP 685 names
    return out


def _resolve_stacks(f: str, table: dict) -> dict[str, dict[str, str]]:
    own: dict[str, dict[str, str]] = {}
    for name, t in table.items():
        _check_table(f"{f}: stack.{name}", t, _STACK, ("packages",))
        own[name] = packages_table(f"{f}: stack.{name}.packages", t["packages"])
    out: dict[str, dict[str, str]] = {}

    def resolve(name: str, chain: tuple) -> dict[str, str]:
        if name in out:
            return out[name]
        if name in chain:
            raise UserError(f"stack {name!r} extends itself ({' -> '.join(chain + (name,))})",
                            where=f"{f}: stack.{name}.extends")
        t = table[name]
        pins: dict[str, str] = {}
        if "extends" in t:
            if t["extends"] not in table:
                raise UserError(f"unknown stack {t['extends']!r}", where=f"{f}: stack.{name}.extends",
                                fix=f"choose one of {', '.join(table)}")
            pins.update(resolve(t["extends"], chain + (name,)))
        pins.update(own[name])   # canonical names: a stack's pin replaces the one it extends however spelled
        out[name] = pins
        return pins

    for name in table:
        resolve(name, ())
    return out


def packages_table(where: str, table: Any) -> dict[str, str]:
    """A `packages = { NAME = "VERSION" }` table keyed by canonical (PEP 503) names, each name and pin checked: two
    spellings of one package (trl and TRL, liger_kernel and liger-kernel) are one error, never "the last one wins"."""
    out: dict[str, str] = {}
    spelled: dict[str, str] = {}
    for pkg, ver in _str_table(where, table).items():
        _grammar(where, "package name", pkg, _PACKAGE, "a package name (PEP 508)")
        name = canonicalize_name(pkg)
        if name in spelled:
            raise UserError(f"{spelled[name]!r} and {pkg!r} name one package ({name})", where=where,
                            fix="pin each package once")
        spelled[name] = pkg
        out[name] = _pin(f"{where}.{pkg}", ver)
    return out


def package_list(where: str, value: Any) -> list[str]:
    """A list of package names, canonical (PEP 503), each checked; two spellings of one package are an error."""
    out: list[str] = []
    for pkg in _str_list(where, value):
        _grammar(where, "package name", pkg, _PACKAGE, "a package name (PEP 508)")
        name = canonicalize_name(pkg)
        if name in out:
            raise UserError(f"{pkg!r} names a package listed already ({name})", where=where,
                            fix="list each package once")
        out.append(name)
    return out


def _pin(where: str, ver: str) -> str:
    if not ver or ver != ver.strip() or any(ch in ver for ch in "=<>!~;,*"):
        raise UserError(f"pin {where.rsplit('.', 1)[-1]} = {ver!r} must be one exact version like \"1.2.3\"",
                        where=where)
    rules_mod.version(ver, where)   # PEP 440, parsed by packaging: "banana" stops here
    return ver


_FLAVOUR_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,31}", re.ASCII)
_CMD_WORD = re.compile(r"[A-Za-z0-9_./:=,+@-]+", re.ASCII)


def _flavour_cells(f: str, data: dict, ctx, naming: dict, vtags: list, cells: list[Cell]) -> list[Cell]:
    """[flavour.NAME] tables -> one flavour cell per (base cell, arch) they name. The flavour's pins are the base
    cell's with `remove` dropped and `packages` laid over; every stack rule and the flavour's own `rules` must hold
    (a flavour names its cells explicitly: a conflict is an error, not an exclusion)."""
    out: list[Cell] = []
    by_name: dict[str, list[Cell]] = {}
    for c in cells:
        by_name.setdefault(c.name, []).append(c)
        by_name.setdefault(c.tag, []).append(c)
    for fname, t in data.get("flavour", {}).items():
        w = f"{f}: flavour.{fname}"
        _grammar(w, "flavour name", fname, _FLAVOUR_NAME, "a short lower-case name (letters, digits, '-')")
        _check_table(w, t, _FLAVOUR, ("cells", "packages"))
        bases: list[Cell] = []
        for n in _str_list(f"{w}.cells", t["cells"]):
            if n not in by_name:
                raise UserError(f"unknown base cell {n!r}", where=f"{w}.cells",
                                fix="name cells or tags that `python build.py --list` shows (not flavour cells)")
            bases += [c for c in by_name[n] if c not in bases]
        packages = packages_table(f"{w}.packages", t["packages"])
        if not packages:
            raise UserError("packages must not be empty", where=f"{w}.packages")
        remove = package_list(f"{w}.remove", t["remove"]) if "remove" in t else []
        rules = _str_list(f"{w}.rules", t["rules"]) if "rules" in t else []
        for r in rules:
            if r not in rules_mod.facts_rules(data):
                raise UserError(f"unknown flavour rule {r!r}", where=f"{w}.rules",
                                fix="flavour rules are [[rule]] entries with facts = \"TABLE\": "
                                    + (", ".join(rules_mod.facts_rules(data)) or "none yet"))
            if r not in ctx.rules:
                raise UserError(f"rule {r!r} has no [[rule]] entry (its reason)", where=f"{w}.rules",
                                fix=f"add [[rule]] id = \"{r}\" with its reason")
        files = []
        for src, dest in _str_table(f"{w}.files", t.get("files", {})).items():
            _grammar(f"{w}.files", "source", src, _REL_PATH, "a folder of the repository like images/notebooks/x")
            _grammar(f"{w}.files", "destination", dest, _PREFIX, "an absolute path like /workspace/notebooks")
            # what the build context holds (.dockerignore, no links), not merely the repository: BuildKit copies it
            why = dockerignore.why_not_in_context(src)
            if why:
                raise UserError(f"{src!r} {why}", where=f"{w}.files",
                                fix="name a real folder under images/ (the build context's own; see .dockerignore) "
                                    "or drop it")
            files.append((src, dest))
        cmd = _str_list(f"{w}.cmd", t["cmd"]) if "cmd" in t else []
        # published as a source archive only: the lock hashes it, the install step builds it
        sdists = sorted(package_list(f"{w}.sdists", t["sdists"])) if "sdists" in t else []
        for word in cmd:
            _grammar(f"{w}.cmd", "word", word, _CMD_WORD, "one plain word (no spaces or quotes)")
        for base in bases:
            if base.flavour:
                continue
            unknown = [p for p in remove if p not in base.pins]
            if unknown:
                raise UserError(f"remove names {unknown[0]!r}, which cell {base.tag} does not pin", where=f"{w}.remove",
                                fix=f"remove only pins of the base stack {base.stack!r}")
            pins = {p: v for p, v in base.pins.items() if p not in remove} | packages
            # an sdist names a package the flavour installs: pinned, or in its committed lock (without a lock yet,
            # the lock step checks what uv resolved: lock.compile_lock)
            locked = _committed_lock_names(ROOT / "locks" / f"{base.venv}-{fname}.txt") if sdists else None
            for pkg in sdists:
                if pkg not in pins and locked is not None and pkg not in locked:
                    raise UserError(f"sdists names {pkg!r}, which flavour {fname!r} does not install on cell "
                                    f"{base.tag} (not pinned, not in locks/{base.venv}-{fname}.txt)",
                                    where=f"{w}.sdists", fix="name a package of the flavour's lock that is published "
                                                              "as a source archive only, or drop it")
            hit = rules_mod.check_stack(ctx, pins)
            for r in rules:
                hit = hit or rules_mod.check_flavour(ctx, r, pins)
            if hit:
                raise UserError(f"flavour {fname!r} on cell {base.tag} breaks rule {hit[0]!r}: {hit[1]} — "
                                f"{ctx.rules[hit[0]]}", where=w, fix="change the flavour's packages or its cells")
            name = _format(f"{f}: naming.flavour_cell_name", naming.get("flavour_cell_name", FLAVOUR_CELL_NAME),
                           name=base.name, flavour=fname)
            tag = _format(f"{f}: naming.flavour_tag", naming.get("flavour_tag", FLAVOUR_TAG), tag=base.tag,
                          flavour=fname, name=base.name, arch=base.arch)
            fields = dict(tag=tag, name=name, arch=base.arch, version=base.version, torch=pins.get("torch", ""))
            version_tags = tuple(_format(f"{f}: naming.version_tags", v, **fields) for v in vtags
                                 if "torch" in pins or "{torch}" not in v)
            out.append(dataclasses.replace(
                base, name=name, tag=tag, stack=f"{base.stack}+{fname}", pins=dict(sorted(pins.items())),
                version_tags=version_tags, venv=f"{base.venv}-{fname}", base_image=base.image, build_image=None,
                flash=None, fabric_plugin=None, flavour=fname, base=base, files=tuple(files), cmd=tuple(cmd),
                sdists=tuple(sdists)))
    return out


def lock_names(text: str) -> set[str]:
    """The canonical names of the packages a lock's text installs (uv's `name==version` lines)."""
    return {canonicalize_name(m.group(1)) for m in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", text, re.M)}


def _committed_lock_names(path: Path) -> set[str] | None:
    try:
        return lock_names(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError):
        return None


def _explicit_cells(w, f, data, ctx, naming, vtags, stacks, c) -> list[Cell]:
    _check_table(w, c, _CELL, ("name", "arch", "base_image", "python", "stack"))
    name = c["name"]
    if not name or not all(ch.isalnum() or ch in "-_." for ch in name) or not name[0].isalnum():
        raise UserError(f"cell name {name!r} must be letters, digits, '-', '_' or '.'", where=f"{w}.name")
    arches = _str_list(f"{w}.arch", [c["arch"]] if isinstance(c["arch"], str) else c["arch"], data["arch"])
    cuda, gpu = c.get("cuda"), c.get("gpu")
    if cuda is not None and cuda not in data.get("cuda", {}):
        raise UserError(f"unknown CUDA version {cuda!r}", where=f"{w}.cuda")
    if gpu is not None and gpu not in data["gpu"]:
        raise UserError(f"unknown GPU generation {gpu!r}", where=f"{w}.gpu",
                        fix=f"choose one of {', '.join(data['gpu'])}")
    attention = c.get("attention") or (data["gpu"][gpu]["attention"] if gpu else "sdpa")
    if attention not in data["attention"]:
        raise UserError(f"unknown attention backend {attention!r}", where=f"{w}.attention")
    variant = c.get("torch_variant")
    if variant is not None and variant not in data["torch_variant"]:
        raise UserError(f"unknown torch variant {variant!r}", where=f"{w}.torch_variant",
                        fix=f"choose one of {', '.join(data['torch_variant'])}")
    if variant is None and cuda is not None:
        variant = rules_mod.variant_for_cuda(ctx, cuda)
    plugin = None
    if "fabric_plugin" in c:
        plugins = data.get("fabric", {}).get("plugins", {})
        if c["fabric_plugin"] not in plugins:
            raise UserError(f"unknown fabric plugin {c['fabric_plugin']!r}", where=f"{w}.fabric_plugin",
                            fix=f"define [fabric.plugins.{c['fabric_plugin']}] in matrix.toml"
                                + (f" or choose one of {', '.join(sorted(plugins))}" if plugins else ""))
        if cuda is None:
            raise UserError("fabric_plugin needs a CUDA cell (NCCL runs only there)", where=f"{w}.fabric_plugin")
        plugin = {"name": c["fabric_plugin"], **plugins[c["fabric_plugin"]]}
    stack_spec = c["stack"]
    out = []
    for arch in arches:
        sname = stack_spec if isinstance(stack_spec, str) else stack_spec.get(arch)
        if not isinstance(sname, str) or sname not in stacks:
            raise UserError(f"no known stack for arch {arch} (got {sname!r})", where=f"{w}.stack",
                            fix=f"choose one of {', '.join(stacks)}")
        if isinstance(stack_spec, dict):
            extra = set(stack_spec) - set(arches)
            if extra:
                raise UserError(f"stack names arches the cell doesn't have: {', '.join(sorted(extra))}",
                                where=f"{w}.stack")
        hit = rules_mod.check_cell(ctx, arch=arch, cuda=cuda, gpu=gpu, attention=attention, variant=variant,
                                   explicit=True, stack_pins=stacks[sname])
        if hit:
            raise UserError(f"cell {name!r} ({arch}) breaks rule {hit[0]!r}: {hit[1]} — {ctx.rules[hit[0]]}",
                            where=w, fix="change the cell or drop it")
        out.append(_make_cell(f, data, naming, vtags, name=name, arch=arch, cuda=cuda, gpu=gpu, variant=variant,
                              stack=sname, pins=stacks[sname], attention=attention, base_image=c["base_image"],
                              python=c["python"], fabric_plugin=plugin))
    return out


def _flash(table: dict, arch: str, variant: str | None) -> dict | None:
    """Where the cell's FlashAttention wheel comes from: a prebuilt wheel on the flash index for this arch and torch
    variant, else a source build (native builders only)."""
    if not table.get("package"):
        return None
    fvar = table.get("prebuilt", {}).get(arch, {}).get(variant or "")
    if fvar:
        # probe: the wheel's existence is not confirmed; the lock step asks the index and falls back to the source.
        return {"how": "index", "flash_variant": fvar, "probe": arch in table.get("probe", [])}
    if table.get("source"):
        return {"how": "source"}
    return {"how": "none"}


def _make_cell(f, data, naming, vtags, *, name, arch, cuda, gpu, variant, stack, pins, attention, base_image,
               python, venv=None, fabric_plugin=None) -> Cell:
    tag = _format(f"{f}: naming.tag", naming["tag"], name=name, arch=arch)
    if not tag or not all(ch.isalnum() or ch in "-_." for ch in tag) or len(tag) > 128:
        raise UserError(f"tag {tag!r} is not a valid image tag", where=f"{f}: naming.tag")
    fields = dict(tag=tag, name=name, arch=arch, version=naming["version"], torch=pins.get("torch", ""))
    # A cell without torch (smoke-aarch64) gets no torch{torch} tag rather than a meaningless one.
    version_tags = tuple(_format(f"{f}: naming.version_tags", t, **fields) for t in vtags
                         if "torch" in pins or "{torch}" not in t)
    arch_list = ""
    cuda_t = data["cuda"][cuda] if cuda else {}
    uv_platform = data["arch"][arch]["uv_platform"]
    if cuda_t.get("glibc"):
        uv_platform = f"{arch}-manylinux_{cuda_t['glibc'].replace('.', '_')}"
    if variant:
        arch_list = data["torch_variant"][variant]["arch_list"].get(arch, "")
    return Cell(
        name=name, tag=tag, arch=arch, platform=data["arch"][arch]["platform"],
        uv_platform=uv_platform, cuda=cuda, gpu=gpu, base_image=base_image, python=python,
        build_image=cuda_t.get("build_image"),
        stack=stack, pins=dict(sorted(pins.items())), torch_variant=variant if "torch" in pins else None,
        cuda_arch_list=data["gpu"][gpu]["cuda_arch_list"] if gpu else "", torch_arch_list=arch_list,
        attention_backend=attention, attention=dict(data["attention"][attention]),
        min_driver=data["cuda"][cuda]["min_driver"] if cuda else None, repository=naming["repository"],
        version=naming["version"], source=naming["source"], version_tags=version_tags, venv=venv or tag,
        default_index=bool(variant and data["torch_variant"][variant].get("default_index")),
        flash=_flash(data["attention"][attention], arch, variant) if cuda else None,
        index_templates=dict(data.get("index", {})),
        fabric_packages=tuple(sorted(data.get("fabric", {}).get("packages", []))) if cuda else (),
        fabric_env=tuple(sorted(data.get("fabric", {}).get("env", {}).items())) if cuda else (),
        fabric_plugin=fabric_plugin,
        gpu_generations=tuple((g, tuple(t["sm"])) for g, t in data["gpu"].items()))
