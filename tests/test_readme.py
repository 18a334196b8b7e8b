"""The docs' commands work as written (the way docker-stacks tests its docs): README.md and every page in docs/.

Every shell block is run here for real, as written, in a copy of the repository (so nothing in the checkout is
rewritten), unless the line above it carries a marker (tests/docsfiles.py): `covered-by` names the tests that run its
commands for real (engine, Slurm, several minutes), `plan-only` runs each command with --dry-run (a GPU image's plan),
`not-run` says what it needs that this machine lacks (a GPU, a cluster). A block that breaks the convention fails
this file, so a new or edited command comes with its check. Every `make TARGET` the docs name must be a target of the
Makefile, and .ci/run must call the README's test command.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import docsfiles
from enginefix import docker, image_id

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
RUN_HERE = [b for b in docsfiles.shell_blocks() if b.marker is None]
PLAN_HERE = [b for b in docsfiles.shell_blocks() if b.marker == "plan-only"]


def _norm(cmd: str) -> str:
    return " ".join(cmd.split())


def test_every_shell_block_is_run_or_marked():
    bad = [p for f in docsfiles.files()
           for p in docsfiles.problems(f.read_text(encoding="utf-8"), f.relative_to(ROOT).as_posix())]
    assert not bad, "\n".join(bad)
    assert RUN_HERE and PLAN_HERE  # the convention is in use: some blocks run, some plan


def test_the_convention_check_catches_each_kind_of_break(tmp_path):
    """problems() on planted pages: each break is named (so the test above can fail)."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test_real():\n    pass\n")
    cases = {
        "```\nmake build\n```\n": "no language",
        "<!-- not-run: because -->\n```bash\nnvidia-smi\n```\n": "must say what it needs",
        "<!-- skip: needs a GPU -->\n```bash\nnvidia-smi\n```\n": "unknown marker",
        "<!-- covered-by: tests/test_x.py::test_gone -->\n```bash\nls\n```\n": "no such test",
        "<!-- covered-by: tests/nope.py -->\n```bash\nls\n```\n": "no such test file",
        "<!-- not-run: needs a GPU host -->\n\nprose\n\n```bash\nls\n```\n": "not on the line just above",
        "<!-- not-run: needs a GPU host -->\n```yaml\na: 1\n```\n": "marker on a yaml block",
    }
    for page, want in cases.items():
        got = docsfiles.problems(page, root=tmp_path)
        assert any(want in g for g in got), (page, got)
    fine = ("<!-- covered-by: tests/test_x.py::test_real -->\n```bash\nls\n```\n"
            "<!-- plan-only: needs the CUDA bases -->\n```sh\npython build.py x\n```\n```text\nout\n```\n")
    assert docsfiles.problems(fine, root=tmp_path) == []


@pytest.fixture(scope="module")
def repo_copy(tmp_path_factory) -> Iterator[Path]:
    """The checkout's files (tracked and untracked-but-not-ignored), without .git, .venv or caches; removed after the
    module (its commands leave images and .sqsh files in it: 0.8 GB)."""
    dest = tmp_path_factory.mktemp("readme") / "repo"
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    yield dest
    shutil.rmtree(dest.parent, ignore_errors=True)


