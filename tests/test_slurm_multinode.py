"""The rendered sft job script on two Slurm nodes: two slurmd in their own network namespaces on this host
(devenv.slurm --netns-nodes 2), one task per node, torchrun's c10d rendezvous and gloo between the
namespaces' addresses (nothing but those and loopback). Bare mode: the launcher from this venv; enroot mode: inside
the smoke .sqsh through the enroot stand-in. A `scancel --signal=USR1` checkpoints the running job and a second
submission of the same script resumes from that checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from builder.slurm import JobSpec, parse_mount, write
from common import launch
from devenv import slurm as devslurm
from test_slurm_job import _sft_setup, enroot_path, submit, wait_job

pytestmark = pytest.mark.slurm
ROOT = Path(__file__).resolve().parents[1]
NODES = [devslurm.netns_node(i) for i in (1, 2)]


def _config(tmp: Path, model: Path, max_steps: int, save_steps: int) -> Path:
    cfg = _sft_setup(tmp, model)
    text = re.sub(r"max_steps: \d+", f"max_steps: {max_steps}", cfg.read_text())
    cfg.write_text(re.sub(r"save_steps: \d+", f"save_steps: {save_steps}", text))
    return cfg


def _story(log: str) -> str:
    """A failed job's log, for the assertion: the launchers' lines, torchrun's agents (LOGLEVEL=INFO: rendezvous,
    each node's workers finished, the exit barrier, with times) and errors, in order; then the tail."""
    said = [line for line in log.splitlines()
            if line.startswith("[trainbox]") or "distributed/elastic" in line or "Error" in line or "error:" in line]
    return "\n".join(said[-80:]) + "\n--- the log's end ---\n" + log[-2500:]


def _assert_two_nodes(log: str, job_id: str, nnodes_line: str = "torchrun nnodes=2 nproc_per_node=1") -> None:
    # One task per node, each in its own namespace: its launcher line and the node's own address.
    ports = set()
    for rank, node in enumerate(NODES):
        m = re.search(rf"{nnodes_line} node_rank={rank} rdzv=c10d tbx1:(\d+) id={job_id}\b", log)
        assert m, _story(log)
        ports.add(int(m.group(1)))
        assert f"[trainbox] node {rank} on {node['name']}" in log, _story(log)
    assert "2 processes" in log, _story(log)
    if "has not exited; what holds it follows" in log:
        # The exit deadline saved the job (trainbox/run/exitdeadline.py); what held the rank is worth a look.
        warnings.warn("a rank was held at exit:\n" + log[log.index("has not exited; what holds it"):][:6000])
    # The launcher's port rule, none of the script's: below the kernel's ephemeral range, where no outgoing
    # connection on node 0 can hold it. devenv's FirstJobId puts the ids where 20000 + id % 20000 is ephemeral.
    eph = launch.ephemeral_range()[0]
    assert 20000 + int(job_id) % 20000 >= eph, f"job {job_id}: the cluster predates FirstJobId; restart it"
    assert ports == {launch.slurm_port({"SLURM_JOB_ID": job_id})} and max(ports) < eph, (ports, eph)


@pytest.mark.timeout(120)
def test_job_steps_run_at_the_test_nodes_priority(slurm2):
    """The suite shares this host with the nodes' jobs; their steps inherit the favoured slurmd's nice value (a
    starved raylet missed Ray's fixed registration wait in CI). Both partitions: each task reports its own."""
    env, partition = slurm2
    want = devslurm.NODE_NICE if os.geteuid() == 0 else os.nice(0)
    for args, hosts in ((["-p", partition, "-N", "2"], {n["name"] for n in NODES}), (["-N", "1"], None)):
        r = subprocess.run(["srun", *args, "sh", "-c", 'echo "$(hostname) $(nice)"'], env=env, capture_output=True,
                           text=True, timeout=90)
        assert r.returncode == 0, r.stderr
        seen = dict(line.split() for line in r.stdout.splitlines())
        assert set(seen.values()) == {str(want)}, (args, seen)
        assert hosts is None or set(seen) == hosts, seen


