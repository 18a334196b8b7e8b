"""The team's FlashAttention wheels (builder/flashwheels.py, .github/workflows/flash-wheels.yml): which cells need a
source build, one job per distinct wheel, the compile step's script run for real against the engine, and the PEP 503
index it publishes read back by pip, uv and the lock step."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import simpleindex
from builder import flashwheels, lock, workflow
from builder.engine import choose_builder
from builder.errors import UserError
from builder.matrix import load_matrix
from builder.paths import ROOT
from enginefix import BUILD_TIMEOUT

M = load_matrix(ROOT / "matrix.toml")
CELLS = {c.tag: c for c in M.cells}
GH200 = CELLS["cu130-hopper-aarch64"]
WORKFLOW = workflow.WORKFLOWS / "flash-wheels.yml"


def _wf() -> dict:
    wf = yaml.safe_load(WORKFLOW.read_text())
    wf["on"] = wf.pop(True)   # YAML 1.1 reads the key `on` as a boolean
    return wf


def _gh200_lock(tmp_path: Path, *platforms: str) -> Path:
    """A root whose GH200 attention lock the real lock step wrote against an index with FA3 wheels for PLATFORMS."""
    wheels = tmp_path / "fa3"
    for plat in platforms:
        simpleindex.stand_in_wheel(wheels, "flash-attn-3", "3.0.0", f"cp39-abi3-{plat}")
    simpleindex.write_index(wheels, tmp_path / "fa3-index")
    out = tmp_path / "out"
    (out / GH200.lock).parent.mkdir(parents=True)
    shutil.copy(ROOT / GH200.lock, out / GH200.lock)
    with simpleindex.serve(tmp_path / "fa3-index", tmp_path / "server.log") as url:
        lock.ensure([GH200], root=out, overrides={"flash": url}, quiet=True)
    return out


def test_fa2_cells_need_one_wheel_each_and_prebuilt_fa3_none():
    jobs = flashwheels.wheel_jobs()
    assert [j["id"] for j in jobs] == ["flash-attn-2.8.3-cu129-aarch64", "flash-attn-2.8.3-cu129-x86_64",
                                       "flash-attn-2.8.3-cu130-aarch64", "flash-attn-2.8.3-cu130-x86_64"]
    served = sorted(t for j in jobs for t in j["cells"].split())
    assert served == sorted(c.tag for c in M.cells if c.attention_backend == "fa2" and not c.flavour)
    j = next(j for j in jobs if j["id"].endswith("cu130-aarch64"))
    assert j["runner"] == flashwheels.FLASH_RUNNERS["aarch64"] == "ubuntu-24.04-arm"
    assert (j["stage"], j["platform"], j["index_variant"]) == ("attention", "linux/arm64", "cu130")
    # the stage the job builds is the rendered Dockerfile's compile stage, writing the wheel where the job reads it
    text = (ROOT / j["dockerfile"]).read_text()
    assert "AS attention\n" in text and "-w /tmp/trainbox/flash " in text
    # no flavour (its attention layer comes with its base) and no prebuilt fa3 x86_64 cell compiles
    assert not any(flashwheels.needs_source_build(c) for c in M.cells if c.flavour or c.attention_backend == "fa3")


def test_runner_labels_come_from_repository_variables(monkeypatch):
    monkeypatch.setenv("TRAINBOX_FLASH_RUNNER_X86_64", "linux-x64-32core")
    runners = {j["arch"]: j["runner"] for j in flashwheels.wheel_jobs()}
    assert runners == {"x86_64": "linux-x64-32core", "aarch64": "ubuntu-24.04-arm"}


def test_probed_fa3_compiles_only_where_its_lock_says_source(tmp_path):
    assert not any("flash-attn-3" in j["id"] for j in flashwheels.wheel_jobs(root=tmp_path / "no-locks"))  # undecided
    out = _gh200_lock(tmp_path / "none", "manylinux_2_28_x86_64")          # no aarch64 wheel: the lock says source
    assert lock.SOURCE_MARK in (out / GH200.attention_lock).read_text()
    fa3 = [j for j in flashwheels.wheel_jobs(root=out) if j["package"] == "flash-attn-3"]
    assert [(j["id"], j["cells"], j["stage"], j["index_variant"]) for j in fa3] == [
        ("flash-attn-3-3.0.0-cu130-aarch64", GH200.tag, "attention-source", "cu130")]
    assert "AS attention-source\n" in (ROOT / fa3[0]["dockerfile"]).read_text()
    out = _gh200_lock(tmp_path / "some", "manylinux_2_28_aarch64")         # a wheel exists: nothing to compile
    assert not any(j["package"] == "flash-attn-3" for j in flashwheels.wheel_jobs(root=out))


def _matrix(tmp_path: Path, hopper_arch_list: str) -> Path:
    """matrix.toml with hopper on fa2 as well, compiled for HOPPER_ARCH_LIST."""
    text = (ROOT / "matrix.toml").read_text()
    old = 'cuda_arch_list = "9.0a"\nattention = "fa3"'
    assert old in text
    path = tmp_path / "matrix.toml"
    path.write_text(text.replace(old, f'cuda_arch_list = "{hopper_arch_list}"\nattention = "fa2"'))
    return path


def test_one_job_per_distinct_wheel_not_per_cell(tmp_path):
    jobs = flashwheels.wheel_jobs(_matrix(tmp_path, "8.0;8.6"))   # ampere and hopper compile the same fa2 wheel
    assert len(jobs) == 4
    assert {j["id"]: j["cells"] for j in jobs}["flash-attn-2.8.3-cu130-x86_64"] == \
        "cu130-ampere-x86_64 cu130-hopper-x86_64"


def test_two_builds_of_one_wheel_name_are_refused(tmp_path):
    path = _matrix(tmp_path, "9.0a")   # same package, version, variant, arch, python; another arch list
    with pytest.raises(UserError, match="compile different flash-attn 2.8.3 wheels for index cu129 aarch64"):
        flashwheels.wheel_jobs(path)
    r = subprocess.run([sys.executable, "-m", "builder.flashwheels", "jobs", "--matrix", str(path)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_jobs_command_writes_step_outputs():
    r = subprocess.run([sys.executable, "-m", "builder.flashwheels", "jobs"], cwd=ROOT, capture_output=True,
                       text=True, check=True)
    lines = r.stdout.splitlines()
    assert lines[0].startswith('matrix={"include":[{"id":"flash-attn-2.8.3-cu129-aarch64"') and lines[1] == "any=true"


def test_the_published_index_is_read_by_pip_uv_and_the_lock_step(tmp_path):
    """The publish job's layout: wheels as release assets + SHA256SUMS, the index made from SHA256SUMS alone."""
    release = tmp_path / "site" / "releases" / "flash-wheels-cu130"
    fa2 = simpleindex.stand_in_wheel(release, "flash-attn", "2.8.3", "py3-none-any")
    fa3 = simpleindex.stand_in_wheel(release, "flash-attn-3", "3.0.0", "cp39-abi3-manylinux_2_28_aarch64")
    sums = subprocess.run(["sha256sum", fa2.name, fa3.name], cwd=release, capture_output=True, text=True,
                          check=True).stdout
    (release / "SHA256SUMS").write_text(sums)
    with simpleindex.serve(tmp_path / "site", tmp_path / "server.log") as url:
        base = url.removesuffix("simple/")
        index = tmp_path / "site" / "flash" / "cu130"
        r = subprocess.run([sys.executable, "-m", "builder.flashwheels", "index", "--sums", str(release / "SHA256SUMS"),
                            "--base-url", base + "releases/flash-wheels-cu130", "--out", str(index)], cwd=ROOT,
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        assert sorted(p.name for p in index.iterdir()) == ["flash-attn", "flash-attn-3", "index.html"]
        flash = base + "flash/cu130/"
        subprocess.run([str(Path(sys.executable).parent / "uv"), "pip", "install", "--no-deps", "--no-cache",
                        "--target", str(tmp_path / "uv"), "--index-url", flash, "flash-attn==2.8.3"], check=True,
                       capture_output=True)
        assert "2.8.3" in (tmp_path / "uv" / "flash_attn" / "__init__.py").read_text()
        # the lock step through --index flash=<team index>: the GH200 cell's FA3 locked by the published hash
        out = tmp_path / "out"
        (out / GH200.lock).parent.mkdir(parents=True)
        shutil.copy(ROOT / GH200.lock, out / GH200.lock)
        lock.ensure([GH200], root=out, overrides={"flash": base + "flash/{flash_variant}/"}, quiet=True)
        assert f"--hash=sha256:{hashlib.sha256(fa3.read_bytes()).hexdigest()}" in \
            (out / GH200.attention_lock).read_text()
        # the index's hash is what pip checks: a wheel that isn't the one summed is refused
        fa2.write_bytes(fa2.read_bytes() + b"\0")
        r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-cache-dir", "--target",
                            str(tmp_path / "pip"), "--index-url", flash, "flash-attn==2.8.3"], capture_output=True,
                           text=True)
        assert r.returncode != 0 and "THESE PACKAGES DO NOT MATCH THE HASHES" in r.stderr, r.stderr[-2000:]


