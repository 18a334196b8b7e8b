"""[[rule]] entries and the [facts] tables they read, checked: a registered check's id, or a facts rule naming its
table; each fact read with packaging now, so a typo is one error naming its key."""
from __future__ import annotations

from builder import rules as rules_mod
from builder.errors import UserError
from builder.matrix.grammar import PACKAGE, grammar
from builder.matrix.packages import package_list
from builder.matrix.schema import RULE_KEYS, check_table, str_table


def check_rule_entries(f: str, data: dict) -> None:
    """[[rule]] entries: a registered check's id (once), or a facts rule (`facts` names its [facts] table)."""
    if not isinstance(data.get("rule"), list):
        raise UserError("must be an array of tables ([[rule]])", where=f"{f}: rule")
    seen: set[str] = set()
    for i, r in enumerate(data["rule"]):
        w = f"{f}: rule[{i}]"
        check_table(w, r, RULE_KEYS, ("id", "reason"))
        registered = r["id"] in rules_mod.REGISTRY
        if not registered and "facts" not in r:
            raise UserError(f"unknown rule id {r['id']!r}", where=f"{w}.id",
                            fix=f"registered rules: {', '.join(rules_mod.CHECKS)}; or give it facts = \"TABLE\" (a "
                                "flavour's pins held to [facts] TABLE)")
        if registered and ("facts" in r or "packages" in r):
            raise UserError(f"rule {r['id']!r} has its own check; facts/packages are for facts rules",
                            where=f"{w}.facts", fix="drop them, or give the facts rule another id")
        if "facts" in r:
            grammar(w, "facts", r["facts"], PACKAGE, "a [facts] table named after its package, like unsloth")
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
    check_table(f"{f}: facts", facts, {t: dict for t in [*rules_mod.RULE_FACTS, *sorted(named)]})
    for table, entries in facts.items():
        str_table(f"{f}: facts.{table}", entries)
        kind = rules_mod.RULE_FACTS.get(table)
        for key, value in entries.items():
            if kind is not None:
                rules_mod.version(key, f"{f}: facts.{table}")
            if kind == "version" or (kind is None and key == "version"):
                rules_mod.version(value, f"{f}: facts.{table}.{key}")
            else:
                rules_mod.specifier(value, f"{f}: facts.{table}.{key}")
    return facts

