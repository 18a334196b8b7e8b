"""A run's lifecycle (outputs, preemption, resume, crash, runsummary): output dir precedence, resume checkpoint choice,
preemption flag -> save+stop, summary, artifact copy."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import TrainerControl, TrainerState

import sidebyside
from trainbox.run import outputs, preemption, resume, runsummary


@pytest.fixture
def fresh(monkeypatch):
    """Reset the module's run flags and restore signal handlers after each test."""
    old = {s: signal.getsignal(s) for s in preemption.PREEMPT_SIGNALS}
    monkeypatch.setattr(preemption, "_preempt_requested", False)
    monkeypatch.setattr(preemption, "_preempted", False)
    monkeypatch.setattr(preemption, "_checkpoint_saved", None)
    for var in ("OUTPUT_DIR", "ARTIFACT_DIR", "SAKURA_ARTIFACT_DIR", "TRAINBOX_PREEMPTED_EXIT_CODE"):
        monkeypatch.delenv(var, raising=False)
    yield
    for s, h in old.items():
        signal.signal(s, h)


def test_output_dir_precedence(fresh, monkeypatch):
    assert outputs.output_dir(None) == "/workspace/outputs"
    monkeypatch.setenv("OUTPUT_DIR", "/env/out")
    assert outputs.output_dir(None) == "/env/out"
    assert outputs.output_dir("/explicit") == "/explicit"


