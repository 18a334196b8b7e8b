"""verl on Slurm (builder/templates/slurm/verl.sh.j2): the rendered verl-ppo and verl-sft jobs, and the verl-ppo job
for real on the two netns Slurm nodes (bare mode): `trainbox ray` forms the cluster across both nodes, the head's
driver gets trainer.nnodes/n_gpus_per_node from the allocation and verl's entry modules import on every node.

verl comes from a venv of its own (uv, cached under ~/.cache/trainbox/verl-venv/) with the verl flavour's pins from
matrix.toml (verl, transformers, hydra-core, and the cells' Ray, the one `trainbox ray` runs), verl's verl-core extra
(its entry modules import uvicorn, fastapi..., which verl's base requirements lack) and torch's CPU build from pip's
configured find-links (devenv.buildinputs' wheelhouse) in place of the image's CUDA torch.
No GPU here: what runs is verl's import tree with CUDA absent and Hydra's composition of verl's own PPO config with
the job's overrides, not a PPO step (verl's rollout needs vLLM/SGLang on GPUs).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import docsfiles
from builder.errors import UserError
from builder.matrix import load_matrix
from builder.slurm import JobSpec, render, write
from devenv.buildinputs import smoke_torch, torch_wheelhouse
from devenv.common import cache_dir

ROOT = Path(__file__).resolve().parents[1]


def verl_requirements() -> list[str]:
    """The x86_64 verl flavour cell's pins that verl's import tree reads, with their extras; CPU torch."""
    cell = next(c for c in load_matrix(ROOT / "matrix.toml").cells if c.flavour == "verl" and c.arch == "x86_64")
    pins = cell.pins
    return [f"verl[verl-core]=={pins['verl']}", f"ray[default]=={pins['ray']}", f"transformers=={pins['transformers']}",
            f"hydra-core=={pins['hydra-core']}", smoke_torch()]


@pytest.fixture(scope="module")
def verl_python():
    """The verl venv's python, made once (uv) and reused while its requirements stay the same."""
    reqs = verl_requirements()
    venv = cache_dir() / "verl-venv" / hashlib.sha256("\n".join(reqs).encode()).hexdigest()[:12]
    done = venv / ".complete"  # written last: a venv cut off mid-install is made again
    if not done.exists():
        shutil.rmtree(venv, ignore_errors=True)
        uv = Path(sys.executable).parent / "uv"
        env = dict(os.environ, UV_HTTP_TIMEOUT="120")
        env.setdefault("SSL_CERT_FILE", "/etc/ssl/certs/ca-certificates.crt")
        t0 = time.monotonic()
        subprocess.run([str(uv), "venv", "-q", "-p", sys.executable, str(venv)], check=True, env=env)
        r = subprocess.run([str(uv), "pip", "install", "-q", "--system-certs", "-p", str(venv / "bin" / "python"),
                            "--find-links", str(torch_wheelhouse()), *reqs], env=env, capture_output=True, text=True)
        if r.returncode != 0:
            shutil.rmtree(venv, ignore_errors=True)
            if not os.environ.get("CI") and re.search(r"(?i)connect|dns|timed out|failed to fetch", r.stderr):
                pytest.skip(f"the package index can't be reached: {r.stderr.strip().splitlines()[-1]}")
            pytest.fail(f"uv pip install {' '.join(reqs)} failed:\n{r.stderr[-3000:]}")
        done.write_text(f"{' '.join(reqs)}\nmade in {time.monotonic() - t0:.0f} s\n")
    return str(venv / "bin" / "python")


def test_verl_ppo_job_runs_verls_driver_on_a_ray_cluster():
    job = render(JobSpec(tag="cu130-hopper-x86_64-verl", entrypoint="verl-ppo", sqsh="/shared/v.sqsh", nodes=2,
                         gpus_per_node=4, ray_args=("--num-cpus", "32"), args=("data.train_files=/data/t.parquet",)))
    assert ('ARGS=(-m trainbox ray --num-cpus 32 -- "$PY" -m verl.trainer.main_ppo\n  '
            '"trainer.nnodes=$SLURM_JOB_NUM_NODES" trainer.n_gpus_per_node=4 data.train_files=/data/t.parquet)') in job
    assert "PY=python3" in job and '--container-image="$TRAINBOX_SQSH"' in job and "#SBATCH --nodes=2" in job
    assert "#SBATCH --signal" not in job  # verl has no SIGUSR1 handler: the signal would kill it
    recipe = render(JobSpec(tag="t", entrypoint="verl-ppo", sqsh="/s/t.sqsh", module="recipe.dapo.main_dapo"))
    assert '"$PY" -m recipe.dapo.main_dapo' in recipe


