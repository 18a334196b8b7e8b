"""What this image is and whether this host can run it: GPU, driver vs CUDA, NCCL, fabric, FA3/FA2/vLLM/bitsandbytes.

Exit codes:
  0  everything the image needs works on this host (a GPU image on a GPU host; a CPU image anywhere: it trains on CPU)
  1  broken: something the image needs fails (driver too old for the image's CUDA, a package missing (a pin of
     the image's constraints file uninstalled included) or failing to import or to run a tiny op, a GPU that
     nvidia-smi sees but torch can't use, a broken image record)
  3  works, but there is no GPU here for a GPU image (or outside any image: unknown what is wanted); `docker run
     --gpus all ...` or a GPU allocation fixes it
  4  runs, with a fallback: e.g. a Hopper image (FA3) on an Ampere GPU falls back to SDPA, a driver that runs the
     image only through CUDA minor-version compatibility, a package version that differs from the image record
  2  bad usage
Broken wins over no-GPU, which wins over fallback. WARN rows (the fabric: RDMA ports, GPUDirect RDMA, /dev/shm,
libibverbs, the network NCCL loads; a package changed against the image's pip constraints) name a fix but change no exit code: one node trains without RDMA. Every check runs in a child process (an import that crashes or
hangs becomes a failed row, not a dead doctor); nothing here needs torch, so a light image without torch is fine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from importlib import metadata

from entrypoints import attention, constraints, fabric, imageinfo

EXIT_OK, EXIT_BROKEN, EXIT_NO_GPU, EXIT_FALLBACK = 0, 1, 3, 4
VERDICTS = {EXIT_OK: "ok", EXIT_BROKEN: "broken", EXIT_NO_GPU: "no-gpu", EXIT_FALLBACK: "fallback"}
PROBE_TIMEOUT_S = float(os.environ.get("TRAINBOX_DOCTOR_TIMEOUT", "300"))  # a cold vLLM import can take minutes

# Minimum Linux driver per CUDA toolkit release (GA), from "CUDA Toolkit and Corresponding Driver Versions"
# (Table 3 of NVIDIA's CUDA Toolkit release notes). Below it but at or above MINOR_COMPAT_FLOOR the toolkit still
# runs through CUDA minor-version compatibility (precompiled kernels only: no PTX JIT).
MIN_DRIVER = {
    "12.0": "525.60.13", "12.1": "530.30.02", "12.2": "535.54.03", "12.3": "545.23.06", "12.4": "550.54.14",
    "12.5": "555.42.02", "12.6": "560.28.03", "12.8": "570.26", "12.9": "575.51.03", "13.0": "580.65.06",
}
MINOR_COMPAT_FLOOR = {"12": "525.60.13", "13": "580.65.06"}


@dataclass
class Check:
    name: str
    status: str  # ok | fallback | fail | no-gpu | info | warn (no effect on the exit code)
    detail: str


def vkey(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v))


def max_cuda_for_driver(driver: str) -> str | None:
    ok = [c for c, d in MIN_DRIVER.items() if vkey(driver) >= vkey(d)]
    return max(ok, key=vkey) if ok else None


def generation(cc: tuple[int, int], table: dict | None = None) -> str:
    """The GPU generation of compute capability `cc`: from the image record's `gpu_generations` (matrix.toml's GPU
    axis, written at render: an exact SM first, then the same major), else (no record: a CPU or older image) the
    generations this code knows."""
    sm = f"{cc[0]}.{cc[1]}"
    for exact in (True, False):
        for name, sms in (table or {}).items():
            if any(s == sm if exact else str(s).split(".")[0] == str(cc[0]) for s in sms or ()):
                return name
    return {8: "ampere", 9: "hopper", 10: "blackwell", 12: "blackwell"}.get(cc[0], f"sm{cc[0]}{cc[1]}")


# ---------------------------------------------------------------------------------------------------------------
# Host facts
# ---------------------------------------------------------------------------------------------------------------
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
        from entrypoints.attention import runtime_usable
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


# ---------------------------------------------------------------------------------------------------------------
# What the image expects
# ---------------------------------------------------------------------------------------------------------------
MODULES = {"fa3": ("flash_attn_interface", "flash_attn_3"), "fa2": ("flash_attn",), "vllm": ("vllm",),
           "bitsandbytes": ("bitsandbytes",)}  # the top-level modules each optional probe imports
ALIASES = {"fa3": ("flash-attn-3", "flash_attn_3", "flash-attn3", "flash_attn_interface"),
           "fa2": ("flash-attn", "flash_attn"), "vllm": ("vllm",), "bitsandbytes": ("bitsandbytes",),
           "torch": ("torch",), "stack": ("transformers", "trl", "peft", "accelerate")}


def expected(info: dict | None) -> dict[str, bool | None]:
    """Probe name -> the image needs it (True), doesn't have it (False), unknown outside an image (None)."""
    if info is None:
        return dict.fromkeys(PROBES)
    exp = {n: any(imageinfo.version_of(info, a) for a in al) for n, al in ALIASES.items()}
    exp["fa3"] = exp["fa3"] or info.get("attention_backend") == "fa3"
    exp["fa2"] = exp["fa2"] or info.get("attention_backend") == "fa2"
    return exp


