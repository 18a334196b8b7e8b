"""A rendered job script on a real Slurm (Debian slurm-wlm + munge, one node, started here by devenv.slurm).

Bare mode (no GPUs, no pyxis): one task per node runs `python -m trainbox sft` from this venv, whose launcher
starts torchrun with 2 CPU processes (gloo) on the tiny Llama; we check the job's state and exit code as Slurm
records them, its log, and the checkpoints it wrote.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from builder.slurm import JobSpec, parse_mount, write
from devenv import slurm as devslurm

pytestmark = pytest.mark.slurm
ROOT = Path(__file__).resolve().parents[1]
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
            "DEADLINE"}


def _job_fields(job_id: str, env: dict) -> dict:
    r = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return dict(kv.split("=", 1) for kv in r.stdout.split() if "=" in kv)


def submit(script: Path, env: dict) -> str:
    r = subprocess.run(["sbatch", "--parsable", str(script)], env=env, capture_output=True, text=True,
                       cwd=script.parent)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def wait_job(job_id: str, env: dict, timeout: float = 900) -> dict:
    """Poll scontrol until the job ends (sbatch --wait polls too slowly for a test); its final fields."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        f = _job_fields(job_id, env)
        if f["JobState"] in TERMINAL:
            return f
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], env=env)
    pytest.fail(f"job {job_id} did not finish in {timeout} s: {f}")


def run_job(script: Path, env: dict, timeout: float = 900) -> dict:
    return wait_job(submit(script, env), env, timeout)


def _sft_setup(tmp: Path, model: Path, model_path: str | None = None) -> Path:
    rows = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                          {"role": "assistant", "content": f"{2 * i}"}]} for i in range(16)]
    (tmp / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tmp / "sft.yaml"
    cfg.write_text(f"""\
model_name_or_path: {model_path or model}
dataset: {tmp / 'data.jsonl'}
output_dir: {tmp / 'out'}
max_steps: 4
save_steps: 2
per_device_train_batch_size: 2
max_length: 64
logging_steps: 1
report_to: none
use_cpu: true
""")
    return cfg


def _bare_job(tmp: Path, cfg: Path) -> Path:
    spec = JobSpec(tag="smoke-cpu", entrypoint="sft", mode="bare", config=str(cfg), nodes=1, gpus_per_node=0,
                   nproc_per_node=2, time="15:00", python=sys.executable, workdir=str(ROOT), log_dir=str(tmp),
                   env=(("HF_HUB_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")))
    return write(spec, tmp / "job.sh")


def test_rendered_sft_job_runs_to_completion(slurm, tiny_model, tmp_path):
    script = _bare_job(tmp_path, _sft_setup(tmp_path, Path(tiny_model)))
    job = run_job(script, slurm)
    log = Path(job["StdOut"]).read_text(errors="replace")
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", log[-3000:]
    assert job["NumNodes"] == "1" and job["JobName"] == "sft-smoke-cpu"
    # The dispatcher's launcher took the script's --nproc-per-node and, one node, torchrun --standalone.
    assert "launch (launcher flags, one node): torchrun nnodes=1 nproc_per_node=2 node_rank=0 rdzv=standalone" in log
    assert "2 processes" in log
    assert "[trainbox] sft done: steps 4/4" in log
    out = tmp_path / "out"
    for step in (2, 4):
        state = json.loads((out / f"checkpoint-{step}" / "trainer_state.json").read_text())
        assert state["global_step"] == step
    assert (out / "model.safetensors").stat().st_size > 0 and (out / "config.json").is_file()


def test_failing_job_is_recorded_as_failed(slurm, tiny_model, tmp_path):
    """A bad config fails the job with the entrypoint's exit code 2 and its one-line error in the log."""
    script = _bare_job(tmp_path, _sft_setup(tmp_path, Path(tiny_model), model_path=str(tmp_path / "no-model")))
    job = run_job(script, slurm)
    log = Path(job["StdOut"]).read_text(errors="replace")
    assert job["JobState"] == "FAILED" and job["ExitCode"] == "2:0", log[-3000:]
    assert "no-model" in log and "error:" in log
    assert not (tmp_path / "out").exists()


def test_cluster_up_is_idempotent(slurm):
    state = devslurm.load_state()
    again = devslurm.up()
    assert again["conf"] == state["conf"] and devslurm.load_state()["slurmctld_pid"] == state["slurmctld_pid"]


# ------------------------------------------------------------------ enroot mode, inside the exported smoke image

# enroot itself is in no package registry: tests/enroot_standin.sh plays it with enroot's defaults (read-only root, no
# home mount, the caller as uid 0 of a user namespace, the environment cleared to the image's). The .sqsh, its /etc/rc
# and everything inside the image are the real thing.
ENROOT_STANDIN = ROOT / "tests" / "enroot_standin.sh"


def enroot_path(tmp: Path) -> str:
    """A PATH whose `enroot` is the stand-in (or the real one named by TRAINBOX_REAL_ENROOT)."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    real = os.environ.get("TRAINBOX_REAL_ENROOT")
    (bin_dir / "enroot").symlink_to(real or ENROOT_STANDIN)
    return f"{bin_dir}:{os.environ['PATH']}"


@pytest.mark.engine
@pytest.mark.timeout(3600)  # may build the smoke image and export it (once per session, shared with test_enroot)
def test_enroot_mode_job_runs_sft_inside_the_sqsh(slurm, smoke_sqsh, tiny_model, tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    import shutil

    shutil.copytree(tiny_model, job / "model")
    _sft_setup(job, job / "model")
    # The config as the container sees it: the job dir is mounted at /job.
    cfg = (job / "sft.yaml").read_text().replace(str(job), "/job")
    (job / "sft.yaml").write_text(cfg)
    spec = JobSpec(tag="smoke-x86_64", entrypoint="sft", mode="enroot", config="/job/sft.yaml", sqsh=str(smoke_sqsh),
                   nodes=1, gpus_per_node=0, nproc_per_node=2, time="15:00", log_dir=str(tmp_path),
                   mounts=(parse_mount(f"{job}:/job"),), env=(("HF_HUB_OFFLINE", "1"),))
    script = write(spec, tmp_path / "job.sh")
    env = dict(slurm, PATH=enroot_path(tmp_path), ENROOT_DATA_PATH=str(tmp_path / "containers"))
    result = run_job(script, env)
    log = Path(result["StdOut"]).read_text(errors="replace")
    assert result["JobState"] == "COMPLETED" and result["ExitCode"] == "0:0", log[-3000:]
    assert "outputs /job/out" in log and "[trainbox] sft done: steps 4/4" in log
    assert json.loads((job / "out" / "checkpoint-4" / "trainer_state.json").read_text())["global_step"] == 4
    assert list((tmp_path / "containers").iterdir()) == []  # the per-job container was removed
