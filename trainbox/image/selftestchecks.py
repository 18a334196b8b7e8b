"""selftest's plan and verdict: which rows run here and how, each in a child process, and the one table.

Rows, in report order: the driver against the image's floor (doctor's own check), every attention kernel against
eager, Liger, bitsandbytes' 4-bit matmul, the fused optimizer step (selftestkernels.py: one child each, so a crash
or a hang is that row's FAIL), the tiny trainings (selftesttrain.py: one child for all of them), vLLM's engine, and an
NCCL all-reduce across the visible GPUs (`trainbox nccl-check`'s own run, its transport line read back).
What cannot run here is SKIP with the reason, decided before any child starts (a GPU row without a GPU costs
nothing); a child's own SKIP says what it found (a kernel not installed). Nothing is downloaded: the children run
with the hub offline, on models and data made on the spot.

TRAINBOX_SELFTEST_FAULT=ROW plants a fault in that row (a kernel's output off, a gradient's sign lost, the saved
weights cut short, the driver taken as too old), which its own check must turn into FAIL.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from common.errors import UsageError
from trainbox.image import imageinfo, selftesttrain
from trainbox.image.doctorchecks import Facts, check_driver
from trainbox.image.doctorprobes import nvidia_smi

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
FAULT_ENV = "TRAINBOX_SELFTEST_FAULT"
ATTENTION = ("fa3", "fa4", "fa2", "varlen", "flex", "sdpa")
KERNEL_ROWS = tuple(f"attention-{k}" for k in ATTENTION) + ("liger", "bitsandbytes-4bit", "fused-optimizer")
ROWS = ("driver", *KERNEL_ROWS, *selftesttrain.ROWS, "vllm-engine", "nccl")
# the rows that run without a GPU; the rest need one
CPU_ROWS = ("attention-sdpa", "attention-flex", "bitsandbytes-4bit", "train-sft", "train-qlora",
            "train-grpo-transformers")
CHILD_TIMEOUT = 170.0  # seconds: the whole run should stay within 3 minutes on a GPU
# What a child must not inherit: a launcher's rank variables would make our trainers join (or start) a job.
DROP = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


@dataclass
class Row:
    row: str
    status: str
    reason: str
    seconds: float = 0.0


def fault() -> str | None:
    name = os.environ.get(FAULT_ENV) or None
    if name and name not in ROWS:
        raise UsageError(f"{FAULT_ENV}={name}: no such row; choose one of {', '.join(ROWS)}")
    return name


def select(only: str | None) -> tuple[str, ...]:
    if not only:
        return ROWS
    names = [n.strip() for n in only.split(",") if n.strip()]
    bad = [n for n in names if n not in ROWS]
    if bad or not names:
        raise UsageError(f"--only {only!r}: unknown row(s) {', '.join(bad) or '(none given)'}; choose from "
                         f"{', '.join(ROWS)}")
    return tuple(r for r in ROWS if r in names)


def driver_row(info: dict | None, record_error: str | None, smi: dict, planted: bool) -> Row:
    """doctor's driver check: the driver nvidia-smi reports against the image record's floor."""
    if record_error:
        return Row("driver", FAIL, f"image record: {record_error}")
    if info is None:
        return Row("driver", SKIP, "no image record (not in a trainbox image): no driver floor to check against")
    if not info.get("cuda"):
        return Row("driver", SKIP, "a CPU image: no driver floor")
    if planted and smi.get("driver"):
        smi = {**smi, "driver": "418.0", "cuda_max": None}  # the planted fault: a driver of CUDA 10's time
    if not smi.get("driver"):
        return Row("driver", SKIP, "no NVIDIA driver here (no nvidia-smi, nothing in /proc/driver/nvidia)")
    check = next(check_driver(Facts(info, smi, {}, {})))
    status = {"fail": FAIL, "ok": PASS, "fallback": PASS}.get(check.status, SKIP)
    return Row("driver", status, check.detail)


def child_env(work: Path, one_gpu: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in DROP and not k.startswith("SLURM_") and k != FAULT_ENV}
    pkg = str(Path(__file__).resolve().parents[2])   # the folder holding trainbox/ and common/
    env["PYTHONPATH"] = os.pathsep.join([pkg, *filter(None, [env.get("PYTHONPATH")])])
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               HF_HOME=str(work / "hf"), HF_DATASETS_CACHE=str(work / "hf" / "datasets"),
               TORCHINDUCTOR_CACHE_DIR=env.get("TORCHINDUCTOR_CACHE_DIR") or str(work / "inductor"))
    if one_gpu:
        first = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
        env["CUDA_VISIBLE_DEVICES"] = first
    return env


def _child(cmd: list[str], env: dict, log: Path, rows: list[str], timeout: float) -> list[Row]:
    """Run one child; its `SELFTEST-ROW` lines are the rows; a row it never printed fails with the child's end."""
    t0 = time.monotonic()
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        out, err, why = r.stdout, r.stderr, f"exit {r.returncode}"
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        why = f"timed out after {timeout:.0f} s"
    log.write_text(out + "\n--- stderr ---\n" + err)
    got = {}
    for line in out.splitlines():
        if line.startswith("SELFTEST-ROW "):
            d = json.loads(line.removeprefix("SELFTEST-ROW "))
            got[d["row"]] = Row(**d)
    last = next((ln.strip() for ln in reversed(err.splitlines()) if ln.strip()), "no output")
    return [got.get(r) or Row(r, FAIL, f"its child process ended ({why}) before the row's verdict: {last[-300:]} "
                                       f"(log: {log})", round(time.monotonic() - t0, 1)) for r in rows]


