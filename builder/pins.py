"""Pins that keep up: which of matrix.toml's pins could move, what blocks the rest, and [facts] refreshed from metadata.

`python -m builder.pins` asks the package index (pip's own defaults: its configured index, mirror or wheelhouse) for
the newest release of every stack pin and for the Requires-Dist of the pinned and newest releases, then prints one row
per pin: newest, could it move, and what blocks it (e.g. "trl 1.16.0 caps vllm<=0.31.0"), and the [facts] entries the
index no longer agrees with. `--write` rewrites only the values of the [facts] tables (and their checked-on date) in
matrix.toml, in place: comments and every other line stay as they are. pip reads metadata only (PEP 658 files where
the index has them), never a whole wheel of torch or vLLM; `pip install --dry-run --report` is the one pip command
that gives versions and Requires-Dist together.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import stat
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import Specifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from builder import rules
from builder.errors import UserError, reports_user_errors, shorten
from builder.matrix import DEFAULT_MATRIX, read_document
from builder.matrix.facts import check_facts_tables, check_rule_entries
from builder.matrix.packages import extras_table, packages_table
from common import atomic

# Requires-Dist markers are read for the GPU cells' interpreter and OS (python 3.12, Linux); the arch matters to a few
# markers only, x86_64 is the reference.
MARKER_ENV = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.0",
              "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
              "implementation_name": "cpython", "platform_python_implementation": "CPython", "os_name": "posix"}
# what pip prints when the index is not reachable (as opposed to reachable without the release asked for)
NETWORK_ERRORS = r"(?i)NewConnectionError|ConnectionError|Max retries|name resolution|timed out|SSLError|ProxyError"
DATE_LINE = re.compile(r"^(# Checked against the package index on )(\d{4}-\d{2}-\d{2})(.*)$", re.M)


@dataclass
class Dist:
    name: str
    version: str
    requires: list[Requirement] = field(default_factory=list)

    def bounds(self, package: str, extras: tuple[str, ...] = ()) -> SpecifierSet | None:
        """What this release requires of PACKAGE (with EXTRAS active), all its requirements on it together."""
        got = None
        for r in self.requires:
            if canonicalize_name(r.name) != canonicalize_name(package):
                continue
            if r.marker and not any(r.marker.evaluate({**MARKER_ENV, "extra": e}) for e in ("", *extras)):
                continue
            got = r.specifier if got is None else got & r.specifier
        return got


def query(requirements: list[str], python: str = sys.executable) -> dict[str, Dist]:
    """Name -> the release pip would pick for each requirement, with its Requires-Dist: `pip install --dry-run
    --report` (no install, no dependencies, installed packages ignored). A pip constraints file configured on the
    machine is set aside: the question is what the index has, not what this machine allows."""
    with tempfile.TemporaryDirectory(prefix="trainbox-pins-") as tmp:
        report = Path(tmp) / "report.json"
        cmd = [python, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed", "--quiet",
               "--disable-pip-version-check", "--report", str(report), *requirements]
        env = dict(os.environ, PIP_CONSTRAINT=os.devnull)
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if p.returncode != 0 or not report.exists():
            raise _pip_error(p, requirements)
        data = json.loads(report.read_text())
    out = {}
    for item in data.get("install", []):
        md = item["metadata"]
        out[canonicalize_name(md["name"])] = Dist(md["name"], md["version"],
                                                  [Requirement(r) for r in md.get("requires_dist", []) or []])
    return out


# pip's words for the one requirement it could not satisfy (pip 23-26)
_NOT_FOUND = re.compile(r"(?:satisfies the requirement|No matching distribution found for) ([^\s(]+)")


def _pip_error(p: subprocess.CompletedProcess, requirements: list[str]) -> UserError:
    """One line for a failed `pip install --dry-run`: the requirement pip names (not every pin of the batch), or
    the index that could not be reached; never a name cut in the middle."""
    lines = [ln.strip() for ln in p.stderr.splitlines() if ln.strip() and "is ignored" not in ln]
    fix = ("check that pip reaches its index (pip config list; PIP_INDEX_URL for a mirror) and that matrix.toml's "
           "pins and [facts] name published releases")
    if re.search(NETWORK_ERRORS, p.stderr):
        return UserError(f"cannot reach the package index ({len(requirements)} requirement(s) asked): "
                         f"{shorten(' '.join(lines[-2:]), 300) or f'pip exit {p.returncode}'}", fix=fix)
    m = _NOT_FOUND.search(p.stderr)
    if m:
        versions = re.search(r"\(from versions: ([^)]*)\)", p.stderr)
        seen = f" (the index has: {shorten(versions.group(1), 200)})" if versions else ""
        return UserError(f"the package index has no release for {m.group(1)}{seen}", fix=fix)
    return UserError(f"pip could not resolve {_names(requirements)}: "
                     f"{shorten(' '.join(lines[-3:]), 400) or f'pip exit {p.returncode}'}", fix=fix)


def _names(requirements: list[str], limit: int = 200) -> str:
    """REQUIREMENTS joined up to LIMIT characters, whole names only ("and N more")."""
    out: list[str] = []
    for i, r in enumerate(requirements):
        if out and len(" ".join(out + [r])) > limit:
            return " ".join(out) + f" and {len(requirements) - i} more"
        out.append(r)
    return " ".join(out)


# ------------------------------------------------------------------------------------------------------ the matrix
def stack_pins(data: dict) -> dict[str, str]:
    """Every package pinned by a stack -> its version (stacks agree on a shared package: `extends` merges them)."""
    pins: dict[str, str] = {}
    for name in sorted(data.get("stack", {})):
        for pkg, ver in data["stack"][name].get("packages", {}).items():
            pins.setdefault(canonicalize_name(pkg), ver)
    return pins


def flavour_pins(data: dict) -> dict[str, dict[str, str]]:
    """Flavour -> the packages it pins over its cells' stacks."""
    return {name: {canonicalize_name(p): v for p, v in f.get("packages", {}).items()}
            for name, f in sorted(data.get("flavour", {}).items())}


