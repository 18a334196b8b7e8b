"""Exclusion and consistency rules. The reasons live in matrix.toml ([[rule]]); the checks live here, by id.

Each check returns None (fine) or a short detail string naming the offending values. Only rules listed in the
matrix are applied, in the order of CHECKS.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from packaging.utils import canonicalize_name
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from builder.errors import UserError

CELL_CHECKS = ("cuda-needs-gpu", "torch-variant-exists", "gpu-min-cuda", "torch-arch-list", "fa3-hopper-only",
               "attention-supported", "vllm-variant-exists")
STACK_CHECKS = ("vllm-pins-torch", "trl-vllm-extra", "vllm-transformers")
# Flavour rules check a flavour's pins ([flavour.NAME] rules = [...]) against a package's own metadata ([facts] table
# named here); they never exclude a cell (--explain shows them per flavour, and per stack for unsloth).
FLAVOUR_FACTS = {"unsloth-fits": "unsloth", "verl-fits": "verl"}
FLAVOUR_CHECKS = tuple(FLAVOUR_FACTS)
CHECKS = CELL_CHECKS + STACK_CHECKS + FLAVOUR_CHECKS


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


def _cell_detail(ctx: Context, rule: str, *, arch, cuda, gpu, attention, variant, stack_pins=None) -> str | None:
    d = ctx.data
    if rule == "cuda-needs-gpu":
        if (cuda is None) != (gpu is None):
            return f"cuda={cuda} gpu={gpu}"
    elif rule == "torch-variant-exists":
        if cuda is not None:
            if variant is None:
                return f"no torch wheel variant is built for CUDA {cuda}"
            vcuda = d["torch_variant"][variant].get("cuda")
            if vcuda != cuda:
                return f"torch variant {variant} is built for CUDA {vcuda or 'none (CPU)'}, not {cuda}"
        if variant is not None and arch not in d["torch_variant"][variant]["arch_list"]:
            return f"torch variant {variant} has no {arch} wheels"
    elif rule == "vllm-variant-exists":
        # Only the expanded stack is known here; a cell whose stack has no vLLM is not affected (checked in
        # check_cell through `stack_pins`).
        if cuda is not None and variant is not None and stack_pins is not None and "vllm" in stack_pins:
            if not d["torch_variant"][variant].get("vllm"):
                return f"no vLLM {stack_pins['vllm']} build for torch variant {variant}"
    elif rule == "gpu-min-cuda":
        if gpu is not None and cuda is not None and _v(cuda) < _v(d["gpu"][gpu]["min_cuda"]):
            return f"{gpu} needs CUDA >= {d['gpu'][gpu]['min_cuda']}, cell has {cuda}"
    elif rule == "torch-arch-list":
        if gpu is not None and variant is not None and cuda is not None:
            arch_list = d["torch_variant"][variant]["arch_list"].get(arch, "")
            missing = [sm for sm in d["gpu"][gpu]["sm"] if not sm_covered(sm, arch_list)]
            if missing:
                return f"torch {variant} for {arch} is built for [{arch_list}], nothing for sm {', '.join(missing)}"
    elif rule == "fa3-hopper-only":
        if attention == "fa3" and gpu != "hopper":
            return f"attention=fa3 on {gpu or 'a CPU-only cell'}"
    elif rule == "attention-supported":
        t = d["attention"].get(attention, {})
        if gpu is None and t.get("package"):
            return f"{attention} needs a GPU"
        if gpu is not None and gpu not in t.get("gpus", ()):
            return f"{attention} supports {', '.join(t.get('gpus', ())) or 'no GPU'}, not {gpu}"
    return None


def check_cell(ctx: Context, *, arch, cuda, gpu, attention, variant, explicit=False, stack_pins=None):
    """(rule id, detail) of the first enabled rule the combination breaks, else None."""
    for rule in CELL_CHECKS:
        if rule in ctx.rules:
            detail = _cell_detail(ctx, rule, arch=arch, cuda=cuda, gpu=gpu, attention=attention, variant=variant,
                                  stack_pins=stack_pins)
            if detail:
                return rule, detail
    return None


def check_attention(ctx: Context, *, gpu, attention):
    """Attention-only rules, independent of arch and CUDA (used for --explain)."""
    for rule in ("fa3-hopper-only", "attention-supported"):
        if rule in ctx.rules:
            detail = _cell_detail(ctx, rule, arch=None, cuda=None, gpu=gpu, attention=attention, variant=None)
            if detail:
                return rule, detail
    return None


def check_stack(ctx: Context, pins: dict):
    """(rule id, detail) of the first enabled consistency rule a stack's pins break, else None."""
    facts = ctx.facts
    vllm = pins.get("vllm")
    if vllm is None:
        return None
    if "vllm-pins-torch" in ctx.rules:
        need = facts.get("vllm_torch", {}).get(vllm)
        if need is None:
            return "vllm-pins-torch", f"no recorded torch pin for vllm {vllm} (add it to [facts] vllm_torch)"
        if "torch" not in pins or Version(pins["torch"]) != Version(need):
            return "vllm-pins-torch", f"vllm {vllm} pins torch=={need}, stack has torch {pins.get('torch')}"
    if "trl-vllm-extra" in ctx.rules and "trl" in pins:
        spec = facts.get("trl_vllm_extra", {}).get(pins["trl"])
        if spec is None:
            return "trl-vllm-extra", f"no recorded vllm range for trl {pins['trl']} (add it to [facts] trl_vllm_extra)"
        if not satisfies(vllm, spec, f"{ctx.file}: facts.trl_vllm_extra.{pins['trl']}"):
            return "trl-vllm-extra", f"trl {pins['trl']}[vllm] needs vllm{spec}, stack has vllm {vllm}"
    if "vllm-transformers" in ctx.rules and "transformers" in pins:
        spec = facts.get("vllm_transformers", {}).get(vllm)
        if spec is None:
            return "vllm-transformers", f"no recorded transformers range for vllm {vllm}"
        if not satisfies(pins["transformers"], spec, f"{ctx.file}: facts.vllm_transformers.{vllm}"):
            return "vllm-transformers", (f"vllm {vllm} needs transformers{spec}, "
                                         f"stack has transformers {pins['transformers']}")
    return None


