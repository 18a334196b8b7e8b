"""The checked document expanded into a Matrix: the [expand] product (minus what the rules exclude), the explicit
[[cell]] tables, then the flavour cells; every tag and cell name unique."""
from __future__ import annotations

import itertools
from pathlib import Path

from builder import rules as rules_mod, templating
from builder.errors import UserError
from builder.matrix.axes import check_axes
from builder.matrix.ci import gpu_runners
from builder.matrix.fabric import check_fabric
from builder.matrix.facts import check_facts_tables, check_rule_entries
from builder.matrix.flavours import flavour_cells
from builder.matrix.model import Cell, Exclusion, Matrix, table_values
from builder.matrix.packages import extras_table, resolve_stacks
from builder.matrix.schema import (
    CELL_KEYS,
    EXPAND_KEYS,
    NAMING_KEYS,
    REQUIRED_CELL,
    REQUIRED_NAMING,
    REQUIRED_TOP,
    TOP_KEYS,
    check_table,
    str_list,
)


def build_matrix(path: Path, data: dict) -> Matrix:
    """DATA (read_document's tree of PATH) checked table by table and expanded; the first problem is one UserError."""
    f = str(path)
    check_table(f, data, TOP_KEYS, REQUIRED_TOP)
    if data["schema"] != 1:
        raise UserError(f"schema {data['schema']} is not supported", where=f"{f}: schema", fix="use schema = 1")

    naming = check_table(f"{f}: naming", data["naming"], NAMING_KEYS, REQUIRED_NAMING)
    vtags = str_list(f"{f}: naming.version_tags", naming["version_tags"]) if naming["version_tags"] else []

    check_axes(f, data)
    arches, cudas, gpus = data["arch"], data.get("cuda", {}), data["gpu"]
    check_fabric(f, data.get("fabric", {}))
    stacks = resolve_stacks(f, data["stack"])
    check_rule_entries(f, data)
    facts = check_facts_tables(f, data)
    extras_table(f, data)

    rule_table: dict[str, str] = {}
    fields = rules_mod.reason_fields(data, stacks)
    for i, r in enumerate(data["rule"]):   # reasons are templates filled from the tables (no version typed twice)
        rule_table[r["id"]] = templating.fill(r["reason"], f"{f}: rule[{i}].reason", **fields)

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
        check_table(w, expand, EXPAND_KEYS, tuple(EXPAND_KEYS))
        e_arch = str_list(f"{w}.arch", expand["arch"], arches)
        e_cuda = str_list(f"{w}.cuda", expand["cuda"], cudas)
        e_gpu = str_list(f"{w}.gpu", expand["gpu"], gpus)
        if expand["stack"] not in stacks:
            raise UserError(f"unknown stack {expand['stack']!r}", where=f"{w}.stack",
                            fix=f"choose one of {', '.join(stacks)}")
        for arch, cuda, gpu in itertools.product(e_arch, e_cuda, e_gpu):
            attention = gpus[gpu]["attention"]
            variant = rules_mod.variant_for_cuda(ctx, cuda)
            hit = rules_mod.check_cell(ctx, arch=arch, cuda=cuda, gpu=gpu, attention=attention, variant=variant,
                                       stack_pins=stacks[expand["stack"]])
            if hit:
                exclusions.append(Exclusion(arch, cuda, gpu, None, hit[0], f"{rule_table[hit[0]]} ({hit[1]})",
                                            hit[1]))
                continue
            name = templating.fill(naming["cell_name"], f"{f}: naming.cell_name", cuda=cuda,
                                   cuda_nodot=cuda.replace(".", ""), gpu=gpu, arch=arch)
            cells.append(_make_cell(f, data, naming, vtags, name=name, arch=arch, cuda=cuda, gpu=gpu,
                                    variant=variant, stack=expand["stack"], pins=stacks[expand["stack"]],
                                    attention=attention, venv=f"cu{cuda.replace('.', '')}-{expand['stack']}-{arch}"))
        # Non-default attention backends per GPU: what an explicit cell may not ask for, and why.
        for gpu in e_gpu:
            for attention in sorted(data["attention"]):
                if attention == gpus[gpu]["attention"]:
                    continue
                hit = rules_mod.check_attention(ctx, gpu=gpu, attention=attention)
                if hit:
                    exclusions.append(Exclusion(None, None, gpu, attention, hit[0],
                                                f"{rule_table[hit[0]]} ({hit[1]})", hit[1]))

    # where each cell comes from: one name is one image (a manifest list over its arches), so one source
    origin = {c.tag: f"[expand] cuda {c.cuda} gpu {c.gpu}" for c in cells}
    for i, c in enumerate(data.get("cell", [])):
        made = _explicit_cells(f"{f}: cell[{i}]", f, data, ctx, naming, vtags, stacks, c)
        origin.update({m.tag: f"cell[{i}]" for m in made})
        cells.extend(made)

    for flavours in (False, True):   # the cells' tags first: a flavour names cells by tag
        if flavours:
            cells.extend(flavour_cells(f, data, ctx, naming, vtags, cells))
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
    return Matrix(path=path, cells=tuple(cells), exclusions=tuple(exclusions), rules=rule_table, data=data,
                  gpu_runners=gpu_runners(f, data))


