"""`docker stop` on a training run in the real smoke image: tini (PID 1, -g) passes SIGTERM to the process group (the
launcher and torchrun; torchrun's workers run in their own sessions), the launcher passes it on to both ranks, they
save a checkpoint and the container exits 0; the run's log lands next to the outputs."""

from __future__ import annotations

import time
import uuid

import pytest

from enginefix import BUILD_TIMEOUT, docker
from test_image_smoke import ENV, FAST, _outdir, mounts  # noqa: F401

pytestmark = [pytest.mark.engine, pytest.mark.timeout(BUILD_TIMEOUT)]


def test_docker_stop_checkpoints_a_two_process_run(smoke_image, mounts, tmp_path):  # noqa: F811
    model, data = mounts
    out = _outdir(tmp_path)
    name = f"trainbox-stop-{uuid.uuid4().hex[:8]}"
    docker("run", "-d", "--name", name, *ENV, "-e", "ARTIFACT_DIR=/workspace/outputs/artifacts",
           "-v", f"{model}:/models/tiny:ro", "-v", f"{data}:/data:ro", "-v", f"{out}:/workspace/outputs",
           smoke_image, "sft", "--model_name_or_path", "/models/tiny", "--dataset", "/data/messages.jsonl",
           "--max_steps", "100000", "--save_steps", "100000", "--max_length", "64", "--nproc_per_node", "2",
           "--output_dir", "/workspace/outputs/sft", *FAST)
    try:
        deadline = time.monotonic() + 600
        while "'loss'" not in (logs := docker("logs", name, check=False).stdout) and time.monotonic() < deadline:
            time.sleep(1)
        assert "'loss'" in logs, logs[-3000:]
        assert "rdzv=standalone" in logs  # one node: torchrun picked its own port
        docker("stop", "-t", "120", name)
        state = docker("inspect", "-f", "{{.State.ExitCode}}", name).stdout.strip()
        logs = docker("logs", name, check=False)
        text = logs.stdout + logs.stderr
    finally:
        docker("rm", "-f", name, check=False)
    assert state == "0", text[-3000:]
    assert "launcher got SIGTERM" in text, text[-3000:]  # from tini
    assert text.count("will checkpoint and stop after this step") == 2, text[-3000:]  # both ranks
    assert "sft preempted (checkpoint saved)" in text, text[-3000:]
    (ckpt,) = (out / "sft").glob("checkpoint-*")
    assert (ckpt / "trainer_state.json").is_file()
    log = (out / "artifacts" / "sft" / "logs" / "sft.log").read_text()
    assert "launcher got SIGTERM" in log and "sft preempted (checkpoint saved)" in log
