"""The smoke image (x86_64, full stack, CPU torch) built for real, and every entrypoint run inside it.

The tiny model and the data are made on the host and mounted read-only; outputs go to a mounted folder owned by the
image's user (uid 1000). HF_HUB_OFFLINE=1 proves nothing is fetched from a hub.
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request
import uuid

import pytest

from enginefix import BUILD_TIMEOUT, docker
from test_data import write_dolly, write_messages, write_verl_gsm8k

# a cold first build (debootstrap + the session images, arm64 under QEMU) runs inside the first test's setup
pytestmark = [pytest.mark.engine, pytest.mark.timeout(BUILD_TIMEOUT)]

FAST = ["--per_device_train_batch_size", "2", "--logging_steps", "1", "--disable_tqdm", "true", "--report_to",
        "none", "--dataloader_num_workers", "0"]
ENV = ["-e", "HF_HUB_OFFLINE=1", "-e", "OMP_NUM_THREADS=1", "-e", "TOKENIZERS_PARALLELISM=false"]


@pytest.fixture(scope="module")
def mounts(tiny_model, tmp_path_factory):
    """(model dir, data dir) on the host; the data in the real formats the trainers read."""
    data = tmp_path_factory.mktemp("data")
    write_verl_gsm8k(data / "gsm8k.parquet")
    write_messages(data / "messages.jsonl")
    write_dolly(data / "dolly.jsonl")
    for p in [tiny_model, *tiny_model.rglob("*"), data, *data.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)  # readable by the image's uid 1000
    for parent in [tiny_model.parent, data.parent]:
        parent.chmod(0o755)
    return tiny_model, data


def _outdir(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    os.chown(out, 1000, 1000)  # the image runs as `trainer` (uid 1000)
    return out


def _run(image, name, args, mounts, out, timeout=900):
    model, data = mounts
    return docker("run", "--rm", *ENV, "-v", f"{model}:/models/tiny:ro", "-v", f"{data}:/data:ro",
                  "-v", f"{out}:/workspace/outputs", image, name, *args, check=False, timeout=timeout)


def test_image_has_the_cell_facts(smoke_build, smoke_image):  # noqa: F811
    info = json.loads(docker("image", "inspect", smoke_image).stdout)[0]
    cfg = info["Config"]
    assert info["Architecture"] == "amd64"
    assert cfg["Entrypoint"] == ["/usr/bin/tini", "-g", "--", "/usr/local/bin/trainbox"]  # tini: PID 1
    who = docker("run", "--rm", "--entrypoint", "id", smoke_image).stdout
    assert who.startswith("uid=1000(trainer)"), who  # the contract's non-root user
    assert cfg["Labels"]["io.trainbox.tag"] == "smoke-x86_64"
    assert smoke_build.layers == len(info["RootFS"]["Layers"]) and smoke_build.size == info["Size"]
    r = docker("run", "--rm", "--entrypoint", "python", smoke_image, "-c",
               "import common, trainbox, torch, trl; "
               "print(trainbox.__file__, common.__file__, torch.__version__, trl.__version__)")
    path, common_path, torch_version, trl_version = r.stdout.split()
    assert path == "/opt/trainbox/trainbox/__init__.py"  # ours, from PYTHONPATH
    assert common_path == "/opt/trainbox/common/__init__.py"  # ours, not an installed distribution's `common`
    assert torch_version == "2.13.0+cpu" and trl_version == "1.16.0"  # the wheelhouse's CPU torch
    # uv installed the venv in the deps stage; neither uv nor its download cache (a cache mount) reached a layer
    r = docker("run", "--rm", "-u", "0", "--entrypoint", "sh", smoke_image, "-c",   # root: /root is 0700
               "ls -d /opt/uv /root/.cache/uv 2>/dev/null | wc -l; cat /opt/venv/lib/python3.11/site-packages/"
               "torch-*.dist-info/INSTALLER; echo; stat -c %u /opt/venv/lib/python3.11/site-packages")
    assert r.stdout.split() == ["0", "uv", "1000"], r.stdout


def test_doctor(smoke_image):  # noqa: F811
    r = docker("run", "--rm", smoke_image, "doctor", check=False)
    assert r.returncode == 0, r.stdout + r.stderr  # a CPU image on a CPU host: nothing missing, it trains on CPU
    j = docker("run", "--rm", smoke_image, "doctor", "--json", check=False)
    assert j.returncode == 0, j.stdout + j.stderr
    report = json.loads(j.stdout)
    assert "smoke" in json.dumps(report)


def test_selftest(smoke_image):  # noqa: F811
    """`trainbox selftest` in the image, no network: the CPU rows pass, every GPU row is SKIP with its reason; a planted
    fault fails its row with exit 1."""
    r = docker("run", "--rm", "--network", "none", *ENV, smoke_image, "selftest", "--json", check=False, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(r.stdout)
    rows = {row["row"]: row for row in report["rows"]}
    assert report["image"]["tag"] == "smoke-x86_64" and rows["driver"]["status"] == "SKIP"
    assert all(row["status"] == "PASS" for name, row in rows.items() if name.startswith("train-") and
               row["status"] != "SKIP") and rows["train-sft"]["status"] == "PASS"
    assert all(row["reason"] for row in rows.values() if row["status"] == "SKIP")
    assert rows["attention-fa3"]["status"] == rows["nccl"]["status"] == "SKIP"
    r = docker("run", "--rm", "--network", "none", *ENV, "-e", "TRAINBOX_SELFTEST_FAULT=attention-sdpa", smoke_image,
               "selftest", "--only", "attention-sdpa", check=False, timeout=900)
    assert r.returncode == 1 and "FAIL" in r.stdout and "logits off by" in r.stdout, r.stdout[-3000:] + r.stderr


def test_grpo_few_steps(smoke_image, mounts, tmp_path):  # noqa: F811
    out = _outdir(tmp_path)
    r = _run(smoke_image, "grpo", ["--model_name_or_path", "/models/tiny", "--dataset", "/data/gsm8k.parquet",
                                   "--preset", "gsm8k", "--max_steps", "2", "--num_generations", "2",
                                   "--max_completion_length", "8", "--bf16", "false",
                                   "--output_dir", "/workspace/outputs/grpo", *FAST], mounts, out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert list((out / "grpo").rglob("*.safetensors")), sorted(p.name for p in (out / "grpo").rglob("*"))


def test_qlora_few_steps(smoke_image, mounts, tmp_path):  # noqa: F811
    out = _outdir(tmp_path)
    r = _run(smoke_image, "qlora", ["--model_name_or_path", "/models/tiny", "--dataset", "/data/dolly.jsonl",
                                    "--max_steps", "2", "--max_length", "64", "--output_dir",
                                    "/workspace/outputs/qlora", *FAST], mounts, out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert list((out / "qlora").rglob("adapter_model.safetensors")), r.stdout[-2000:]


def test_sft_two_processes(smoke_image, mounts, tmp_path):  # noqa: F811
    out = _outdir(tmp_path)
    r = _run(smoke_image, "sft", ["--model_name_or_path", "/models/tiny", "--dataset", "/data/messages.jsonl",
                                  "--max_steps", "2", "--max_length", "64", "--nproc_per_node", "2",
                                  "--output_dir", "/workspace/outputs/sft", *FAST], mounts, out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert (out / "sft" / "model.safetensors").is_file()
    summary = [ln for ln in r.stdout.splitlines() if "steps 2/2" in ln]
    assert summary, r.stdout[-2000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def test_jupyter_published_port_needs_the_token(smoke_image):  # noqa: F811
    port, token, name = _free_port(), uuid.uuid4().hex, f"trainbox-jupyter-{uuid.uuid4().hex[:8]}"
    docker("run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8888", "-e", f"JUPYTER_TOKEN={token}",
           smoke_image, "jupyter")
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:  # wait until the server answers (not a timing assertion: a readiness poll)
            try:
                if _status(f"{base}/api") == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                logs = docker("logs", name, check=False)
                pytest.fail(f"jupyter did not answer on {base}:\n{logs.stdout[-2000:]}{logs.stderr[-2000:]}")
            time.sleep(1)
        assert _status(f"{base}/api/status?token={token}") == 200
        assert _status(f"{base}/api/status") == 403
        assert _status(f"{base}/api/status?token=wrong{token}") == 403
    finally:
        docker("rm", "-f", name, check=False)