def make_ckpt(root, step, complete=True):
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"x")
    if complete:
        (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return d


def test_resume_checkpoint_numeric_order_and_incomplete(fresh, tmp_path):
    assert resume.resume_checkpoint(str(tmp_path / "missing")) is None
    assert resume.resume_checkpoint(str(tmp_path)) is None
    make_ckpt(tmp_path, 9)
    make_ckpt(tmp_path, 10)
    (tmp_path / "checkpoint-notes").mkdir()
    assert resume.resume_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-10")  # 10 > 9, not "1" < "9"
    make_ckpt(tmp_path, 12, complete=False)  # killed while saving
    assert resume.resume_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-10")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_sets_save_and_stop_at_step_end(fresh, sig):
    cb = preemption.PreemptionCallback()
    args, state, control = SimpleNamespace(output_dir="/o"), TrainerState(), TrainerControl()
    state.global_step = 3
    cb.on_step_end(args, state, control)
    assert not control.should_save and not control.should_training_stop and not preemption.was_preempted()
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # let the interpreter run the Python-level handler
    assert preemption.preempt_requested()
    cb.on_step_end(args, state, control)
    assert control.should_save and control.should_training_stop
    assert preemption.was_preempted()
    cb.on_save(args, state, control)
    assert preemption._checkpoint_saved == "/o/checkpoint-3"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_step_end_takes_back_signals_a_native_library_took(fresh, sig):
    """Triton's LLVM installs its own sigaction for SIGTERM/SIGUSR1 when it first compiles (seen on H200 under
    FSDP2: training then ignored preemption). Python still reports our handler, so each step end re-installs it."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    cb = preemption.PreemptionCallback()
    args, state, control = SimpleNamespace(output_dir="/o"), TrainerState(), TrainerControl()
    libc.signal(int(sig), 1)  # SIG_IGN behind Python's back, as a C library's sigaction would be
    assert signal.getsignal(sig) is preemption._handler  # Python cannot tell
    cb.on_step_end(args, state, control)
    os.kill(os.getpid(), sig)
    time.sleep(0.05)
    assert preemption.preempt_requested(), "the signal went to the native disposition, not to ours"
    cb.on_step_end(args, state, control)
    assert control.should_save and control.should_training_stop


def test_exit_code(fresh, monkeypatch):
    assert preemption.exit_code() == 0
    monkeypatch.setattr(preemption, "_preempted", True)
    assert preemption.exit_code() == 0  # clean end by default: torchrun/Slurm see success
    monkeypatch.setenv("TRAINBOX_PREEMPTED_EXIT_CODE", "99")
    assert preemption.exit_code() == 99


def fake_trainer(tmp_path, steps=5, tokens=1000):
    cb = preemption.PreemptionCallback()
    state = TrainerState()
    cb.on_train_begin(None, state, None)
    cb.started_at -= 2.0  # pretend two seconds of training
    state.global_step, state.max_steps, state.num_input_tokens_seen = steps, 10, tokens
    return SimpleNamespace(state=state, callback_handler=SimpleNamespace(callbacks=[cb]))


def test_summary_line(fresh, tmp_path):
    line = runsummary.summary(fake_trainer(tmp_path), str(tmp_path), time.time() - 3, "sft")
    assert line.startswith("[trainbox] sft done: steps 5/10 (this run 5)")
    assert "tokens 1000 (" in line and "tokens/s" in line and f"outputs {tmp_path}" in line
    tokens_per_s = float(line.split("tokens 1000 (")[1].split()[0])
    assert 0 < tokens_per_s <= 500.0  # 1000 tokens over at least 2 s


def test_finish_copies_to_artifact_dir(fresh, tmp_path, monkeypatch, capsys):
    out = tmp_path / "outputs"
    (out / "checkpoint-5").mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"weights")
    art = tmp_path / "artifacts"
    monkeypatch.setenv("SAKURA_ARTIFACT_DIR", str(art))
    runsummary.finish(fake_trainer(tmp_path), str(out), time.time(), "qlora")
    assert (art / "outputs" / "model.safetensors").read_bytes() == b"weights"
    assert not (art / "outputs" / "checkpoint-5").exists()  # checkpoints only on request
    assert f"artifacts {art / 'outputs'}" in capsys.readouterr().out
    # A second run replaces the copy; ARTIFACT_DIR wins over SAKURA_ARTIFACT_DIR; no temp dirs left behind.
    (out / "model.safetensors").write_bytes(b"new")
    art2 = tmp_path / "a2"
    monkeypatch.setenv("ARTIFACT_DIR", str(art2))
    runsummary.finish(fake_trainer(tmp_path), str(out), time.time(), "qlora")
    assert (art2 / "outputs" / "model.safetensors").read_bytes() == b"new"
    outputs.copy_artifacts(str(out), str(art), "qlora")
    assert (art / "outputs" / "model.safetensors").read_bytes() == b"new"
    assert sorted(os.listdir(art)) == ["outputs"]


def test_finish_silent_on_other_ranks(fresh, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("ARTIFACT_DIR", str(tmp_path / "art"))
    runsummary.finish(fake_trainer(tmp_path), str(tmp_path), time.time(), "sft")
    assert capsys.readouterr().out == "" and not (tmp_path / "art").exists()


def test_preempted_summary_names_checkpoint(fresh, tmp_path, monkeypatch):
    monkeypatch.setattr(preemption, "_preempted", True)
    make_ckpt(tmp_path, 5)
    line = runsummary.summary(fake_trainer(tmp_path), str(tmp_path), time.time(), "sft")
    assert "preempted (checkpoint saved)" in line and str(tmp_path / "checkpoint-5") in line


# ------------------------------------------------------------------ the run's log, next to the outputs (runlog.py)

ROOT = Path(__file__).resolve().parents[1]

TEE_RUN = """
import os, subprocess, sys
from types import SimpleNamespace
from trainbox.run import runlog
plan = SimpleNamespace(mode="torchrun", node_rank=int(sys.argv[2]), env={})
with runlog.for_command("sft", sys.argv[1], plan, ["--x", "1"]):
    print("python print", flush=True)
    os.write(2, b"native stderr\\n")
    subprocess.run([sys.executable, "-c", "print('a rank (child process)')"], check=True)
print("after the run", flush=True)
"""


@pytest.mark.parametrize("node_rank, name", [(0, "sft.log"), (1, "sft.node1.log")])
def test_command_run_log_has_every_process_and_lands_in_artifacts(tmp_path, node_rank, name):
    out, art = tmp_path / "out", tmp_path / "art"
    env = {k: v for k, v in os.environ.items() if "ARTIFACT_DIR" not in k}
    r = subprocess.run([sys.executable, "-c", TEE_RUN, str(out), str(node_rank)], cwd=ROOT, capture_output=True,
                       text=True, env=dict(env, PYTHONPATH=str(ROOT), ARTIFACT_DIR=str(art)), timeout=60)
    assert r.returncode == 0, r.stderr
    # Still on the terminal, as before.
    assert r.stdout.splitlines() == ["python print", "a rank (child process)", "after the run"]
    assert r.stderr == "native stderr\n"
    log = (out / "logs" / name).read_text()
    assert log.startswith("$ trainbox sft --x 1\n") and "after the run" not in log
    assert {"python print", "native stderr", "a rank (child process)"} <= set(log.splitlines())
    assert (art / "out" / "logs" / name).read_text() == log
    assert [p.name for p in (art / "out" / "logs").iterdir()] == [name]  # no temporaries


def test_workers_and_other_ranks_keep_no_log(monkeypatch):
    from trainbox.run import runlog

    plan = SimpleNamespace(mode="train", env={}, node_rank=0)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert not runlog.keeps_log_here(plan)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert runlog.keeps_log_here(plan)
    assert not runlog.keeps_log_here(SimpleNamespace(mode="train", env={"RANK": "1"}, node_rank=0))


HUB_TOKEN = "hf_s3cretTokenForTheRunLogTest"


def test_sft_command_run_puts_its_log_next_to_the_model_in_artifact_dir(tiny_model, tmp_path):
    """`trainbox sft --nproc-per-node 2` with ARTIFACT_DIR: the launcher's log holds both ranks' lines and the final
    summary (printed after the outputs were copied), and it is copied next to the model."""
    from test_data import write_messages
    from test_sft import FAST, env_for

    data = write_messages(tmp_path / "chat.jsonl", 16)
    out, art = tmp_path / "out", tmp_path / "art"
    r = subprocess.run([sys.executable, "-u", "-m", "trainbox.cli.sft", "--model_name_or_path", str(tiny_model),
                        "--dataset", str(data), "--output_dir", str(out), "--max_steps", "2",
                        "--nproc-per-node", "2", "--hub_token", HUB_TOKEN, *FAST], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=env_for(tmp_path, ARTIFACT_DIR=str(art)))  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (art / "out" / "model.safetensors").is_file()
    # A token given on the command line is nowhere: not on the terminal, not in the log, not in any output file.
    assert HUB_TOKEN not in r.stdout + r.stderr
    leaked = [p for p in [*out.rglob("*"), *art.rglob("*")] if p.is_file() and HUB_TOKEN.encode() in p.read_bytes()]
    assert leaked == [], leaked
    assert "--hub_token ***" in (out / "logs" / "sft.log").read_text()
    log = (art / "out" / "logs" / "sft.log").read_text()
    assert "torchrun nnodes=1 nproc_per_node=2" in log and "rdzv=standalone" in log  # the launcher
    assert "DDP over gloo, 2 processes (CPU)" in log  # rank 0
    assert "[trainbox] sft done" in log and f"artifacts {art / 'out'}" in log  # after the outputs' copy
    assert log == (out / "logs" / "sft.log").read_text()


def test_notebook_run_shares_the_log_and_artifact_copy(tiny_model, tmp_path):
    """notebook.run: the same log file and artifact copy, teeing Python's streams (a kernel's output isn't fd 1);
    the entrypoint's own command-run log does not start a second tee."""
    from test_data import write_messages
    from test_sft import FAST, env_for

    data = write_messages(tmp_path / "chat.jsonl", 8)
    out, art = tmp_path / "nb-out", tmp_path / "art"
    code = ("import sys; from trainbox.run import notebook; "
            f"notebook.run('sft', {['--model_name_or_path', str(tiny_model), '--dataset', str(data), '--max_steps', '1', *FAST]!r}, output_dir={str(out)!r})")  # noqa: E501
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=env_for(tmp_path, ARTIFACT_DIR=str(art)))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    log = (art / "nb-out" / "logs" / "sft.log").read_text()
    assert log.startswith("$ trainbox sft ") and log.count("$ trainbox sft ") == 1
    assert "[trainbox] sft done" in log and "[trainbox] sft done" in r.stdout
    assert (art / "nb-out" / "model.safetensors").is_file()


