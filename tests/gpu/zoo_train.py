"""The model zoo trained on a GPU with trainbox's defaults there: for every architecture of tests/zoo.py the jobs of
tests/test_zoo.py (sft 2 steps, sft resumed to 3, qlora 1 step with --merge, grpo 1 step; bf16 as a GPU runs them)
in one process per model, the models side by side on the one GPU. The CPU test runs other kernels (SDPA,
FlexAttention's dense math, no compiled MoE, TRL's loss head); here each model gets what it gets on a GPU: torch's
varlen kernel (with gpt-oss's sinks), FlexAttention (Gemma 2's softcap), the compiled MoE experts, the one-pass loss
head, bitsandbytes' 4-bit base, the static decoder.

Usage: python tests/gpu/zoo_train.py [NAME ...] [--extra OPTIONS] [--json FILE]

Per model: each job's exit code, the attention line and packing, the losses sft logged (finite, steps 1-3 after the
resume), whether the three saved models (sft, qlora merged, grpo) load, wall seconds and the peak GPU memory sft
printed. `RESULT {"failures": [...]}`; exit 1 when any. Each model's whole log is kept beside its outputs (the path is
printed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
TIMEOUT = 1200  # seconds for one model's four jobs


def train(name: str, base: Path, data: dict, extra: list[str]) -> dict:
    import test_zoo
    from zoo import make_zoo_model

    folder = base / name
    model = make_zoo_model(folder / "model", name)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_CACHE": str(folder),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    start = time.time()
    try:
        r = test_zoo.train_all(model, data, folder, gpu=True, extra=tuple(extra), env=env, timeout=TIMEOUT)
        log = r.stdout + r.stderr
    except subprocess.TimeoutExpired as e:  # its jobs hung: the exit codes it printed so far say where
        log = "".join(x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.stdout, e.stderr))
        log += f"\nZOO-TIMEOUT after {TIMEOUT} s\n"
    (folder / "log.txt").write_text(log)
    return check(name, folder, log, time.time() - start)


def check(name: str, folder: Path, log: str, seconds: float) -> dict:
    from transformers import AutoModelForCausalLM

    out, problems = folder / "out", [f"timed out after {TIMEOUT} s"] if "ZOO-TIMEOUT" in log else []
    rcs = [line.split()[1:] for line in log.splitlines() if line.startswith("ZOO-RC")]
    if rcs != [["sft", "0"], ["sft", "0"], ["qlora", "0"], ["grpo", "0"]]:
        problems.append(f"exit codes {rcs}")
    attn = re.search(r"attention: .*?\((\w+)\)", log)
    packed = "packing on" in log
    if not packed:
        problems.append("sft did not pack")
    state = out / "sft" / "checkpoint-3" / "trainer_state.json"
    losses = ([e["loss"] for e in json.loads(state.read_text())["log_history"] if "loss" in e] if state.is_file()
              else [])
    if len(losses) != 3 or not all(math.isfinite(x) for x in losses):
        problems.append(f"sft losses {losses}")
    loads = {}
    for label, saved in (("sft", out / "sft"), ("qlora", out / "qlora" / "merged"), ("grpo", out / "grpo")):
        try:
            AutoModelForCausalLM.from_pretrained(saved)
            loads[label] = True
        except Exception as e:  # noqa: BLE001 - reported per model
            loads[label] = False
            problems.append(f"{label} output does not load ({type(e).__name__})")
    peak = re.search(r"peak GPU memory ([\d.]+) GiB", log)
    return {"model": name, "attention": attn.group(1) if attn else None, "packed": packed,
            "policy_padding_free": "policy forward: padding-free" in log, "sft_losses": losses, "loads": loads,
            "seconds": round(seconds, 1), "sft_peak_gib": float(peak.group(1)) if peak else None,
            "problems": problems, "log": str(folder / "log.txt")}


def main() -> int:
    from zoo import ZOO

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", metavar="NAME", help=f"zoo models (default all: {', '.join(ZOO)})")
    ap.add_argument("--extra", default="", metavar="OPTIONS",
                    help='options added to every job, e.g. --extra "--torch_compile true"')
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    unknown = [n for n in a.names if n not in ZOO]
    if unknown:
        print(f"error: not in the zoo: {', '.join(unknown)} (tests/zoo.py has {', '.join(ZOO)})", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("error: no GPU here (the CPU half is tests/test_zoo.py)", file=sys.stderr)
        return 2
    from test_data import write_dolly, write_messages
    from test_grpo import gsm8k_rows, write_jsonl

    names = a.names or list(ZOO)
    base = Path(tempfile.mkdtemp(prefix="zoo-train-"))
    data = {"chat": str(write_messages(base / "chat.jsonl", 16)), "dolly": str(write_dolly(base / "dolly.jsonl", 16)),
            "gsm8k": str(write_jsonl(base / "gsm8k.jsonl", gsm8k_rows(8)))}
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}; {len(names)} models side by side in {base}",
          flush=True)
    with ThreadPoolExecutor(len(names)) as pool:
        results = list(pool.map(lambda n: train(n, base, data, shlex.split(a.extra)), names))
    print(f"{'model':16} {'attention':16} packed  pf-grpo  {'sft losses':26} loads  {'s':>6}  peak GiB  problems")
    for r in results:
        losses = " ".join(f"{x:.3f}" for x in r["sft_losses"])
        print(f"{r['model']:16} {r['attention'] or '?':16} {r['packed']!s:7} {r['policy_padding_free']!s:8} "
              f"{losses:26} {sum(r['loads'].values())}/3  {r['seconds']:6.1f}  {r['sft_peak_gib'] or 0:8.2f}  "
              f"{'; '.join(r['problems']) or 'OK'}")
    failures = [f"{r['model']}: {p}" for r in results for p in r["problems"]]
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    print("RESULT " + json.dumps({"failures": failures}), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
