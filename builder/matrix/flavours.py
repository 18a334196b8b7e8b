"""[flavour.NAME]: a named stack on top of some cells' stacks, built FROM the cell's image (templates/Flavour.j2):
one flavour cell per (base cell, arch) it names, every rule checked on its pins."""
from __future__ import annotations

import dataclasses
import re

from builder import dockerignore, rules as rules_mod, templating
from builder.errors import UserError
from builder.matrix.grammar import PREFIX, REL_PATH, grammar
from builder.matrix.locknames import committed_lock_names
from builder.matrix.model import Cell
from builder.matrix.packages import package_list, packages_table
from builder.matrix.schema import FLAVOUR_CELL_NAME, FLAVOUR_KEYS, FLAVOUR_TAG, check_table, str_list, str_table
from builder.paths import ROOT

_FLAVOUR_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,31}", re.ASCII)
_CMD_WORD = re.compile(r"[A-Za-z0-9_./:=,+@-]+", re.ASCII)


def flavour_cells(f: str, data: dict, ctx, naming: dict, vtags: list, cells: list[Cell]) -> list[Cell]:
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
        grammar(w, "flavour name", fname, _FLAVOUR_NAME, "a short lower-case name (letters, digits, '-')")
        check_table(w, t, FLAVOUR_KEYS, ("cells", "packages"))
        bases: list[Cell] = []
        for n in str_list(f"{w}.cells", t["cells"]):
            if n not in by_name:
                raise UserError(f"unknown base cell {n!r}", where=f"{w}.cells",
                                fix="name cells or tags that `python build.py --list` shows (not flavour cells)")
            bases += [c for c in by_name[n] if c not in bases]
        packages = packages_table(f"{w}.packages", t["packages"])
        if not packages:
            raise UserError("packages must not be empty", where=f"{w}.packages")
        remove = package_list(f"{w}.remove", t["remove"]) if "remove" in t else []
        rules = str_list(f"{w}.rules", t["rules"]) if "rules" in t else []
        for r in rules:
            if r not in rules_mod.facts_rules(data):
                raise UserError(f"unknown flavour rule {r!r}", where=f"{w}.rules",
                                fix="flavour rules are [[rule]] entries with facts = \"TABLE\": "
                                    + (", ".join(rules_mod.facts_rules(data)) or "none yet"))
            if r not in ctx.rules:
                raise UserError(f"rule {r!r} has no [[rule]] entry (its reason)", where=f"{w}.rules",
                                fix=f"add [[rule]] id = \"{r}\" with its reason")
        files = []
        for src, dest in str_table(f"{w}.files", t.get("files", {})).items():
            grammar(f"{w}.files", "source", src, REL_PATH, "a folder of the repository like images/notebooks/x")
            grammar(f"{w}.files", "destination", dest, PREFIX, "an absolute path like /workspace/notebooks")
            # what the build context holds (.dockerignore, no links), not merely the repository: BuildKit copies it
            why = dockerignore.why_not_in_context(src)
            if why:
                raise UserError(f"{src!r} {why}", where=f"{w}.files",
                                fix="name a real folder under images/ (the build context's own; see .dockerignore) "
                                    "or drop it")
            files.append((src, dest))
        cmd = str_list(f"{w}.cmd", t["cmd"]) if "cmd" in t else []
        # published as a source archive only: the lock hashes it, the install step builds it
        sdists = sorted(package_list(f"{w}.sdists", t["sdists"])) if "sdists" in t else []
        for word in cmd:
            grammar(f"{w}.cmd", "word", word, _CMD_WORD, "one plain word (no spaces or quotes)")
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
            locked = committed_lock_names(ROOT / "locks" / f"{base.venv}-{fname}.txt") if sdists else None
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
            name = templating.fill(naming.get("flavour_cell_name", FLAVOUR_CELL_NAME), f"{f}: naming.flavour_cell_name",
                           name=base.name, flavour=fname)
            tag = templating.fill(naming.get("flavour_tag", FLAVOUR_TAG), f"{f}: naming.flavour_tag", tag=base.tag,
                          flavour=fname, name=base.name, arch=base.arch)
            fields = dict(tag=tag, name=name, arch=base.arch, version=base.version, torch=pins.get("torch", ""))
            version_tags = tuple(templating.fill(v, f"{f}: naming.version_tags", **fields) for v in vtags
                                 if "torch" in pins or "{torch}" not in v)
            out.append(dataclasses.replace(
                base, name=name, tag=tag, stack=f"{base.stack}+{fname}", pins=dict(sorted(pins.items())),
                version_tags=version_tags, venv=f"{base.venv}-{fname}", base_image=base.image, build_image=None,
                flash=None, fabric_plugin=None, flavour=fname, base=base, files=tuple(files), cmd=tuple(cmd),
                sdists=tuple(sdists)))
    return out

