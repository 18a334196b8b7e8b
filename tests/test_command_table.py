"""The command table (common/commands.py) is the one list of in-image commands (issue 30 item 3).

A dummy trainer registered by adding one module and one table entry, in a copy of the packages, is listed by
`trainbox --help`, runs through the one trainer skeleton (runner.run_trainer: a log kept, bad input one line and
exit 2), may run from a notebook and gets a Slurm job script: no other list needed an edit. A second list of command
names anywhere in the product fails here.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common import commands
from trainbox import dispatch
from trainbox.run import notebook

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("trainbox", "common", "builder", "devenv")
TABLE_FILE = ROOT / "common" / "commands.py"

DUMMY = '''"""Dummy trainer: one module and one table entry (tests/test_command_table.py)."""

import sys

from common import launch
from common.errors import UsageError
from trainbox.training import config, runner


class Options:
    output_dir = None


def parse(argv):
    options, rest = Options(), list(argv)
    if "--output_dir" in rest:  # notebook.run passes its folder
        i = rest.index("--output_dir")
        options.output_dir = rest[i + 1]
        config.set_explicit(options, {"output_dir"})
        del rest[i:i + 2]
    if rest != ["--ok"]:
        raise UsageError(f"dummy takes --ok only, not {' '.join(rest)!r}; pass --ok")
    return launch.LaunchArguments(), options


def train(options):
    print("[trainbox] dummy trained", flush=True)
    return 0


def main(argv):
    return runner.run_trainer("dummy", argv, parse, lambda options, plan: None, train)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
'''


def add_dummy(tmp_path: Path) -> Path:
    """A copy of the packages with the dummy trainer's module and its one table entry; returns the copy's parent."""
    home = tmp_path / "pkg"
    for package in ("trainbox", "common"):
        shutil.copytree(ROOT / package, home / package, ignore=shutil.ignore_patterns("__pycache__"))
    (home / "trainbox" / "cli" / "dummy.py").write_text(DUMMY)
    # The skeleton's signal set-up shields transformers' DataLoader workers if transformers is there; the dummy has
    # none to shield, and the import costs 6 s a run on a busy host: an unimportable stub stands in for it.
    (home / "transformers").mkdir()
    (home / "transformers" / "__init__.py").write_text("raise ImportError('not for the dummy trainer')\n")
    table = home / "common" / "commands.py"
    text = table.read_text()
    assert text.count("TABLE = (\n") == 1
    table.write_text(text.replace("TABLE = (\n", 'TABLE = (\n    Command("dummy", "dummy", trainer=True, slurm=True),\n'))
    return home


def run(home: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """python ARGS in HOME (`-m` puts the working folder first on sys.path: the copy, not the checkout)."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    clean["PYTHONPATH"] = os.pathsep.join([str(home), str(ROOT)])  # the copies first, then the checkout's builder
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=home,
                          env={**clean, **(env or {})})


def test_a_dummy_trainer_is_one_module_and_one_table_entry(tmp_path):
    home = add_dummy(tmp_path)
    out = tmp_path / "out"
    listed = run(home, "-m", "trainbox", "--help")
    assert listed.returncode == 0, listed.stderr
    assert "  dummy      Dummy trainer: one module and one table entry" in listed.stdout

    bad = run(home, "-m", "trainbox", "dummy", "--nope", env={"OUTPUT_DIR": str(out)})
    assert bad.returncode == 2
    assert bad.stderr.splitlines() == ["error: dummy takes --ok only, not '--nope'; pass --ok"], bad.stderr

    ok = run(home, "-m", "trainbox", "dummy", "--ok", env={"OUTPUT_DIR": str(out)})
    assert ok.returncode == 0, ok.stderr
    assert "[trainbox] dummy trained" in ok.stdout
    assert "dummy trained" in (out / "logs" / "dummy.log").read_text()  # the skeleton kept the run's log

    in_kernel = run(home, "-c", "from trainbox.run import notebook; "
                    f"print(notebook.run('dummy', ['--ok'], output_dir={str(tmp_path / 'nb')!r}))")
    assert in_kernel.returncode == 0 and in_kernel.stdout.strip().endswith("0"), in_kernel.stderr

    job = run(home, "-m", "builder.slurm", "--tag", "t", "--entrypoint", "dummy", "--config", "/data/d.yaml",
              "--sqsh", "/images/t.sqsh")
    assert job.returncode == 0, job.stderr
    assert "ARGS=(dummy --config /data/d.yaml)" in job.stdout
    no_config = run(home, "-m", "builder.slurm", "--tag", "t", "--entrypoint", "dummy", "--sqsh", "/images/t.sqsh")
    assert no_config.returncode == 2 and "no --config given: pass the dummy YAML path" in no_config.stderr