def test_dataloader_workers_outlive_the_preemption_signal(tmp_path):
    """`scancel`/`docker stop` signal every process, DataLoader workers too. A worker with the default disposition
    (what Triton leaves after it takes SIGTERM) died, and the rank crashed without a checkpoint. The Trainer's
    worker_init_fn (transformers.trainer.seed_worker) is wrapped: workers ignore the signal, the loader runs on."""
    script = tmp_path / "loader.py"
    script.write_text(textwrap.dedent("""\
        import ctypes, os, signal, sys
        from functools import partial
        import torch
        from torch.utils.data import DataLoader, Dataset
        from trainbox.run import preemption
        if sys.argv[1] == "shielded":
            preemption.install_signal_handlers()
        import transformers.trainer as hf_trainer   # looked up at loader build time, as Trainer._get_dataloader does
        libc = ctypes.CDLL(None)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        libc.signal(int(signal.SIGTERM), 0)   # SIG_DFL behind Python's back, as Triton's LLVM leaves it

        class Signalled(Dataset):
            def __len__(self):
                return 8
            def __getitem__(self, i):
                if i == 2:
                    os.kill(os.getpid(), signal.SIGTERM)   # the worker gets scancel's signal mid-epoch
                return torch.tensor([i])

        loader = DataLoader(Signalled(), batch_size=2, num_workers=1,
                            worker_init_fn=partial(hf_trainer.seed_worker, num_workers=1, rank=0))
        print("batches", len(list(loader)))
        """))
    env = dict(os.environ, PYTHONPATH=str(Path(outputs.__file__).resolve().parents[2]))
    hows = ("plain", "shielded")
    runs = dict(zip(hows, sidebyside.in_parallel([
        partial(subprocess.run, [sys.executable, str(script), how], capture_output=True, text=True, env=env,
                timeout=120) for how in hows])))
    assert runs["plain"].returncode != 0 and "killed by signal: Terminated" in runs["plain"].stderr  # the failure
    assert runs["shielded"].returncode == 0 and "batches 4" in runs["shielded"].stdout, runs["shielded"].stderr