def package_facts(facts: dict) -> list[str]:
    """The [facts] tables that record one package's Requires-Dist at a version (unsloth, verl)."""
    return [t for t, v in facts.items() if isinstance(v, dict) and "version" in v]


# ---------------------------------------------------------------------------------------------- could a pin move?
@dataclass
class Row:
    package: str             # "trl", or "trl (unsloth)" for a flavour's own pin
    pin: str
    newest: str
    blockers: list[str]      # pinned releases whose requirements exclude the newest release
    needs: list[str]         # what the newest release requires that other pins don't meet (they move together)

    @property
    def verdict(self) -> str:
        if Version(self.newest) <= Version(self.pin):
            return "up to date"
        if self.blockers:
            return "no"
        return "yes" if not self.needs else "with " + ", ".join(re.match(r"[\w.-]+", n).group() for n in self.needs)


def _failing(spec: SpecifierSet, version: str) -> str:
    """The specifiers of SPEC that VERSION fails, in the order a reader expects (lower bounds first)."""
    v = Version(version)
    bad = [s for s in spec if not s.contains(v, prereleases=True)]
    return ",".join(str(s) for s in sorted(bad, key=_spec_order))


def _verb(failing: str) -> str:
    return "pins" if failing.startswith("==") else "caps" if failing.startswith("<") else "requires"


def rows(pins: dict[str, str], pinned: dict[str, Dist], newest: dict[str, Dist], only: set[str] | None = None,
         label: str = "", extras: dict[str, tuple[str, ...]] | None = None) -> list[Row]:
    """A row per pin (per pin in ONLY): PINNED are the releases pinned together, NEWEST the index's newest; EXTRAS
    (matrix.toml [extras]): the extras a package is installed with, whose requirements bind like its own."""
    extras = extras or {}
    out = []
    for pkg, pin in pins.items():
        if only is not None and pkg not in only:
            continue
        new = newest[pkg].version if pkg in newest else pin
        blockers, needs = [], []
        if Version(new) > Version(pin):
            for other, dist in pinned.items():
                if other == pkg:
                    continue
                spec = dist.bounds(pkg, extras.get(other, ()))
                if spec is not None and not spec.contains(Version(new), prereleases=True):
                    bad = _failing(spec, new)
                    extra = "".join(f"[{e}]" for e in extras.get(other, ()) if dist.bounds(pkg) != spec)
                    blockers.append(f"{dist.name}{extra} {dist.version} {_verb(bad)} {pkg}{bad}")
            for other, ver in pins.items():
                spec = newest[pkg].bounds(other, extras.get(pkg, ())) if pkg in newest else None
                if other != pkg and spec is not None and not spec.contains(Version(ver), prereleases=True):
                    needs.append(f"{other}{_failing(spec, ver)} (pinned {ver})")
        out.append(Row(f"{pkg} ({label})" if label else pkg, pin, new, blockers, needs))
    return out


