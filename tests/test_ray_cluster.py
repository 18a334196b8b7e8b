"""`trainbox ray`: Ray on Slurm. Unit checks (options, ports, the rendered job) and the real thing: a bare-mode job
on the two netns Slurm nodes (devenv.slurm --netns-nodes 2) whose driver runs a Ray task pinned to each node.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import docsfiles
from builder.errors import UserError
from builder.slurm import JobSpec, render, write
from common import launch
from trainbox.cli import ray_cluster

ROOT = Path(__file__).resolve().parents[1]


def trainbox(args, env=None):
    env = {k: v for k, v in (env or os.environ).items() if not k.startswith("SLURM_")}
    return subprocess.run([sys.executable, "-m", "trainbox", "ray", *args], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=60)


@pytest.mark.parametrize("args, message", [
    (["--", "python", "x.py"], "runs inside a Slurm step with one task per node"),
    ([], "no command given"),
    (["--gpu-free-head"], "no command given"),
    (["--timeout", "0", "--", "x"], "argument --timeout: must be at least 1"),
    (["--port-base", "80", "--", "x"], "argument --port-base: must be 1024.."),
    (["--bogus", "--", "x"], "unrecognized arguments: --bogus"),
])
def test_bad_options_are_one_line_and_exit_2(args, message):
    r = trainbox(args)
    assert r.returncode == 2 and r.stdout == "", r
    assert len(r.stderr.splitlines()) == 1 and message in r.stderr, r.stderr


def test_several_tasks_per_node_is_refused():
    env = dict(os.environ, SLURM_JOB_ID="13001", SLURM_STEP_ID="0", SLURM_NNODES="2", SLURM_NTASKS="4",
               SLURM_JOB_NODELIST="n[1-2]")
    with pytest.raises(ray_cluster.UsageError, match="one task per node, got 4 tasks on 2 nodes"):
        ray_cluster.main_env(["--", "true"], env)


def test_ports_are_one_block_below_the_ephemeral_range_and_skip_torchs():
    seen = set()
    for job in range(0, 200):
        base = ray_cluster.port_base({"SLURM_JOB_ID": str(job)}, (32768, 60999))
        p = ray_cluster.ports(base)
        assert launch.PORT_WINDOW_START <= base and p["max_worker"] < 32768
        assert not any(base <= t < base + ray_cluster.BLOCK for t in launch.TORCH_DEFAULT_PORTS)
        assert len(set(p.values())) == len(p)
        seen.add(base)
    assert len(seen) > 50  # consecutive jobs get different blocks
    with pytest.raises(ray_cluster.UsageError, match="no room"):
        ray_cluster.port_base({"SLURM_JOB_ID": "1"}, (10500, 60999))


# The head's wait with its `ray start` dead and a GCS port that accepts but never answers (a hung GCS): Ray's own
# client blocks in ray.init() for good there, so only the head watch ends it.
HEAD_DIES = """\
import socket, subprocess
from trainbox.cli import ray_cluster
gcs = socket.socket()
gcs.bind(("127.0.0.1", 0))
gcs.listen(16)
head = subprocess.Popen(["sleep", "2"], start_new_session=True)  # the head's `ray start`, dying on a loaded node
try:
    ray_cluster.wait_for_nodes(f"127.0.0.1:{gcs.getsockname()[1]}", ["tbx1", "tbx2"], 300, head)
except ray_cluster.HeadExited as e:  # the wait's own check saw it: also one line (run_head logs it)
    print(f"[trainbox] ray error: {e}")
    raise SystemExit(1)
