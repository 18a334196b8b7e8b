"""Package tables of matrix.toml: pins (`packages = { NAME = "VERSION" }`), package lists, [stack.NAME] with its
`extends` chain, and [extras]. Names are canonical (PEP 503), so two spellings of one package are one error."""
from __future__ import annotations

from typing import Any

from packaging.utils import canonicalize_name

from builder import rules as rules_mod
from builder.errors import UserError
from builder.matrix.grammar import PACKAGE, grammar
from builder.matrix.schema import STACK_KEYS, check_table, str_list, str_table


def resolve_stacks(f: str, table: dict) -> dict[str, dict[str, str]]:
    own: dict[str, dict[str, str]] = {}
    for name, t in table.items():
        check_table(f"{f}: stack.{name}", t, STACK_KEYS, ("packages",))
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
    for pkg, ver in str_table(where, table).items():
        grammar(where, "package name", pkg, PACKAGE, "a package name (PEP 508)")
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
    for pkg in str_list(where, value):
        grammar(where, "package name", pkg, PACKAGE, "a package name (PEP 508)")
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


def extras_table(f: str, data: dict) -> dict[str, tuple[str, ...]]:
    """[extras]: package -> the extras the stacks and flavours install it with (trl = ["vllm"]): their requirements
    bind the pins as the package's own do (builder.pins reads them). Canonical names, checked."""
    table = data.get("extras", {})
    check_table(f"{f}: extras", table, {k: list for k in table})
    out: dict[str, tuple[str, ...]] = {}
    for pkg, extras in table.items():
        grammar(f"{f}: extras", "package name", pkg, PACKAGE, "a package name (PEP 508)")
        if canonicalize_name(pkg) in out:
            raise UserError(f"{pkg!r} names a package listed already", where=f"{f}: extras")
        out[canonicalize_name(pkg)] = tuple(package_list(f"{f}: extras.{pkg}", extras))  # extras: PEP 685 names
    return out
