"""Every entrypoint inside the smoke .sqsh the way enroot and pyxis start it on a cluster, with enroot's defaults:
read-only root, no home mount, the caller (root here) as uid 0 of a user namespace, the environment cleared to the
image's. `enroot start NAME ARGS` runs /etc/rc, i.e. the image ENTRYPOINT; pyxis instead starts the container once
and runs each task inside it with the ENTRYPOINT skipped, which `enroot exec PID trainbox ...` does here.

`enroot` is tests/enroot_standin.sh (CI), or the real one when TRAINBOX_REAL_ENROOT names its binary. Outputs go to
the image's VOLUME /workspace/outputs, which lives in the container's rootfs folder under ENROOT_DATA_PATH.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from test_data import write_dolly, write_messages, write_verl_gsm8k
from test_slurm_job import enroot_path

pytestmark = [pytest.mark.engine, pytest.mark.timeout(3600)]  # may build and export the smoke image
NAME = "trainbox-runtime-test"
FAST = ["--per_device_train_batch_size", "2", "--logging_steps", "1", "--disable_tqdm", "true", "--report_to",
        "none", "--dataloader_num_workers", "0", "--model_name_or_path", "/models/tiny"]
JOB_ENV = ["-e", "HF_HUB_OFFLINE=1", "-e", "OMP_NUM_THREADS=1", "-e", "TOKENIZERS_PARALLELISM=false"]


@pytest.fixture(scope="module")
def container(smoke_sqsh, tiny_model, tmp_path_factory):
    """`enroot create` of the smoke .sqsh once; the env to call `enroot` with, the mounts, the outputs folder."""
    tmp = tmp_path_factory.mktemp("enroot-rt")
    data = tmp / "data"
    data.mkdir()
    write_verl_gsm8k(data / "gsm8k.parquet")
    write_messages(data / "messages.jsonl")
    write_dolly(data / "dolly.jsonl")
    env = dict(os.environ, PATH=enroot_path(tmp), ENROOT_DATA_PATH=str(tmp / "data-path"),
               ENROOT_RUNTIME_PATH=str(tmp / "runtime"), ENROOT_CACHE_PATH=str(tmp / "cache"))
    for k in ("HF_HOME", "XDG_CACHE_HOME", "OUTPUT_DIR"):
        env.pop(k, None)
    subprocess.run(["enroot", "create", "--force", "--name", NAME, str(smoke_sqsh)], env=env, check=True,
                   capture_output=True, timeout=900)
    mounts = ["-m", f"{tiny_model}:/models/tiny", "-m", f"{data}:/data"]
    yield env, mounts, tmp / "data-path" / NAME / "workspace" / "outputs"
    subprocess.run(["enroot", "remove", "--force", NAME], env=env, capture_output=True)


def enroot(env, *args, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run(["enroot", *args], env=env, capture_output=True, text=True, timeout=timeout)


def _moved_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if "is not writable" in ln]
    assert len(lines) == 1, stderr[-3000:]  # said once (the dispatcher), not once per rank
    return lines[0]


def test_enroot_defaults_hold(container):
    """The stand-in is only worth something if these hold: read-only root, HOME not mounted, uid 0 = the caller."""
    env, mounts, outputs = container
    r = enroot(env, "start", *mounts, NAME, "sh", "-c",
               'echo "uid=$(id -u) home=$HOME"; cat /proc/self/uid_map; touch /x 2>&1; mkdir "$HOME/.cache" 2>&1; '
               'touch /workspace/outputs/probe && echo outputs-writable; grep -c " $HOME " /proc/self/mounts || :')
    out = r.stdout
    assert "uid=0 home=/root" in out, out + r.stderr
    assert out.splitlines()[1].split() == ["0", "0", "1"]  # only the caller is mapped, as root
    assert out.count("Read-only file system") == 2 and "outputs-writable" in out, out
    assert out.splitlines()[-1] == "0"  # nothing mounted on $HOME
    assert (outputs / "probe").is_file()


def test_sft_under_enroot_start(container):
    env, mounts, outputs = container
    r = enroot(env, "start", *mounts, *JOB_ENV, NAME, "sft", "--dataset", "/data/messages.jsonl", "--max_steps", "2",
               "--max_length", "64", "--output_dir", "/workspace/outputs/sft", *FAST)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    line = _moved_line(r.stderr)
    assert "$HOME (/root) is not writable" in line
    moved = re.search(r"\(([A-Z_, ]+)\)", line).group(1).split(", ")
    assert {"HF_HOME", "TRITON_CACHE_DIR", "XDG_CACHE_HOME"} <= set(moved), line
    assert "[trainbox] sft done: steps 2/2" in r.stdout
    assert (outputs / "sft" / "model.safetensors").stat().st_size > 0


@pytest.fixture(scope="module")
def started(container):
    """The container started once, the way pyxis holds it for a job's tasks (a process to join), then stopped."""
    env, mounts, _ = container
    p = subprocess.Popen(["enroot", "start", *mounts, NAME, "sleep", "3600"], env=env)
    end = time.monotonic() + 120
    pid = None
    while pid is None:
        assert p.poll() is None and time.monotonic() < end, "the container did not start"
        pid = next((q.pid for q in _tree(p.pid) if _name(q) == "sleep"), None)
        time.sleep(0.2)
    yield pid
    for q in _tree(p.pid):
        with contextlib.suppress(psutil.NoSuchProcess):
            q.kill()
    p.wait(timeout=30)


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _name(q: psutil.Process) -> str | None:
    """None for a process that exited since it was listed (enroot's start runs short-lived helpers: seen on CI)."""
    try:
        return q.name()
    except psutil.NoSuchProcess:
        return None


