"""A run's edges (issue 65): `--resume never` starts over for real, outputs follow the umask, `--max_steps 0` is
refused, a stop signal before training ends cleanly with a line."""

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common import atomic
from trainbox.run import outputs, preemption, resume

ROOT = Path(__file__).resolve().parent.parent


def _mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def _with_umask(mask):
    def run():
        os.umask(mask)
    return run


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(preemption, "_preempt_requested", False)
    monkeypatch.setattr(preemption, "_preempted", False)
    monkeypatch.setattr(preemption, "_checkpoint_saved", None)
    monkeypatch.setattr(resume, "_run_name", None)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TRAINBOX_PREEMPTED_EXIT_CODE"):
        monkeypatch.delenv(k, raising=False)


def _ckpt(root: Path, step: int) -> Path:
    d = root / f"checkpoint-{step}"
    d.mkdir(parents=True)
    (d / "trainer_state.json").write_text(json.dumps({"global_step": step, "max_steps": step}))
    return d


# ---------------------------------------------------------------- case 1: --resume never starts over


def test_resume_never_moves_the_earlier_run_aside_so_auto_never_takes_it(fresh, tmp_path, capsys):
    out = tmp_path / "out"
    for step in (2, 4, 6):
        _ckpt(out, step)
    (out / resume.RUN_FILE).write_text(json.dumps({"trainer": "sft", "finished": True, "global_step": 6,
                                                   "max_steps": 6, "num_train_epochs": 3.0}))
    (out / "model.safetensors").write_bytes(b"old final model")  # the new run overwrites it: not moved
    assert resume.resolve_resume("never", str(out), None, "sft") is None
    said = capsys.readouterr().out
    [aside] = list(out.glob(resume.ABANDONED + "*"))
    assert said.count("\n") == 1 and "--resume never" in said and str(aside) in said and "nothing deleted" in said
    assert "3 checkpoints (checkpoint-2 .. checkpoint-6)" in said and "run record" in said
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoint-2", "checkpoint-4", "checkpoint-6", resume.RUN_FILE]
    assert not list(out.glob("checkpoint-*")) and (out / "model.safetensors").is_file()
    # The new run's first checkpoint is what auto takes next: the abandoned checkpoint-6 is out of its sight.
    _ckpt(out, 1)
    assert resume.resolve_resume("auto", str(out), None, "sft") == str(out / "checkpoint-1")
    # A second start-over the same second gets a folder of its own; an empty output folder moves nothing.
    resume.resolve_resume("never", str(out), None, "sft")
    assert len(list(out.glob(resume.ABANDONED + "*"))) == 2
    assert resume.abandon_earlier_run(str(tmp_path / "empty"), "sft") is None
    capsys.readouterr()
    # Only the main process moves anything; the launcher's check (no entrypoint name) neither.
    _ckpt(out, 3)
    assert resume.resolve_resume("never", str(out)) is None
    os.environ["RANK"] = "1"
    try:
        assert resume.resolve_resume("never", str(out), None, "sft") is None
    finally:
        del os.environ["RANK"]
    assert (out / "checkpoint-3").is_dir() and capsys.readouterr().out == ""


def test_abandoned_checkpoints_stay_out_of_the_artifact_copy(fresh, tmp_path, monkeypatch):
    out = tmp_path / "out"
    _ckpt(out / "abandoned-20260101T000000Z", 6)
    (out / "model.safetensors").write_bytes(b"w")
    monkeypatch.delenv(outputs.CHECKPOINTS_ENV, raising=False)
    copied = Path(outputs.copy_artifacts(str(out), str(tmp_path / "art"), "sft"))
    assert (copied / "model.safetensors").is_file() and not list(copied.glob("abandoned-*"))


# ---------------------------------------------------------------- case 2: outputs follow the umask


@pytest.mark.parametrize("mask", [0o002, 0o022])
def test_safetensors_and_atomic_writes_follow_the_umask(tmp_path, mask):
    """safetensors >= 0.8 wrote 0600 whatever the umask (its Rust temporary); the atomic writer forced 0644."""
    import torch
    from safetensors.torch import save_file

    old = os.umask(mask)
    try:
        outputs.follow_umask_in_safetensors()
        outputs.follow_umask_in_safetensors()  # idempotent: wrapped once
        save_file({"w": torch.zeros(2)}, str(tmp_path / "a.safetensors"))
        atomic.write_text(tmp_path / "r.json", "{}")
        with open(tmp_path / "plain.txt", "w") as f:
            f.write("x")
        want = _mode(tmp_path / "plain.txt")
        assert want == 0o666 & ~mask
        assert _mode(tmp_path / "a.safetensors") == want and _mode(tmp_path / "r.json") == want
        # An existing file keeps its own mode, as open(..., "w") keeps it.
        os.chmod(tmp_path / "a.safetensors", 0o640)
        os.chmod(tmp_path / "r.json", 0o640)
        save_file({"w": torch.ones(2)}, str(tmp_path / "a.safetensors"))
        atomic.write_text(tmp_path / "r.json", "{ }")
        assert _mode(tmp_path / "a.safetensors") == 0o640 and _mode(tmp_path / "r.json") == 0o640
        assert atomic.umask() == mask
    finally:
        os.umask(old)