def installed_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def same_version(recorded: str, found: str) -> bool:
    """'2.13.0' (record) matches '2.13.0+cu126' (wheel local label); a recorded local label must match exactly."""
    return found == recorded or ("+" not in recorded and found.split("+")[0] == recorded)


# ---------------------------------------------------------------------------------------------------------------
# Verdict (pure: tests feed it facts)
# ---------------------------------------------------------------------------------------------------------------
def evaluate(info: dict | None, smi: dict, probes: dict[str, dict], installed: dict[str, str | None],
             record_error: str | None = None, fabric_facts: dict | None = None) -> list[Check]:
    checks: list[Check] = []
    add = lambda n, s, d: checks.append(Check(n, s, d))  # noqa: E731
    exp = expected(info)

    if record_error:
        add("image record", "fail", record_error)
    elif info is None:
        add("image record", "info", f"none at {imageinfo.path()}: not a trainbox image; checking what's installed")
    else:
        add("image record", "ok", f"{info.get('tag')} (cell {info.get('cell')})")

    t = probes.get("torch", {})
    torch_ok = "version" in t and "error" not in t
    smi_gpus = smi.get("gpus") or []
    torch_gpus = t.get("devices") or []
    image_cuda = (info or {}).get("cuda")

    # -- torch and the GPU ------------------------------------------------------------------------------------
    if exp["torch"] is False:
        add("torch", "info", "not in this image (light image)")
    elif not torch_ok:
        add("torch", "fail" if exp["torch"] else "info", f"import failed: {t.get('error', 'not probed')}")
    elif image_cuda and not t.get("cuda"):
        add("torch", "fail", f"torch {t['version']} is a CPU build but the image is for CUDA {image_cuda}; "
                             "rebuild the image")
    else:
        add("torch", "ok", f"{t['version']} (CUDA {t.get('cuda') or 'none: CPU build'})")

    gpus = torch_gpus or smi_gpus
    cpu_image = info is not None and not image_cuda
    if not gpus:
        why = smi.get("error") or ("nvidia-smi not found" if not smi.get("found") else "nvidia-smi lists none")
        if cpu_image:  # what it was built for: CPU training works, nothing is missing
            add("gpu", "ok", f"none visible ({why}); a CPU image: trains on CPU")
        else:
            add("gpu", "no-gpu", f"no GPU visible ({why}); run with `docker run --gpus all` / a Slurm GPU "
                                 "allocation and an image env with NVIDIA_VISIBLE_DEVICES")
    elif smi_gpus and torch_ok and t.get("cuda") and not t.get("available"):
        add("gpu", "fail", f"nvidia-smi sees {len(smi_gpus)} GPU(s) but torch can't use them "
                           f"(torch CUDA {t.get('cuda')}, driver {smi.get('driver')}): see the driver row")
    else:
        names = {}
        for g in gpus:
            key = f"{g['name']} (sm{''.join(map(str, g['cc'] or []))})"
            names[key] = names.get(key, 0) + 1
        add("gpu", "ok", ", ".join(f"{n}× {k}" for k, n in names.items()))
        if torch_ok and t.get("available") and t.get("op") is not True:
            add("gpu op", "fail", f"a float16 matmul on the GPU failed: {t.get('error', 'wrong result')}")

    cc = tuple(gpus[0]["cc"]) if gpus and gpus[0].get("cc") else None

    # -- driver vs the image's CUDA ---------------------------------------------------------------------------
    driver = smi.get("driver")
    if image_cuda and driver:
        need = (info or {}).get("min_driver") or MIN_DRIVER.get(image_cuda)
        floor = MINOR_COMPAT_FLOOR.get(image_cuda.split(".")[0])
        top = smi.get("cuda_max") or max_cuda_for_driver(driver) or "?"
        if floor and vkey(driver) < vkey(floor):
            add("driver", "fail", f"driver {driver} (CUDA ≤ {top}) is too old for this CUDA {image_cuda} image: "
                                  f"needs ≥ {need} (at the very least {floor}); upgrade the driver or use an image "
                                  "with an older CUDA")
        elif need and vkey(driver) < vkey(need):
            add("driver", "fallback", f"driver {driver} (CUDA ≤ {top}) is older than CUDA {image_cuda}'s {need}: "
                                      "runs through minor-version compatibility (no PTX JIT); upgrade for full support")
        elif MIN_DRIVER.get(image_cuda) and vkey(driver) < vkey(MIN_DRIVER[image_cuda]):
            add("driver", "ok", f"{driver} (CUDA ≤ {top}) runs this CUDA {image_cuda} image through CUDA minor-version "
                                f"compatibility (any {image_cuda.split('.')[0]}.x driver ≥ {need}; its wheels ship "
                                "kernels for the GPU, no PTX JIT needed)")
        else:
            add("driver", "ok", f"{driver} (CUDA ≤ {top}) ≥ {need} needed by CUDA {image_cuda}")
    elif image_cuda and gpus:
        add("driver", "info", "driver version unknown (no nvidia-smi): can't compare with the image's CUDA")
    elif driver:
        top = smi.get("cuda_max") or max_cuda_for_driver(driver) or "?"
        add("driver", "info", f"{driver} (CUDA ≤ {top})" + ("; the image is a CPU image" if info else ""))

    # -- GPU generation, attention -----------------------------------------------------------------------------
    want = (info or {}).get("gpu")
    found = generation(cc, (info or {}).get("gpu_generations")) if cc else None
    if cc and want and found != want:
        add("gpu generation", "fallback", f"image built for {want}, this GPU is {found} "
                                          f"(sm{cc[0]}{cc[1]}); use the {found} image for full speed")
    if info is not None and cc:
        choice = attention.decide(info, cc, lambda name: probed_usable(name, probes))
        add("attention", "ok" if choice.name == info.get("attention_backend") else "fallback", choice.line())
    elif info is not None:
        add("attention", "ok" if cpu_image else "no-gpu",
            f"image default {info.get('attention_backend')}; without a GPU: SDPA")

    # -- NCCL ---------------------------------------------------------------------------------------------------
    if torch_ok and t.get("available"):
        if t.get("nccl"):
            add("nccl", "ok", t["nccl"])
        else:
            add("nccl", "fail", f"torch.cuda.nccl.version() failed: {t.get('nccl_error')}; "
                                "multi-GPU training won't run")
    if fabric_facts is not None:  # fabric.py: RDMA ports, GPUDirect, /dev/shm, libibverbs, NCCL's network
        gpu_image = None if info is None else bool(image_cuda)
        for name, status, detail in fabric.rows(fabric_facts, bool(torch_ok and t.get("available")), gpu_image):
            add(name, status, detail)

    # -- optional pieces ------------------------------------------------------------------------------------------
    stack = probes.get("stack") or {}
    for mod in ALIASES["stack"]:
        e = bool(imageinfo.version_of(info, mod)) if info is not None else None
        if mod in stack:
            add(mod, "ok", stack[mod])
        elif f"{mod}_error" in stack or "error" in stack:
            err = stack.get(f"{mod}_error") or stack["error"]
            if not e and err.startswith("ModuleNotFoundError"):
                add(mod, "info", "not installed" if e is None else "not in this image")
            else:
                add(mod, "fail" if e else "info", f"import failed: {err}")
        elif e is False:
            add(mod, "info", "not in this image")
    labels = {"fa3": "flash-attn 3", "fa2": "flash-attn 2", "vllm": "vllm", "bitsandbytes": "bitsandbytes"}
    for name, label in labels.items():
        e = exp[name]
        p = probes.get(name)
        if e is False:
            add(label, "info", "not in this image")
            continue
        if p is None:
            continue
        if "error" in p:
            needs_driver = not gpus and re.search(r"libcuda|CUDA driver|no NVIDIA driver|nvidia", p["error"], re.I)
            if needs_driver:
                add(label, "no-gpu", f"needs the NVIDIA driver to import ({p['error']})")
            elif name == "fa3" and e and cc and cc[0] != 9:
                add(label, "fallback", f"unusable on sm{cc[0]}{cc[1]} ({p['error']})")
            elif not e and p["error"].startswith("ModuleNotFoundError"):
                add(label, "info", "not installed")
            else:
                add(label, "fail" if e else "info", f"import failed: {p['error']}")
            continue
        ver = p.get("version") or p.get("module") or ", ".join(f"{k} {v}" for k, v in p.items() if k != "op")
        if p.get("op") is False:
            add(label, "fail", f"{ver}: imports but its tiny GPU op gave a wrong result")
        elif name == "fa3" and cc and cc[0] != 9:
            add(label, "fallback", f"{ver} imports, but FA3 kernels need Hopper (sm90): training uses SDPA here")
        else:
            add(label, "ok", f"{ver}" + (", GPU op ok" if p.get("op") else ""))

    # -- versions vs the image record ----------------------------------------------------------------------------
    for dist, recorded in sorted(((info or {}).get("versions") or {}).items()):
        found = installed.get(dist)
        if found is None:
            add(f"version {dist}", "fail", f"record says {recorded}, not installed; rebuild or re-pull the image")
        elif not same_version(str(recorded), found):
            add(f"version {dist}", "fallback", f"record says {recorded}, found {found} (changed after the build?)")
    if info is not None and info.get("versions"):
        ok = [d for d in info["versions"] if installed.get(d) and same_version(str(info["versions"][d]), installed[d])]
        if ok:
            add("versions", "ok", f"{len(ok)} of {len(info['versions'])} match the record")
    return checks


