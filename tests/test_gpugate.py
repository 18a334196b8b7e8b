"""The build workflow's GPU gate (builder/gpugate.py, matrix.toml [ci] gpu_runners): with a runner configured, a
gpu-test job per pushed GPU image of that generation and arch runs `trainbox selftest --json` in it, pulled by digest,
and publish waits for it; without one there is no such job and the publish log names each image published untested.
Rendered from copies of the matrix, checked with actionlint; bad [ci] input is one error naming the key."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from builder import gpugate, workflow
from builder.errors import UserError
from builder.matrix import load_matrix
from test_workflow import _actionlint, _runs

ROOT = Path(__file__).resolve().parents[1]
# blackwell: hopper's cells wait for their FA3 locks (lock.yml), so the plan builds none of them today
RUNNERS = ('gpu_runners = { blackwell = { x86_64 = ["self-hosted", "gpu", "b200"], '
           'aarch64 = ["self-hosted", "gb200"] } }')


def _matrix(tmp_path: Path, ci_line: str) -> Path:
    text = (ROOT / "matrix.toml").read_text()
    assert "\n[ci]\ngpu_runners = {}\n" in text
    path = tmp_path / "matrix.toml"
    (tmp_path / "locks").symlink_to(ROOT / "locks")   # the plan reads the locks next to the matrix (--frozen)
    path.write_text(text.replace("\n[ci]\ngpu_runners = {}\n", f"\n[ci]\n{ci_line}\n"))
    return path


def _load(text: str) -> dict:
    wf = yaml.safe_load(text)
    wf["on"] = wf.pop(True)
    return wf


def test_without_a_runner_nothing_waits_and_publish_names_every_untested_gpu_image():
    wf = _load(workflow.render())
    assert gpugate.JOB not in wf["jobs"] and wf["jobs"]["publish"]["needs"] == ["plan", "build"]
    step = next(s for s in wf["jobs"]["publish"]["steps"] if s.get("if") == "matrix.untested != ''")
    assert "::warning title=published without a GPU test::$tag" in step["run"]
    include = workflow.plan()
    rows = workflow.publish_rows(include)
    cells = {c.tag: c for c in load_matrix().cells}
    named = [t for r in rows for t in r["untested"].split()]
    planned_gpu = sorted(t for i in include for t in i["cells"].split() if cells[t].cuda)
    assert planned_gpu and sorted(named) == planned_gpu   # every pushed GPU image once, no CPU one
    assert all(cells[t].name == r["cell"] for r in rows for t in r["untested"].split())
    assert gpugate.rows(include) == []


def test_a_configured_runner_tests_each_image_of_its_generation_before_publishing(tmp_path):
    path = _matrix(tmp_path, RUNNERS)
    text = workflow.render(path)
    wf = _load(text)
    job = wf["jobs"][gpugate.JOB]
    assert job["needs"] == ["plan", "build"] and job["runs-on"] == "${{ matrix.runner }}"
    assert job["strategy"]["matrix"] == "${{ fromJSON(needs.plan.outputs.gputest) }}"
    run = _runs(job)
    assert ".pushed_ref" in run and 'docker pull "$ref"' in run           # by the digest the build pushed
    assert 'docker run --rm --gpus all "$REF" selftest --json' in run and 'exit "$status"' in run
    publish = wf["jobs"]["publish"]
    assert publish["needs"] == ["plan", "build", gpugate.JOB]
    assert publish["if"].startswith("github.event_name != 'pull_request'")
    assert "needs.gpu-test.result == 'success'" in publish["if"] and "!cancelled()" in publish["if"]
    include = workflow.plan(matrix_path=path)
    rows = gpugate.rows(include, path)
    cells = {c.tag: c for c in load_matrix(path).cells}
    planned = [t for i in include for t in i["cells"].split()]
    assert rows and sorted(r["tag"] for r in rows) == sorted(t for t in planned if cells[t].gpu == "blackwell")
    for r in rows:
        assert r["runner"] == (["self-hosted", "gpu", "b200"] if cells[r["tag"]].arch == "x86_64"
                               else ["self-hosted", "gb200"])
        assert r["tag"] in next(i["cells"].split() for i in include if i["venv"] == r["venv"])
    untested = [t for r in workflow.publish_rows(include, path) for t in r["untested"].split()]
    assert untested and not any(cells[t].gpu == "blackwell" for t in untested)
    out = tmp_path / ".github" / "workflows" / "build.yml"
    out.parent.mkdir(parents=True)
    out.write_text(text)
    r = subprocess.run([_actionlint(), "-no-color", str(out)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


def test_plan_prints_the_gpu_test_matrix(tmp_path):
    path = _matrix(tmp_path, 'gpu_runners = { ampere = ["self-hosted", "a100"] }')   # an array: x86_64 images
    r = subprocess.run([sys.executable, "-m", "builder.workflow", "plan", "--matrix", str(path)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = dict(line.split("=", 1) for line in r.stdout.splitlines())
    got = json.loads(out["gputest"])["include"]
    assert out["gputest_any"] == "true" and got
    assert all("-ampere-x86_64" in g["tag"] and g["runner"] == ["self-hosted", "a100"] for g in got)


@pytest.mark.parametrize("ci_line, says", [
    ('gpu_runners = { volta = ["self-hosted"] }', "ci.gpu_runners.volta: unknown GPU generation"),
    ('gpu_runners = { hopper = ["${{ secrets.REGISTRY_PASSWORD }}"] }', "is not letters, digits"),
    ('gpu_runners = { hopper = { riscv64 = ["self-hosted"] } }', "unknown arch 'riscv64'"),
    ('gpu_runners = { hopper = [] }', "must not be empty"),
    ('gpu_runners = { hopper = "self-hosted" }', "must be an array of runner labels or a table"),
    ('gpu_runner = { hopper = ["self-hosted"] }', "unknown key 'gpu_runner'"),
])
def test_bad_ci_input_is_one_error_naming_the_key(tmp_path, ci_line, says):
    with pytest.raises(UserError) as e:
        load_matrix(_matrix(tmp_path, ci_line))
    assert says in str(e.value) and "\n" not in str(e.value)
