"""GPU check for preemption: `sft`, `qlora` or `grpo` on all visible GPUs (FSDP2 with >1), SIGTERM to the launcher after
the first logged step -> every rank checkpoints (sharded with FSDP2) and exits 0 -> a rerun resumes from that step.

    python tests/gpu/check_preempt.py [--entrypoint sft|qlora|grpo] [--signal-all] [--model PATH] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import ROOT, build_model, report, run_entrypoint, write_chat_data
from common.launch import descendants


def _watchdog(p: subprocess.Popen, seconds: float) -> None:
    """If the run has not ended `seconds` after the signal: dump every process's Python stacks (SIGUSR2), then kill."""
    try:
        p.wait(timeout=seconds)
        return
    except subprocess.TimeoutExpired:
        pass
    print(f"STUCK {seconds}s after SIGTERM: signal state, then stacks", flush=True)
    procs = [p.pid, *descendants(p.pid)]  # before anything dies and its children are re-parented
    for pid in procs:  # which process blocks, ignores or has pending what (hex masks, bit n-1 = signal n)
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120].decode(errors="replace")
            sig = [ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith(("Sig", "Shd"))]
            blk = set()
            for t in Path(f"/proc/{pid}/task").iterdir():
                blk |= {ln for ln in (t / "status").read_text().splitlines() if ln.startswith("SigBlk")}
            print(f"  pid {pid}: {cmd}\n    " + " ".join(sig) + f"\n    threads' {sorted(blk)}", flush=True)
        except OSError:
            pass
    for pid in procs:
        try:
            # Only our processes dump stacks on SIGUSR2; it would kill torchrun itself.
            if b"trainbox.cli." in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGUSR2)
        except (OSError, ProcessLookupError):
            pass
    time.sleep(5)
    for pid in reversed(procs):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entrypoint", choices=("sft", "qlora", "grpo"), default="sft")
    ap.add_argument("--model", help="saved model directory; default: build a ~100M Llama locally")
    ap.add_argument("--work", help="work directory (default: a temporary one)")
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("--signal-all", action="store_true",
                    help="SIGTERM every process of the run (launcher, torchrun, ranks), as Slurm's scancel does")
    ap.add_argument("--stuck-after", type=float, default=90, help="seconds after the signal before dumping stacks")
    a = ap.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="check-preempt-"))
    work.mkdir(parents=True, exist_ok=True)
    model = a.model or str(build_model(work / "llama-100m"))
    out = work / "out"
    common = ["--model_name_or_path", model, "--output_dir", str(out), "--logging_steps", "1", "--save_steps", "100000",
              "--report_to", "none", "--disable_tqdm", "true"]  # fmt: skip
    if a.entrypoint == "grpo":  # gsm8k preset; rollouts as grpo picks them (vLLM colocate when installed)
        from grpo_bench import write_gsm8k

        data = write_gsm8k(work / "gsm8k.jsonl", rows=512)
        args = common + ["--dataset", str(data), "--preset", "gsm8k", "--per_device_train_batch_size", "8",
                         "--num_generations", "8", "--max_completion_length", "64", "--bf16", "true"]  # fmt: skip
    else:
        data = write_chat_data(work / "chat.jsonl", rows=2048, words=256)
        args = common + ["--dataset", str(data), "--per_device_train_batch_size", "4", "--max_length", "256"]
        if a.entrypoint == "sft":
            args += ["--bf16", "true"]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}".rstrip(":"), PYTHONUNBUFFERED="1")
    log = work / "preempt.log"
    t0 = time.time()
    p = subprocess.Popen([sys.executable, "-m", f"trainbox.cli.{a.entrypoint}", *args, "--max_steps", "100000"],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    lines, sent = [], None
    with open(log, "w") as f:
        for line in p.stdout:
            lines.append(line)
            f.write(line)
            f.flush()
            if sent is None and "'loss'" in line:
                sent = time.time()
                for pid in [p.pid, *(descendants(p.pid) if a.signal_all else [])]:
                    os.kill(pid, signal.SIGTERM)
                threading.Thread(target=_watchdog, args=(p, a.stuck_after), daemon=True).start()
    rc = p.wait()
    ckpts = sorted(out.glob("checkpoint-*"), key=lambda c: int(c.name.split("-")[1]))
    step = json.loads((ckpts[-1] / "trainer_state.json").read_text())["global_step"] if ckpts else None
    result = {"preempt_rc": rc, "checkpoint_step": step, "stop_after_signal_s": round(time.time() - sent, 1),
              "first_run_s": round(time.time() - t0, 1), "signal_all": a.signal_all}  # fmt: skip
    if rc != 0 or step is None:
        print("".join(lines)[-20000:], file=sys.stderr)
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
