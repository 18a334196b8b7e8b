"""Issue 29's in-image cases (#4-#6, #21-#26) and issue 32's nccl-check transport line: each as a user meets it.

A read-only container (#4) is made for real where we may mount: a private mount namespace (`unshare -m`, root) with a
read-only tmpfs over /tmp and /var/tmp, a read-only working directory and home, and a writable tmpfs as the outputs
volume, which is what `docker run --read-only` leaves. The same run in the smoke image is the engine-marked test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from enginefix import docker

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable

# ---------------------------------------------------------------------------------------------------- #4 read-only


def _can_unshare() -> bool:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return False
    r = subprocess.run(["unshare", "-m", "--propagation", "private", "true"], capture_output=True)
    return r.returncode == 0


needs_mount = pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare -m (a private mount namespace)")

# /tmp becomes a read-only tmpfs holding `ro` (cwd, home) and `out` (its own writable tmpfs: the outputs volume).
# What the run needs from under the old /tmp (a checkout or venv there: CI's clone may live in /tmp) is bound back
# in, read-only like the rest, from a view of the old /tmp kept in $KEEP (a folder outside /tmp).
READ_ONLY_BOX = """set -e
mount --bind /tmp "$KEEP"
mount -t tmpfs tmpfs /tmp
mkdir -p /tmp/out /tmp/ro
mount -t tmpfs tmpfs /tmp/out
for p in $KEEP_PATHS; do mkdir -p "/tmp/$p"; mount --bind "$KEEP/$p" "/tmp/$p"; done
mount -o remount,ro /tmp
mount -t tmpfs -o ro tmpfs /var/tmp
cd /tmp/ro
exec "$@"
"""


def _under_tmp(paths) -> str:
    """The parts of `paths` under /tmp, relative to it (the box binds them back in)."""
    out = []
    for p in paths:
        real = Path(p).resolve()
        if real.is_relative_to("/tmp") and real != Path("/tmp"):
            out.append(str(real.relative_to("/tmp")).split("/")[0])
    return " ".join(sorted(set(out)))


def in_read_only_box(args: list[str], output_dir: str = "/tmp/out", timeout: int = 300):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TMP", "TEMP", "XDG_", "HF_", "OUTPUT_DIR"))}
    env.update(HOME="/tmp/ro/home", OUTPUT_DIR=output_dir, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    keep = tempfile.mkdtemp(prefix="trainbox-box-", dir="/dev/shm" if os.path.isdir("/dev/shm") else "/run")
    env.update(KEEP=keep, KEEP_PATHS=_under_tmp([ROOT, sys.prefix, sys.base_prefix, PY]))
    try:
        return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", READ_ONLY_BOX, "box", *args],
                              capture_output=True, text=True, env=env, timeout=timeout)
    finally:
        os.rmdir(keep)


@needs_mount
def test_read_only_container_runs_with_temp_files_on_the_outputs_volume():
    """nccl-check makes a temp file (its one-process store) and doctor's probes use tempfile: both ran into
    `No usable temporary directory`; now TMPDIR goes to the outputs volume, said in one line."""
    r = in_read_only_box([PY, "-m", "trainbox", "nccl-check", "--min-bytes", "4K", "--max-bytes", "4K",
                          "--iters", "1", "--warmup", "0", "--ops", "all_reduce"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "No usable temporary directory" not in r.stderr and "Traceback" not in r.stderr
    assert "TMPDIR=/tmp/out/.tmp-0 on the outputs volume" in r.stderr
    assert "nccl-check: 1 ranks" in r.stdout


@needs_mount
def test_read_only_container_doctor_reports_instead_of_a_traceback():
    r = in_read_only_box([PY, "-m", "trainbox", "doctor"])
    assert "Traceback" not in r.stderr and "No usable temporary directory" not in r.stdout + r.stderr
    assert r.returncode in (0, 3, 4), r.stdout + r.stderr  # no GPU / fallbacks here; never a crash (1) or usage (2)
    assert "VERDICT:" in r.stdout


@needs_mount
def test_read_only_everywhere_is_one_line_and_exit_2():
    r = in_read_only_box([PY, "-m", "trainbox", "doctor"], output_dir="/tmp/ro/outputs")
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no writable folder for temporary files" in lines[0] and "--tmpfs /tmp" in lines[0]


def test_temp_plan_without_mounts(tmp_path, monkeypatch):
    """The same decision where we may not mount: tempfile's candidates all unwritable."""
    import tempfile

    from common.errors import UsageError
    from trainbox.run import cachedirs

    ro = tmp_path / "file"
    ro.write_text("")
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setattr(tempfile, "_candidate_tempdir_list", lambda: [str(ro / "sub")])
    add, line = cachedirs.temp_plan({"OUTPUT_DIR": str(tmp_path / "out")})
    assert add == {"TMPDIR": str(tmp_path / "out" / f".tmp-{os.getuid()}")} and "outputs volume" in line
    with pytest.raises(UsageError, match="no writable folder for temporary files"):
        cachedirs.temp_plan({"OUTPUT_DIR": str(ro / "out")})


