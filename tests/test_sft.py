"""sft end to end on CPU: tiny Llama, synthetic data in the real formats, 1 process, 2 processes, 2 "nodes" on one
host (c10d at 127.0.0.1), srun-style one task per rank, SIGTERM -> checkpoint -> resume, bad config -> exit 2."""

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from common.launch import descendants
from test_data import write_dolly, write_messages, write_verl_gsm8k

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--max_length", "64", "--per_device_train_batch_size", "2", "--logging_steps", "1",
        "--disable_tqdm", "true", "--report_to", "none", "--dataloader_num_workers", "0"]  # fmt: skip


def env_for(tmp_path, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OUTPUT_DIR", "ARTIFACT_DIR", "SAKURA_"))}
    env.update(
        PYTHONPATH=str(ROOT),
        HF_HUB_OFFLINE="1",  # proves nothing is fetched from a hub
        HF_DATASETS_CACHE=str(tmp_path / "hf-datasets"),
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
    )
    env.update(extra)
    return env


def run(module, args, env, timeout=300):
    return subprocess.run(
        [sys.executable, "-u", "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def spawn(module, args, env):
    return subprocess.Popen(
        [sys.executable, "-u", "-m", module, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def state(ckpt):
    return json.loads((Path(ckpt) / "trainer_state.json").read_text())


def loss_steps(ckpt):
    return [e["step"] for e in state(ckpt)["log_history"] if "loss" in e]


def test_messages_single_process_outputs_artifacts_tensorboard(tiny_model, tmp_path):
    data = write_messages(tmp_path / "chat.jsonl", 16)
    out, art = tmp_path / "outputs", tmp_path / "artifacts"
    env = env_for(tmp_path, OUTPUT_DIR=str(out), ARTIFACT_DIR=str(art))  # no --output_dir: $OUTPUT_DIR applies
    r = run("trainbox.cli.sft", ["--model_name_or_path", str(tiny_model), "--dataset", str(data), "--max_steps", "3",
                                "--save_steps", "2", *FAST, "--report_to", "tensorboard"], env)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "single process (CPU)" in r.stdout
    summary = [line for line in r.stdout.splitlines() if line.startswith("[trainbox] sft done")]
    assert len(summary) == 1 and "steps 3/3" in summary[0] and "tokens/s" in summary[0] and str(out) in summary[0]
    assert state(out / "checkpoint-2")["global_step"] == 2
    trained, initial = load_file(out / "model.safetensors"), load_file(tiny_model / "model.safetensors")
    assert any(not (trained[k] == initial[k]).all() for k in initial)  # full-parameter training moved weights
    assert list(out.glob("runs/*/events.out.tfevents.*"))  # report_to tensorboard wrote events
    assert (art / "outputs" / "model.safetensors").is_file()
    assert not (art / "outputs" / "checkpoint-2").exists()  # checkpoints reach ARTIFACT_DIR only on request


def test_verl_gsm8k_from_yaml_with_legacy_option(tiny_model, tmp_path):
    data = write_verl_gsm8k(tmp_path / "train.parquet", 8)
    cfg = tmp_path / "sft.yaml"
    cfg.write_text(
        f"model_name_or_path: {tiny_model}\ndataset: {data}\nprompt_key: extra_info.question\n"
        f"response_key: extra_info.answer\nwarmup_ratio: 0.1\nmax_steps: 2\noutput_dir: {tmp_path / 'o'}\n"
    )
    r = run("trainbox.cli.sft", ["--config", str(cfg), *FAST], env_for(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "warmup_ratio was removed upstream" in r.stderr
    assert (tmp_path / "o" / "model.safetensors").is_file()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--learning_rat", "1"], "unknown option --learning_rat; did you mean --learning_rate"),
        (["--model_name_or_path", "/no/such/model"], "model path /no/such/model does not exist"),
        (["--dataset", "/no/such/data.parquet"], "dataset path /no/such/data.parquet does not exist"),
        (["--prompt_key", "extra_info.query", "--response_key", "extra_info.answer"], "key extra_info.query not found"),
        (["--dataset_format", "messages"], "missing column(s) messages"),
        (["--report_to", "wandb"], "needs the wandb package"),
        (["--resume", "/no/ckpt"], "not a complete checkpoint"),
        (["--nnodes", "2"], "needs --master-addr"),
        (["--resume_from_checkpoint", "/no/ckpt"], "not a complete checkpoint"),
        # launcher mode: checked before torchrun starts, so one error line instead of a failure per rank
        (["--nproc-per-node", "2", "--dataset_format", "dolly"], "missing column(s) instruction"),
    ],
)
def test_bad_config_exits_2_before_loading_a_model(tiny_model, tmp_path, monkeypatch, capsys, args, needle):
    import importlib.util

    if "wandb" in args and importlib.util.find_spec("wandb"):
        pytest.skip("wandb is installed here")
    import transformers

    from trainbox.cli import sft

    def no_model(*a, **k):
        raise AssertionError("a model was loaded before the config was validated")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_model)
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    data = write_verl_gsm8k(tmp_path / "g.parquet", 4)
    base = ["--model_name_or_path", str(tiny_model), "--dataset", str(data), "--output_dir", str(tmp_path / "o")]
    try:
        assert sft.main(base + FAST + args) == 2
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and needle in err[-1], err
    assert not (tmp_path / "o").exists()


def test_sigterm_saves_checkpoint_and_rerun_resumes(tiny_model, tmp_path):
    data = write_dolly(tmp_path / "dolly.jsonl", 32)
    out = tmp_path / "out"
    args = ["--model_name_or_path", str(tiny_model), "--dataset", str(data), "--output_dir", str(out),
            "--save_steps", "1000", *FAST]  # fmt: skip
    p = spawn("trainbox.cli.sft", args + ["--max_steps", "1000"], env_for(tmp_path))
    seen = []
    for line in p.stdout:
        seen.append(line)
        if "'loss'" in line:  # training is under way: preempt it
            p.send_signal(signal.SIGTERM)
            break
    seen.append(p.stdout.read())
    assert p.wait(timeout=120) == 0, "".join(seen)
    log = "".join(seen)
    assert "got signal SIGTERM" in log and "sft preempted (checkpoint saved)" in log
    ckpts = sorted(out.glob("checkpoint-*"))
    assert len(ckpts) == 1, ckpts
    n = state(ckpts[0])["global_step"]
    assert 1 <= n < 1000 and not (out / "model.safetensors").exists()  # stopped early, no final model

    r = run("trainbox.cli.sft", args + ["--max_steps", str(n + 2)], env_for(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"resuming from {ckpts[0]}" in r.stdout
    assert f"steps {n + 2}/{n + 2} (this run 2)" in r.stdout
    final = out / f"checkpoint-{n + 2}"
    assert state(final)["global_step"] == n + 2
    assert loss_steps(final)[-3:] == [n, n + 1, n + 2]  # one continuous history, not a restart from step 1


@pytest.mark.parametrize("target", ["launcher", "every process"])
def test_two_processes_sigterm_reaches_both_ranks(tiny_model, tmp_path, target):
    """`--nproc-per-node 2`: the launcher starts torchrun (gloo DDP). SIGTERM to the launcher (`docker stop`) is
    forwarded to both ranks; SIGTERM to every process (Slurm's scancel) must not make torchrun kill the ranks
    before they save. Either way both ranks checkpoint and the run exits 0."""
    data = write_messages(tmp_path / "chat.jsonl", 32)
    out = tmp_path / "out"
    args = ["--model_name_or_path", str(tiny_model), "--dataset", str(data), "--output_dir", str(out),
            "--save_steps", "1000", "--max_steps", "1000", "--nproc-per-node", "2", *FAST]  # fmt: skip
    p = spawn("trainbox.cli.sft", args, env_for(tmp_path))
    seen = []
    for line in p.stdout:
        seen.append(line)
        if "'loss'" in line:
            pids = [p.pid] + (descendants(p.pid) if target == "every process" else [])
            for pid in pids:
                os.kill(pid, signal.SIGTERM)
            break
    seen.append(p.stdout.read())
    log = "".join(seen)
    assert p.wait(timeout=120) == 0, log
    assert "torchrun nnodes=1 nproc_per_node=2" in log and "DDP over gloo, 2 processes (CPU)" in log
    assert log.count("got signal SIGUSR1") == 2  # forwarded to each rank
    if target == "every process":
        assert log.count("got signal SIGTERM") == 2 and "SignalException" not in log, log
    (ckpt,) = out.glob("checkpoint-*")
    assert state(ckpt)["global_step"] >= 1 and (ckpt / "model.safetensors").is_file()


def test_two_nodes_on_one_host_c10d(tiny_model, tmp_path):
    data = write_verl_gsm8k(tmp_path / "g.parquet", 16)
    out = tmp_path / "out"
    port = str(free_port())
    procs = [
        spawn("trainbox.cli.sft", ["--model_name_or_path", str(tiny_model), "--dataset", str(data),
                                  "--output_dir", str(out), "--max_steps", "2", *FAST, "--nnodes", "2",
                                  "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port,
                                  "--node-rank", str(rank)], env_for(tmp_path))  # fmt: skip
        for rank in (0, 1)
    ]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n-----\n".join(logs)
    both = "".join(logs)
    assert both.count("torchrun nnodes=2 nproc_per_node=1") == 2
    assert "DDP over gloo, 2 processes (CPU)" in both and both.count("[trainbox] sft done") == 1
    assert state(out / "checkpoint-2")["global_step"] == 2 and (out / "model.safetensors").is_file()


def test_srun_style_one_task_per_rank(tiny_model, tmp_path):
    """What `srun -N1 -n2 python -m trainbox.cli.sft ...` gives each task: the tasks are the ranks, no torchrun."""
    data = write_messages(tmp_path / "chat.jsonl", 16)
    out = tmp_path / "out"
    job = str(10000 + free_port() % 20000)  # the rendezvous port derives from the job id
    procs = []
    for rank in (0, 1):
        env = env_for(tmp_path, SLURM_JOB_ID=job, SLURM_STEP_ID="0", SLURM_JOB_NODELIST="localhost",
                      SLURM_NNODES="1", SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_NODEID="0",
                      SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank))  # fmt: skip
        procs.append(spawn("trainbox.cli.sft", ["--model_name_or_path", str(tiny_model), "--dataset", str(data),
                                               "--output_dir", str(out), "--max_steps", "2", *FAST], env))  # fmt: skip
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n-----\n".join(logs)
    assert "DDP over gloo, 2 processes (CPU)" in logs[0] and "[trainbox] sft done" in logs[0]
    assert state(out / "checkpoint-2")["global_step"] == 2