def test_two_node_bare_job_preempts_and_resumes(slurm2, tiny_model, tmp_path):
    env, partition = slurm2
    cfg = _config(tmp_path, Path(tiny_model), max_steps=60, save_steps=1000)
    spec = JobSpec(tag="smoke-cpu", entrypoint="sft", mode="bare", config=str(cfg), nodes=2, gpus_per_node=0,
                   nproc_per_node=1, time="15:00", partition=partition, python=sys.executable, workdir=str(ROOT),
                   log_dir=str(tmp_path),
                   env=(("HF_HUB_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"), ("LOGLEVEL", "INFO")))
    script = write(spec, tmp_path / "job.sh")

    job_id = submit(script, env)
    log_path = tmp_path / f"sft-smoke-cpu-{job_id}.out"
    end = time.monotonic() + 600
    while "'loss'" not in (log_path.read_text(errors="replace") if log_path.exists() else ""):
        assert time.monotonic() < end, "training never logged a step"
        time.sleep(0.5)
    r = subprocess.run(["scancel", "--signal=USR1", job_id], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    job = wait_job(job_id, env)
    log = log_path.read_text(errors="replace")
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", _story(log)
    assert job["NumNodes"] == "2" and job["NodeList"] == "tbx[1-2]"
    _assert_two_nodes(log, job_id)
    m = re.search(r"\[trainbox\] sft preempted \(checkpoint saved\): steps (\d+)/60", log)
    assert m, _story(log)
    step = int(m.group(1))
    assert 0 < step < 60 and (tmp_path / "out" / f"checkpoint-{step}" / "trainer_state.json").is_file()

    # Same script again: resume=auto picks the checkpoint up, on both nodes.
    job2_id = submit(script, env)
    job2 = wait_job(job2_id, env)
    log2 = (tmp_path / f"sft-smoke-cpu-{job2_id}.out").read_text(errors="replace")
    assert job2["JobState"] == "COMPLETED" and job2["ExitCode"] == "0:0", _story(log2)
    _assert_two_nodes(log2, job2_id)
    assert f"[trainbox] sft done: steps 60/60 (this run {60 - step})" in log2, _story(log2)
    assert (tmp_path / "out" / "model.safetensors").stat().st_size > 0


@pytest.mark.engine
@pytest.mark.timeout(3600)  # may build and export the smoke image (once per session)
def test_two_node_enroot_job_runs_sft_inside_the_sqsh(slurm2, smoke_sqsh, tiny_model, tmp_path):
    env, partition = slurm2
    job = tmp_path / "job"
    job.mkdir()
    shutil.copytree(tiny_model, job / "model")
    cfg = _config(job, job / "model", max_steps=4, save_steps=2)
    cfg.write_text(cfg.read_text().replace(str(job), "/job"))  # as the container sees it
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    spec = JobSpec(tag="smoke-x86_64", entrypoint="sft", mode="enroot", config="/job/sft.yaml", sqsh=str(smoke_sqsh),
                   nodes=2, gpus_per_node=0, nproc_per_node=1, time="15:00", partition=partition,
                   log_dir=str(tmp_path), mounts=(parse_mount(f"{job}:/job"),), hf_cache=str(cache),
                   env=(("HF_HUB_OFFLINE", "1"), ("LOGLEVEL", "INFO")))
    script = write(spec, tmp_path / "job.sh")
    env = dict(env, PATH=enroot_path(tmp_path), ENROOT_DATA_PATH=str(tmp_path / "containers"))
    job_id = submit(script, env)
    result = wait_job(job_id, env, timeout=1500)
    log = Path(result["StdOut"]).read_text(errors="replace")
    assert result["JobState"] == "COMPLETED" and result["ExitCode"] == "0:0", _story(log)
    _assert_two_nodes(log, job_id)
    assert "[trainbox] sft done: steps 4/4" in log and "outputs /job/out" in log
    # $HOME is read-only in the container: the other caches moved, HF_HOME stayed the job script's shared mount.
    moved = [re.search(r"\(([A-Z_, ]+)\)", ln).group(1).split(", ") for ln in log.splitlines()
             if "is not writable" in ln]
    assert len(moved) == 2 and all("HF_HOME" not in names and "TRITON_CACHE_DIR" in names for names in moved), moved
    assert (cache / "datasets").is_dir()  # the datasets cache landed in the shared mount
    assert json.loads((job / "out" / "checkpoint-4" / "trainer_state.json").read_text())["global_step"] == 4
    assert list((tmp_path / "containers").iterdir()) == []
