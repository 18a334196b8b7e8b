"""lifecycle: output dir precedence, resume checkpoint choice, preemption flag -> save+stop, summary, artifact copy."""

import json
import os
import signal
import time
from types import SimpleNamespace

import pytest
from transformers import TrainerControl, TrainerState

from entrypoints import lifecycle


@pytest.fixture
def fresh(monkeypatch):
    """Reset the module's run flags and restore signal handlers after each test."""
    old = {s: signal.getsignal(s) for s in lifecycle.PREEMPT_SIGNALS}
    monkeypatch.setattr(lifecycle, "_preempt_requested", False)
    monkeypatch.setattr(lifecycle, "_preempted", False)
    monkeypatch.setattr(lifecycle, "_checkpoint_saved", None)
    for var in ("OUTPUT_DIR", "ARTIFACT_DIR", "SAKURA_ARTIFACT_DIR", "TRAINBOX_PREEMPTED_EXIT_CODE"):
        monkeypatch.delenv(var, raising=False)
    yield
    for s, h in old.items():
        signal.signal(s, h)


def test_output_dir_precedence(fresh, monkeypatch):
    assert lifecycle.output_dir(None) == "/workspace/outputs"
    monkeypatch.setenv("OUTPUT_DIR", "/env/out")
    assert lifecycle.output_dir(None) == "/env/out"
    assert lifecycle.output_dir("/explicit") == "/explicit"


def make_ckpt(root, step, complete=True):
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"x")
    if complete:
        (d / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return d


def test_resume_checkpoint_numeric_order_and_incomplete(fresh, tmp_path):
    assert lifecycle.resume_checkpoint(str(tmp_path / "missing")) is None
    assert lifecycle.resume_checkpoint(str(tmp_path)) is None
    make_ckpt(tmp_path, 9)
    make_ckpt(tmp_path, 10)
    (tmp_path / "checkpoint-notes").mkdir()
    assert lifecycle.resume_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-10")  # 10 > 9, not "1" < "9"
    make_ckpt(tmp_path, 12, complete=False)  # killed while saving
    assert lifecycle.resume_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-10")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_sets_save_and_stop_at_step_end(fresh, sig):
    cb = lifecycle.PreemptionCallback()
    args, state, control = SimpleNamespace(output_dir="/o"), TrainerState(), TrainerControl()
    state.global_step = 3
    cb.on_step_end(args, state, control)
    assert not control.should_save and not control.should_training_stop and not lifecycle.was_preempted()
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # let the interpreter run the Python-level handler
    assert lifecycle.preempt_requested()
    cb.on_step_end(args, state, control)
    assert control.should_save and control.should_training_stop
    assert lifecycle.was_preempted()
    cb.on_save(args, state, control)
    assert lifecycle._checkpoint_saved == "/o/checkpoint-3"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_step_end_takes_back_signals_a_native_library_took(fresh, sig):
    """Triton's LLVM installs its own sigaction for SIGTERM/SIGUSR1 when it first compiles (seen on H200 under
    FSDP2: training then ignored preemption). Python still reports our handler, so each step end re-installs it."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    cb = lifecycle.PreemptionCallback()
    args, state, control = SimpleNamespace(output_dir="/o"), TrainerState(), TrainerControl()
    libc.signal(int(sig), 1)  # SIG_IGN behind Python's back, as a C library's sigaction would be
    assert signal.getsignal(sig) is lifecycle._handler  # Python cannot tell
    cb.on_step_end(args, state, control)
    os.kill(os.getpid(), sig)
    time.sleep(0.05)
    assert lifecycle.preempt_requested(), "the signal went to the native disposition, not to ours"
    cb.on_step_end(args, state, control)
    assert control.should_save and control.should_training_stop


def test_exit_code(fresh, monkeypatch):
    assert lifecycle.exit_code() == 0
    monkeypatch.setattr(lifecycle, "_preempted", True)
    assert lifecycle.exit_code() == 0  # clean end by default: torchrun/Slurm see success
    monkeypatch.setenv("TRAINBOX_PREEMPTED_EXIT_CODE", "99")
    assert lifecycle.exit_code() == 99


def fake_trainer(tmp_path, steps=5, tokens=1000):
    cb = lifecycle.PreemptionCallback()
    state = TrainerState()
    cb.on_train_begin(None, state, None)
    cb.started_at -= 2.0  # pretend two seconds of training
    state.global_step, state.max_steps, state.num_input_tokens_seen = steps, 10, tokens
    return SimpleNamespace(state=state, callback_handler=SimpleNamespace(callbacks=[cb]))


def test_summary_line(fresh, tmp_path):
    line = lifecycle.summary(fake_trainer(tmp_path), str(tmp_path), time.time() - 3, "sft")
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
    lifecycle.finish(fake_trainer(tmp_path), str(out), time.time(), "qlora")
    assert (art / "outputs" / "model.safetensors").read_bytes() == b"weights"
    assert (art / "outputs" / "checkpoint-5").is_dir()
    assert f"artifacts {art / 'outputs'}" in capsys.readouterr().out
    # A second run replaces the copy; ARTIFACT_DIR wins over SAKURA_ARTIFACT_DIR; no temp dirs left behind.
    (out / "model.safetensors").write_bytes(b"new")
    art2 = tmp_path / "a2"
    monkeypatch.setenv("ARTIFACT_DIR", str(art2))
    lifecycle.finish(fake_trainer(tmp_path), str(out), time.time(), "qlora")
    assert (art2 / "outputs" / "model.safetensors").read_bytes() == b"new"
    lifecycle.copy_artifacts(str(out), str(art), "qlora")
    assert (art / "outputs" / "model.safetensors").read_bytes() == b"new"
    assert sorted(os.listdir(art)) == ["outputs"]


def test_finish_silent_on_other_ranks(fresh, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("ARTIFACT_DIR", str(tmp_path / "art"))
    lifecycle.finish(fake_trainer(tmp_path), str(tmp_path), time.time(), "sft")
    assert capsys.readouterr().out == "" and not (tmp_path / "art").exists()


def test_preempted_summary_names_checkpoint(fresh, tmp_path, monkeypatch):
    monkeypatch.setattr(lifecycle, "_preempted", True)
    make_ckpt(tmp_path, 5)
    line = lifecycle.summary(fake_trainer(tmp_path), str(tmp_path), time.time(), "sft")
    assert "preempted (checkpoint saved)" in line and str(tmp_path / "checkpoint-5") in line