def test_the_checkout_refuses_the_dummy_it_does_not_list(tmp_path):
    """The same calls on the package as it is: the table entry is what made them pass."""
    home = tmp_path / "pkg"
    shutil.copytree(ROOT / "trainbox", home / "trainbox", ignore=shutil.ignore_patterns("__pycache__"))
    (home / "trainbox" / "cli" / "dummy.py").write_text(DUMMY)  # the module alone is not enough
    assert "dummy" not in run(home, "-m", "trainbox", "--help").stdout
    assert run(home, "-m", "trainbox", "dummy", "--ok").returncode == 2
    job = run(home, "-m", "builder.slurm", "--tag", "t", "--entrypoint", "dummy", "--config", "/d.yaml",
              "--sqsh", "/images/t.sqsh")
    assert job.returncode == 2 and "invalid choice: 'dummy'" in job.stderr


def test_the_table_gives_the_lists_it_replaced():
    """Behaviour unchanged: the names each reader had before the table."""
    from builder import slurm

    assert commands.names(public=True) == ("jupyter", "grpo", "qlora", "sft", "plan", "doctor", "selftest", "nccl-check",
                                             "ray")
    assert commands.names(public=False) == ("healthcheck",)
    assert set(commands.names(trainer=True)) == {"sft", "qlora", "grpo"}
    assert set(slurm.ENTRYPOINTS) == {"sft", "grpo", "nccl-check", "ray", "verl-ppo", "verl-sft"}
    assert set(slurm.NO_CONFIG) == {"nccl-check", "ray", "verl-ppo", "verl-sft"}
    assert commands.module("ray") == "ray_cluster" and commands.module("nccl-check") == "nccl_check"
    for c in commands.TABLE:
        assert (ROOT / "trainbox" / "cli" / f"{c.module}.py").is_file(), c
        assert (ROOT / commands.path(c.name)).is_file() and commands.qualified(c.name) == f"trainbox.cli.{c.module}"
    with pytest.raises(ValueError, match=r"^unknown entrypoint 'doctor'; one of grpo, qlora, sft$"):
        notebook.run("doctor", [], output_dir="/nonexistent")


def test_the_table_is_pure_data():
    """builder/ imports it on the host: no import of the package or a library, torch and TRL least of all."""
    tree = ast.parse(TABLE_FILE.read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported <= {"__future__", "typing"}, imported
    probe = subprocess.run([sys.executable, "-c", "import sys, common.commands; "
                            "print(sorted(m for m in ('torch', 'trl', 'transformers') if m in sys.modules))"],
                           capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert probe.stdout.strip() == "[]", probe.stderr


def name_lists(source: str, names=frozenset(commands.BY_NAME)) -> list[tuple[int, list[str]]]:
    """(line, names) of every tuple/list/set literal or dict's keys in SOURCE that holds two or more command names."""
    found = []
    for node in ast.walk(ast.parse(source)):
        items = node.keys if isinstance(node, ast.Dict) else node.elts if isinstance(
            node, (ast.Tuple, ast.List, ast.Set)) else []
        hit = sorted({i.value for i in items if isinstance(i, ast.Constant) and i.value in names})
        if len(hit) >= 2:
            found.append((node.lineno, hit))
    return found


def test_no_second_list_of_command_names():
    bad = {}
    for path in [ROOT / "build.py", *(p for d in PRODUCT for p in sorted((ROOT / d).rglob("*.py")))]:
        if path != TABLE_FILE:
            found = name_lists(path.read_text())
            if found:
                bad[str(path.relative_to(ROOT))] = found
    assert not bad, f"command names listed outside common/commands.py (read the table instead): {bad}"


def test_the_list_check_catches_a_planted_list():
    assert name_lists('NAMES = ("grpo", "qlora", "sft")\n') == [(1, ["grpo", "qlora", "sft"])]
    assert name_lists('if name in ["sft", "ray"]:\n    pass\n') == [(1, ["ray", "sft"])]
    assert name_lists('MODULES = {"ray": "ray_cluster", "nccl-check": "nccl_check"}\n') == [(1, ["nccl-check", "ray"])]
    assert name_lists('LOSS = ("grpo", "dr_grpo")\nX = commands.names(trainer=True)\n') == []