@pytest.mark.engine
def test_read_only_smoke_image_doctor(smoke_image):
    """The image as built (this test fails on an image built before the fix: the traceback). The session's smoke
    image, built for the suite: a skip decided at collection time, when no image exists yet, never ran it on CI."""
    r = docker("run", "--rm", "--read-only", smoke_image, "doctor", check=False)
    assert "Traceback" not in r.stderr and "VERDICT:" in r.stdout, r.stdout + r.stderr
    assert "TMPDIR=/workspace/outputs/.tmp-1000 on the outputs volume" in r.stderr
    # Another uid can't write the image user's outputs volume either: one line, exit 2.
    r = docker("run", "--rm", "--read-only", "--user", "12345", smoke_image, "doctor", check=False)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stdout + r.stderr
    assert "no writable folder for temporary files" in r.stderr and "uid 12345" in r.stderr


# ---------------------------------------------------------------------------------------------------- #5 ports


@pytest.mark.parametrize("args, msg", [
    (["--master-port", "99999"], "--master-port: must be a TCP port, 1 to 65535, got 99999"),
    (["--master-port", "0"], "--master-port: must be a TCP port"),
    (["--node-rank", "-1"], "--node-rank: must be 0 or more"),
])
def test_nccl_check_port_out_of_range_is_one_line(args, msg):
    r = subprocess.run([PY, "-m", "trainbox", "nccl-check", *args], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.count("\n") == 1 and msg in r.stderr and "Traceback" not in r.stderr


# ------------------------------------------------------------------------- #6, #25 every option's range, up front


def test_qlora_lora_dropout_out_of_range_is_refused_before_the_model_loads(tiny_model, tmp_path):
    from test_data import write_dolly
    from test_sft import env_for, run

    data = write_dolly(tmp_path / "dolly.jsonl", 16)
    out = tmp_path / "out"
    r = run("trainbox.cli.qlora", ["--model_name_or_path", str(tiny_model), "--dataset", str(data),
                                  "--output_dir", str(out), "--lora_dropout", "1.5", "--max_steps", "1"],
            env_for(tmp_path))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "error: --lora_dropout 1.5: must be from 0 to 1 (not included)" in r.stderr
    assert "[trainbox] qlora: model" not in r.stdout and "Traceback" not in r.stderr  # nothing loaded
    assert not out.exists()


@pytest.mark.parametrize("entrypoint, args, msg", [
    ("grpo", ["--vllm_mode", "banana"], "invalid choice: 'banana' (choose from 'server', 'colocate')"),
    ("grpo", ["--vllm_server_wait", "-1"], "--vllm_server_wait -1.0: must be above 0"),
    ("grpo", ["--loss_type", "ppo"], "invalid choice: 'ppo'"),
    ("grpo", ["--vllm_gpu_memory_utilization", "1.5"], "must be from 0 (not included) to 1"),
    ("grpo", ["--vllm_server_port", "70000"], "--vllm_server_port 70000: must be from 1 to 65535"),
    ("qlora", ["--lora_dropout", "1.5"], "--lora_dropout 1.5: must be from 0 to 1 (not included)"),
    ("sft", ["--master_port", "99999"], "--master_port 99999: must be from 1 to 65535"),
    ("sft", ["--adam_beta1", "-0.1"], "--adam_beta1 -0.1: must be from 0 to 1"),
    ("sft", ["--max_steps", "-5"], "--max_steps -5: must be at least -1"),
])
def test_unused_options_are_still_checked_when_parsed(tiny_model, entrypoint, args, msg):
    """The options are judged when parsed, whether or not this run will use them (vLLM is not installed here)."""
    import importlib

    from common.errors import UsageError

    module = importlib.import_module(f"trainbox.cli.{entrypoint}")
    with pytest.raises(UsageError) as e:
        module.parse(["--model_name_or_path", str(tiny_model), "--dataset", "x.jsonl", *args])
    assert msg in str(e.value)


def test_yaml_values_meet_the_same_checks(tiny_model, tmp_path):
    from common.errors import UsageError
    from trainbox.cli import grpo

    (tmp_path / "a.yaml").write_text("vllm_mode: banana\n")
    with pytest.raises(UsageError, match="vllm_mode .*'banana' is not one of"):
        grpo.parse(["--config", str(tmp_path / "a.yaml")])
    (tmp_path / "b.yaml").write_text("scale_rewards: false\nvllm_mode: server\n")  # TRL maps a YAML false to none
    grpo.parse(["--config", str(tmp_path / "b.yaml"), "--model_name_or_path", str(tiny_model)])


def trainer_option_classes() -> dict:
    """Each trainer of the command table -> the option dataclasses its `parse` hands to config.parse_args (caught
    there: nothing parsed), so a new trainer's options are checked without naming it here."""
    import importlib

    from common import commands
    from trainbox.training import config

    class Seen(Exception):
        pass

    def capture(types, *a, **k):
        raise Seen(types)

    found = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(config, "parse_args", capture)
        for name in commands.names(trainer=True):
            with pytest.raises(Seen) as seen:
                importlib.import_module(commands.qualified(name)).parse([])
            found[name] = seen.value.args[0]
    return found


def test_every_numeric_option_has_a_range():
    """A trainer option that is a number is either in config.RANGES or, on purpose, in config.UNBOUNDED: a new TRL
    option (or a new trainer's) fails here until someone decides its range."""
    import dataclasses
    import typing

    from trainbox.training import config

    classes = {cls for types in trainer_option_classes().values() for cls in types}
    assert len(classes) >= 4  # the table has trainers, each with options (a capture that saw nothing fails here)
    missing = []
    for cls in sorted(classes, key=lambda c: c.__name__):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            text = str(hints.get(f.name))
            if ("int" in text or "float" in text) and "Literal" not in text and f.name not in config.RANGES \
                    and f.name not in config.UNBOUNDED:
                missing.append(f"{cls.__name__}.{f.name}")
    assert missing == []


# ---------------------------------------------------------------------------------- #21 a pinned package uninstalled


def test_doctor_fails_on_a_pinned_package_that_is_gone(tmp_path, monkeypatch, capsys):
    """`pip uninstall -y tqdm; trainbox doctor` said the constraints matched: the missing pin was skipped."""
    import json
    from importlib import metadata

    from trainbox.cli import doctor
    from trainbox.image import constraints, doctorchecks

    pins = tmp_path / "constraints.txt"
    pins.write_text(f"tqdm=={metadata.version('tqdm')}\nno-such-pinned-package==1.0\n"
                    "other-platform-only==2.0 ; sys_platform == 'win32'\n")
    monkeypatch.setattr(constraints, "PATH", str(pins))
    code = doctor.main(["--json"])
    report = json.loads(capsys.readouterr().out)
    row = next(c for c in report["checks"] if c["name"] == "constraints")
    assert row["status"] == "fail" and code == doctorchecks.EXIT_BROKEN
    assert "pinned but not installed: no-such-pinned-package 1.0" in row["detail"]
    assert "tqdm" not in row["detail"] and "other-platform-only" not in row["detail"]  # a pin for elsewhere
    assert row["detail"].endswith("`pip install no-such-pinned-package==1.0`")


# ------------------------------------------------------------------- issue 32 #5: nccl-check names what it measured

# Two GPUs of one node, NCCL 2.27 with NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 (rank 0's file; rank 1's is alike).
LOG_SOCKET_ONE_NODE = """\
gpu-a:5101:5101 [0] NCCL INFO NCCL version 2.27.5+cuda12.9
gpu-a:5101:5140 [0] NCCL INFO NCCL_P2P_DISABLE set by environment to 1
gpu-a:5101:5140 [0] NCCL INFO NCCL_SHM_DISABLE set by environment to 1.
gpu-a:5101:5140 [0] NCCL INFO NET/IB : No device found.
gpu-a:5101:5140 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.2<0>
gpu-a:5101:5140 [0] NCCL INFO Using network Socket
gpu-a:5101:5140 [0] NCCL INFO Channel 00/02 : 0 1
gpu-a:5101:5140 [0] NCCL INFO Channel 00/0 : 1[1] -> 0[0] [receive] via NET/Socket/0
gpu-a:5101:5140 [0] NCCL INFO Channel 01/0 : 1[1] -> 0[0] [receive] via NET/Socket/0
gpu-a:5101:5140 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] [send] via NET/Socket/0
gpu-a:5101:5140 [0] NCCL INFO Connected all rings, use ring PXN 0 GDR 0
"""
LOG_P2P_ONE_NODE = """\
gpu-a:5101:5140 [0] NCCL INFO Using network Socket
gpu-a:5101:5140 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
gpu-a:5101:5140 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/IPC
"""
LOG_SHM_ONE_NODE = """\
gpu-a:5101:5140 [0] NCCL INFO Using network Socket
gpu-a:5101:5140 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via SHM/direct/direct
"""


def test_nccl_log_channels_name_the_ranks_and_the_transport():
    from trainbox.image import fabric

    p = fabric.parse_nccl_log(LOG_SOCKET_ONE_NODE)
    assert p["channels"] == [[1, 0, "NET/Socket/0"], [0, 1, "NET/Socket/0"]]
    assert fabric.parse_nccl_log(LOG_P2P_ONE_NODE)["channels"] == [[0, 1, "P2P/CUMEM/read"], [0, 1, "P2P/IPC"]]


@pytest.mark.parametrize("log, short", [
    (LOG_SOCKET_ONE_NODE, "NET/Socket (one node; inter-node would be Socket)"),
    (LOG_P2P_ONE_NODE, "P2P/CUMEM, P2P/IPC (one node; inter-node would be Socket)"),
    (LOG_SHM_ONE_NODE, "SHM (one node; inter-node would be Socket)"),
])
def test_nccl_check_names_the_transport_two_gpus_of_one_node_used(log, short):
    """P2P and SHM disabled: 3.18 GB/s measured over sockets was reported as `no peers` / `one GPU`."""
    from trainbox.cli import nccl_check
    from trainbox.image import fabric

    logs = [{"host": "gpu-a", "log": fabric.parse_nccl_log(log)} for _ in range(2)]
    got_short, text, _ = nccl_check.transport_line("nccl", 1, logs)
    assert got_short == short
    assert "no peers" not in text and text.startswith(f"one node: {fabric.parse_nccl_log(log)['channels'][0][2]}")
    out = nccl_check.report([("all_reduce", 1 << 30, 0.675)], 2, ["gpu-a"], 2, "nccl", "2.27.5", logs, False, True)
    assert out.splitlines()[-1].endswith(f"transport {short}")


def test_nccl_check_tells_a_nodes_own_socket_links_from_the_network():
    """Two nodes: rank 0 -> 1 on one host over sockets is within the node; 1 -> 2 crosses hosts."""
    from trainbox.cli import nccl_check
    from trainbox.image import fabric

    log = LOG_SOCKET_ONE_NODE + "gpu-a:5101:5140 [1] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [send] via NET/Socket/1\n"
    logs = [{"host": h, "log": fabric.parse_nccl_log(log)} for h in ("a", "a", "b", "b")]
    intra, inter = nccl_check.split_links(logs)
    assert intra == ["NET/Socket/0"] and inter == ["NET/Socket/1"]
    short, text, _ = nccl_check.transport_line("nccl", 2, logs)
    assert short == "Socket" and "within a node NET/Socket/0 (TCP sockets)" in text


# ------------------------------------------------------------------ #24 an accepted option is honoured or refused


def test_sft_refuses_lora_options_it_would_ignore(tiny_model, tmp_path):
    """`sft --use_peft true --lora_r 8` trained and saved a full model, no adapter."""
    from test_data import write_messages
    from test_sft import env_for, run

    data = write_messages(tmp_path / "chat.jsonl", 16)
    out = tmp_path / "out"
    r = run("trainbox.cli.sft", ["--model_name_or_path", str(tiny_model), "--dataset", str(data), "--output_dir",
                                str(out), "--use_peft", "true", "--lora_r", "8", "--max_steps", "1"], env_for(tmp_path))
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        "error: --use_peft, --lora_r: sft trains every weight (no LoRA, no 4/8-bit base) and would ignore them; use "
        "`trainbox qlora` for LoRA on a 4-bit base (or `trainbox grpo --mode lora|qlora`), or drop them"]
    assert not out.exists()