def nccl_row(work: Path, planted: bool, timeout: float) -> Row:
    """`trainbox nccl-check` (torchrun across the visible GPUs, all-reduce only, small sizes): its data check and
    transport line."""
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "trainbox", "nccl-check", "--ops", "all_reduce", "--min-bytes", "1M", "--max-bytes",
           "16M", "--iters", "5", "--warmup", "2", "--backend", "nccl"]
    env = child_env(work, one_gpu=False)
    if planted:
        env["NCCL_NET"] = "trainbox-planted-fault"   # the planted fault: a network NCCL has no plugin for
        env["NCCL_P2P_DISABLE"] = env["NCCL_SHM_DISABLE"] = "1"
    try:
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Row("nccl", FAIL, f"nccl-check timed out after {timeout:.0f} s", round(time.monotonic() - t0, 1))
    (work / "nccl.log").write_text(r.stdout + "\n--- stderr ---\n" + r.stderr)
    seconds = round(time.monotonic() - t0, 1)
    lines = r.stdout.splitlines()
    summary = next((ln for ln in reversed(lines) if ln.startswith("nccl-check: ") and "busbw" in ln), None)
    transport = next((ln.removeprefix("transport: ") for ln in lines if ln.startswith("transport: ")), None)
    if r.returncode != 0 or not summary or "DATA CHECK FAILED" in summary:
        last = next((ln for ln in reversed((r.stderr + r.stdout).splitlines()) if ln.strip()), "no output")
        return Row("nccl", FAIL, f"nccl-check exit {r.returncode}: {last.strip()[-300:]} (log: {work / 'nccl.log'})",
                   seconds)
    return Row("nccl", PASS, summary.removeprefix("nccl-check: ") + (f"; {transport}" if transport else ""), seconds)


def skips(rows, gpu: bool, has_vllm: bool, planted: str | None) -> dict[str, str]:
    """Rows that cannot run here -> why, known before any child starts."""
    why = {}
    for r in rows:
        if not gpu and r not in CPU_ROWS and r != "driver":
            why[r] = "no GPU here (no nvidia-smi GPU, no /dev/nvidiactl)"
    for r, w in selftesttrain.engines(gpu, has_vllm).items():
        if w and r in rows:
            why[r] = w
    if not has_vllm and "vllm-engine" in rows:
        why["vllm-engine"] = "vllm is not installed"
    return why


