"""Exclusion and consistency rules, registered by id. The reasons live in matrix.toml ([[rule]]); the checks here.

A cell rule reads one combination (arch, CUDA, GPU, attention backend, torch variant, the stack's pins), a stack rule a
stack's pins; each returns None (fine) or a short detail naming the offending values. A facts rule needs no code: a
[[rule]] with `facts = "TABLE"` holds a flavour's pins to [facts] TABLE (one package's Requires-Dist at a version),
the generic check_flavour. Only rules listed in the matrix apply, in the order they are registered here. Reasons are
templates filled from the matrix's tables (reason_fields), so no version is typed twice.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from builder.errors import UserError


@dataclass(frozen=True)
class Rule:
    id: str
    kind: str                 # "cell" or "stack"
    check: Callable
    attention_only: bool = False   # reads only the GPU and the backend (--explain's per-GPU backend exclusions)
    facts: tuple[tuple[str, str], ...] = ()   # the [facts] tables it reads: (table, "version" or "range" values)


REGISTRY: dict[str, Rule] = {}


def rule(rule_id: str, kind: str, attention_only: bool = False, facts: dict[str, str] | None = None):
    """Register the decorated check under RULE_ID (its [[rule]] entry in matrix.toml gives the reason); FACTS: the
    [facts] tables it reads, each mapping versions to a "version" or to a version "range"."""
    def register(fn: Callable) -> Callable:
        if rule_id in REGISTRY:
            raise ValueError(f"rule {rule_id!r} is registered twice")
        REGISTRY[rule_id] = Rule(rule_id, kind, fn, attention_only, tuple((facts or {}).items()))
        return fn
    return register


@dataclass(frozen=True)
class Combo:
    """What a cell rule reads."""
    arch: str | None
    cuda: str | None
    gpu: str | None
    attention: str | None
    variant: str | None
    stack_pins: dict | None = None


@dataclass(frozen=True)
class Context:
    data: dict
    stacks: dict
    facts: dict
    rules: dict   # id -> reason, only the enabled ones
    file: str = "matrix.toml"


def _v(text: str) -> tuple[int, ...]:
    parts = re.findall(r"\d+", text.split("+")[0])
    return tuple(int(p) for p in parts) or (0,)


def variant_for_cuda(ctx: Context, cuda: str) -> str | None:
    """The torch wheel variant built for exactly this CUDA version, if one exists."""
    for name, t in ctx.data["torch_variant"].items():
        if t.get("cuda") == cuda:
            return name
    return None


def sm_covered(sm: str, arch_list: str) -> bool:
    """A cubin for sm_X.Y runs on sm_X.Z with Z >= Y (same major); sm_90a kernels count as 9.0."""
    want = _v(sm)
    for entry in arch_list.replace(",", ";").split(";"):
        entry = entry.strip().rstrip("af").replace("+PTX", "")
        if not entry:
            continue
        have = _v(entry)
        if have[0] == want[0] and have[1:] <= want[1:]:
            return True
    return False


def version(text: str, where: str) -> Version:
    """A PEP 440 version (packaging's parser), or one UserError naming WHERE."""
    try:
        return Version(text)
    except (InvalidVersion, TypeError):
        raise UserError(f"{text!r} is not a version", where=where,
                        fix='write one exact PEP 440 version, e.g. "4.6.0" or "1.17.0rc1"') from None


def specifier(text: str, where: str) -> SpecifierSet:
    """A PEP 440 version range (packaging's parser), or one UserError naming WHERE."""
    try:
        return SpecifierSet(text)
    except (InvalidSpecifier, TypeError):
        raise UserError(f"cannot read the version range {text!r}", where=where,
                        fix="write PEP 440 clauses like >=0.22.0,<=0.31.0 or ~=1.2") from None


def satisfies(version_text: str, spec: str, where: str) -> bool:
    """Whether the resolver would accept the pinned VERSION_TEXT for SPEC (PEP 440, through packaging). A release
    candidate or dev release is below its release (1.16.0rc1 < 1.16.0); it may match a range only when it is itself
    the pin, as pip and uv allow pre-releases for a package pinned to one."""
    v = version(version_text, where)
    return specifier(spec, where).contains(v, prereleases=v.is_prerelease or None)


# ----------------------------------------------------------------------------------------------- cell rules
@rule("cuda-needs-gpu", "cell")
def _cuda_needs_gpu(ctx: Context, c: Combo) -> str | None:
    if (c.cuda is None) != (c.gpu is None):
        return f"cuda={c.cuda} gpu={c.gpu}"
    return None


@rule("torch-variant-exists", "cell")
def _torch_variant_exists(ctx: Context, c: Combo) -> str | None:
    variants = ctx.data["torch_variant"]
    if c.cuda is not None:
        if c.variant is None:
            return f"no torch wheel variant is built for CUDA {c.cuda}"
        vcuda = variants[c.variant].get("cuda")
        if vcuda != c.cuda:
            return f"torch variant {c.variant} is built for CUDA {vcuda or 'none (CPU)'}, not {c.cuda}"
    if c.variant is not None and c.arch not in variants[c.variant]["arch_list"]:
        return f"torch variant {c.variant} has no {c.arch} wheels"
    return None


@rule("gpu-min-cuda", "cell")
def _gpu_min_cuda(ctx: Context, c: Combo) -> str | None:
    need = ctx.data["gpu"][c.gpu]["min_cuda"] if c.gpu is not None else None
    if need and c.cuda is not None and _v(c.cuda) < _v(need):
        return f"{c.gpu} needs CUDA >= {need}, cell has {c.cuda}"
    return None


@rule("torch-arch-list", "cell")
def _torch_arch_list(ctx: Context, c: Combo) -> str | None:
    if c.gpu is None or c.variant is None or c.cuda is None:
        return None
    arch_list = ctx.data["torch_variant"][c.variant]["arch_list"].get(c.arch, "")
    missing = [sm for sm in ctx.data["gpu"][c.gpu]["sm"] if not sm_covered(sm, arch_list)]
    if missing:
        return f"torch {c.variant} for {c.arch} is built for [{arch_list}], nothing for sm {', '.join(missing)}"
    return None


@rule("fa3-hopper-only", "cell", attention_only=True)
def _fa3_gpus(ctx: Context, c: Combo) -> str | None:
    """FlashAttention 3 on a GPU its [attention.fa3] gpus doesn't list (its own rule: the reason says why)."""
    if c.attention == "fa3" and c.gpu not in ctx.data["attention"].get("fa3", {}).get("gpus", ()):
        return f"attention=fa3 on {c.gpu or 'a CPU-only cell'}"
    return None


@rule("attention-supported", "cell", attention_only=True)
def _attention_supported(ctx: Context, c: Combo) -> str | None:
    t = ctx.data["attention"].get(c.attention, {})
    if c.gpu is None and t.get("package"):
        return f"{c.attention} needs a GPU"
    if c.gpu is not None and c.gpu not in t.get("gpus", ()):
        return f"{c.attention} supports {', '.join(t.get('gpus', ())) or 'no GPU'}, not {c.gpu}"
    return None


@rule("vllm-variant-exists", "cell")
def _vllm_variant_exists(ctx: Context, c: Combo) -> str | None:
    # a cell whose stack has no vLLM is not affected
    if c.cuda is not None and c.variant is not None and c.stack_pins is not None and "vllm" in c.stack_pins:
        if not ctx.data["torch_variant"][c.variant].get("vllm"):
            return f"no vLLM {c.stack_pins['vllm']} build for torch variant {c.variant}"
    return None


# ---------------------------------------------------------------------------------------------- stack rules
@rule("vllm-pins-torch", "stack", facts={"vllm_torch": "version"})
def _vllm_pins_torch(ctx: Context, pins: dict) -> str | None:
    vllm = pins.get("vllm")
    if vllm is None:
        return None
    need = ctx.facts.get("vllm_torch", {}).get(vllm)
    if need is None:
        return f"no recorded torch pin for vllm {vllm} (add it to [facts] vllm_torch)"
    if "torch" not in pins or Version(pins["torch"]) != Version(need):
        return f"vllm {vllm} pins torch=={need}, stack has torch {pins.get('torch')}"
    return None


def _range_fact(ctx: Context, pins: dict, table: str, key: str, other: str, label: str) -> str | None:
    """[facts] TABLE maps a version of `key` to the range of `other` it accepts; None when the stack's pins agree.
    `label` names the requirement in the reason (e.g. "trl X[vllm]")."""
    kv, ov = pins.get(key), pins.get(other)
    if kv is None or ov is None:
        return None
    spec = ctx.facts.get(table, {}).get(kv)
    if spec is None:
        return f"no recorded {other} range for {key} {kv} (add it to [facts] {table})"
    if not satisfies(ov, spec, f"{ctx.file}: facts.{table}.{kv}"):
        return f"{label.format(kv)} needs {other}{spec}, stack has {other} {ov}"
    return None


@rule("trl-vllm-extra", "stack", facts={"trl_vllm_extra": "range"})
def _trl_vllm_extra(ctx: Context, pins: dict) -> str | None:
    return _range_fact(ctx, pins, "trl_vllm_extra", "trl", "vllm", "trl {}[vllm]")


@rule("vllm-transformers", "stack", facts={"vllm_transformers": "range"})
def _vllm_transformers(ctx: Context, pins: dict) -> str | None:
    return _range_fact(ctx, pins, "vllm_transformers", "vllm", "transformers", "vllm {}")


def ids(kind: str) -> tuple[str, ...]:
    """The registered rule ids of KIND, in the order they apply."""
    return tuple(r.id for r in REGISTRY.values() if r.kind == kind)


CELL_CHECKS = ids("cell")
STACK_CHECKS = ids("stack")
CHECKS = tuple(REGISTRY)
# [facts] tables the registered rules read -> "version" or "range" (what their values are)
RULE_FACTS = {table: kind for r in REGISTRY.values() for table, kind in r.facts}


def check_cell(ctx: Context, *, arch, cuda, gpu, attention, variant, explicit=False, stack_pins=None):
    """(rule id, detail) of the first enabled cell rule the combination breaks, else None."""
    combo = Combo(arch, cuda, gpu, attention, variant, stack_pins)
    return _first(ctx, [r for r in REGISTRY.values() if r.kind == "cell"], combo)


def check_attention(ctx: Context, *, gpu, attention):
    """The attention-only rules, independent of arch and CUDA (used for --explain)."""
    combo = Combo(None, None, gpu, attention, None)
    return _first(ctx, [r for r in REGISTRY.values() if r.attention_only], combo)


def check_stack(ctx: Context, pins: dict):
    """(rule id, detail) of the first enabled consistency rule a stack's pins break, else None."""
    return _first(ctx, [r for r in REGISTRY.values() if r.kind == "stack"], pins)


def _first(ctx: Context, candidates: list[Rule], arg):
    for r in candidates:
        if r.id in ctx.rules:
            detail = r.check(ctx, arg)
            if detail:
                return r.id, detail
    return None


# ----------------------------------------------------------------------------- facts rules (no code of their own)
def facts_rules(data: dict) -> dict[str, dict]:
    """[[rule]] id -> its entry, for the rules with `facts = "TABLE"`: a flavour's pins held to [facts] TABLE, the
    Requires-Dist of `packages` (default: the package TABLE names; several: the tighter bound, shipped together)."""
    return {r["id"]: r for r in data.get("rule", []) if isinstance(r, dict) and "facts" in r}


def requirement_conflicts(package: str, spec: dict, pins: dict, file: str = "matrix.toml") -> list[str] | None:
    """Each pin outside PACKAGE's Requires-Dist ranges (SPEC: [facts] PACKAGE); None when PINS pin none of the
    packages it bounds (nothing to install it with, e.g. a stack without a training stack)."""
    bounded = {canonicalize_name(p): rng for p, rng in spec.items() if p != "version"}
    if not any(p in pins for p in bounded):
        return None
    return [f"{pkg} {pins[canonicalize_name(pkg)]} is outside {package}'s {pkg}{rng}" for pkg, rng in spec.items()
            if pkg != "version" and canonicalize_name(pkg) in pins
            and not satisfies(pins[canonicalize_name(pkg)], rng, f"{file}: facts.{package}.{pkg}")]


def flavour_conflicts(package: str, spec: dict, pins: dict, file: str = "matrix.toml") -> list[str]:
    """What keeps PINS from installing PACKAGE at its recorded version: the package's own pin, then each pin outside
    its Requires-Dist range (SPEC: [facts] PACKAGE)."""
    out = []
    own = pins.get(canonicalize_name(package))   # PINS are keyed by canonical names (matrix/packages.py)
    if "version" in spec and own != spec["version"]:
        out.append(f"{package} is pinned {own or 'nowhere'}, its facts are for {spec['version']}")
    return out + (requirement_conflicts(package, spec, pins, file) or [])


def check_flavour(ctx: Context, rule_id: str, pins: dict):
    """(rule id, detail) where a flavour's pins break facts rule RULE_ID, else None."""
    package = facts_rules(ctx.data)[rule_id]["facts"]
    spec = ctx.facts.get(package)
    if not spec:
        return rule_id, f"no [facts] {package} table to check the pins against"
    conflicts = flavour_conflicts(package, spec, pins, ctx.file)
    return (rule_id, "; ".join(conflicts)) if conflicts else None


def fit_lines(package: str, facts: dict, cells, reason: str, rule_id: str, file: str = "matrix.toml") -> list[str]:
    """--explain's lines on a facts rule: per stack, its cells and whether PACKAGE ([facts] PACKAGE) fits its pins."""
    spec = facts.get(package)
    if not spec:
        return []
    lines = [f"{package} flavour ({package} {spec.get('version', '?')}, its metadata) rule={rule_id}: {reason}"]
    by_stack: dict[str, list] = {}
    for c in cells:
        by_stack.setdefault(c.stack, []).append(c)
    for stack, group in by_stack.items():
        conflicts = requirement_conflicts(package, spec, group[0].pins, file)
        verdict = ("not offered (no training stack)" if conflicts is None else
                   "does not fit: " + "; ".join(conflicts) if conflicts else "fits")
        lines.append(f"  stack {stack} ({', '.join(c.tag for c in group)}): {verdict}")
    return lines


def unsloth_lines(facts: dict, cells, reason: str, file: str = "matrix.toml") -> list[str]:
    """builder/cli.py's --explain call (kept until it calls fit_lines for every facts rule)."""
    return fit_lines("unsloth", facts, cells, reason, "unsloth-fits", file)


# ------------------------------------------------------------------------------------------- reasons, filled
def reason_fields(data: dict, stacks: dict[str, dict]) -> dict[str, str]:
    """The fields a [[rule]] reason may name, from the matrix's own tables (a version is written once)."""
    variants = data.get("torch_variant", {})
    cudas = data.get("cuda", {})
    gpus = data.get("gpu", {})
    with_cuda = [n for n, t in variants.items() if t.get("cuda")]
    names = [f"(default index) {n}" if variants[n].get("default_index") else n for n in with_cuda]
    torch = sorted({p["torch"] for p in stacks.values() if "torch" in p}, key=Version)
    by_need = sorted(gpus, key=lambda g: _v(gpus[g].get("min_cuda", "0")), reverse=True)
    fields = {
        "torch": " / ".join(torch),
        "torch_variants": _and(names),
        "no_torch_variants": _and([f"cu{c.replace('.', '')}" for c in cudas
                                   if c not in {variants[n]["cuda"] for n in with_cuda}]) or "no",
        "cuda_without_torch": _and([c for c in cudas if c not in {variants[n]["cuda"] for n in with_cuda}]) or "none",
        "vllm_variants": _and([n for n, t in variants.items() if t.get("vllm")]),
        "min_cuda": ", ".join(f"{g.capitalize()} (sm {', '.join(gpus[g]['sm'])}) >= {gpus[g]['min_cuda']}"
                              for g in by_need if gpus[g].get("min_cuda")),
        "attention_gpus": "; ".join(f"{a}: {', '.join(g.capitalize() for g in t.get('gpus', ()))}"
                                    for a, t in data.get("attention", {}).items()),
    }
    for a, t in data.get("attention", {}).items():
        fields[f"{a}_gpus"] = _and([g.capitalize() for g in t.get("gpus", ())])
    return fields


def _and(items: list[str]) -> str:
    return ", ".join(items[:-1]) + f" and {items[-1]}" if len(items) > 1 else "".join(items)