def test_model_options_refused_only_when_set_to_something_else(tiny_model):
    from common.errors import UsageError
    from trainbox.cli import grpo, sft
    from trainbox.training import config
    from trainbox.training.grpo import options as grpo_options

    *_, model_args, _ = sft.parse(["--model_name_or_path", str(tiny_model), "--use_peft", "false", "--lora_r", "16"])
    config.check_full_training(model_args)  # the defaults, said out loud: nothing ignored
    *_, model_args, _ = sft.parse(["--model_name_or_path", str(tiny_model), "--load_in_4bit", "true"])
    with pytest.raises(UsageError, match="--load_in_4bit: sft trains every weight"):
        config.check_full_training(model_args)
    script, _, _, model_args = grpo.parse(["--mode", "full", "--lora_r", "8"])
    with pytest.raises(UsageError, match="--lora_r: --mode full trains every weight and would ignore it"):
        grpo_options.resolve_mode(script, model_args)
    script, _, _, model_args = grpo.parse(["--mode", "lora", "--bnb_4bit_quant_type", "fp4"])
    with pytest.raises(UsageError, match="--bnb_4bit_quant_type: --mode lora keeps the base unquantized"):
        grpo_options.resolve_mode(script, model_args)
    script, _, _, model_args = grpo.parse(["--mode", "lora", "--lora_r", "8"])
    assert grpo_options.resolve_mode(script, model_args) == "lora"