def test_a_real_sft_run_follows_the_umask_and_resume_never_starts_over(tiny_model, tmp_path):
    """Run 1 under umask 002 (a shared cluster folder): every file it wrote, the safetensors of the final model and
    of each checkpoint included, is group-writable like config.json. Run 2 with --resume never under umask 022:
    the first run's checkpoints are moved aside with one line, and the next auto resume would take run 2's own."""
    from test_data import write_messages
    from test_sft import FAST, env_for

    data = write_messages(tmp_path / "chat.jsonl", 8)
    out = tmp_path / "out"
    run = [sys.executable, "-m", "trainbox", "sft", "--model_name_or_path", str(tiny_model), "--dataset", str(data),
           "--output_dir", str(out), "--save_steps", "1", *FAST]
    r = subprocess.run([*run, "--max_steps", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=env_for(tmp_path), preexec_fn=_with_umask(0o002))
    assert r.returncode == 0, r.stderr[-3000:]
    written = [p for p in out.rglob("*") if p.is_file()]
    tensors = [p for p in written if p.suffix == ".safetensors"]
    assert {p.parent.name for p in tensors} >= {"out", "checkpoint-1", "checkpoint-2"}, tensors
    assert {oct(_mode(p)) for p in written} == {oct(0o664)}, {str(p): oct(_mode(p)) for p in written}

    r = subprocess.run([*run, "--max_steps", "1", "--resume", "never"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=env_for(tmp_path), preexec_fn=_with_umask(0o022))
    assert r.returncode == 0, r.stderr[-3000:]
    [aside] = list(out.glob("abandoned-*"))
    assert f"moved to {aside}" in r.stdout and "resuming from" not in r.stdout, r.stdout[-2000:]
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoint-1", "checkpoint-2", resume.RUN_FILE]
    assert resume.resume_checkpoint(str(out)) == str(out / "checkpoint-1")
    assert json.loads((out / "checkpoint-1" / "trainer_state.json").read_text())["global_step"] == 1
    assert _mode(out / "model.safetensors") == 0o664  # overwritten: keeps its mode
    assert _mode(out / "checkpoint-1" / "model.safetensors") == 0o644  # new, under 022


# ---------------------------------------------------------------- case 11: --max_steps 0


def test_max_steps_0_is_refused_before_anything_loads(tiny_model, tmp_path):
    from common.errors import UsageError
    from test_data import write_messages
    from trainbox.cli import sft

    data = write_messages(tmp_path / "chat.jsonl", 4)
    with pytest.raises(UsageError, match=r"--max_steps 0 trains nothing; pass a number of steps above 0, or -1"):
        sft.parse(["--model_name_or_path", str(tiny_model), "--dataset", str(data), "--max_steps", "0"])
    # -1 (the default: epochs) and a positive count parse.
    for steps in ("-1", "3"):
        sft.parse(["--model_name_or_path", str(tiny_model), "--dataset", str(data), "--max_steps", steps])


# ---------------------------------------------------------------- case 12: a stop signal before training


def test_stop_before_training_says_so_and_exits_with_the_preempted_code(fresh, capsys, monkeypatch):
    assert preemption.stop_before_training("sft") == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nothing to save yet" in err and preemption.was_preempted()
    monkeypatch.setenv("TRAINBOX_PREEMPTED_EXIT_CODE", "99")  # a job script that requeues itself
    assert preemption.stop_before_training("sft") == 99


def test_sigterm_while_the_trainer_imports_ends_cleanly_with_a_line(tiny_model, tmp_path):
    """`docker stop` / scancel a second after the start: the trainer was still importing torch (seconds), and the
    default disposition killed it (exit 143, no output). Now the dispatcher holds the signal across its exec, the
    trainer takes it into its handler first thing, and it ends before training: exit 0, one line, no checkpoint."""
    from test_data import write_messages
    from test_sft import FAST, env_for

    data = write_messages(tmp_path / "chat.jsonl", 4)
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-m", "trainbox", "sft", "--model_name_or_path", str(tiny_model),
                          "--dataset", str(data), "--output_dir", str(out), "--max_steps", "2", *FAST],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_for(tmp_path))
    deadline = time.time() + 60
    while b"trainbox.cli.sft" not in Path(f"/proc/{p.pid}/cmdline").read_bytes():  # the dispatcher exec'ed it
        assert time.time() < deadline and p.poll() is None
        time.sleep(0.02)
    p.send_signal(signal.SIGTERM)  # while the trainer imports torch (seconds)
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0, (p.returncode, stderr[-3000:])
    assert "nothing to save yet" in stderr and "Traceback" not in stderr, stderr[-3000:]
    assert not list(out.glob("checkpoint-*")) and not (out / "model.safetensors").exists()