def table(rs: list[Row]) -> str:
    lines = [["package", "pin", "newest", "could move?", "what blocks it"]]
    for r in rs:
        why = "; ".join(r.blockers) or ("; ".join(f"{r.package.split()[0]} {r.newest} needs {n}" for n in r.needs))
        lines.append([r.package, r.pin, r.newest, r.verdict, why or "-"])
    widths = [max(len(row[i]) for row in lines) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4] for row in lines)


# ------------------------------------------------------------------------------------------------------- [facts]
def _spec_order(s: Specifier) -> tuple:
    return ({">=": 0, ">": 0, "<=": 1, "<": 1, "==": 2, "~=": 2}.get(s.operator, 3), Version(s.version.rstrip(".*"))
            if s.version.rstrip(".*")[:1].isdigit() else Version("0"), s.operator)


def tightest(spec: SpecifierSet) -> SpecifierSet:
    """SPEC with redundant bounds dropped: the highest lower bound and the lowest upper bound, every other specifier
    kept (what 'the tighter of two requirements' means when both bound a package)."""
    lower = [s for s in spec if s.operator in (">=", ">")]
    upper = [s for s in spec if s.operator in ("<=", "<")]
    keep = [s for s in spec if s.operator not in (">=", ">", "<=", "<")]
    if lower:
        keep.append(max(lower, key=lambda s: (Version(s.version), s.operator == ">")))
    if upper:
        keep.append(min(upper, key=lambda s: (Version(s.version), s.operator == "<")))
    return SpecifierSet(",".join(str(s) for s in keep))


def spec_text(spec: SpecifierSet) -> str:
    return ",".join(str(s) for s in sorted(spec, key=_spec_order))


def _same(old, new) -> bool:
    """Versions compare as versions, ranges as sets of specifiers (order and trailing zeros don't matter)."""
    if old == new:
        return True
    try:
        if any(c in str(old) for c in "<>=!~"):
            return SpecifierSet(str(old)) == SpecifierSet(str(new))
        return Version(str(old)) == Version(str(new))
    except ValueError:
        return False


def fact_requirements(facts: dict, together: dict[str, tuple[str, ...]] | None = None) -> list[str]:
    """The exact releases whose metadata the recorded [facts] were read from (TOGETHER: a facts table -> the packages
    whose Requires-Dist it records, matrix.toml's [[rule]] packages)."""
    together = together or {}
    reqs = [f"vllm=={v}" for v in facts.get("vllm_torch", {})]
    reqs += [f"vllm=={v}" for v in facts.get("vllm_transformers", {})]
    reqs += [f"trl=={v}" for v in facts.get("trl_vllm_extra", {})]
    for t in package_facts(facts):
        reqs += [f"{p}=={facts[t]['version']}" for p in together.get(t, (t,))]
    return sorted(set(reqs))


def _pin_of(spec: SpecifierSet | None) -> str | None:
    exact = [s.version for s in spec or () if s.operator in ("==", "===")]
    return exact[0] if len(exact) == 1 else None


def facts_from(facts: dict, by_version: dict[tuple[str, str], Dist], newest: dict[str, Dist],
               pinned_versions: dict[str, str] | None = None, extras: dict[str, tuple[str, ...]] | None = None,
               together: dict[str, tuple[str, ...]] | None = None) -> dict:
    """[facts] as the metadata says: every recorded key re-read, the newest vLLM and TRL added; a package's table
    (unsloth, verl) read at the version a flavour pins (PINNED_VERSIONS), else at its recorded one. BY_VERSION:
    (name, version) -> release. A recorded value that still means the same (same range written otherwise) keeps its
    text, so a no-op refresh leaves matrix.toml's bytes alone."""
    pinned_versions, extras, together = pinned_versions or {}, extras or {}, together or {}

    def rel(name: str, ver: str) -> Dist:
        d = by_version.get((canonicalize_name(name), ver))
        if d is None:
            raise UserError(f"{name} {ver} is not on the package index", where="matrix.toml [facts]",
                            fix="correct or remove that [facts] entry")
        return d

    def keep(old, new):
        return old if old is not None and _same(old, new) else new

    out: dict = {}
    vllms = list(facts.get("vllm_torch", {}))
    trls = list(facts.get("trl_vllm_extra", {}))
    if "vllm" in newest:
        vllms += [newest["vllm"].version]
    if "trl" in newest:
        trls += [newest["trl"].version]
    if "vllm_torch" in facts:
        out["vllm_torch"] = {v: keep(facts["vllm_torch"].get(v), _pin_of(rel("vllm", v).bounds("torch")) or "?")
                             for v in dict.fromkeys(vllms)}
    if "trl_vllm_extra" in facts:
        out["trl_vllm_extra"] = {v: keep(facts["trl_vllm_extra"].get(v),
                                         spec_text(rel("trl", v).bounds("vllm", extras.get("trl", ())) or SpecifierSet()))
                                 for v in dict.fromkeys(trls)}
    if "vllm_transformers" in facts:
        keys = list(facts["vllm_transformers"]) + [v for v in vllms[-1:] if v not in facts["vllm_transformers"]]
        out["vllm_transformers"] = {v: keep(facts["vllm_transformers"].get(v),
                                            spec_text(rel("vllm", v).bounds("transformers") or SpecifierSet()))
                                    for v in dict.fromkeys(keys)}
    for table_name in package_facts(facts):
        # the version a flavour pins (the fact checks that pin), else the recorded one: re-read, never moved here
        old = facts[table_name]
        ver = pinned_versions.get(canonicalize_name(table_name), old["version"])
        dists = [rel(p, ver) for p in together.get(table_name, (table_name,))]
        entry = {"version": ver}
        for pkg in (k for k in old if k != "version"):
            combined = SpecifierSet()
            for spec in (d.bounds(pkg, extras.get(canonicalize_name(table_name), ())) for d in dists):
                combined &= spec if spec is not None else SpecifierSet()
            entry[pkg] = keep(old.get(pkg), spec_text(tightest(combined)))
        out[table_name] = entry
    for k, v in facts.items():   # tables this tool does not know stay as they are
        out.setdefault(k, v)
    return out