# ------------------------------------------------------------------ a crashed run ends (crash.ends_on_crash)



@pytest.mark.parametrize("name,nproc", [("sft", 1), ("sft", 2), ("qlora", 1)])
def test_an_injected_crash_with_loader_workers_exits_nonzero_within_30s(tiny_model, tmp_path, name, nproc):
    """The crash at step 2 with 2 persistent DataLoader workers per rank (which ignore SIGTERM): before, the process
    hung in multiprocessing's exit handler (measured: still alive after 10 min, SIGTERM only said it would
    checkpoint); now it exits 1 within seconds, leaving no process behind; with 2 ranks the other rank ends too."""
    import psutil

    from test_data import write_messages
    from test_sft import FAST, env_for

    data = write_messages(tmp_path / "chat.jsonl", 32)
    argv = ["--model_name_or_path", str(tiny_model), "--dataset", str(data), "--output_dir", str(tmp_path / "out"),
            "--max_steps", "5", *FAST, "--dataloader_num_workers", "2", "--dataloader_persistent_workers", "true"]
    if nproc > 1:
        argv += ["--nproc-per-node", str(nproc)]
    # torchrun's ranks run `python -m trainbox.cli.sft`, not this script: the crash is injected there by a
    # sitecustomize on PYTHONPATH.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('LOCAL_RANK') == '1' or os.environ.get('TRAINBOX_CRASH_ALL'):\n"
        "    import transformers\n    real = transformers.Trainer.training_step\n"
        "    def training_step(self, *a, **k):\n        if self.state.global_step >= 1:\n"
        "            raise RuntimeError('injected crash at step 2')\n        return real(self, *a, **k)\n"
        "    transformers.Trainer.training_step = training_step\n")
    env = env_for(tmp_path)
    env["PYTHONPATH"] = f"{site}{os.pathsep}{env['PYTHONPATH']}"
    env["TRAINBOX_CRASH_ALL"] = "" if nproc > 1 else "1"
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", f"trainbox.cli.{name}", *argv], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        raise AssertionError(f"{name} x{nproc}: still running 300 s after start (a hang)")
    took = time.monotonic() - t0
    assert p.returncode != 0 and took < 30 + 60, (took, out[-3000:])  # 30 s past start-up, on a busy 2-core box
    assert "injected crash at step 2" in out, out[-3000:]
    crashed_at = out.index("injected crash at step 2")
    assert "[trainbox] the run crashed" in out[crashed_at - 5000:] or "[trainbox] the run crashed" in out, out[-3000:]
    left = [q for q in psutil.process_iter(["cmdline"]) if str(tmp_path / "out") in " ".join(q.info["cmdline"] or [])]
    assert left == [], f"processes left behind: {left}"
    print(f"{name} x{nproc}: exit {p.returncode} after {took:.1f} s (start-up and 1 step included)")


