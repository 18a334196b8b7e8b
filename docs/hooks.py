"""mkdocs hook: the pages whose content has its home elsewhere, rendered at build time (nothing here is copied).

- One page per command: each in-image command of the command table (common/commands.py: public ones, as
  `trainbox --help` lists them) and each host command (build.py, and every `python -m builder.X` module with a
  `__main__` block). A page holds the module's docstring and what its own parser prints for `--help`. The trainers'
  help comes through trainbox/helpcache.py: rendered once in one process (one TRL import), then read back.
- The generated parts of committed pages: `<!-- generated: NAME -->` is replaced by GENERATED[NAME]: the command
  tables of commands/index.md, the matrix's axes and rules read from matrix.toml, `python build.py --list` and
  `--explain` as they print today.

A command added to the table gets its page and its nav entry with no edit here (tests/test_docs.py checks both).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from common import commands  # noqa: E402  (after the path: mkdocs imports this file by path)

HOST_PACKAGE = "builder"
NAV_TITLE = "Commands"


def _env() -> dict[str, str]:
    # Fixed width: argparse wraps to $COLUMNS, and the page must not depend on the terminal that built it.
    return dict(os.environ, COLUMNS="110", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                TRAINBOX_VERBOSE="0")


def _run(args: list[str]) -> str:
    r = subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {r.returncode}: {r.stderr.strip()[-2000:]}")
    return r.stdout


def _docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""


def host_commands() -> list[tuple[str, Path, list[str]]]:
    """(page name, source file, how to run it) for build.py and every builder module with a __main__ block."""
    out = [("build.py", ROOT / "build.py", ["build.py"])]
    for path in sorted((ROOT / HOST_PACKAGE).glob("*.py")):
        if re.search(r'^if __name__ == "__main__":', path.read_text(encoding="utf-8"), re.M):
            out.append((f"{HOST_PACKAGE}.{path.stem}", path, ["-m", f"{HOST_PACKAGE}.{path.stem}"]))
    return out


def trainer_help(names: tuple[str, ...]) -> dict[str, str]:
    """The trainers' --help, from the help cache; rendered first (one process, one TRL import) where it is stale."""
    from trainbox import helpcache

    if any(helpcache.load(n) is None for n in names):
        _run(["-c", "from trainbox import helpcache; helpcache.render_all()"])
    out = {}
    for n in names:
        text = helpcache.load(n)
        if text is None:
            raise RuntimeError(f"trainbox {n} --help was not stored by helpcache.render_all")
        out[n] = text
    return out


def _page(title: str, how: str, doc: str, help_text: str, source: str) -> str:
    return "\n".join([
        f"# `{title}`", "",
        f"Run as `{how}`. Source: `{source}`. This page is generated from the module's docstring and its parser "
        "(docs/hooks.py): what `--help` prints is below.", "",
        "## What it does", "", "```text", doc.strip() or "(no docstring)", "```", "",
        "## Options (`--help`)", "", "```text", help_text.rstrip(), "```", ""])


def command_pages() -> dict[str, str]:
    """Page path (under docs/) -> Markdown, for every public in-image command and every host command."""
    from concurrent.futures import ThreadPoolExecutor

    names = commands.names(public=True)
    trainers = commands.names(trainer=True)
    # (page, title, how to run, source, argv of its --help); the trainers' help comes from the help cache instead
    specs = [(n, f"trainbox {n}", f"trainbox {n} [OPTIONS]", commands.path(n), ["-m", "trainbox", n, "--help"])
             for n in names]
    specs += [(n, "python build.py" if n == "build.py" else f"python -m {n}", "python " + " ".join(how) + " [OPTIONS]",
               src.relative_to(ROOT).as_posix(), [*how, "--help"]) for n, src, how in host_commands()]
    with ThreadPoolExecutor(max_workers=4) as pool:  # each --help is a Python start-up: side by side
        cached = pool.submit(trainer_help, tuple(n for n in names if n in trainers))
        helps = {s[0]: pool.submit(_run, s[4]) for s in specs if s[0] not in trainers}
        texts = {**{k: f.result() for k, f in helps.items()}, **cached.result()}
    pages = {f"commands/{page}.md": _page(title, how, _docstring(ROOT / src), texts[page], src)
             for page, title, how, src, _ in specs}
    return pages


