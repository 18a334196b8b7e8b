"""GPU check for preemption: `sft` (or `qlora`) on all visible GPUs (FSDP2 with >1), SIGTERM to the launcher after
the first logged step -> every rank checkpoints (sharded with FSDP2) and exits 0 -> a rerun resumes from that step.

    python tests/gpu/check_preempt.py [--entrypoint sft|qlora] [--model PATH] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, build_model, report, run_entrypoint, write_chat_data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entrypoint", choices=("sft", "qlora"), default="sft")
    ap.add_argument("--model", help="saved model directory; default: build a ~100M Llama locally")
    ap.add_argument("--work", help="work directory (default: a temporary one)")
    ap.add_argument("--json", help="also write the result here")
    a = ap.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="check-preempt-"))
    work.mkdir(parents=True, exist_ok=True)
    model = a.model or str(build_model(work / "llama-100m"))
    data = write_chat_data(work / "chat.jsonl", rows=2048, words=256)
    out = work / "out"
    args = ["--model_name_or_path", model, "--dataset", str(data), "--output_dir", str(out),
            "--per_device_train_batch_size", "4", "--max_length", "256", "--logging_steps", "1",
            "--save_steps", "100000", "--report_to", "none", "--disable_tqdm", "true"]  # fmt: skip
    if a.entrypoint == "sft":
        args += ["--bf16", "true"]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}".rstrip(":"), PYTHONUNBUFFERED="1")
    log = work / "preempt.log"
    t0 = time.time()
    p = subprocess.Popen([sys.executable, "-m", f"entrypoints.{a.entrypoint}", *args, "--max_steps", "100000"],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    lines = []
    for line in p.stdout:
        lines.append(line)
        if "'loss'" in line:
            sent = time.time()
            p.send_signal(signal.SIGTERM)
            break
    lines.append(p.stdout.read())
    rc = p.wait()
    log.write_text("".join(lines))
    ckpts = sorted(out.glob("checkpoint-*"), key=lambda c: int(c.name.split("-")[1]))
    step = json.loads((ckpts[-1] / "trainer_state.json").read_text())["global_step"] if ckpts else None
    result = {"preempt_rc": rc, "checkpoint_step": step, "stop_after_signal_s": round(time.time() - sent, 1),
              "first_run_s": round(time.time() - t0, 1)}  # fmt: skip
    if rc != 0 or step is None:
        print("".join(lines)[-6000:], file=sys.stderr)
        result.update(rc=1, summary=None)
        return report(result, a.json)
    resumed = run_entrypoint(a.entrypoint, args + ["--max_steps", str(step + 5)], work / "resume.log")
    final = out / f"checkpoint-{step + 5}" / "trainer_state.json"
    resumed["resumed_to"] = json.loads(final.read_text())["global_step"] if final.is_file() else None
    resumed["resumed_from_log"] = f"resuming from {ckpts[-1]}" in (work / "resume.log").read_text()
    result.update(resumed)
    if resumed["resumed_to"] != step + 5 or not resumed["resumed_from_log"]:
        result["rc"] = 1
    return report(result, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