print("the wait returned")
"""


def test_a_head_whose_ray_start_dies_while_it_waits_fails_in_one_line():
    r = subprocess.run([sys.executable, "-c", HEAD_DIES], cwd=ROOT, capture_output=True, text=True, timeout=90,
                       env=dict(os.environ, RAY_USAGE_STATS_ENABLED="0"))
    errors = [ln for ln in r.stdout.splitlines() if ln.startswith("[trainbox] ray error:")]
    assert r.returncode == 1 and len(errors) == 1, (r.stdout, r.stderr[-2000:])
    assert "the head's `ray start` exited 0" in errors[0] and "the wait returned" not in r.stdout


def test_start_commands_head_and_worker():
    a, cmd = ray_cluster.parse(["--gpu-free-head", "--", "python", "d.py", "--", "x"])
    assert cmd == ["python", "d.py", "--", "x"]
    head = ray_cluster.start_command(20000, True, "10.0.0.1", "10.0.0.1:20000", a)
    assert "--head" in head and "--port=20000" in head and "--num-gpus=0" in head and "--block" in head
    assert "--ray-client-server-port=20001" in head and "--min-worker-port=20016" in head
    assert "--max-worker-port=20255" in head and "--node-ip-address=10.0.0.1" in head
    worker = ray_cluster.start_command(20000, False, "10.0.0.2", "10.0.0.1:20000", a)
    assert "--address=10.0.0.1:20000" in worker and "--head" not in worker
    assert not any(x.startswith(("--num-gpus", "--port=", "--ray-client")) for x in worker)  # GPUs: Ray detects


def test_ray_start_waits_longer_for_its_raylet_than_rays_fixed_30_s(monkeypatch):
    """The `ray start` the nodes run (RAY_START) replaces Ray's services.get_node with one that retries a "not
    registered yet" RuntimeError for up to RAYLET_WAIT_S, then runs Ray's own CLI; a lasting failure still raises."""
    import ray._private.services as services
    import ray.scripts.scripts as scripts

    calls, ran = [], []

    def flaky(*args, **kwargs):
        calls.append(args)
        if len(calls) < 3:
            raise RuntimeError("node info not found")
        return {"node_id": args[1]}

    monkeypatch.setattr(services, "get_node", flaky)
    monkeypatch.setattr(services, "start_raylet", services.start_raylet)  # RAY_START wraps it: undone after the test
    monkeypatch.setattr(scripts, "main", lambda: ran.append(True))
    exec(compile(ray_cluster.RAY_START, "RAY_START", "exec"), {})
    assert ran == [True] and services.get_node is not flaky
    assert services.get_node("gcs:1", "abc") == {"node_id": "abc"} and len(calls) == 3
    monkeypatch.setattr(services, "get_node", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("never")))
    exec(compile(ray_cluster.RAY_START.replace(f"+ {ray_cluster.RAYLET_WAIT_S}", "+ 0"), "RAY_START", "exec"), {})  # no wait
    with pytest.raises(RuntimeError, match="never"):
        services.get_node("gcs:1", "abc")
    head = ray_cluster.start_command(20000, True, "10.0.0.1", "10.0.0.1:20000", ray_cluster.parse(["--", "x"])[0])
    assert head[1:3] == ["-c", ray_cluster.RAY_START] and head[3] == "start"


# Every Python process the raylet spawns as its dashboard agent sleeps first: the agent of a loaded node, whose imports
# took 15.0 s in a CI run, where the raylet gives it a fixed 15 s to write its port file and then aborts.
SLOW_AGENT = """\
import time
with open("/proc/self/cmdline", "rb") as f:
    if b"dashboard/agent.py" in f.read():
        time.sleep(AGENT_DELAY_S)
"""
AGENT_DELAY_S = 25


def start_ray_head(ray_start: list[str]) -> tuple[str, str]:
    """`ray start --head` (ray_start: the interpreter's arguments before `start`) beside a slow dashboard agent:
    ("up" once its node has registered and its agent has come up, else "exited N"; its output)."""
    temp = Path(tempfile.mkdtemp(prefix="tbxray", dir="/tmp"))  # Ray's socket paths must fit in 107 bytes
    (temp / "site").mkdir()
    (temp / "site" / "sitecustomize.py").write_text(SLOW_AGENT.replace("AGENT_DELAY_S", str(AGENT_DELAY_S)))
    base = 30000  # below the ephemeral range; this module's tests run one at a time
    cmd = ray_cluster.start_command(base, True, "127.0.0.1", f"127.0.0.1:{base}",
                                    ray_cluster.parse(["--num-cpus", "1", "--", "x"])[0])
    cmd = [sys.executable, *ray_start, *cmd[cmd.index("start"):], f"--temp-dir={temp / 'ray'}"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(temp / "site"), str(ROOT)]), RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    out = []
    try:
        for line in proc.stdout:   # `ray start --block` prints this once its node has registered with the GCS
            out.append(line)
            if "Ray runtime started" in line:
                break
        else:
            return f"exited {proc.wait()}", "".join(out)
        agent_log = temp / "ray" / "session_latest" / "logs" / "dashboard_agent.log"
        end = time.monotonic() + AGENT_DELAY_S + 90
        while proc.poll() is None and time.monotonic() < end:
            if agent_log.exists() and "Loaded" in agent_log.read_text(errors="replace"):
                return "up", "".join(out)
            time.sleep(1)
        return f"exited {proc.poll()}, agent: {agent_log.exists() and agent_log.read_text()[-1000:]}", "".join(out)
    finally:
        ray_cluster._stop(proc, grace=20)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.timeout(300)
def test_ray_start_forms_a_node_whose_dashboard_agent_misses_the_raylets_fixed_15_s():
    state, out = start_ray_head(["-c", ray_cluster.RAY_START])
    assert state == "up", out[-3000:]