def flavour_conflicts(package: str, spec: dict, pins: dict, file: str = "matrix.toml") -> list[str]:
    """What keeps PINS from installing PACKAGE at its recorded version: the package's own pin, then each pin outside
    its Requires-Dist range (SPEC: [facts] PACKAGE)."""
    out = []
    own = pins.get(canonicalize_name(package))
    if "version" in spec and own != spec["version"]:
        out.append(f"{package} is pinned {own or 'nowhere'}, its facts are for {spec['version']}")
    for pkg, rng in spec.items():   # PINS are keyed by canonical names (builder.matrix.packages_table)
        pin = pins.get(canonicalize_name(pkg)) if pkg != "version" else None
        if pin is not None and not satisfies(pin, rng, f"{file}: facts.{package}.{pkg}"):
            out.append(f"{pkg} {pin} is outside {package}'s {pkg}{rng}")
    return out


def check_flavour(ctx: Context, rule: str, pins: dict):
    """(rule id, detail) where a flavour's pins break flavour rule RULE, else None."""
    package = FLAVOUR_FACTS[rule]
    spec = ctx.facts.get(package)
    if not spec:
        return rule, f"no [facts] {package} table to check the pins against"
    conflicts = flavour_conflicts(package, spec, pins, ctx.file)
    return (rule, "; ".join(conflicts)) if conflicts else None


# The stack pins that unsloth's and unsloth-zoo's Requires-Dist bound ([facts] unsloth, read from their METADATA).
UNSLOTH_PACKAGES = ("torch", "transformers", "trl", "peft", "bitsandbytes", "accelerate", "datasets")


def unsloth_conflicts(facts: dict, pins: dict, file: str = "matrix.toml") -> list[str] | None:
    """None when the flavour doesn't apply (no training stack or no facts); else each pin outside Unsloth's range."""
    spec = facts.get("unsloth")
    if not spec or "trl" not in pins:
        return None
    return [f"{pkg} {pins[pkg]} is outside unsloth's {pkg}{spec[pkg]}" for pkg in UNSLOTH_PACKAGES
            if pkg in spec and pkg in pins and not satisfies(pins[pkg], spec[pkg], f"{file}: facts.unsloth.{pkg}")]


def unsloth_lines(facts: dict, cells, reason: str, file: str = "matrix.toml") -> list[str]:
    """--explain's lines on the Unsloth notebook flavour: per stack, the cells and whether it fits (which pins don't)."""
    spec = facts.get("unsloth")
    if not spec:
        return []
    lines = [f"unsloth flavour (unsloth {spec.get('version', '?')} + unsloth-zoo, their metadata) rule=unsloth-fits: "
             f"{reason}"]
    by_stack: dict[str, list] = {}
    for c in cells:
        by_stack.setdefault(c.stack, []).append(c)
    for stack, group in by_stack.items():
        tags = ", ".join(c.tag for c in group)
        conflicts = unsloth_conflicts(facts, group[0].pins, file)
        if conflicts is None:
            verdict = "not offered (no training stack)"
        elif conflicts:
            verdict = "does not fit: " + "; ".join(conflicts)
        else:
            verdict = "fits"
        lines.append(f"  stack {stack} ({tags}): {verdict}")
    return lines
