"""builder.slurm: rendered job scripts (content, shell syntax, bad input). The real-Slurm run is test_slurm_job.py."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from builder.slurm import JobSpec, UserError, parse_mount, render, sqsh_name, write
from common import launch

ROOT = Path(__file__).resolve().parents[1]
PYXIS = JobSpec(tag="smoke-x86_64", entrypoint="sft", mode="pyxis", config="/data/sft.yaml",
                sqsh="/shared/img/smoke-x86_64.sqsh", nodes=2, gpus_per_node=4, partition="gpu",
                time="1-00:00:00", data="/lus/data", outputs="/lus/out", hf_cache="/lus/hf",
                mounts=(parse_mount("/etc/hosts:/host/hosts:ro"),), args=("--max_steps", "10"))


def _sbatch_directives(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if line.startswith("#SBATCH --"):
            k, _, v = line[len("#SBATCH --"):].partition("=")
            out[k] = v
    return out


def _srun_line(text: str) -> str:
    """The srun command with its continuation lines joined."""
    lines = text.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith("srun "))
    cmd = ""
    while True:
        cmd += lines[i].rstrip("\\").strip() + " "
        if not lines[i].endswith("\\"):
            return cmd.strip()
        i += 1


@pytest.mark.parametrize("mode", ["pyxis", "enroot", "bare"])
@pytest.mark.parametrize("entrypoint", ["sft", "grpo"])
def test_every_mode_is_valid_bash(mode, entrypoint, tmp_path):
    spec = JobSpec(tag="t", entrypoint=entrypoint, mode=mode, config="/c.yaml",
                   sqsh=None if mode == "bare" else "/s/t.sqsh", workdir="/repo" if mode == "bare" else None)
    script = write(spec, tmp_path / "job.sh")
    assert script.stat().st_mode & 0o111
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    assert text.startswith("#!/bin/bash\n")
    assert f"ARGS=({entrypoint} --config /c.yaml)" in text
    # The per-node task is POSIX sh (it runs inside the image under pyxis): check it with dash.
    task = text.split("NODE_TASK='", 1)[1].split("'\n", 1)[0] if mode != "enroot" else None
    if task:
        assert subprocess.run(["sh", "-n", "-c", task], capture_output=True).returncode == 0


def test_pyxis_script():
    text = render(PYXIS)
    d = _sbatch_directives(text)
    assert d["nodes"] == "2" and d["ntasks-per-node"] == "1" and d["gpus-per-node"] == "4"
    assert d["partition"] == "gpu" and d["time"] == "1-00:00:00" and d["job-name"] == "sft-smoke-x86_64"
    assert d["signal"] == "USR1@300"
    srun = shlex.split(_srun_line(text))
    assert "--container-image=$TRAINBOX_SQSH" in srun
    assert "export TRAINBOX_SQSH=/shared/img/smoke-x86_64.sqsh" in text
    mounts = next(a for a in srun if a.startswith("--container-mounts=")).split("=", 1)[1].split(",")
    assert mounts == ["/etc/hosts:/host/hosts:ro", "/lus/data:/data", "/lus/out:/workspace/outputs",
                      "/lus/hf:/cache/huggingface"]
    assert "--container-workdir=/workspace" in srun and "--no-container-mount-home" in srun
    env = next(a for a in srun if a.startswith("--container-env=")).split("=", 1)[1].split(",")
    assert env == ["HF_HOME", "OUTPUT_DIR"]  # the Slurm variables pass through: the image does not set them
    assert "LAUNCH=(--nproc-per-node 4)" in text
    assert "exec trainbox \"$@\"" in text  # pyxis skips the ENTRYPOINT: call the dispatcher by name
    assert "ARGS=(sft --config /data/sft.yaml --max_steps 10)" in text


def _launch_flags(text: str):
    """The launcher flags the job script gives every node's dispatcher (its LAUNCH array)."""
    line = next(ln for ln in text.splitlines() if ln.startswith("LAUNCH=("))
    words = shlex.split(line[len("LAUNCH=("):-1])
    kw = {w[2:].replace("-", "_"): int(v) if v.isdigit() else v for w, v in zip(words[::2], words[1::2])}
    return SimpleNamespace(**{f: kw.get(f) for f in launch.LAUNCH_FIELDS})


