"""The memory plan's estimate against the peak a real run allocates (issue: within 10 %), on the device.

    python benchmarks/memory_plan.py [--shapes llama-1b llama-8b] [--gpus 1 2] [--accum 1 4] [--steps 4]
    python benchmarks/memory_plan.py --report-runs   # also fixed rungs (TRAINBOX_MEMORY_PLAN=report) for the terms
    python benchmarks/memory_plan.py --shapes gpt-oss-2b mixtral-2b --gpus 1 --accum 1        # MoE rows
    python benchmarks/memory_plan.py --shapes llama-1b --gpus 1 --accum 1 --attn eager sdpa --data uniform \
        --batch 4 --max-length 1024                                   # eager's scores, SDPA's mask biases

Each run is `trainbox sft` with its defaults on chat data with a long-tailed length mix (packed: every micro-batch
is batch x 2048 tokens), micro-batch 8 x 2048 per GPU, the given gradient accumulation (--batch, --max-length,
--data uniform: every row --max-length long, as eager and SDPA rows need: they are padded, not packed, and the
estimate counts their L x L matrices at --max-length; --attn: the kernel, "default" the one sft picks); the plan line it prints
(its chosen settings and estimate) is set beside the peak allocated and reserved memory of the largest rank
(benchmarks/train_throughput.py's measuring hook). One GPU and an 8B shape do not fit on an 80 GB card: that row is
the plan's refusal (`trainbox plan`, no training).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import train_throughput as tt  # noqa: E402

PLAN_RE = re.compile(r"^\[trainbox\] (memory plan: .*)$", re.M)
EST_RE = re.compile(r"estimate ([\d.]+) GiB per GPU")


def sft_argv(model: Path, data: Path, out: Path, gpus: int, accum: int, steps: int, *extra: str, batch: int = 8,
             max_length: int = 2048) -> list[str]:
    return [sys.executable, "-m", "trainbox", "sft", *(["--nproc-per-node", str(gpus)] if gpus > 1 else []),
            "--model_name_or_path", str(model), "--dataset", str(data / "train.jsonl"), "--output_dir", str(out),
            "--max_steps", str(steps), "--resume", "never", "--max_length", str(max_length),
            "--per_device_train_batch_size", str(batch), "--gradient_accumulation_steps", str(accum),
            "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none", "--seed", "0",
            "--disable_tqdm", "true", *extra]  # fmt: skip


def one(label: str, argv: list[str], work: Path, log: Path, env_extra: dict) -> dict:
    import os

    start = log.stat().st_size if log.is_file() else 0
    saved = {k: os.environ.get(k) for k in env_extra}
    os.environ.update(env_extra)
    try:
        res = tt.run(label, argv, work, log)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    text = log.read_text(errors="replace")[start:]
    plan = PLAN_RE.findall(text)
    res["plan"] = plan[0] if plan else None
    res["plan_lines"] = len(plan)
    m = EST_RE.search(plan[0]) if plan else None
    res["estimate_gib"] = float(m.group(1)) if m else None
    oom = "OutOfMemoryError" in text
    est, peak = res.get("estimate_gib"), res.get("peak_gib")
    err = f"{100 * (est - peak) / peak:+.1f} %" if est and peak else "-"
    print(f"ROW {label:<34} estimate {est or 0:6.1f}  peak alloc {peak or 0:6.1f}  reserved "
          f"{res.get('peak_reserved_gib') or 0:6.1f}  error {err:>8}  {'OOM' if oom else 'FAILED' if res.get('failed') else 'ok'}"
          f"  plan lines {len(plan)}\n    {plan[0] if plan else '(no plan line)'}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["llama-1b", "llama-8b"], choices=sorted(tt.SHAPES))
    ap.add_argument("--gpus", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--accum", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--report-runs", action="store_true", help="also the fixed rungs in report mode")
    ap.add_argument("--attn", nargs="+", default=["default"], help="attention kernels (--attn_implementation)")
    ap.add_argument("--data", choices=["mix", "uniform"], default="mix", help="row lengths: long-tailed or all full")
    ap.add_argument("--batch", type=int, default=8, help="per-device micro-batch (rows)")
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--work", default=tempfile.mkdtemp(prefix="memplan-"))
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    log = work / "memplan.log"
    data = tt.write_chat(work / f"data-{a.data}-{a.max_length}",
                         tt.lengths(a.data, a.batch * 4 * 2 * a.steps * 8, a.max_length))
    rows = {}
    for shape in a.shapes:
        model = tt.make_model(work / shape, shape)
        for gpus in a.gpus:
            if shape == "llama-8b" and gpus == 1:
                r = subprocess.run([sys.executable, "-m", "trainbox", "plan", "--model_name_or_path", str(model),
                                    "--gpu-memory", "77.7", "--per_device_train_batch_size", "8", "--max_length",
                                    "2048"], capture_output=True, text=True, cwd=ROOT)
                print(f"ROW {shape}-1gpu: plan exit {r.returncode}\n    {r.stdout.strip().splitlines()[-1]}", flush=True)
                continue
            for accum in a.accum:
                for attn in a.attn:
                    label = f"{shape}-{gpus}gpu-ga{accum}" + ("" if attn == "default" else f"-{attn}")
                    one_gpu = {"CUDA_VISIBLE_DEVICES": "0"} if gpus == 1 else {}  # else sft uses every visible GPU
                    kernel = [] if attn == "default" else ["--attn_implementation", attn]
                    rows[label] = one(label, sft_argv(model, data, work / f"o-{label}", gpus, accum, a.steps, *kernel,
                                                      batch=a.batch, max_length=a.max_length),
                                      work, log, {"BENCH_SKIP": "1", **one_gpu})
        if a.report_runs:
            # transformers reads a string --fsdp_config as the path of a JSON file
            conf = {"version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "state_dict_type": "SHARDED_STATE_DICT"}
            cfgf, keep = work / "reshard.json", work / "keep.json"
            cfgf.write_text(json.dumps({**conf, "reshard_after_forward": True}))
            keep.write_text(json.dumps({**conf, "reshard_after_forward": False}))
            fixed = [("ckpt-reshard", ["--gradient_checkpointing", "true", "--fsdp_config", str(cfgf)])]
            if shape == "llama-1b":  # (the 8B shape's kept layers can't fit: 2 bytes x 8 B parameters more)
                fixed += [("ckpt-keep", ["--gradient_checkpointing", "true", "--fsdp_config", str(keep)]),
                          ("nockpt-reshard", ["--gradient_checkpointing", "false", "--fsdp_config", str(cfgf)])]
            for name, extra in fixed:
                label = f"{shape}-2gpu-report-{name}"
                rows[label] = one(label, sft_argv(model, data, work / f"o-{label}", 2, 1, a.steps, *extra), work, log,
                                  {"BENCH_SKIP": "1", "TRAINBOX_MEMORY_PLAN": "report"})
    json.dump(rows, open(work / "memplan-results.json", "w"), indent=1, default=str)


if __name__ == "__main__":
    main()