# ------------------------------------------------------- #22 resume never overshoots, #23 nor crosses trainers


def _sft(tiny_model, data, out, tmp_path, *extra):
    from test_sft import FAST, env_for, run

    return run("trainbox.cli.sft", ["--model_name_or_path", str(tiny_model), "--dataset", str(data), "--output_dir",
                                   str(out), *FAST, *extra], env_for(tmp_path))


def test_a_finished_sft_run_submitted_again_trains_nothing(tiny_model, tmp_path):
    """The same command twice: the second resumed and trained `steps 2/1`, overwriting the final model."""
    from test_data import write_messages

    data = write_messages(tmp_path / "chat.jsonl", 16)
    out = tmp_path / "out"
    r = _sft(tiny_model, data, out, tmp_path, "--max_steps", "1")
    assert r.returncode == 0 and "sft done: steps 1/1" in r.stdout, r.stdout + r.stderr
    assert json.loads((out / "checkpoint-1" / "trainbox.json").read_text()) == {"trainer": "sft"}
    final = (out / "model.safetensors").stat().st_mtime_ns
    r = _sft(tiny_model, data, out, tmp_path, "--max_steps", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[trainbox] sft: nothing to train: " in r.stdout and "checkpoint-1 reached step 1 of 1" in r.stdout
    assert "steps 2/1" not in r.stdout and "sft done" not in r.stdout
    assert (out / "model.safetensors").stat().st_mtime_ns == final and not (out / "checkpoint-2").exists()


def test_sft_refuses_to_resume_a_grpo_checkpoint(tiny_model, tmp_path):
    """grpo then sft into one output folder: sft resumed GRPO's optimizer, scheduler and state."""
    from test_data import write_messages
    from test_grpo import FAST, gsm8k_rows, run_grpo, write_jsonl

    out = tmp_path / "out"
    gsm8k = write_jsonl(tmp_path / "gsm8k.jsonl", gsm8k_rows(16))
    r = run_grpo(["--model_name_or_path", tiny_model, "--dataset", gsm8k, "--preset", "gsm8k", "--max_steps", "1",
                  "--output_dir", out, *FAST], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((out / "checkpoint-1" / "trainbox.json").read_text()) == {"trainer": "grpo"}
    r = _sft(tiny_model, write_messages(tmp_path / "chat.jsonl", 16), out, tmp_path, "--max_steps", "2")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "[trainbox] sft: model" not in r.stdout  # before the model loads
    assert [line for line in r.stderr.splitlines() if "error" in line] == [
        f"error: {out} holds a grpo run (checkpoint-1); sft would resume from its weights, optimizer and scheduler: "
        "give sft its own output folder (--output_dir DIR or OUTPUT_DIR), or move that run away"]


def test_resume_decisions(tmp_path):
    """The same rules on planted checkpoints (no training): epochs as the target, the run record, --resume PATH."""
    from types import SimpleNamespace

    from common.errors import UsageError
    from trainbox.run import resume

    def ckpt(out, step, max_steps, epochs=3.0, trainer=None):
        c = out / f"checkpoint-{step}"
        c.mkdir(parents=True)
        (c / "trainer_state.json").write_text(json.dumps({"global_step": step, "max_steps": max_steps,
                                                          "num_train_epochs": epochs}))
        if trainer:
            (c / "trainbox.json").write_text(json.dumps({"trainer": trainer}))
        return str(c)

    epochs3 = SimpleNamespace(max_steps=-1, num_train_epochs=3.0)
    out = tmp_path / "a"
    c = ckpt(out, 24, 24)  # an old checkpoint without a record: epochs done
    with pytest.raises(resume.Finished) as e:
        resume.resolve_resume("auto", str(out), epochs3, "sft")
    assert e.value.code == 0
    assert resume.resolve_resume("auto", str(out), SimpleNamespace(max_steps=-1, num_train_epochs=4.0), "sft") == c
    assert resume.resolve_resume("auto", str(out), SimpleNamespace(max_steps=30, num_train_epochs=3.0), "sft") == c
    assert resume.resolve_resume("never", str(out), epochs3, "sft") is None

    out = tmp_path / "b"  # finished, no checkpoint kept: the run record says so
    out.mkdir()
    (out / resume.RUN_FILE).write_text(json.dumps({"trainer": "qlora", "finished": True, "global_step": 8,
                                                   "max_steps": -1, "num_train_epochs": 3.0}))
    with pytest.raises(resume.Finished):
        resume.resolve_resume("auto", str(out), epochs3, "qlora")
    assert resume.resolve_resume("auto", str(out), epochs3, "sft") is None  # nothing to resume: a fresh run

    c = ckpt(tmp_path / "c", 1, 5, trainer="grpo")
    with pytest.raises(UsageError, match="holds a grpo run"):
        resume.resolve_resume("auto", str(tmp_path / "c"), epochs3, "qlora")
    with pytest.raises(UsageError, match="a grpo checkpoint; sft can't resume from it"):
        resume.resolve_resume(c, str(tmp_path / "elsewhere"), epochs3, "sft")
    assert resume.resolve_resume(c, str(tmp_path / "elsewhere"), epochs3, "grpo") == c


# ------------------------------------------------------------------------------- #26 --help fast with a fresh HOME


def test_help_cache_is_keyed_on_what_the_trainer_imports():
    """Editing an unrelated entrypoint (doctor.py) no longer throws the trainers' kept --help away."""
    from trainbox import helpcache

    names = {p.name for p in helpcache.sources("sft")}
    assert {"sft.py", "config.py", "launch.py", "data.py", "__init__.py"} <= names
    # The launcher's options (part of every trainer's --help) live in the shared package: followed there too.
    assert helpcache.PACKAGE.parent / "common" / "launch.py" in helpcache.sources("sft")
    assert not names & {"doctor.py", "nccl_check.py", "jupyter.py", "dispatch.py", "grpo.py"}
    assert "vllm_server.py" in {p.name for p in helpcache.sources("grpo")}
    assert "sftlib.py" in {p.name for p in helpcache.sources("qlora")}  # qlora's options include sftlib's


def test_help_kept_in_a_checkout_is_found_with_a_fresh_home(tmp_path, monkeypatch):
    """Host .venv, fresh $HOME: 6.4 s (TRL imported) every time; the text now lives in the checkout's .cache."""
    from trainbox import helpcache

    monkeypatch.delenv("TRAINBOX_HELP_DIR", raising=False)
    monkeypatch.setattr(helpcache, "PACKAGE", tmp_path / "repo" / "trainbox")
    (tmp_path / "repo" / "trainbox" / "cli").mkdir(parents=True)
    (tmp_path / "repo" / "pyproject.toml").write_text("")
    for name in ("__init__.py", "cli/__init__.py", "cli/sft.py"):
        (tmp_path / "repo" / "trainbox" / name).write_text("x = 1\n")
    monkeypatch.setenv("HOME", str(tmp_path / "home1"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    helpcache.store("sft", "usage: trainbox sft\n")
    assert (tmp_path / "repo" / ".cache" / "trainbox-help" / "sft.txt").is_file()
    monkeypatch.setenv("HOME", str(tmp_path / "home2"))  # a fresh home
    assert helpcache.load("sft") == "usage: trainbox sft\n"
    (tmp_path / "repo" / "trainbox" / "cli" / "doctor.py").write_text("y = 2\n")  # not imported by sft
    assert helpcache.load("sft") == "usage: trainbox sft\n"
    (tmp_path / "repo" / "trainbox" / "cli" / "sft.py").write_text("x = 2\n")
    assert helpcache.load("sft") is None


def test_dispatcher_help_with_a_fresh_home_is_fast_after_the_first(tmp_path):
    import time

    env = {k: v for k, v in os.environ.items() if k not in ("TRAINBOX_HELP_DIR", "XDG_CACHE_HOME")}
    env["PYTHONPATH"] = str(ROOT)
    first = subprocess.run([PY, "-m", "trainbox", "sft", "--help"], env={**env, "HOME": str(tmp_path / "h1")},
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    t = time.monotonic()
    again = subprocess.run([PY, "-m", "trainbox", "sft", "--help"], env={**env, "HOME": str(tmp_path / "h2")},
                           capture_output=True, text=True, timeout=300)
    took = time.monotonic() - t
    assert again.stdout == first.stdout and took < 2.0, took  # TRL's import alone takes 5-6 s here