def run(only: str | None, work: Path, timeout: float = CHILD_TIMEOUT) -> tuple[dict | None, list[Row]]:
    """The image record (None outside an image) and every selected row, in report order."""
    rows = select(only)
    planted = fault()
    record_error = None
    try:
        info = imageinfo.load()
    except imageinfo.ImageInfoError as e:
        info, record_error = None, str(e)
    smi = nvidia_smi()
    gpu = bool(smi.get("gpus")) or os.path.exists("/dev/nvidiactl")
    has_vllm = importlib.util.find_spec("vllm") is not None
    done: dict[str, Row] = {}
    if "driver" in rows:
        done["driver"] = driver_row(info, record_error, smi, planted == "driver")
    for r, w in skips(rows, gpu, has_vllm, planted).items():
        done[r] = Row(r, SKIP, w)
    todo = [r for r in rows if r not in done]
    env = child_env(work, one_gpu=True)
    if not gpu:
        env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    free = work / "vllm-free"
    if "vllm-engine" not in todo:
        free.touch()
    train_rows = [r for r in todo if r in selftesttrain.ROWS]
    py = sys.executable
    with ThreadPoolExecutor(max_workers=max(2, min(8, (os.cpu_count() or 2) // 2))) as pool:
        train = None
        if train_rows:   # first: the longest child
            cmd = [py, "-u", "-m", "trainbox.image.selftesttrain", str(work / "train"), *train_rows,
                   *(["--fault", planted] if planted in train_rows else []), *(["--gpu"] if gpu else [])]
            train = pool.submit(_child, cmd, {**env, selftesttrain.VLLM_FREE_ENV: str(free)}, work / "train.log",
                                train_rows, timeout)

        def kernel(r: str) -> list[Row]:
            cmd = [py, "-u", "-m", "trainbox.image.selftestkernels", r, *(["--fault"] if planted == r else [])]
            return _child(cmd, env, work / f"{r}.log", [r], timeout)

        short = [pool.submit(kernel, r) for r in todo if r in KERNEL_ROWS]
        if "nccl" in todo:
            short.append(pool.submit(lambda: [nccl_row(work, planted == "nccl", timeout)]))
        for f in short:
            done.update({row.row: row for row in f.result()})
        # vLLM sizes its cache from the GPU memory free while it profiles: started once the short children, which
        # free theirs when they end, are gone; grpo's colocated vLLM waits for this one's end (the `free` file).
        if "vllm-engine" in todo:
            try:
                done.update({row.row: row for row in kernel("vllm-engine")})
            finally:
                free.touch()
        if train is not None:
            done.update({row.row: row for row in train.result()})
    return info, [done[r] for r in rows]


def exit_code(rows: list[Row]) -> int:
    return 1 if any(r.status == FAIL for r in rows) else 0


def render(info: dict | None, rows: list[Row], seconds: float) -> str:
    head = (f"selftest of {info.get('tag')} (cell {info.get('cell')}, {info.get('arch')}, cuda "
            f"{info.get('cuda') or '-'}, attention {info.get('attention_backend')})" if info
            else "selftest (no image record: not in a trainbox image; the image's own rows are SKIP)")
    w = max(len(r.row) for r in rows)
    lines = [head, "", f"{'ROW':<{w}}  {'STATUS':<6}  {'SECONDS':>7}  REASON"]
    lines += [f"{r.row:<{w}}  {r.status:<6}  {r.seconds:>7.1f}  {r.reason}" for r in rows]
    n = {s: sum(r.status == s for r in rows) for s in (PASS, FAIL, SKIP)}
    lines += ["", f"selftest: {n[PASS]} PASS, {n[FAIL]} FAIL, {n[SKIP]} SKIP in {seconds:.0f} s: "
              + ("FAILED (exit 1)" if n[FAIL] else "nothing failed (exit 0)")]
    return "\n".join(lines)


def as_json(info: dict | None, rows: list[Row], seconds: float) -> str:
    code = exit_code(rows)
    return json.dumps({"verdict": "fail" if code else "pass", "exit_code": code, "seconds": round(seconds, 1),
                       "image": info, "rows": [asdict(r) for r in rows]}, indent=2)