def differences(old: dict, new: dict) -> list[str]:
    """'table.key: recorded X, index Y' for each recorded fact the index disagrees with (new keys are not listed)."""
    lines = []
    for table_name, entries in old.items():
        for key, value in entries.items():
            got = new.get(table_name, {}).get(key)
            if got is not None and not _same(value, got):
                lines.append(f"facts.{table_name}.{key}: recorded {value!r}, the index says {got!r}")
    return lines


def added(old: dict, new: dict) -> list[str]:
    return [f"facts.{t}.{k} = {v!r}" for t, entries in new.items() for k, v in entries.items()
            if k not in old.get(t, {})]


# ------------------------------------------------------------------------------------------- matrix.toml in place
def _key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)


def inline(table_value: dict) -> str:
    return "{ " + ", ".join(f"{_key(k)} = {json.dumps(v)}" for k, v in table_value.items()) + " }"


def rewrite(text: str, facts: dict, today: str) -> str:
    """TEXT with each [facts] table's line replaced by FACTS' value and the checked-on date set; nothing else moves."""
    m = re.search(r"^\[facts\]\s*$", text, re.M)
    if not m:
        raise UserError("matrix.toml has no [facts] table", fix="add one (see the repository's matrix.toml)")
    end = re.search(r"^\[", text[m.end():], re.M)
    stop = m.end() + end.start() if end else len(text)
    section = text[m.end():stop]
    for name, value in facts.items():
        pat = re.compile(rf"^{re.escape(_key(name))}[ \t]*=[ \t]*\{{.*\}}[ \t]*$", re.M)
        if not pat.search(section):
            raise UserError(f"[facts] {name} is not a one-line inline table", where="matrix.toml",
                            fix="write it as NAME = { ... } on one line")
        section = pat.sub(lambda _m, n=name, v=value: f"{_key(n)} = {inline(v)}", section, count=1)
    section = DATE_LINE.sub(lambda d: d.group(1) + today + d.group(3), section, count=1)
    out = text[:m.end()] + section + text[stop:]
    try:
        same = tomllib.loads(out).get("facts") == facts
    except tomllib.TOMLDecodeError:
        same = False
    if not same:   # what was written is what was meant, or nothing is written
        raise UserError("rewriting [facts] would not give the facts read from the index", where="matrix.toml",
                        fix="check the [facts] lines by hand")
    return out


# ---------------------------------------------------------------------------------------------------------- the CLI
@dataclass
class Report:
    rows: list[Row]
    facts: dict
    new_facts: dict


def _releases(requirements: list[str], known: dict[tuple[str, str], Dist]) -> None:
    """Add the releases REQUIREMENTS (NAME==VERSION) name to KNOWN, one pip call per batch of distinct names (pip
    refuses two versions of one package in one call)."""
    missing = [tuple(r.split("==")) for r in requirements]
    missing = [(n, v) for n, v in missing if (canonicalize_name(n), v) not in known]
    while missing:
        batch = {canonicalize_name(n): (n, v) for n, v in reversed(missing)}
        known.update({(k, d.version): d for k, d in query([f"{n}=={v}" for n, v in batch.values()]).items()})
        missing = [(n, v) for n, v in missing if (canonicalize_name(n), v) not in known and
                   batch[canonicalize_name(n)] != (n, v)]