def constraints_check(pins: dict[str, tuple[str, str]], installed: dict[str, str], path: str) -> Check | None:
    """The installed packages against the image's constraints file; no row where there is no file. A pinned
    package that is gone (`pip uninstall`) is a FAIL naming it: what imports it breaks. One installed at another
    version (`PIP_CONSTRAINT= pip install ...`) is a WARN. PINS from constraints.pins, INSTALLED by normalised
    name. Not a fallback: the record's own packages are the version rows' job."""
    if not pins:
        return None
    missing = [(name, version) for key, (name, version) in sorted(pins.items()) if key not in installed]
    changed = [(name, installed[key], version) for key, (name, version) in sorted(pins.items())
               if key in installed and not same_version(version, installed[key])]
    if not changed and not missing:
        return Check("constraints", "ok", f"the installed packages match {path} ({len(pins)} pins)")
    parts = []
    if missing:
        parts.append(f"pinned but not installed: {', '.join(f'{n} {v}' for n, v in missing)}")
    if changed:
        parts.append(f"installed at another version: {', '.join(f'{n} {got} (pinned {v})' for n, got, v in changed)}")
    back = [f"{n}=={v}" for n, v in missing] + [f"{n}=={v}" for n, _, v in changed]
    return Check("constraints", "fail" if missing else "warn",
                 f"against {path}: {'; '.join(parts)}; the image was tested with the pinned versions: put them back "
                 f"with `pip install {' '.join(back)}`")