def _explicit_cells(w, f, data, ctx, naming, vtags, stacks, c) -> list[Cell]:
    check_table(w, c, CELL_KEYS, REQUIRED_CELL)
    name = c["name"]
    if not name or not all(ch.isalnum() or ch in "-_." for ch in name) or not name[0].isalnum():
        raise UserError(f"cell name {name!r} must be letters, digits, '-', '_' or '.'", where=f"{w}.name")
    arches = str_list(f"{w}.arch", [c["arch"]] if isinstance(c["arch"], str) else c["arch"], data["arch"])
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
                              stack=sname, pins=stacks[sname], attention=attention, cell=c, fabric_plugin=plugin))
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


def _make_cell(f, data, naming, vtags, *, name, arch, cuda, gpu, variant, stack, pins, attention, cell=None,
               venv=None, fabric_plugin=None) -> Cell:
    """One cell: the from_table fields copied from its rows (CELL, the [[cell]] table of an explicit cell, first),
    the rest worked out here."""
    tag = templating.fill(naming["tag"], f"{f}: naming.tag", name=name, arch=arch)
    if not tag or not all(ch.isalnum() or ch in "-_." for ch in tag) or len(tag) > 128:
        raise UserError(f"tag {tag!r} is not a valid image tag", where=f"{f}: naming.tag")
    fields = dict(tag=tag, name=name, arch=arch, version=naming["version"], torch=pins.get("torch", ""))
    # A cell without torch (smoke-aarch64) gets no torch{torch} tag rather than a meaningless one.
    version_tags = tuple(templating.fill(t, f"{f}: naming.version_tags", **fields) for t in vtags
                         if "torch" in pins or "{torch}" not in t)
    rows = {"cell": cell, "arch": data["arch"][arch], "cuda": data["cuda"][cuda] if cuda else None,
            "gpu": data["gpu"][gpu] if gpu else None,
            "torch_variant": data["torch_variant"][variant] if variant else None, "naming": naming}
    copied = table_values(rows)
    if cuda and data["cuda"][cuda].get("glibc"):
        copied["uv_platform"] = f"{arch}-manylinux_{data['cuda'][cuda]['glibc'].replace('.', '_')}"
    arch_list = ""
    if variant:
        arch_list = data["torch_variant"][variant]["arch_list"].get(arch, "")
    return Cell(
        **copied, name=name, tag=tag, arch=arch, cuda=cuda, gpu=gpu,
        stack=stack, pins=dict(sorted(pins.items())), torch_variant=variant if "torch" in pins else None,
        torch_arch_list=arch_list, attention_backend=attention, attention=dict(data["attention"][attention]),
        version_tags=version_tags, venv=venv or tag,
        flash=_flash(data["attention"][attention], arch, variant) if cuda else None,
        index_templates=dict(data.get("index", {})),
        fabric_packages=tuple(sorted(data.get("fabric", {}).get("packages", []))) if cuda else (),
        fabric_env=tuple(sorted(data.get("fabric", {}).get("env", {}).items())) if cuda else (),
        fabric_plugin=fabric_plugin,
        gpu_generations=tuple((g, tuple(t["sm"])) for g, t in data["gpu"].items()))