def test_a_truncated_trainer_state_resumes_from_the_checkpoint_before(fresh, tmp_path, tiny_model):
    """A kill during the Trainer's plain write of trainer_state.json: the unit check, then a real sft resume."""
    make_ckpt(tmp_path / "u", 1)
    bad = make_ckpt(tmp_path / "u", 2)
    (bad / "trainer_state.json").write_text('{"global_step": 2, "log_hist')
    assert resume.resume_checkpoint(str(tmp_path / "u")) == str(tmp_path / "u" / "checkpoint-1")

    from test_data import write_messages
    from test_sft import FAST, env_for

    data = write_messages(tmp_path / "chat.jsonl", 16)
    out = tmp_path / "out"
    run = [sys.executable, "-m", "trainbox.cli.sft", "--model_name_or_path", str(tiny_model), "--dataset", str(data),
           "--output_dir", str(out), "--save_steps", "1", *FAST]
    r = subprocess.run([*run, "--max_steps", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=env_for(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    state = out / "checkpoint-2" / "trainer_state.json"
    state.write_text(state.read_text()[:40])  # cut short
    r = subprocess.run([*run, "--max_steps", "3"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=env_for(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "skipping" in r.stderr and "checkpoint-2" in r.stderr and "does not parse" in r.stderr, r.stderr[-3000:]
    assert json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())["global_step"] == 3


def test_checkpoints_reach_the_artifacts_only_on_request_and_nothing_is_copied_when_preempted(fresh, tmp_path,
                                                                                             monkeypatch, capsys):
    out = tmp_path / "outputs"
    (out / "checkpoint-5").mkdir(parents=True)
    (out / "checkpoint-5" / "optimizer.pt").write_bytes(b"big")
    (out / "logs").mkdir()
    (out / "logs" / "sft.log").write_text("log")
    (out / "model.safetensors").write_bytes(b"weights")
    monkeypatch.setenv("ARTIFACT_DIR", str(tmp_path / "a"))
    monkeypatch.setenv(outputs.CHECKPOINTS_ENV, "1")
    runsummary.finish(fake_trainer(tmp_path), str(out), time.time(), "sft")
    assert (tmp_path / "a" / "outputs" / "checkpoint-5" / "optimizer.pt").is_file()
    assert (tmp_path / "a" / "outputs" / "logs" / "sft.log").is_file()
    monkeypatch.setenv("ARTIFACT_DIR", str(tmp_path / "b"))
    monkeypatch.setattr(preemption, "_preempted", True)
    runsummary.finish(fake_trainer(tmp_path), str(out), time.time(), "sft")
    assert not (tmp_path / "b").exists()
    assert "artifacts not copied (preempted" in capsys.readouterr().out


_AGREE_RANK = """
import json, sys, torch.distributed as dist
from trainbox.run import preemption
rank, init = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
agreement = preemption.FlagAgreement(preemption.flag_group())
stopped = next((step for step in range(1, 9) if agreement.step(rank == 1 and step >= 3)), None)
agreement.close()
dist.destroy_process_group()
print(json.dumps(stopped))
"""


def test_ranks_agree_on_the_flag_at_the_same_step_one_step_later(tmp_path):
    """Two gloo ranks; rank 1 is signalled during step 3: the overlapped agreement (no blocking all-reduce at any
    step end) tells both ranks at the end of step 4, never one without the other (FlagAgreement's bound)."""
    init = f"file://{tmp_path / 'store'}"
    procs = [subprocess.Popen([sys.executable, "-c", _AGREE_RANK, str(r), init], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, cwd=Path(outputs.__file__).parents[2])
             for r in (0, 1)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [json.loads(o.strip().splitlines()[-1]) for o in outs] == [4, 4], outs
