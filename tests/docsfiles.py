"""The user docs as the tests read them: README.md and every page under docs/, their fenced blocks, and the marker
convention for shell blocks (CONTRIBUTING's docs section, docs/contributing.md):

    <!-- covered-by: tests/FILE.py::test_name ... -->   the block's commands run for real in those tests
    <!-- plan-only: needs ... -->                        each command runs here with --dry-run added
    <!-- not-run: needs ... -->                          it can't run here; the reason says why

on the line just above the fence. A shell block without a marker is run as written (tests/test_readme.py).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
SHELL = {"bash", "sh", "shell", "console"}
KINDS = ("covered-by", "plan-only", "not-run")
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
MARKER = re.compile(r"<!-- ([a-z-]+): (.*?) -->")


def files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def text() -> str:
    """Every doc file's text, joined (for a fact the docs must state somewhere)."""
    return "\n".join(p.read_text(encoding="utf-8") for p in files())


class Block(NamedTuple):
    path: str  # relative to ROOT
    line: int
    lang: str
    marker: str | None  # one of KINDS, or another word (an error), or None
    arg: str
    body: str

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    def commands(self) -> list[str]:
        """Each command line: continuations joined, trailing comments dropped."""
        out = []
        for line in re.sub(r"\\\n\s*", "", self.body).splitlines():
            cmd = re.sub(r"\s+#.*$", "", line).strip()
            if cmd and not cmd.startswith("#"):
                out.append(cmd)
        return out


def blocks_of(markdown: str, path: str) -> list[Block]:
    out = []
    for m in FENCE.finditer(markdown):
        before = markdown[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mk = MARKER.fullmatch(before.strip())
        out.append(Block(path, markdown.count("\n", 0, m.start()) + 1, m[1].strip().split(" ")[0], mk[1] if mk else None,
                         mk[2].strip() if mk else "", m[2]))
    return out


def blocks() -> list[Block]:
    return [b for p in files() for b in blocks_of(p.read_text(encoding="utf-8"), p.relative_to(ROOT).as_posix())]


def shell_blocks() -> list[Block]:
    return [b for b in blocks() if b.lang in SHELL]


def commands() -> list[str]:
    """Every command line of every shell block, in file order, once each."""
    out: list[str] = []
    for b in shell_blocks():
        out += [c for c in b.commands() if c not in out]
    return out


def problems(markdown: str, path: str = "page.md", root: Path = ROOT) -> list[str]:
    """What breaks the convention in one page: a fence with no language, a marker on a block that isn't shell or of
    an unknown kind, a reason that doesn't say what is needed, a covered-by test that doesn't exist, a stray marker."""
    out = []
    found = blocks_of(markdown, path)
    for b in found:
        if not b.lang:
            out.append(f"{b.where}: a fence with no language (say bash, text, yaml...)")
        if b.marker is None:
            continue
        if b.lang not in SHELL:
            out.append(f"{b.where}: a {b.marker} marker on a {b.lang or 'bare'} block")
        elif b.marker not in KINDS:
            out.append(f"{b.where}: unknown marker {b.marker!r} (one of {', '.join(KINDS)})")
        elif b.marker in ("plan-only", "not-run") and not re.match(r"needs \S.{4,}", b.arg):
            out.append(f"{b.where}: {b.marker} must say what it needs: 'needs a GPU ...', got {b.arg!r}")
        elif b.marker == "covered-by":
            nodes = b.arg.split()
            if not nodes:
                out.append(f"{b.where}: covered-by names no test")
            for node in nodes:
                file, _, name = node.partition("::")
                src = root / file
                if not file.startswith("tests/") or not src.is_file():
                    out.append(f"{b.where}: covered-by {node}: no such test file")
                elif name and not re.search(rf"^def {re.escape(name)}\(", src.read_text(encoding="utf-8"), re.M):
                    out.append(f"{b.where}: covered-by {node}: no such test")
    markers = [k for k in re.findall(r"^<!-- ([a-z-]+): .*? -->[ \t]*$", markdown, re.M)
               if k != "generated"]  # docs/hooks.py's own placeholders
    if len(markers) != sum(b.marker is not None for b in found):
        out.append(f"{path}: a marker that is not on the line just above a fence")
    return out