@pytest.mark.parametrize("mode", ["pyxis", "enroot", "bare"])
def test_the_script_leaves_the_rendezvous_to_the_launcher(mode, monkeypatch):
    """One port rule (launch.slurm_port), none in the script: no arithmetic on the job id, no MASTER_* passed.
    A job id whose old-formula port (20000 + id % 20000) is ephemeral gets a port below the kernel's range;
    one node gets torchrun --standalone."""
    monkeypatch.setattr(launch.shutil, "which", lambda name: None)  # our host-list parser, not scontrol
    kw = {"sqsh": None, "workdir": "/repo"} if mode == "bare" else {"sqsh": "/s/t.sqsh"}
    for nodes in (1, 2):
        text = render(JobSpec(tag="t", mode=mode, config="/c.yaml", nodes=nodes, gpus_per_node=0, **kw))
        assert "SLURM_JOB_ID %" not in text and "$((" not in text and "MASTER_" not in text
        assert "--master-" not in text and "--node-rank" not in text and "--nnodes" not in text
        job = 13000  # 20000 + 13000 % 20000 = 33000: inside Linux's default ephemeral range (32768-60999)
        env = {"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "tbx[1-2]" if nodes > 1 else
               "tbx1", "SLURM_NNODES": str(nodes), "SLURM_NODEID": "0"}
        p = launch.plan(_launch_flags(text), env)
        cmd = " ".join(launch.torchrun_command(p, "m", []))
        if nodes == 1:
            assert p.standalone and "--standalone" in cmd and "--rdzv-endpoint" not in cmd
        else:
            eph = launch.ephemeral_range()[0]
            assert 20000 + job % 20000 >= eph, "the job id no longer exercises the old formula's failure"
            assert p.master_port < eph and p.master_port == launch.slurm_port(env)
            assert f"--rdzv-endpoint tbx1:{p.master_port}" in cmd and p.is_host


def test_enroot_script():
    text = render(JobSpec(tag="t", mode="enroot", entrypoint="grpo", config="/data/g.yaml", sqsh="/s/t.sqsh",
                          gpus_per_node=8, data="/lus/d", mounts=(parse_mount("/a:/b:ro"),)))
    assert 'enroot create --force --name "$name" "$TRAINBOX_SQSH"' in text
    assert "enroot start --mount /a:/b:none:x-create=auto,rbind,ro --mount /lus/d:/data" in text
    # enroot start clears the environment: the launcher's Slurm variables are named.
    assert "".join(f" --env {k}" for k in launch.SLURM_STEP_ENV) in text
    assert "enroot remove --force" in text
    assert "--container-image" not in text
    assert "--nproc-per-node 8" in text


def test_bare_script_defaults():
    text = render(JobSpec(tag="t", mode="bare", config="/c.yaml", gpus_per_node=0, workdir="/repo",
                          python="/repo/.venv/bin/python", cpus_per_task=2, env=(("A", "x y"),)))
    d = _sbatch_directives(text)
    assert "gpus-per-node" not in d and "partition" not in d and d["cpus-per-task"] == "2"
    assert "--nproc-per-node 1" in text  # no GPUs -> one process per node
    assert "export TRAINBOX_PYTHON=/repo/.venv/bin/python" in text and "export A='x y'" in text
    assert 'exec "$TRAINBOX_PYTHON" -m trainbox "$@"' in text


def test_sqsh_name():
    assert sqsh_name("smoke-x86_64") == "smoke-x86_64.sqsh"


@pytest.mark.parametrize("kw, msg", [
    ({"sqsh": "rel/x.sqsh"}, "absolute path"),
    ({"sqsh": "/x.tar"}, "absolute path to a .sqsh"),
    ({"sqsh": "/a b.sqsh"}, "spaces"),
    ({"sqsh": None}, "absolute path"),
    ({"entrypoint": "jupyter"}, "no job script"),
    ({"mode": "docker"}, "mode"),
    ({"nodes": 0}, "--nodes"),
    ({"gpus_per_node": -1}, "--gpus-per-node"),
    ({"nproc_per_node": 0}, "--nproc-per-node"),
    ({"time": "2h"}, "--time"),
    ({"partition": "a;b"}, "--partition"),
    ({"config": None}, "--config"),
    ({"tag": "a b"}, "tag"),
    ({"data": "/d", "mounts": (parse_mount("/x:/data"),)}, "destination /data"),
    ({"env": (("1A", "x"),)}, "variable name"),
])
def test_bad_input(kw, msg):
    base = dict(tag="t", mode="pyxis", config="/c.yaml", sqsh="/s/t.sqsh")
    with pytest.raises(UserError, match=msg):
        render(JobSpec(**{**base, **kw}))


@pytest.mark.parametrize("spec, msg", [("/a", "SRC:DST"), ("a:/b", "absolute"), ("/a:/b:rx", "SRC:DST"),
                                       ("/a b:/c", "no ','"), ("/a,b:/c", "no ','")])
def test_bad_mount(spec, msg):
    with pytest.raises(UserError, match=msg):
        parse_mount(spec)


def test_bare_rejects_container_options():
    with pytest.raises(UserError, match="bare mode"):
        render(JobSpec(tag="t", mode="bare", config="/c", workdir="/r", sqsh="/s/t.sqsh"))
    with pytest.raises(UserError, match="--workdir"):
        render(JobSpec(tag="t", mode="bare", config="/c"))


def test_cli_writes_file_and_bad_input_exits_2(tmp_path):
    out = tmp_path / "job.sh"
    r = subprocess.run([sys.executable, "-m", "builder.slurm", "--tag", "t", "--config", "/c.yaml", "--sqsh",
                        "/s/t.sqsh", "--nodes", "2", "-o", str(out), "--", "--max_steps", "3"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "ARGS=(sft --config /c.yaml --max_steps 3)" in out.read_text()
    r = subprocess.run([sys.executable, "-m", "builder.slurm", "--tag", "t", "--config", "/c.yaml", "--sqsh",
                        "x.sqsh", "-o", str(tmp_path / "bad.sh")], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "absolute" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.sh"]