def run(cmd: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    # `python` is the venv's, as the README says (`.venv/bin/python`, or the venv activated)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    return subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("block", RUN_HERE, ids=lambda b: b.where)
def test_shell_block_runs_as_written(block, repo_copy):
    before = {p: p.read_bytes() for p in (ROOT / "images").rglob("Dockerfile")}
    there = set(os.listdir(repo_copy))
    r = run("set -euo pipefail\n" + block.body, repo_copy)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stdout.strip() or set(os.listdir(repo_copy)) - there  # it said something, or wrote what it was asked
    assert {p: p.read_bytes() for p in (ROOT / "images").rglob("Dockerfile")} == before  # the checkout is untouched


@pytest.mark.parametrize("block", PLAN_HERE, ids=lambda b: b.where)
def test_gpu_build_block_plans_here(block, repo_copy):
    for cmd in block.commands():
        assert cmd.startswith("python build.py "), f"{block.where}: plan-only is for build.py commands: {cmd}"
        r = run(cmd + " --dry-run", repo_copy)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        assert "base: nvidia/cuda:" in r.stdout


def test_slurm_command_writes_its_script(repo_copy):
    cmd = next(c for c in docsfiles.commands() if c.startswith("python -m builder.slurm") and "--entrypoint sft" in c)
    r = run(cmd.split(" && sbatch")[0], repo_copy)
    assert r.returncode == 0, r.stderr
    script = (repo_copy / "sft.sh").read_text()
    assert "#SBATCH --nodes=2" in script and "/shared/cu129-hopper-x86_64.sqsh" in script


def test_make_targets_the_docs_name_exist():
    docs = docsfiles.text()
    targets = set(re.findall(r"`make ([a-z][a-z-]*)`", docs)) | set(re.findall(r"^make ([a-z-]+)", docs, re.M))
    assert {"build", "test", "bases", "engine"} <= targets
    for t in sorted(targets):
        r = subprocess.run(["make", "-n", t], cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0, f"make {t}: {r.stderr.strip()}"


def test_the_command_lists_name_every_public_command():
    """README's and the site's front page's `trainbox doctor | ...` lines name each command the dispatcher lists
    (common.commands), so a new trainer shows up there or fails here."""
    from common import commands

    for page in (README, (ROOT / "docs" / "index.md").read_text()):
        lists = [set(m.split(" | ")) for m in re.findall(r"trainbox ([a-z-]+(?: \| [a-z-]+)+)", " ".join(page.split()))]
        assert lists, "no `trainbox doctor | ...` command list"
        for listed in lists:
            assert listed == set(commands.names(public=True)), sorted(listed ^ set(commands.names(public=True)))


def test_ci_runs_the_readme_test_command():
    setup = re.search(r"## Set up\n.*?```bash\n(.*?)```", README, re.S).group(1)
    test_cmd = next(_norm(re.sub(r"#.*", "", line)) for line in setup.splitlines() if "test" in line.split("#")[0])
    ci = [_norm(re.sub(r"#.*", "", line)) for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = [c for c in ci if c and not c.startswith(("set ", "cd ", "export "))]
    assert commands == [test_cmd], f".ci/run runs {commands}; the README's test command is {test_cmd!r}"


@pytest.mark.engine
@pytest.mark.timeout(5400)
def test_sqsh_command_exports_the_smoke_image(repo_copy, smoke_build):
    """The docs' --sqsh command, run as written with this machine's bases and wheelhouse (made by `make build`'s
    steps: devenv.bases, devenv.buildinputs); the build is a cache hit after the session's smoke build (smoke_build:
    done before this test reads the tag below, and never while it runs), up to its labels. The copy has no .git
    (revision "unknown"), so its image is another one: the copy's matrix names a repository of this test's own,
    and the session's trainbox:smoke-x86_64 (enginefix's smoke_build, exported and read by other tests) still names
    the image it named before."""
    from devenv import bases, buildinputs, engine

    engine.up()
    ref = bases.publish()
    (repo_copy / ".cache").mkdir(exist_ok=True)
    (repo_copy / ".cache" / "bases.toml").write_text(f'[bases]\n"debian:bookworm" = "{ref}"\n')
    buildinputs.install_certs(repo_copy / "images" / "certs")
    assert buildinputs.main(["--wheelhouse", str(repo_copy / ".cache" / "wheels")]) == 0
    cmd = next(c for c in docsfiles.commands() if "--sqsh out/" in c)
    matrix = repo_copy / "matrix.toml"
    original = matrix.read_text()
    repo = f"trainbox-readme-{uuid.uuid4().hex[:8]}"
    assert original.count('\nrepository = "trainbox"\n') == 1
    shared = image_id("trainbox:smoke-x86_64")
    matrix.write_text(original.replace('\nrepository = "trainbox"\n', f'\nrepository = "{repo}"\n'))
    try:
        r = run(cmd, repo_copy, timeout=5000)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert (repo_copy / "out" / "smoke-x86_64.sqsh").stat().st_size > 10_000_000
        assert image_id(f"{repo}:smoke-x86_64") is not None
        assert image_id("trainbox:smoke-x86_64") == shared
    finally:
        matrix.write_text(original)
        made = docker("image", "ls", "--format", "{{.Repository}}:{{.Tag}}", repo, check=False).stdout.split()
        if made:
            docker("rmi", *made, check=False)   # the tags; the layers stay in the build cache
