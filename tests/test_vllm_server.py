"""GRPO with a vLLM server beside the trainers (trainbox/training/grpo/vllm_server.py): roles, health wait, lease, teardown.

No vLLM can run here (no GPU, not installed): the server is a stand-in HTTP process started on 127.0.0.1 that
answers vLLM's /health, put in through TRAINBOX_VLLM_SERVE_CMD exactly where `trl vllm-serve` would run.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from builder import slurm as job
from common import launch
from common.errors import UsageError
from trainbox.training.grpo import vllm_server

ROOT = Path(__file__).resolve().parent.parent

STANDIN = textwrap.dedent("""
    import http.server, sys
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404); self.end_headers()
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def slurm_env(node: int, nnodes: int = 3) -> dict:
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": f"gpu[1-{nnodes}]",
            "SLURM_NNODES": str(nnodes), "SLURM_NTASKS": str(nnodes), "SLURM_NODEID": str(node)}


def test_slurm_roles_last_node_serves_the_others_train(monkeypatch):
    monkeypatch.setattr(launch.shutil, "which", lambda _: None)  # our host-list parser, not scontrol
    monkeypatch.setattr(launch, "local_procs", lambda env: 4)
    roles = [vllm_server.slurm_roles(slurm_env(n), 1, 8) for n in range(3)]
    assert [r.role for r in roles] == ["trainer", "trainer", "server"]
    assert {r.server_host for r in roles} == {"gpu3"}
    assert [r.holds_lease for r in roles] == [True, False, False]
    assert roles[2].tensor_parallel_size == 8 and roles[2].lease_port == 8001
    assert roles[0].trainer_args() == ["--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_host", "gpu3",
                                       "--vllm_server_port", "8000", "--vllm_group_port", "51216"]
    for n in (0, 1):  # the trainers' torchrun sees only the trainer nodes
        p = launch.plan(launch.LaunchArguments(), {**slurm_env(n), **roles[n].trainer_env})
        assert (p.mode, p.nnodes, p.node_rank, p.master_addr, p.is_host) == ("torchrun", 2, n, "gpu1", n == 0)
        assert p.master_port == launch.slurm_port(slurm_env(n))
        # as the job script starts it (--nproc-per-node N: the launcher-flags path)
        p = launch.plan(launch.LaunchArguments(nproc_per_node=4), {**slurm_env(n), **roles[n].trainer_env})
        assert (p.nnodes, p.node_rank, p.master_addr, p.is_host, p.standalone) == (2, n, "gpu1", n == 0, False)
    ports = vllm_server.slurm_roles(slurm_env(0), 1, 8, http_port=9000, group_port=9100)
    assert (ports.http_port, ports.group_port, ports.lease_port) == (9000, 9100, 9001)


@pytest.mark.parametrize("env, nodes, msg", [
    (slurm_env(0, nnodes=1), 1, "leaves no node to train"),
    (slurm_env(0), 2, "serves from one node"),
    ({}, 1, "needs an srun step"),
    ({**slurm_env(0), "SLURM_NTASKS": "6"}, 1, "one Slurm task per node"),
])
def test_slurm_roles_refused(monkeypatch, env, nodes, msg):
    monkeypatch.setattr(launch.shutil, "which", lambda _: None)
    with pytest.raises(UsageError, match=msg):
        vllm_server.slurm_roles(env, nodes, 8)


def test_local_roles_split_gpus():
    r = vllm_server.local_roles(["0", "1", "2", "3"], 1)
    assert (r.server_gpus, r.trainer_gpus, r.server_host, r.tensor_parallel_size) == (["3"], ["0", "1", "2"],
                                                                                     "127.0.0.1", 1)
    with pytest.raises(UsageError, match="leaves none to train"):
        vllm_server.local_roles(["0"], 1)


def test_serve_command_uses_trl_names(monkeypatch):
    monkeypatch.delenv(vllm_server.STANDIN_ENV, raising=False)
    roles = vllm_server.Roles("server", "gpu3", tensor_parallel_size=8)
    assert vllm_server.serve_command("/m", roles) == ["trl", "vllm-serve", "--model", "/m", "--host", "0.0.0.0",
                                                      "--port", "8000", "--tensor_parallel_size", "8"]
    cmd = vllm_server.serve_command("/m", roles, "--tensor_parallel_size 2 --gpu_memory_utilization 0.8")
    assert cmd[-4:] == ["--tensor_parallel_size", "2", "--gpu_memory_utilization", "0.8"] and cmd.count("8") == 0
    monkeypatch.setenv(vllm_server.STANDIN_ENV, "python3 standin.py {port}")
    assert vllm_server.serve_command("/m", roles) == ["python3", "standin.py", "8000"]


