"""The README's commands work as written (the way docker-stacks tests its docs).

Every command in a ```bash block of README.md is either run here for real (in a copy of the repository, so nothing
in the checkout is rewritten) or named in COVERED_BY together with the tests that run it for real; a command that is
neither fails this file, so a new or edited README command must come with its check. Every `make TARGET` the README
names must be a target of the Makefile, and .ci/run must call the README's test command.
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

from enginefix import docker, image_id

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

# Cheap commands, run for real in a copy of the repository.
RUN_HERE = {
    "python build.py --list",
    "python build.py --explain",
    "python build.py --arch aarch64 --dry-run",
    "cp matrix.toml /tmp/other.toml && python build.py --matrix /tmp/other.toml --list",
}
# Builds for a GPU machine with the CUDA bases and upstream indexes: their plan (selection, bases, indexes, locks,
# tags) is run for real here with --dry-run; the build itself is what the named tests run on this machine's cells.
PLAN_HERE = {
    "python build.py cu129-hopper": [],
    "python build.py --cuda 13.0 --arch x86_64 --push --registry registry.example/team/trainbox":
        ["tests/test_gpu_image.py::test_pip_check_is_clean_and_the_stack_imports"],
}
# Commands whose real run is a test elsewhere (engine, Slurm, several minutes).
COVERED_BY = {
    "trainbox plan --model_name_or_path ./llama-70b-config --nnodes 2 --nproc-per-node 8 --gpu-memory 77.7":
        ["tests/test_memplan.py::test_plan_for_70b_on_2_nodes_of_8_and_8b_on_one_24gb_card"],
    "trainbox plan --model_name_or_path ./llama-8b-config --gpu-memory 22.5 --per_device_train_batch_size 4":
        ["tests/test_memplan.py::test_plan_for_70b_on_2_nodes_of_8_and_8b_on_one_24gb_card"],
    "make build": ["tests/test_push.py::test_cli_push_prints_digests_that_the_registry_serves",
                   "tests/test_readme.py::test_make_targets_the_readme_names_exist"],
    "make test": ["tests/test_readme.py::test_ci_runs_the_readme_test_command"],
    "python build.py --cell smoke --arch x86_64 --config .cache/bases.toml --wheelhouse .cache/wheels":
        ["tests/test_push.py::test_cli_push_prints_digests_that_the_registry_serves"],
    "python build.py --cell smoke --config .cache/bases.toml --wheelhouse .cache/wheels "
    "--push --registry 127.0.0.1:5555/trainbox":
        ["tests/test_push.py::test_cli_push_prints_digests_that_the_registry_serves",
         "tests/test_push.py::test_manifest_list_joins_both_arches"],
    "python build.py --cell smoke --base debian:bookworm=$(python -m devenv.bases)":
        ["tests/test_push.py::test_cli_push_prints_digests_that_the_registry_serves"],
    "docker build --platform linux/amd64 -f images/<tag>/Dockerfile "
    "--build-arg BASE_IMAGE=<other base> --build-arg VCS_REF=$(git rev-parse HEAD) .":
        # the rendered file with BASE_IMAGE substituted is what every smoke build builds; BuildKit's cache mount only
        ["tests/test_push.py::test_cli_push_prints_digests_that_the_registry_serves",
         "tests/test_render.py::test_buildkit_syntax_is_only_the_venv_installs_cache_mount"],
    "python build.py --cell smoke --arch x86_64 --config .cache/bases.toml --wheelhouse .cache/wheels --sqsh out/":
        ["tests/test_readme.py::test_sqsh_command_exports_the_smoke_image"],
    "python -m builder.enroot trainbox:smoke-x86_64 out/smoke.sqsh --compression zstd --block-size 1M":
        ["tests/test_enroot.py::test_export_replaces_existing_and_cli_works"],
    "python -m builder.slurm --tag cu129-hopper-x86_64 --entrypoint sft --config /data/sft.yaml "
    "--sqsh /shared/cu129-hopper-x86_64.sqsh --nodes 2 --gpus-per-node 8 --partition gpu --time 04:00:00 "
    "--data /lus/data --outputs /lus/out --hf-cache /lus/hf -o sft.sh && sbatch sft.sh":
        ["tests/test_readme.py::test_slurm_command_writes_its_script", "tests/test_slurm_job.py"],
    "python -m builder.slurm --tag cu129-hopper-x86_64 --entrypoint nccl-check --sqsh /shared/cu129-hopper-x86_64.sqsh "
    "--nodes 2 --gpus-per-node 8 --partition gpu --time 00:15:00 -o nccl.sh && sbatch nccl.sh":
        # the rendered job's command line; the entrypoint itself runs through the real launcher with 2 ranks
        ["tests/test_nccl_check.py::test_a_slurm_job_for_nccl_check",
         "tests/test_nccl_check.py::test_two_nodes_by_flags_on_one_host"],
    "python -m builder.slurm --tag cu130-hopper-x86_64 --entrypoint ray --sqsh /shared/cu130-hopper-x86_64.sqsh "
    "--data /shared/rl --nodes 2 --gpus-per-node 8 --partition gpu --time 04:00:00 -o ray.sh "
    "-- python /data/my_driver.py && sbatch ray.sh":
        # the README's command renders its job here; the same job in bare mode forms a 2-node cluster for real
        ["tests/test_ray_cluster.py::test_the_readme_ray_job_command_writes_its_script",
         "tests/test_ray_cluster.py::test_two_node_ray_cluster_runs_a_task_on_each_node"],
    "python -m builder.slurm --tag cu130-hopper-x86_64-verl --entrypoint verl-ppo "
    "--sqsh /shared/cu130-hopper-x86_64-verl.sqsh --data /shared/rl --nodes 2 --gpus-per-node 8 --partition gpu "
    "-o ppo.sh -- data.train_files=/data/gsm8k/train.parquet data.val_files=/data/gsm8k/test.parquet "
    "actor_rollout_ref.model.path=/data/models/Qwen2.5-0.5B-Instruct trainer.save_freq=50 && sbatch ppo.sh":
        # the README's command renders its job there; the same job in bare mode runs on the 2-node Slurm
        ["tests/test_verl_slurm.py::test_the_readme_verl_job_command_writes_its_script",
         "tests/test_verl_slurm.py::test_verl_ppo_job_on_two_nodes_imports_verl_on_each"],
}


def readme_commands() -> list[str]:
    """Each command line of the README's ```bash blocks: continuations joined, trailing comments dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in re.sub(r"\\\n\s*", "", block).splitlines():
            cmd = re.sub(r"\s+#.*$", "", line).strip()
            if cmd and cmd not in out:
                out.append(cmd)
    return out