def index() -> str:
    """The command tables of commands/index.md: each command's first docstring line, linked to its page."""
    from trainbox import dispatch

    names = commands.names(public=True)
    lines = ["Inside every image (`docker run IMAGE NAME ...`, or under pyxis `srun "
             "--container-image=/abs/x.sqsh trainbox NAME ...`):", "", "| command | what it does |", "|---|---|"]
    lines += [f"| [`trainbox {n}`]({n}.md) | {dispatch.summary(n)} |" for n in names]
    lines += ["", "On the host, from the repository root (`python` is `.venv/bin/python`):", "",
              "| command | what it does |", "|---|---|"]
    for name, src, how in host_commands():
        first = (_docstring(src).strip().splitlines() or ["(no docstring)"])[0]
        lines.append(f"| [`python {' '.join(how)}`]({name}.md) | {first} |")
    return "\n".join(lines) + "\n"


def nav_entries() -> list:
    names = commands.names(public=True)
    return (["commands/index.md"] + [{f"trainbox {n}": f"commands/{n}.md"} for n in names]
            + [{("python build.py" if n == "build.py" else f"python -m {n}"): f"commands/{n}.md"}
               for n, _, _ in host_commands()])


# --- the matrix page's generated parts ---

def _matrix() -> dict:
    return tomllib.loads((ROOT / "matrix.toml").read_text(encoding="utf-8"))


def _cell(v) -> str:
    text = ", ".join(map(str, v)) if isinstance(v, list) else str(v)
    return text.replace("|", "\\|")


def _table(rows: dict, keys: list[str], first: str) -> str:
    out = [f"| {first} | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for name, row in rows.items():
        out.append(f"| `{name}` | " + " | ".join(_cell(row.get(k, "")) for k in keys) + " |")
    return "\n".join(out)


def axes() -> str:
    m = _matrix()
    return "\n\n".join([
        "**CPU architectures** (`[arch]`)", _table(m["arch"], ["platform", "uv_platform"], "arch"),
        "**CUDA versions** (`[cuda]`)", _table(m["cuda"], ["base_image", "python", "min_driver"], "CUDA"),
        "**GPU generations** (`[gpu]`)", _table(m["gpu"], ["sm", "cuda_arch_list", "attention", "min_cuda"], "GPU"),
        "**Wheel indexes** (`[index]`; empty = the installer's default)",
        "| name | URL |\n|---|---|\n" + "\n".join(f"| `{k}` | `{v}` |" for k, v in m["index"].items())])


def rules() -> str:
    out = ["| rule | reason (a template: `--explain` fills in the fields) |", "|---|---|"]
    out += [f"| `{r['id']}` | {_cell(r['reason'])} |" for r in _matrix()["rule"]]
    return "\n".join(out)


GENERATED = {
    "commands-index": index,
    "matrix-axes": axes,
    "matrix-rules": rules,
    "build-list": lambda: "```text\n" + _run(["build.py", "--list"]).rstrip() + "\n```",
    "build-explain": lambda: "```text\n" + _run(["build.py", "--explain"]).rstrip() + "\n```",
}
MARK = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.M)


def fill(markdown: str) -> str:
    def one(m: re.Match) -> str:
        if m[1] not in GENERATED:
            raise RuntimeError(f"unknown generated part {m[1]!r} (docs/hooks.py GENERATED has {sorted(GENERATED)})")
        return GENERATED[m[1]]()
    return MARK.sub(one, markdown)


# --- mkdocs events ---

def on_config(config, **kwargs):
    for item in config["nav"] or []:
        if isinstance(item, dict) and NAV_TITLE in item:
            item[NAV_TITLE] = nav_entries()
    return config


def on_files(files, config, **kwargs):
    from mkdocs.structure.files import File

    for path, text in command_pages().items():
        files.append(File.generated(config, path, content=text))
    return files


def on_page_markdown(markdown, page, config, files, **kwargs):
    return fill(markdown)