def installed_all() -> dict[str, str]:
    """Normalised name -> version of every installed distribution."""
    from entrypoints.constraints import norm

    return {norm(d.metadata["Name"]): d.version for d in metadata.distributions() if d.metadata["Name"]}


def probed_usable(name: str, probes: dict[str, dict]) -> str | None:
    """attention.decide's `usable` from doctor's probes (the trainers run the same kernels in-process)."""
    if name == "sdpa":
        return None
    if name == "varlen":
        got = (probes.get("torch") or {}).get("varlen")
        return None if got == "ok" else (got or "not probed (no GPU op allowed)")
    p = probes.get(name)
    if p is None:
        return "not probed by doctor"
    if "error" in p:
        return p["error"]
    if p.get("op") is False:
        return "its test op gave a wrong result"
    return None


def exit_code(checks: list[Check]) -> int:
    statuses = {c.status for c in checks}
    if "fail" in statuses:
        return EXIT_BROKEN
    if "no-gpu" in statuses:
        return EXIT_NO_GPU
    if "fallback" in statuses:
        return EXIT_FALLBACK
    return EXIT_OK


# ---------------------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------------------
def render(info: dict | None, host: dict, checks: list[Check], code: int) -> str:
    lines = []
    if info:
        lines.append(f"IMAGE  {info.get('tag')}  cell={info.get('cell')} arch={info.get('arch')} "
                     f"cuda={info.get('cuda') or '-'} gpu={info.get('gpu') or '-'} "
                     f"cuda_arch_list={info.get('cuda_arch_list') or '-'} attention={info.get('attention_backend')} "
                     f"python={info.get('python')}")
        vers = info.get("versions") or {}
        if vers:
            lines.append("       " + " ".join(f"{k}=={v}" for k, v in sorted(vers.items())))
    else:
        lines.append("IMAGE  (no image record: not running in a trainbox image)")
    smi = host["nvidia_smi"]
    lines.append(f"HOST   {host['hostname']} {host['machine']} python {host['python']}; "
                 f"nvidia-smi: {'driver ' + str(smi.get('driver')) if smi.get('driver') else 'no GPU/driver'}"
                 + (f", CUDA ≤ {smi['cuda_max']}" if smi.get("cuda_max") else ""))
    w = max(len(c.name) for c in checks)
    lines += ["", f"{'CHECK':<{w}}  {'STATUS':<8}  DETAIL"]
    lines += [f"{c.name:<{w}}  {c.status.upper():<8}  {c.detail}" for c in checks]
    meaning = {EXIT_OK: "everything the image needs works on this host", EXIT_BROKEN: "broken: fix the FAIL rows",
               EXIT_NO_GPU: "no GPU here: the image is fine but can't train on this host",
               EXIT_FALLBACK: "runs, with fallbacks: see the FALLBACK rows"}
    warns = sum(c.status == "warn" for c in checks)
    lines += ["", f"VERDICT: {VERDICTS[code]} (exit {code}): {meaning[code]}"
              + (f"; {warns} WARN row(s) name a fix" if warns else "")]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="trainbox doctor", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)

    record_error = None
    try:
        info = imageinfo.load()
    except imageinfo.ImageInfoError as e:
        info, record_error = None, str(e)
    smi = nvidia_smi()
    exp = expected(info) if record_error is None else dict.fromkeys(PROBES)
    # GPU ops only where a GPU may exist (nvidia-smi may be absent in a container that still has the device nodes)
    may_have_gpu = bool(smi.get("gpus")) or os.path.exists("/dev/nvidiactl")
    wanted = [n for n in PROBES if exp[n] is not False or n == "torch"]
    # A probe whose module is not there at all need not start a Python (an import of torch costs seconds).
    probes = {n: {"error": f"ModuleNotFoundError: No module named '{MODULES[n][0]}'"} for n in wanted
              if n in MODULES and not any(importlib.util.find_spec(m) for m in MODULES[n])}
    # The NCCL probe needs CUDA torch and a GPU: asked only where both may be (it runs beside the other probes).
    nccl_probe = may_have_gpu and importlib.util.find_spec("torch") is not None
    with ThreadPoolExecutor(max_workers=len(wanted) + 1) as pool:
        fab = pool.submit(fabric.facts, nccl_probe)
        futures = {n: pool.submit(run_probe, n, may_have_gpu) for n in wanted if n not in probes}
        probes.update({n: f.result() for n, f in futures.items()})
        fabric_facts = fab.result()
    if exp["torch"] is False and "No module named 'torch'" in probes["torch"].get("error", ""):
        probes.pop("torch")
    installed = {d: installed_version(d) for d in ((info or {}).get("versions") or {})}
    checks = evaluate(info, smi, probes, installed, record_error, fabric_facts)
    drift = constraints_check(constraints.pins(constraints.PATH), installed_all(), constraints.PATH)
    if drift:
        checks.append(drift)
    code = exit_code(checks)
    host = {"hostname": socket.gethostname(), "machine": platform.machine(), "python": platform.python_version(),
            "nvidia_smi": smi, "probes": probes, "fabric": fabric_facts}
    if args.json:
        print(json.dumps({"verdict": VERDICTS[code], "exit_code": code, "image": info, "host": host,
                          "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        print(render(info, host, checks, code))
    return code


if __name__ == "__main__":
    from entrypoints.dispatch import run_main

    sys.exit(run_main(main, prog="trainbox doctor"))