def read_matrix(path: Path) -> dict:
    """The parts of PATH this tool reads ([stack.*] and [flavour.*] packages, [facts]), each checked as builder.matrix
    checks it, before pip is asked anything: a bad value is one error naming its key, never a traceback, and no
    name reaches pip's command line unless it is a package name (one starting with '-' would be read as an option)."""
    where = str(path)
    data = read_document(path)
    for section in ("stack", "flavour"):
        tables = data.get(section, {})
        if not isinstance(tables, dict):
            raise UserError("must be a table", where=f"{where}: {section}")
        for name, t in tables.items():
            if not isinstance(t, dict):
                raise UserError("must be a table", where=f"{where}: {section}.{name}")
            packages_table(f"{where}: {section}.{name}.packages", t.get("packages", {}))
    check_rule_entries(where, data)
    check_facts_tables(where, data)
    extras_table(where, data)
    return data


def shape(data: dict) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
    """(extras, together) as matrix.toml declares them: [extras] (package -> the extras it is installed with) and
    each facts rule's `packages` (a [facts] table -> the packages whose Requires-Dist it records)."""
    extras = {canonicalize_name(p): tuple(canonicalize_name(e) for e in es) for p, es in data.get("extras", {}).items()}
    together = {r["facts"]: tuple(canonicalize_name(p) for p in r["packages"])
                for r in rules.facts_rules(data).values() if "packages" in r}
    return extras, together


def check(matrix: Path, pins_too: bool = True) -> Report:
    """The pins table (unless not PINS_TOO: then only the recorded [facts] are re-read) and [facts] refreshed."""
    data = read_matrix(matrix)
    extras, together = shape(data)
    pins = stack_pins(data)
    flavours = flavour_pins(data)
    facts = data.get("facts", {})
    flavour_versions = {p: v for own in flavours.values() for p, v in own.items()}
    reqs = fact_requirements(facts, together)
    reqs += [f"{p}=={flavour_versions[canonicalize_name(t)]}" for t in package_facts(facts)
             if canonicalize_name(t) in flavour_versions for p in together.get(t, (t,))]
    if not pins_too:
        known: dict[tuple[str, str], Dist] = {}
        _releases(reqs, known)
        return Report([], facts, facts_from(facts, known, {}, flavour_versions, extras, together))
    names = set(pins) | {p for f in flavours.values() for p in f}
    newest = query(sorted(names))
    pinned = query([f"{p}=={v}" for p, v in pins.items()])
    known = {(k, d.version): d for src in (pinned, newest) for k, d in src.items()}
    out = rows(pins, pinned, newest, extras=extras)
    for name, own in flavours.items():
        _releases([f"{p}=={v}" for p, v in own.items()], known)
        along = {**pins, **own}
        dists = {p: known[(p, v)] if (p, v) in known else pinned[p] for p, v in along.items() if
                 (p, v) in known or p in pinned}
        out += rows(along, dists, newest, only=set(own), label=name, extras=extras)
    _releases(reqs, known)
    return Report(out, facts, facts_from(facts, known, newest, flavour_versions, extras, together))


@reports_user_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m builder.pins", description=__doc__.splitlines()[0])
    p.add_argument("--matrix", default=str(DEFAULT_MATRIX))
    p.add_argument("--write", action="store_true", help="rewrite [facts] values and their checked-on date in place")
    a = p.parse_args(argv)
    matrix = Path(a.matrix)
    if not matrix.is_file():
        raise UserError(f"no matrix file at {matrix}", fix="pass --matrix FILE")
    rep = check(matrix)
    print(table(rep.rows))
    diff, new = differences(rep.facts, rep.new_facts), added(rep.facts, rep.new_facts)
    for line in diff:
        print(f"stale: {line}")
    for line in new:
        print(f"new: {line}")
    if a.write:
        # through a symbolic link to the file it names, keeping that file's mode (the atomic rename would otherwise
        # put a regular 0644 file in the link's place and leave the real matrix as it was)
        target = matrix.resolve()
        text = target.read_text()
        out = rewrite(text, rep.new_facts, datetime.date.today().isoformat())
        if out != text:
            atomic.write_text(target, out, mode=stat.S_IMODE(target.stat().st_mode))
            print(f"{matrix}: [facts] refreshed" + (f" (in {target})" if target != matrix.absolute() else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