def test_a_slurm_job_for_ray_renders_the_command_after_dashes():
    spec = JobSpec(tag="cu130-hopper-x86_64", entrypoint="ray", sqsh="/shared/x.sqsh", nodes=2,
                   args=("python", "driver.py"))
    job = render(spec)
    assert "ARGS=(ray -- python driver.py)" in job and "LAUNCH=()" in job and "LAUNCH=(--" not in job
    job = render(JobSpec(tag="t", entrypoint="ray", mode="enroot", sqsh="/s/t.sqsh",
                         args=("--gpu-free-head", "--", "python", "d.py")))
    assert "ARGS=(ray --gpu-free-head -- python d.py)" in job and "enroot start" in job
    with pytest.raises(UserError, match="needs the command the head runs"):
        render(JobSpec(tag="t", entrypoint="ray", sqsh="/s/t.sqsh"))
    assert "LAUNCH=(--nproc-per-node 8)" in render(JobSpec(tag="t", entrypoint="nccl-check", sqsh="/s/t.sqsh"))
    # the CLI: everything after -- is the head's command
    r = subprocess.run([sys.executable, "-m", "builder.slurm", "--tag", "t", "--entrypoint", "ray", "--sqsh",
                        "/s/t.sqsh", "--nodes", "2", "--", "python", "d.py"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "ARGS=(ray -- python d.py)" in r.stdout, r.stderr


DRIVER = """\
import json, socket, sys
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

ray.init()  # RAY_ADDRESS from trainbox ray
nodes = [n for n in ray.nodes() if n["Alive"]]

@ray.remote(num_cpus=1)
def where():
    return socket.gethostname(), ray.get_runtime_context().get_node_id()

refs = [where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
        for n in nodes]
out = ray.get(refs, timeout=120)
print("RAYTASKS " + json.dumps(sorted(out)), flush=True)
assert sorted(h for h, _ in out) == ["tbx1", "tbx2"], out
assert {i for _, i in out} == {n["NodeID"] for n in nodes}
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.slurm
@pytest.mark.after_builds  # load-sensitive (Ray's fixed startup waits, see RAY_START): not beside the emulated builds
@pytest.mark.timeout(300)
@pytest.mark.parametrize("exit_code", [0, 3])
def test_two_node_ray_cluster_runs_a_task_on_each_node(slurm2, tmp_path, exit_code):
    from test_slurm_job import submit, wait_job

    env, partition = slurm2
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    spec = JobSpec(tag="smoke-cpu", entrypoint="ray", mode="bare", nodes=2, gpus_per_node=0, time="10:00",
                   partition=partition, python=sys.executable, workdir=str(ROOT), log_dir=str(tmp_path),
                   args=("--timeout", "150", "--num-cpus", "1", "--", sys.executable, str(driver), str(exit_code)))
    script = write(spec, tmp_path / "job.sh")
    job_id = submit(script, env)
    job = wait_job(job_id, env, timeout=240)
    log = (tmp_path / f"ray-smoke-cpu-{job_id}.out").read_text(errors="replace")
    assert job["JobState"] == ("COMPLETED" if exit_code == 0 else "FAILED"), log[-4000:]
    assert job["ExitCode"] == f"{exit_code}:0" and job["NodeList"] == "tbx[1-2]", (job, log[-4000:])
    m = re.search(r"\[trainbox\] ray cluster up: 2/2 nodes in [\d.]+ s \((.*)\); RAY_ADDRESS=([\d.]+):(\d+)", log)
    assert m, log[-4000:]
    assert "tbx1" in m.group(1) and "tbx2" in m.group(1)
    assert int(m.group(3)) == ray_cluster.port_base({"SLURM_JOB_ID": job_id}) < launch.ephemeral_range()[0]
    tasks = re.search(r"RAYTASKS (.*)", log)
    assert tasks and "tbx1" in tasks.group(1) and "tbx2" in tasks.group(1), log[-4000:]
    assert f"[trainbox] ray command exited {exit_code}; stopping the cluster" in log
    # exit 0: the head goes, the worker follows; else srun's --kill-on-bad-exit ends the worker, which exits 0
    assert ("[trainbox] ray worker node 1: the head is gone; leaving" in log
            or "[trainbox] ray node 1: stopped by SIGTERM" in log), log[-4000:]


def test_the_host_ray_pin_is_the_gpu_stacks():
    import tomllib

    from builder.matrix import load_matrix

    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    gpu = next(c for c in load_matrix(ROOT / "matrix.toml").cells if c.cuda and c.arch == "x86_64")
    assert f"ray=={gpu.pins['ray']}" in dev


def test_the_docs_ray_job_command_writes_its_script(tmp_path):
    cmd = next(c for c in docsfiles.commands() if "--entrypoint ray" in c and c.startswith("python"))
    assert cmd.endswith(" && sbatch ray.sh")
    r = subprocess.run(["bash", "-c", cmd.removesuffix(" && sbatch ray.sh")], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT),
                                                       PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}"))
    assert r.returncode == 0, r.stderr
    job = (tmp_path / "ray.sh").read_text()
    assert "ARGS=(ray -- python /data/my_driver.py)" in job and "LAUNCH=()" in job and "#SBATCH --nodes=2" in job
    assert "--container-image=\"$TRAINBOX_SQSH\"" in job and "/shared/rl:/data" in job