def free_pair() -> int:
    """A port P with P and P+1 free on 127.0.0.1 (HTTP and lease)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no free port pair")


def server_task(tmp_path, port: int, wait: float = 30, standin: str = STANDIN) -> subprocess.Popen:
    """The server node's task: vllm_server.serve with the stand-in in place of `trl vllm-serve`."""
    (tmp_path / "standin.py").write_text(standin)
    code = (f"import sys; from trainbox.training.grpo import vllm_server as v; r = v.Roles('server', '127.0.0.1', {port}); "
            f"sys.exit(v.serve(v.serve_command('/m', r), r, {wait}))")
    env = {**os.environ, vllm_server.STANDIN_ENV: f"{sys.executable} {tmp_path / 'standin.py'} {{port}}",
           "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def test_trainers_end_server_task_stops(tmp_path):
    port = free_pair()
    task = server_task(tmp_path, port)
    roles = vllm_server.Roles("trainer", "127.0.0.1", port, holds_lease=True)
    watch = vllm_server.Watch(roles, wait=20)
    assert vllm_server.wait_healthy("127.0.0.1", port, 20, watch.gone, interval=0.1) < 20
    assert watch.gone() is None
    watch.close()  # the trainers ended: the lease closes
    out, _ = task.communicate(timeout=40)
    assert task.returncode == 0, out
    assert "trainers finished, stopping the server" in out
    assert not vllm_server.healthy("127.0.0.1", port, timeout=1)  # the stand-in is gone too


def test_server_dies_trainers_get_one_line(tmp_path):
    port = free_pair()
    task = server_task(tmp_path, port)
    roles = vllm_server.Roles("trainer", "127.0.0.1", port, holds_lease=True)
    watch = vllm_server.Watch(roles, wait=20)
    vllm_server.wait_healthy("127.0.0.1", port, 20, watch.gone, interval=0.1)
    standin = [p for p in launch.descendants(task.pid)]
    assert standin
    os.kill(standin[0], signal.SIGKILL)  # vLLM crashed
    out, _ = task.communicate(timeout=30)
    assert task.returncode != 0 and "error: vLLM server exited with code -9" in out
    deadline = time.monotonic() + 10
    while watch.gone() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "went away" in watch.gone()
    with pytest.raises(vllm_server.ServerDown) as e:
        vllm_server.wait_healthy("127.0.0.1", port, 20, watch.gone, interval=0.1)
    assert str(e.value).count("\n") == 0 and f"127.0.0.1:{port}" in str(e.value)
    watch.close()


def test_health_never_answers_names_host_and_port():
    port = free_pair()
    with pytest.raises(vllm_server.ServerDown, match=rf"at 127.0.0.1:{port} did not answer /health within 1 s"):
        vllm_server.wait_healthy("127.0.0.1", port, 1, interval=0.2)
    with pytest.raises(vllm_server.ServerDown, match=f"never opened its lease port {port + 1}"):
        vllm_server.connect_lease("127.0.0.1", port + 1, 0.5, interval=0.2)


def test_no_trainer_connects_server_task_gives_up(tmp_path):
    port = free_pair()
    task = server_task(tmp_path, port, wait=1)
    out, _ = task.communicate(timeout=40)
    assert task.returncode == 1 and f"no trainer connected to the lease port {port + 1} within 1 s" in out


def test_one_node_split_runs_and_stops_the_server(tmp_path, monkeypatch):
    """The one-node layout's watch: the server is the launcher's child; it dies -> the thread says so in one line."""
    (tmp_path / "standin.py").write_text(STANDIN)
    port = free_pair()
    proc = subprocess.Popen([sys.executable, str(tmp_path / "standin.py"), str(port)], start_new_session=True)
    roles = vllm_server.local_roles(["0", "1"], 1, http_port=port)
    watch = vllm_server.Watch(roles, 20, proc)
    vllm_server.wait_healthy("127.0.0.1", port, 20, watch.gone, interval=0.1)
    watch.close()
    assert proc.poll() is not None and not vllm_server.healthy("127.0.0.1", port, timeout=1)


def test_grpo_options_point_the_trainers_at_the_server(monkeypatch):
    from trainbox.cli import grpo
    from trainbox.training import config
    from trainbox.training.grpo import rollouts as grpo_rollouts

    script, launch_args, raw, _ = grpo.parse(["--model_name_or_path", "m", "--vllm_server_gpus", "1"])
    roles = grpo_rollouts.arrange_server(script, raw, launch_args, {"CUDA_VISIBLE_DEVICES": "0,1,2"})
    assert (roles.server_gpus, launch_args.nproc_per_node) == (["2"], 2)
    assert (raw.use_vllm, raw.vllm_mode, raw.vllm_server_host) == (True, "server", "127.0.0.1")
    assert {"use_vllm", "vllm_mode"} <= config.explicit(raw)
    # more `trl vllm-serve` options in one word, TRL's names (a word with a space is a value, as argparse reads it)
    for given in (["--vllm_serve_args", "--gpu_memory_utilization 0.8"], ["--vllm_serve_args=--enforce_eager"]):
        script, *_ = grpo.parse(["--model_name_or_path", "m", *given])
        assert script.vllm_serve_args == given[-1].removeprefix("--vllm_serve_args=")
    # the ranks under torchrun do not arrange anything again
    script, launch_args, raw, _ = grpo.parse(["--model_name_or_path", "m", "--vllm_server_gpus", "1"])
    assert grpo_rollouts.arrange_server(script, raw, launch_args, {"TORCHELASTIC_RUN_ID": "x"}) is None


@pytest.mark.parametrize("extra, msg", [
    (["--vllm_server_gpus", "1", "--vllm_mode", "colocate"], "drop use_vllm/vllm_mode"),
    (["--vllm_server_gpus", "1", "--vllm_server_nodes", "1"], "exclude each other"),
    (["--vllm_server_nodes", "1"], "needs an srun step"),
])
def test_grpo_server_options_refused_in_one_line(capsys, monkeypatch, extra, msg):
    from trainbox.cli import grpo

    for k in ("SLURM_JOB_ID", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert grpo.main(["--model_name_or_path", "m", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and msg in err and "\n" not in err


def test_job_script_renders_the_roles():
    spec = job.JobSpec(tag="t", entrypoint="grpo", config="/data/g.yaml", sqsh="/a/t.sqsh", nodes=3, vllm_nodes=1)
    text = job.render(spec)
    assert "ARGS=(grpo --config /data/g.yaml --vllm_server_nodes 1)" in text
    assert "nodes 0..1 train (2 node(s), torchrun),\n# node 2 runs `trl vllm-serve`" in text
    assert "8000" in text and "51216" in text and "8001" in text
    assert "vllm" not in job.render(job.JobSpec(tag="t", entrypoint="grpo", config="/g.yaml", sqsh="/a/t.sqsh"))
    for bad in (dict(nodes=1, vllm_nodes=1), dict(nodes=3, vllm_nodes=2), dict(entrypoint="sft", nodes=3, vllm_nodes=1)):
        with pytest.raises(job.UserError):
            job.render(job.JobSpec(**{"tag": "t", "entrypoint": "grpo", "config": "/g.yaml", "sqsh": "/a/t.sqsh",
                                      **bad}))


def test_preemption_signals_keep_the_server_for_the_trainers_save(tmp_path):
    """Slurm signals every process of the step: SIGUSR1 (save now) leaves task and server up; after SIGTERM the task
    serves on until the trainers' lease closes, then exits 0."""
    port = free_pair()
    task = server_task(tmp_path, port)
    watch = vllm_server.Watch(vllm_server.Roles("trainer", "127.0.0.1", port, holds_lease=True), wait=20)
    vllm_server.wait_healthy("127.0.0.1", port, 20, watch.gone, interval=0.1)
    for pid in [task.pid, *launch.descendants(task.pid)]:
        os.kill(pid, signal.SIGUSR1)
    time.sleep(0.5)
    assert task.poll() is None and vllm_server.healthy("127.0.0.1", port)
    task.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert task.poll() is None and vllm_server.healthy("127.0.0.1", port)  # the trainers' last step still runs
    watch.close()
    out, _ = task.communicate(timeout=40)
    assert task.returncode == 0 and "trainers finished" in out, out


def test_grpo_one_node_split_end_to_end_wiring(tmp_path, tiny_model):
    """`trainbox grpo --vllm_server_gpus 1` for real, up to what needs vLLM: the launcher starts the (stand-in)
    server on the last GPU, waits for /health, torchrun's rank gets TRL's server options (its rollouts line), and
    the server is stopped when the ranks end. The rank stops where TRL imports vLLM: only an empty `vllm` package
    (enough for our find_spec) is on the path, no vLLM can run here."""
    from test_grpo import FAST, gsm8k_rows, write_jsonl

    data = write_jsonl(tmp_path / "gsm8k.jsonl", gsm8k_rows(8))
    (tmp_path / "stub" / "vllm").mkdir(parents=True)
    (tmp_path / "stub" / "vllm" / "__init__.py").write_text("")
    (tmp_path / "standin.py").write_text(STANDIN)
    port = free_pair()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path / 'stub'}", "CUDA_VISIBLE_DEVICES": "0,1",
           vllm_server.STANDIN_ENV: f"{sys.executable} {tmp_path / 'standin.py'} {{port}}"}
    env.pop("OUTPUT_DIR", None)
    r = subprocess.run([sys.executable, "-m", "trainbox", "grpo", "--model_name_or_path", str(tiny_model),
                        "--dataset", str(data), "--preset", "gsm8k", "--max_steps", "1", *FAST,
                        "--output_dir", str(tmp_path / "out"), "--vllm_server_gpus", "1",
                        "--vllm_server_port", str(port), "--vllm_server_wait", "30"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert "[trainbox] vllm server on GPU(s) 1:" in out, out[-3000:]
    assert f"vllm server at 127.0.0.1:{port} healthy after" in out, out[-3000:]
    assert "torchrun nnodes=1 nproc_per_node=1" in out
    assert (f"rollouts: vLLM server at 127.0.0.1:{port} (use_vllm set; started by this run" in out), out[-3000:]
    assert r.returncode != 0 and "the run crashed" in out  # the rank: TRL cannot use the empty vllm package
    assert not vllm_server.healthy("127.0.0.1", port, timeout=1)  # the launcher stopped its server


@pytest.mark.slurm
def test_two_node_job_last_node_serves(tmp_path, tiny_model, slurm2):
    """The rendered job (--vllm-nodes 1) on the two netns Slurm nodes: tbx2 runs the (stand-in) server, tbx1 the
    trainers' torchrun (nnodes 1) pointed at tbx2:8000; the rank ends where TRL imports vLLM (an empty `vllm`
    package, see above), the server task ends with it and the job fails as the rank did, instead of hanging."""
    from test_grpo import FAST, gsm8k_rows, write_jsonl
    from test_slurm_job import submit, wait_job

    env, partition = slurm2
    data = write_jsonl(tmp_path / "gsm8k.jsonl", gsm8k_rows(8))
    (tmp_path / "stub" / "vllm").mkdir(parents=True)
    (tmp_path / "stub" / "vllm" / "__init__.py").write_text("")
    (tmp_path / "standin.py").write_text(STANDIN.replace('"127.0.0.1"', '"0.0.0.0"'))
    cfg = tmp_path / "grpo.yaml"
    cfg.write_text(f"model_name_or_path: {tiny_model}\ndataset: {data}\npreset: gsm8k\nmax_steps: 1\n"
                   f"output_dir: {tmp_path / 'out'}\nvllm_server_wait: 60\n")
    spec = job.JobSpec(tag="smoke-cpu", entrypoint="grpo", mode="bare", config=str(cfg), nodes=2, gpus_per_node=0,
                       nproc_per_node=1, time="10:00", partition=partition, python=sys.executable, workdir=str(ROOT),
                       log_dir=str(tmp_path), vllm_nodes=1, args=tuple(FAST),
                       env=(("HF_HUB_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"),
                            ("PYTHONPATH", str(tmp_path / "stub")),
                            (vllm_server.STANDIN_ENV, f"{sys.executable} {tmp_path / 'standin.py'} {{port}}")))
    script = job.write(spec, tmp_path / "job.sh")
    job_id = submit(script, env)
    fields = wait_job(job_id, env, timeout=240)
    log = (tmp_path / f"grpo-smoke-cpu-{job_id}.out").read_text(errors="replace")
    assert "[trainbox] vllm server: " in log and "(HTTP 8000, lease 8001)" in log, log[-4000:]
    assert "[trainbox] vllm server at tbx2:8000 healthy after" in log, log[-4000:]
    # One trainer node: the launcher's own one-node rule (the job passes --nproc-per-node): torchrun --standalone.
    assert "torchrun nnodes=1 nproc_per_node=1 node_rank=0 rdzv=standalone" in log, log[-4000:]
    assert "[trainbox] node 0 on tbx1" in log and "[trainbox] node 1 on tbx2" in log
    assert "rollouts: vLLM server at tbx2:8000 (use_vllm set; started by this run" in log, log[-4000:]
    assert "the run crashed" in log and fields["JobState"] == "FAILED", (fields, log[-4000:])
    assert "[trainbox] vllm server: trainers finished, stopping the server" in log, log[-4000:]  # the lease, across nodes