def pyxis_task(container, pid, *cmd, timeout=900) -> subprocess.CompletedProcess:
    env, _, _ = container
    return enroot(env, "exec", *JOB_ENV, str(pid), *cmd, timeout=timeout)


def test_qlora_as_a_pyxis_task(container, started):
    _, _, outputs = container
    r = pyxis_task(container, started, "trainbox", "qlora", "--dataset", "/data/dolly.jsonl", "--max_steps", "2",
                   "--max_length", "64", "--output_dir", "/workspace/outputs/qlora", *FAST)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    _moved_line(r.stderr)
    assert list((outputs / "qlora").rglob("adapter_model.safetensors")), r.stdout[-2000:]


def test_grpo_as_a_pyxis_task(container, started):
    _, _, outputs = container
    r = pyxis_task(container, started, "trainbox", "grpo", "--dataset", "/data/gsm8k.parquet", "--preset", "gsm8k",
                   "--max_steps", "2", "--num_generations", "2", "--max_completion_length", "8", "--bf16", "false",
                   "--output_dir", "/workspace/outputs/grpo", *FAST)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    _moved_line(r.stderr)
    assert list((outputs / "grpo").rglob("*.safetensors")), r.stdout[-2000:]


def test_doctor_as_a_pyxis_task(container, started):
    r = pyxis_task(container, started, "trainbox", "doctor", "--json")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]  # a CPU image on a CPU host: ok
    assert "smoke" in r.stdout and "Read-only file system" not in r.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def test_jupyter_answers_with_the_token(container):
    env, mounts, _ = container
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(env, JUPYTER_TOKEN=token, JUPYTER_PORT=str(port))
    log = Path(env["ENROOT_DATA_PATH"]).parent / "jupyter.log"
    with open(log, "w") as f:
        p = subprocess.Popen(["enroot", "start", *mounts, "-e", "JUPYTER_TOKEN", "-e", "JUPYTER_PORT", NAME, "jupyter"],
                             env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        end = time.monotonic() + 180
        while _status(f"{base}/api/status?token={token}") != 200:
            assert p.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < end, log.read_text()[-3000:]
            time.sleep(1)
        assert _status(f"{base}/api/status") == 403  # and not without it
        assert "is not writable" in log.read_text()  # its runtime/data dirs moved off the read-only home
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(timeout=60)