def test_verl_sft_job_runs_the_torchrun_launcher_without_ray():
    job = render(JobSpec(tag="t", entrypoint="verl-sft", mode="bare", python="/v/bin/python", workdir="/w", nodes=2,
                         gpus_per_node=8, args=("model.path=/m",)))
    assert 'ARGS=(-c "$LAUNCHER" 8 verl.trainer.sft_trainer model.path=/m)' in job
    assert "launch.run_torchrun(plan" in job and "trainbox ray" not in job and "RAY" not in job
    assert "export TRAINBOX_PYTHON=/v/bin/python" in job


@pytest.mark.parametrize("spec, message", [
    (dict(entrypoint="verl-ppo", mode="enroot"), "run through pyxis or bare"),
    (dict(entrypoint="verl-ppo", config="/d/x.yaml"), "Hydra overrides after --"),
    (dict(entrypoint="verl-ppo", nproc_per_node=2), "processes are Ray's"),
    (dict(entrypoint="verl-ppo", ray_args=("--gpu-free-head",)), "no --gpu-free-head"),
    (dict(entrypoint="verl-ppo", args=("trainer.nnodes=4",)), "from Slurm"),
    (dict(entrypoint="verl-sft", ray_args=("--num-cpus", "2")), "without Ray"),
    (dict(entrypoint="verl-sft", module="x; rm -rf /"), "not a Python module name"),
    (dict(entrypoint="sft", config="/c.yaml", module="verl.x"), "for verl jobs"),
])
def test_bad_verl_jobs_are_refused_in_one_line(spec, message):
    with pytest.raises(UserError, match=re.escape(message)):
        render(JobSpec(tag="t", sqsh="/s/t.sqsh", **spec))


