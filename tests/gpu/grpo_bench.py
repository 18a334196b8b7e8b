"""GPU check for `grpo`: a few GRPO steps with the gsm8k preset on a local model (or a ~100M Llama built here, no hub);
prints steps/s, tokens/s (prompt + completion tokens) and peak GPU memory from the entrypoint's summary line.

    python tests/gpu/grpo_bench.py [--model PATH] [--mode full|lora|qlora] [--steps 10] [--batch 8]
                                   [--num-generations 8] [--completion 256] [--vllm-server] [--json out.json]

Rollouts are whatever `grpo` picks (vLLM colocate when vllm is importable, else transformers generate); the chosen
one is reported in the result. `--vllm-server` instead starts `trl vllm-serve` on the last visible GPU and trains on
the others with `vllm_mode server` (needs 2 GPUs). The random model rarely stops early, so completions run to
--completion tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from common import build_model, report, run_entrypoint


def write_gsm8k(path: Path, rows: int) -> Path:
    """gsm8k-shaped rows: a word problem and a worked answer ending in `#### N`."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(rows):
            a, b = rng.randint(2, 500), rng.randint(2, 500)
            f.write(json.dumps({
                "question": f"Natalia sold {a} clips in April and {b} clips in May. How many clips did she sell?",
                "answer": f"She sold {a} + {b} = <<{a}+{b}={a + b}>>{a + b} clips.\n#### {a + b}",
            }) + "\n")
    return path


def start_vllm_server(model: str, max_len: int, log: Path) -> tuple[subprocess.Popen, int]:
    """`trl vllm-serve` on the last visible GPU; returns once /health answers. The trainer gets the other GPUs."""
    import torch

    n = torch.cuda.device_count()
    if n < 2:
        raise SystemExit(f"--vllm-server needs 2 GPUs (one serves, the others train); {n} visible")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(n)))).split(",")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "trl.scripts.vllm_serve", "--model", model, "--port", str(port),
           "--gpu_memory_utilization", "0.5", "--max_model_len", str(max_len)]  # fmt: skip
    server = subprocess.Popen(cmd, env=dict(os.environ, CUDA_VISIBLE_DEVICES=visible[-1]), stdout=open(log, "w"),
                              stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.time() + 300
    while time.time() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"vllm-serve exited {server.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible[:-1])
                    return server, port
        except OSError:
            time.sleep(2)
    server.kill()
    raise SystemExit(f"vllm-serve did not answer /health in 300 s:\n{log.read_text()[-4000:]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="saved model directory; default: build a ~100M Llama locally")
    ap.add_argument("--mode", choices=("full", "lora", "qlora"), default="full")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8, help="per-device batch size (completions per step per GPU)")
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--completion", type=int, default=256, help="max_completion_length")
    ap.add_argument("--work", help="work directory (default: a temporary one)")
    ap.add_argument("--vllm-server", action="store_true", help="roll out through `trl vllm-serve` on its own GPU")
    ap.add_argument("--json", help="also write the result here")
    a = ap.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="grpo-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    model = a.model or str(build_model(work / "llama-100m"))
    data = write_gsm8k(work / "gsm8k.jsonl", rows=max(64, a.steps * a.batch))
    args = ["--model_name_or_path", model, "--dataset", str(data), "--preset", "gsm8k", "--mode", a.mode,
            "--output_dir", str(work / "out"), "--max_steps", str(a.steps), "--per_device_train_batch_size",
            str(a.batch), "--num_generations", str(a.num_generations), "--max_completion_length", str(a.completion),
            "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none", "--resume", "never",
            "--disable_tqdm", "true", "--bf16", "true", "--dtype", "bfloat16"]  # fmt: skip
    log = work / "grpo.log"
    server = None
    if a.vllm_server:
        server, port = start_vllm_server(model, 512 + a.completion, work / "vllm-serve.log")
        args += ["--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_port", str(port)]
    try:
        result = run_entrypoint("grpo", args, log)
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
    text = log.read_text()
    result["mode"] = a.mode
    if m := re.search(r"rollouts: ([^;]+)", text):
        result["rollouts"] = m.group(1)
    if m := re.search(r"grpo: loaded: ([^\n]+)", text):
        result["loaded"] = m.group(1)
    # Per-step generation vs. update split from the Trainer's own log lines (`step_time` is TRL's).
    steps = [float(x) for x in re.findall(r"'step_time': '([\d.]+)'", text)]
    if steps:
        result["step_time_s_median"] = sorted(steps)[len(steps) // 2]
    return report(result, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