def _norm(cmd: str) -> str:
    return " ".join(cmd.split())


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


def test_every_readme_command_is_run_or_covered():
    known = {_norm(c) for c in [*RUN_HERE, *PLAN_HERE, *COVERED_BY]}
    missing = [c for c in readme_commands() if _norm(c) not in known]
    assert not missing, f"README commands with no check (add them to RUN_HERE or COVERED_BY): {missing}"
    stale = known - {_norm(c) for c in readme_commands()}
    assert not stale, f"checks for commands the README no longer shows: {sorted(stale)}"


def test_the_covering_tests_exist():
    for cmd, tests in [*COVERED_BY.items(), *PLAN_HERE.items()]:
        for node in tests:
            path, _, name = node.partition("::")
            text = (ROOT / path).read_text()
            assert not name or re.search(rf"^def {re.escape(name)}\(", text, re.M), f"{node} (for {cmd!r}) is gone"


@pytest.mark.parametrize("cmd", sorted(RUN_HERE))
def test_cheap_command_works_as_written(cmd, repo_copy):
    before = {p: p.read_bytes() for p in (ROOT / "images").rglob("Dockerfile")}
    r = run(cmd, repo_copy)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stdout.strip()
    assert {p: p.read_bytes() for p in (ROOT / "images").rglob("Dockerfile")} == before  # the checkout is untouched


@pytest.mark.parametrize("cmd", sorted(PLAN_HERE))
def test_gpu_build_command_plans_here(cmd, repo_copy):
    r = run(cmd + " --dry-run", repo_copy)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "base: nvidia/cuda:" in r.stdout


def test_slurm_command_writes_its_script(repo_copy):
    cmd = next(c for c in readme_commands() if c.startswith("python -m builder.slurm"))
    r = run(cmd.split(" && sbatch")[0], repo_copy)
    assert r.returncode == 0, r.stderr
    script = (repo_copy / "sft.sh").read_text()
    assert "#SBATCH --nodes=2" in script and "/shared/cu129-hopper-x86_64.sqsh" in script


def test_make_targets_the_readme_names_exist():
    targets = set(re.findall(r"`make ([a-z][a-z-]*)`", README)) | set(re.findall(r"^make ([a-z-]+)", README, re.M))
    assert {"build", "test", "bases", "engine"} <= targets
    for t in sorted(targets):
        r = subprocess.run(["make", "-n", t], cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0, f"make {t}: {r.stderr.strip()}"


def test_ci_runs_the_readme_test_command():
    setup = re.search(r"## Set up\n.*?```bash\n(.*?)```", README, re.S).group(1)
    test_cmd = next(_norm(re.sub(r"#.*", "", line)) for line in setup.splitlines() if "test" in line.split("#")[0])
    ci = [_norm(re.sub(r"#.*", "", line)) for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    commands = [c for c in ci if c and not c.startswith(("set ", "cd ", "export "))]
    assert commands == [test_cmd], f".ci/run runs {commands}; the README's test command is {test_cmd!r}"


@pytest.mark.engine
@pytest.mark.timeout(5400)
def test_sqsh_command_exports_the_smoke_image(repo_copy, smoke_build):
    """The README's --sqsh command, run as written with this machine's bases and wheelhouse (made by `make build`'s
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
    cmd = next(c for c in readme_commands() if "--sqsh out/" in c)
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