def test_a_malformed_sums_file_is_one_error_line(tmp_path):
    sums = tmp_path / "SHA256SUMS"
    sums.write_text("not-a-hash  flash_attn-2.8.3-py3-none-any.whl\n")
    r = subprocess.run([sys.executable, "-m", "builder.flashwheels", "index", "--sums", str(sums), "--base-url",
                        "https://example.invalid/r/", "--out", str(tmp_path / "idx")], cwd=ROOT, capture_output=True,
                       text=True)
    assert r.returncode == 2 and "SHA256SUMS:1: not a `sha256sum` line" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "idx").exists()


def test_relock_command_points_the_served_cells_at_the_team_index():
    text = flashwheels.relock_command(flashwheels.wheel_jobs(), "https://team.example/trainbox/")
    assert text.splitlines()[-1] == ("python build.py --lock --index 'flash=https://team.example/trainbox/flash/"
                                     "{flash_variant}/' cu129-ampere-aarch64 cu129-ampere-x86_64 cu130-ampere-aarch64 "
                                     "cu130-ampere-x86_64")
    assert '# cu130-ampere-x86_64: add x86_64 = { cu130 = "cu130" } to the `prebuilt` of its [attention.fa2]' in text


def test_the_workflow_is_generated_checked_and_actionlint_clean(tmp_path):
    assert "flash-wheels.yml" in workflow.GENERATED
    assert WORKFLOW.read_text() == workflow.render(name="flash-wheels.yml")
    r = subprocess.run([sys.executable, "-m", "builder.workflow", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:]
    exe = shutil.which("actionlint") or str(Path(sys.executable).parent / "actionlint")
    r = subprocess.run([exe, "-no-color", str(WORKFLOW)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout
    wf = _wf()
    assert set(wf["on"]) == {"workflow_dispatch", "push"} and "matrix.toml" in wf["on"]["push"]["paths"]
    jobs = wf["jobs"]
    assert jobs["wheel"]["runs-on"] == "${{ matrix.runner }}" and jobs["publish"]["needs"] == ["plan", "wheel"]
    compile_step = next(s for s in jobs["wheel"]["steps"] if s.get("run") == flashwheels.COMPILE)
    assert compile_step["env"]["STAGE"] == "${{ matrix.stage }}"
    runs = "\n".join(s.get("run", "") for s in jobs["publish"]["steps"])
    assert "gh release upload" in runs and "python -m builder.flashwheels index" in runs
    assert "python -m builder.flashwheels relock" in runs
    assert {"actions/upload-pages-artifact@v3", "actions/deploy-pages@v4"} <= {s.get("uses") for s in
                                                                                jobs["publish"]["steps"]}


@pytest.mark.engine
@pytest.mark.timeout(BUILD_TIMEOUT)
def test_the_compile_step_extracts_the_stage_wheel_and_its_sha256(tmp_path, engine):  # noqa: F811
    """The workflow's compile script, run as written against this engine: a stage named like the rendered one puts a
    wheel in /tmp/trainbox/flash; the script keeps only that wheel and its sha256."""
    wheel = simpleindex.stand_in_wheel(tmp_path / "ctx", "flash-attn", "2.8.3", "cp312-cp312-linux_x86_64")
    (tmp_path / "ctx" / "Dockerfile").write_text(f"FROM scratch AS attention\nCOPY {wheel.name} /tmp/trainbox/flash/\n"
                                                 "COPY Dockerfile /tmp/trainbox/other/\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # `docker` as on a runner: a CLI that builds with BuildKit (here Debian's classic one); `python`: this venv's
    (bin_dir / "docker").symlink_to(choose_builder("auto").cli)
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "TAG": "cu130-ampere-x86_64",
           "STAGE": "attention", "ID": "flash-attn-2.8.3-cu130-x86_64", "PLATFORM": "linux/amd64",
           "DOCKERFILE": "Dockerfile", "INDEX_VARIANT": "cu130", "DOCKER_BUILDKIT": "1"}
    r = subprocess.run(["bash", "-e", "-c", flashwheels.COMPILE], cwd=tmp_path / "ctx", env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    dist = tmp_path / "ctx" / "dist" / "cu130"
    assert sorted(p.name for p in dist.iterdir()) == sorted([wheel.name, "flash-attn-2.8.3-cu130-x86_64.sha256"])
    assert (dist / "flash-attn-2.8.3-cu130-x86_64.sha256").read_text() == \
        f"{hashlib.sha256(wheel.read_bytes()).hexdigest()}  {wheel.name}\n"
    # a stage without a wheel fails the step (no empty upload)
    shutil.rmtree(tmp_path / "ctx" / "dist")
    shutil.rmtree(tmp_path / "ctx" / "out")
    (tmp_path / "ctx" / "Dockerfile").write_text("FROM scratch AS attention\nCOPY Dockerfile /tmp/trainbox/flash/\n")
    r = subprocess.run(["bash", "-e", "-c", flashwheels.COMPILE], cwd=tmp_path / "ctx", env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode != 0


def test_a_push_rebuilds_only_when_a_wheel_input_changes(tmp_path):
    """The plan job compares `fingerprint` before and after a push: an attention pin moves it, other edits don't."""
    def fingerprint(text: str) -> str:
        path = tmp_path / "matrix.toml"
        path.write_text(text)
        return subprocess.run([sys.executable, "-m", "builder.flashwheels", "fingerprint", "--matrix", str(path)],
                              cwd=ROOT, capture_output=True, text=True, check=True).stdout
    text = (ROOT / "matrix.toml").read_text()
    fa2 = "060c9188beec3a8b62b33a3bfa6d5d2d44975fab"
    assert fa2 in text
    same = fingerprint(text)
    assert "flash-attn" in same and "8.0;8.6" in same
    assert fingerprint(text + "\n# a comment\n") == same
    assert fingerprint(text.replace(fa2, "0" * 40)) != same
    assert fingerprint(text.replace('FLASH_ATTN_CUDA_ARCHS = "80"', 'FLASH_ATTN_CUDA_ARCHS = "86"')) != same


def test_a_rebuilt_wheel_replaces_its_line_in_the_release_sums(tmp_path):
    old, new = tmp_path / "old.sums", tmp_path / "new.sums"
    old.write_text(f"{'a' * 64}  flash_attn-2.8.3-cp312-cp312-linux_x86_64.whl\n"
                   f"{'b' * 64}  flash_attn-2.8.3-cp312-cp312-linux_aarch64.whl\n")
    new.write_text(f"{'c' * 64} *flash_attn-2.8.3-cp312-cp312-linux_x86_64.whl\n")
    r = subprocess.run([sys.executable, "-m", "builder.flashwheels", "merge-sums", str(new), str(old)], cwd=ROOT,
                       capture_output=True, text=True, check=True)
    assert r.stdout == (f"{'b' * 64}  flash_attn-2.8.3-cp312-cp312-linux_aarch64.whl\n"
                        f"{'c' * 64}  flash_attn-2.8.3-cp312-cp312-linux_x86_64.whl\n")
    r = subprocess.run([sys.executable, "-m", "builder.flashwheels", "merge-sums", str(new), str(tmp_path / "none")],
                       cwd=ROOT, capture_output=True, text=True, check=True)   # a new release has no SHA256SUMS yet
    assert r.stdout == f"{'c' * 64}  flash_attn-2.8.3-cp312-cp312-linux_x86_64.whl\n"
