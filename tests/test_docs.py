"""The docs site: `mkdocs build --strict` passes offline (mkdocs.yml: no fonts fetched, no network plugin), every
command of the command table and every host command has its generated page, a command added to the table gets one
with no edit of the docs, and the README stays a short front page."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import docsfiles
from common import commands
from common.commands import Command

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))
import hooks  # noqa: E402  (docs/hooks.py: the mkdocs hook, imported by path as mkdocs does)

README_LINES, README_WIDTH = 250, 300


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "WARNING" not in r.stderr, r.stderr[-3000:]
    return out


def test_every_command_has_its_generated_page(site):
    names = commands.names(public=True)
    assert names
    for name in names:
        page = (site / "commands" / name / "index.html").read_text(encoding="utf-8")
        options = page.partition('id="options-help"')[2]
        assert f"trainbox {name}" in options, name  # what its own --help printed, rendered at build time
    for name, _, how in hooks.host_commands():
        page = (site / "commands" / name / "index.html").read_text(encoding="utf-8")
        assert "usage:" in page.partition('id="options-help"')[2], name
    index = (site / "commands" / "index.html").read_text(encoding="utf-8")
    for name in names:
        assert f'href="{name}/"' in index, name
    hidden = commands.names(public=False)
    assert hidden and not any((site / "commands" / n).exists() for n in hidden)  # not listed, no page


def test_the_site_is_offline(site):
    """No page asks the network for fonts or scripts when it is read (theme.font: false, no social plugin)."""
    for page in site.rglob("*.html"):
        text = page.read_text(encoding="utf-8")
        assert "fonts.googleapis" not in text and "fonts.gstatic" not in text, page


def test_the_matrix_page_is_generated_from_matrix_toml(site):
    import tomllib

    page = (site / "matrix" / "index.html").read_text(encoding="utf-8")
    matrix = tomllib.loads((ROOT / "matrix.toml").read_text())
    for rule in matrix["rule"]:
        assert f"<code>{rule['id']}</code>" in page, rule["id"]
    for cuda in matrix["cuda"]:
        assert f"<code>{cuda}</code>" in page
    assert "<!-- generated:" not in page


def test_a_command_added_to_the_table_gets_a_page_and_a_nav_entry(monkeypatch):
    """The property other helpers rely on: one line in common/commands.py (and its module) is all a new command
    needs for the docs. The dummy's --help is faked: its module does not exist."""
    dummy = Command("zz-dummy", "zz_dummy")
    monkeypatch.setattr(commands, "TABLE", (*commands.TABLE, dummy))
    monkeypatch.setattr(commands, "BY_NAME", {**commands.BY_NAME, dummy.name: dummy})
    # every --help faked (the real ones are the site test's): what is checked is where the new command shows up
    monkeypatch.setattr(hooks, "_run", lambda args: f"usage: {' '.join(args)}\n")
    monkeypatch.setattr(hooks, "trainer_help", lambda names: {n: f"usage: trainbox {n}\n" for n in names})
    monkeypatch.setattr(hooks, "_docstring", lambda path: "" if path.name == "zz_dummy.py" else
                        hooks.ast.get_docstring(hooks.ast.parse(path.read_text())) or "")
    pages = hooks.command_pages()
    assert "usage: -m trainbox zz-dummy --help" in pages["commands/zz-dummy.md"]
    assert {"trainbox zz-dummy": "commands/zz-dummy.md"} in hooks.nav_entries()


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines (at most {README_LINES}: move text to docs/)"
    long = [i + 1 for i, line in enumerate(lines) if len(line) > README_WIDTH]
    assert not long, f"README.md lines over {README_WIDTH} characters: {long}"
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", "\n".join(lines))
    assert links and all((ROOT / link).exists() for link in links), [x for x in links if not (ROOT / x).exists()]
    for page in ("journeys/workstation.md", "journeys/one-gpu.md", "journeys/slurm.md", "journeys/gh200.md",
                 "journeys/ci.md", "getting-started.md", "performance.md"):
        assert f"docs/{page}" in links, f"README.md links no docs/{page}"


def test_every_docs_page_is_in_the_nav():
    """mkdocs.yml's nav names each committed page (validation.omitted_files: warn makes a forgotten one fail
    --strict too; this says which)."""
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for page in (ROOT / "docs").rglob("*.md"):
        rel = page.relative_to(ROOT / "docs").as_posix()
        assert rel in nav or rel in str(hooks.nav_entries()), f"docs/{rel} is not in mkdocs.yml's nav"
    assert any(b.path.startswith("docs/") for b in docsfiles.shell_blocks())
