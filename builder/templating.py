"""Templates in matrix.toml and index URLs: str.format with plain `{field}` names only.

No attribute access or indexing (`{variant.__class__}`), no conversion (`{x!r}`) and no format spec (`{x:>99999999}`
made a 100 MB string): a template is a name with holes, nothing more. `{{` and `}}` are a literal brace.
"""

from __future__ import annotations

import string

from builder.errors import UserError, shorten


def fill(template: str, where: str, **values: str) -> str:
    """`template` with its fields filled from `values`; one UserError naming `where` for anything else."""
    fields = "{" + "}, {".join(sorted(values)) + "}"
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise UserError(f"bad template {shorten(template)!r} ({e})", where=where,
                        fix=f"use only the fields {fields}; write a literal brace as {{{{ or }}}}") from None
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if name not in values or spec or conversion:
            raise UserError(f"bad template {shorten(template)!r}: field {shorten('{' + name + '}', 60)!r}"
                            + (" has a format spec or conversion" if name in values else " is not known"),
                            where=where, fix=f"use only the fields {fields} (plain, no ':' or '!')")
    return template.format(**values)
