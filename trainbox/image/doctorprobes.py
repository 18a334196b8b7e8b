"""doctor's facts about this host: the GPUs and driver (nvidia-smi, else /proc), child-process probes of torch, FA3,
FA2, vLLM, bitsandbytes and the training stack, and the installed distributions. Every probe runs in a child process
(an import that crashes or hangs becomes an error fact, not a dead doctor); nothing here needs torch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata

from trainbox.image.constraints import norm

PROBE_TIMEOUT_S = float(os.environ.get("TRAINBOX_DOCTOR_TIMEOUT", "300"))  # a cold vLLM import can take minutes


def vkey(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v))


def driver_from_proc(text: str) -> str | None:
    """The kernel module's version from /proc/driver/nvidia/version ('NVRM version: NVIDIA UNIX x86_64 Kernel Module
    550.54.15  Tue Mar 5 ...'): there even where a container has no nvidia-smi (no `utility` capability)."""
    m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
    return m.group(1) if m else None


def nvidia_smi() -> dict:
    """GPUs as nvidia-smi reports them; {"found": False} when it isn't on PATH (driver then from /proc if loaded)."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        try:
            driver = driver_from_proc(open("/proc/driver/nvidia/version").read())
        except OSError:
            driver = None
        return {"found": False, "gpus": [], **({"driver": driver} if driver else {})}
    try:
        q = subprocess.run([exe, "--query-gpu=name,compute_cap,driver_version,memory.total",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=60)
        header = subprocess.run([exe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"found": True, "gpus": [], "error": f"nvidia-smi: {e}"}
    if q.returncode != 0:
        return {"found": True, "gpus": [], "error": (q.stdout + q.stderr).strip().splitlines()[0:1] or ["failed"]}
    gpus = []
    for line in q.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 4:
            cc = vkey(parts[1])
            gpus.append({"name": parts[0], "cc": list(cc[:2]) if len(cc) >= 2 else None, "driver": parts[2],
                         "memory_mib": int(parts[3]) if parts[3].isdigit() else None})
    m = re.search(r"CUDA Version:\s*([\d.]+)", header.stdout)
    return {"found": True, "gpus": gpus, "driver": gpus[0]["driver"] if gpus else None,
            "cuda_max": m.group(1) if m else None}


# Each probe is a tiny program printing one JSON object as its last stdout line; TRAINBOX_DOCTOR_GPU=1 allows GPU ops.
# Attention ops use head dim 128 in bf16: the images' FA3 build keeps only that (FLASH_ATTENTION_DISABLE_HDIM64/96/
# 192/256, no FP8) to bound its compile time.
_PRELUDE = ("import json, os, sys\nout = {}\n"
            "def gpu():\n    if os.environ.get('TRAINBOX_DOCTOR_GPU') != '1':\n        return False\n"
            "    import torch\n    return torch.cuda.is_available()\n")
PROBES = {
    "torch": """
import torch
out['version'] = torch.__version__
out['cuda'] = torch.version.cuda
out['available'] = torch.cuda.is_available()
out['devices'] = []
if out['available']:
    for i in range(torch.cuda.device_count()):
        out['devices'].append({'name': torch.cuda.get_device_name(i), 'cc': list(torch.cuda.get_device_capability(i))})
    out['arch_list'] = torch.cuda.get_arch_list()
    try:
        out['nccl'] = '.'.join(map(str, torch.cuda.nccl.version()))
    except Exception as e:
        out['nccl_error'] = f'{type(e).__name__}: {e}'
    x = torch.ones(64, 64, device='cuda', dtype=torch.float16)
    out['op'] = bool(((x @ x) == 64).all().item())
    if gpu():
        from trainbox.training.attention import runtime_usable
        out['varlen'] = runtime_usable('varlen') or 'ok'
""",
    "fa3": """
try:
    import flash_attn_interface as fa3
    out['module'] = 'flash_attn_interface'
except ImportError:
    import flash_attn_3 as fa3
    out['module'] = 'flash_attn_3'
if gpu():
    import torch
    if torch.cuda.get_device_capability(0)[0] == 9:
        q = torch.randn(1, 16, 2, 128, device='cuda', dtype=torch.bfloat16)
        r = fa3.flash_attn_func(q, q, q, causal=True)
        o = r[0] if isinstance(r, tuple) else r
        out['op'] = bool(o.shape == q.shape and torch.isfinite(o).all().item())
""",
    "fa2": """
import flash_attn
out['version'] = flash_attn.__version__
if gpu():
    import torch
    if torch.cuda.get_device_capability(0)[0] >= 8:
        q = torch.randn(1, 16, 2, 128, device='cuda', dtype=torch.bfloat16)
        o = flash_attn.flash_attn_func(q, q, q, causal=True)
        out['op'] = bool(o.shape == q.shape and torch.isfinite(o).all().item())
""",
    "vllm": """
import vllm
out['version'] = vllm.__version__
if gpu():
    # vLLM's compiled ops: a wheel built for another torch/CUDA, or without kernels for this GPU, fails here.
    import torch
    from vllm import _custom_ops as ops
    x = torch.randn(4, 256, device='cuda', dtype=torch.float16)
    y = torch.empty_like(x)
    ops.rms_norm(y, x, torch.ones(256, device='cuda', dtype=torch.float16), 1e-6)
    ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    out['op'] = bool(torch.allclose(y.float(), ref, atol=1e-2, rtol=1e-2))
""",
    # Without a GPU only the version (metadata): importing bitsandbytes takes 5 s of CPU, and its point is the GPU op.
    "bitsandbytes": """
if not gpu():
    from importlib import metadata
    out['version'] = metadata.version('bitsandbytes')
else:
    import bitsandbytes as bnb
    out['version'] = bnb.__version__
    import torch
    from bitsandbytes import functional as F
    w = torch.randn(128, 64, device='cuda', dtype=torch.float16)
    q, state = F.quantize_4bit(w, quant_type='nf4')
    err = (F.dequantize_4bit(q, state) - w).abs().mean().item()
    out['op'] = err < 0.2
""",
    # Versions from the installed metadata: importing transformers and TRL costs 8 s of CPU (the trainers import
    # them at start anyway and fail loudly there); what doctor compares with the image record is the version.
    "stack": """
from importlib import metadata
for m in ('transformers', 'trl', 'peft', 'accelerate'):
    try:
        out[m] = metadata.version(m)
    except metadata.PackageNotFoundError:
        out[m + '_error'] = f"ModuleNotFoundError: No module named '{m}'"
""",
}

MODULES = {"fa3": ("flash_attn_interface", "flash_attn_3"), "fa2": ("flash_attn",), "vllm": ("vllm",),
           "bitsandbytes": ("bitsandbytes",)}  # the top-level modules each optional probe imports


def run_probe(name: str, gpu: bool) -> dict:
    code = _PRELUDE + "try:\n" + "".join(f"    {ln}\n" for ln in PROBES[name].strip("\n").splitlines()) + \
        "except Exception as e:\n    out['error'] = f'{type(e).__name__}: {e}'\nprint(json.dumps(out))\n"
    env = dict(os.environ, TRAINBOX_DOCTOR_GPU="1" if gpu else "0")
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                           timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {PROBE_TIMEOUT_S:.0f}s"}
    lines = r.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        how = f"killed by signal {-r.returncode}" if r.returncode < 0 else f"exit {r.returncode}"
        return {"error": f"crashed ({how}): {tail}"}


def installed_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def installed_all() -> dict[str, str]:
    """Normalised name -> version of every installed distribution."""
    return {norm(d.metadata["Name"]): d.version for d in metadata.distributions() if d.metadata["Name"]}