def test_the_cli_writes_a_verl_job(tmp_path):
    r = subprocess.run([sys.executable, "-m", "builder.slurm", "--tag", "t", "--entrypoint", "verl-ppo", "--sqsh",
                        "/s/t.sqsh", "--nodes", "2", "--ray-arg=--num-cpus", "--ray-arg=8", "-o", str(tmp_path / "j"),
                        "--", "trainer.total_epochs=1"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "j").read_text()
    assert "ray --num-cpus 8 -- " in text and "trainer.total_epochs=1)" in text
    assert subprocess.run(["bash", "-n", str(tmp_path / "j")]).returncode == 0
    r = subprocess.run([sys.executable, "-m", "builder.slurm", "--tag", "t", "--entrypoint", "verl-sft", "--sqsh",
                        "/s/t.sqsh", "--mode", "enroot"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "pyxis or bare" in r.stderr, r.stderr


def test_the_docs_verl_job_command_writes_its_script(tmp_path):
    cmd = next(c for c in docsfiles.commands() if "--entrypoint verl-ppo" in c and c.startswith("python"))
    assert cmd.endswith(" && sbatch ppo.sh")
    r = subprocess.run(["bash", "-c", cmd.removesuffix(" && sbatch ppo.sh")], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT),
                                                       PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}"))
    assert r.returncode == 0, r.stderr
    job = (tmp_path / "ppo.sh").read_text()
    assert '-m verl.trainer.main_ppo\n  "trainer.nnodes=$SLURM_JOB_NUM_NODES" trainer.n_gpus_per_node=8 ' in job
    assert "data.train_files=/data/gsm8k/train.parquet" in job and "/shared/rl:/data" in job
    assert "#SBATCH --partition=gpu" in job and "ARGS=(-m trainbox ray -- " in job


# The head's driver in place of verl.trainer.main_ppo (--module): it composes verl's own PPO config with the
# overrides the job passed (Hydra refuses a key verl does not have), joins the job's Ray cluster like main_ppo's
# ray.init() and imports verl's entry modules in a Ray task pinned to each node.
PROBE = """\
import json, socket, sys
import ray
from hydra import compose, initialize_config_module
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

try:  # what main_ppo's @hydra.main does first; reported, and the node checks still run
    with initialize_config_module("verl.trainer.config", version_base=None):
        cfg = compose("ppo_trainer", overrides=sys.argv[1:])
    composed = {"nnodes": cfg.trainer.nnodes, "n_gpus_per_node": cfg.trainer.n_gpus_per_node}
except Exception as e:
    composed = {"error": f"{type(e).__name__}: {' '.join(str(e).split())}"}
print("VERLCONFIG " + json.dumps(composed), flush=True)
ray.init()  # RAY_ADDRESS from trainbox ray, as verl's run_ppo calls it
nodes = [n for n in ray.nodes() if n["Alive"]]

@ray.remote(num_cpus=1)
def imports():
    import importlib, verl, torch
    for m in ("verl.trainer.main_ppo", "verl.trainer.sft_trainer"):
        importlib.import_module(m)
    return socket.gethostname(), ray.get_runtime_context().get_node_id(), verl.__version__, torch.cuda.is_available()

refs = [imports.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
        for n in nodes]
print("VERLNODES " + json.dumps(sorted(ray.get(refs, timeout=400))), flush=True)
"""


@pytest.mark.slurm
@pytest.mark.network
@pytest.mark.timeout(900)  # may make the verl venv first
def test_verl_ppo_job_on_two_nodes_imports_verl_on_each(slurm2, verl_python, tmp_path):
    from test_slurm_job import submit, wait_job

    env, partition = slurm2
    (tmp_path / "verl_probe.py").write_text(PROBE)
    spec = JobSpec(tag="smoke-cpu", entrypoint="verl-ppo", mode="bare", nodes=2, gpus_per_node=0, time="7:00",
                   partition=partition, python=verl_python, workdir=str(ROOT), log_dir=str(tmp_path),
                   module="verl_probe", ray_args=("--timeout", "240", "--num-cpus", "1"),
                   env=(("PYTHONPATH", str(tmp_path)), ("PYTHONWARNINGS", "ignore")),
                   args=("trainer.total_epochs=1",))
    job_id = submit(write(spec, tmp_path / "verl.sh"), env)
    job = wait_job(job_id, env, timeout=480)
    log = (tmp_path / f"verl-ppo-smoke-cpu-{job_id}.out").read_text(errors="replace")
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", log[-4000:]
    assert job["NodeList"] == "tbx[1-2]", job
    m = re.search(r"\[trainbox\] ray cluster up: 2/2 nodes in [\d.]+ s \((.*)\); RAY_ADDRESS=", log)
    assert m and "tbx1" in m.group(1) and "tbx2" in m.group(1), log[-4000:]
    nodes = re.search(r"VERLNODES (.*)", log)
    assert nodes, log[-4000:]
    seen = json.loads(nodes.group(1))
    assert [h for h, *_ in seen] == ["tbx1", "tbx2"] and len({i for _, i, *_ in seen}) == 2, seen
    assert all(v == "0.9.1" and cuda is False for *_, v, cuda in seen), seen
    assert "[trainbox] ray command exited 0; stopping the cluster" in log
    # verl's own PPO config with the job's overrides, under the flavour's hydra-core (main_ppo's first step)
    composed = json.loads(re.search(r"VERLCONFIG (.*)", log).group(1))
    assert composed == {"nnodes": 2, "n_gpus_per_node": 0}, (
        f"verl's ppo_trainer config under hydra-core=={verl_requirements()[3].split('==')[1]} (matrix.toml "
        f"[flavour.verl]): {composed}")


# A rank in place of verl.trainer.sft_trainer (--module): it imports verl's SFT entry module as torchrun's rank would,
# then a gloo all-gather across the job's ranks (verl's own process group wants a CUDA device: none here).
SFT_PROBE = """\
import json, os, socket
import torch.distributed as dist
import verl.trainer.sft_trainer  # noqa: F401

dist.init_process_group("gloo")
ranks = [None] * dist.get_world_size()
dist.all_gather_object(ranks, [socket.gethostname(), int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])])
if dist.get_rank() == 0:
    print("VERLSFT " + json.dumps(sorted(ranks)), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slurm
@pytest.mark.network
@pytest.mark.timeout(900)  # may make the verl venv first
def test_verl_sft_job_on_two_nodes_runs_one_torchrun_per_node(slurm2, verl_python, tmp_path):
    from common import launch
    from test_slurm_job import submit, wait_job

    env, partition = slurm2
    (tmp_path / "verl_sft_probe.py").write_text(SFT_PROBE)
    spec = JobSpec(tag="smoke-cpu", entrypoint="verl-sft", mode="bare", nodes=2, gpus_per_node=0, time="7:00",
                   partition=partition, python=verl_python, workdir=str(ROOT), log_dir=str(tmp_path),
                   module="verl_sft_probe", env=(("PYTHONPATH", str(tmp_path)), ("PYTHONWARNINGS", "ignore")))
    job_id = submit(write(spec, tmp_path / "verl.sh"), env)
    job = wait_job(job_id, env, timeout=480)
    log = (tmp_path / f"verl-sft-smoke-cpu-{job_id}.out").read_text(errors="replace")
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", log[-4000:]
    port = launch.slurm_port({"SLURM_JOB_ID": job_id})
    for rank in (0, 1):  # the launcher's line on each node: its rendezvous rule, no port of the script's
        assert re.search(rf"torchrun nnodes=2 nproc_per_node=1 node_rank={rank} rdzv=c10d tbx1:{port} "
                         rf"id={job_id}\b", log), log[-4000:]
    ranks = re.search(r"VERLSFT (.*)", log)
    assert ranks and json.loads(ranks.group(1)) == [["tbx1", 0, 0], ["tbx2", 1, 0]], log[-4000:]
    assert "[trainbox] ray" not in log and "ray start" not in log  # SFT starts no Ray
