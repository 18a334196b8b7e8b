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
doctor looks; `trainbox selftest` proves: every kernel against eager and a 3-step sft/qlora/grpo here (~3 minutes).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

from trainbox.image import constraints, fabric, imageinfo
from trainbox.image.doctorchecks import (
    EXIT_BROKEN,
    EXIT_FALLBACK,
    EXIT_NO_GPU,
    EXIT_OK,
    VERDICTS,
    Check,
    constraints_check,
    evaluate,
    exit_code,
    expected,
)
from trainbox.image.doctorprobes import MODULES, PROBES, installed_all, installed_version, nvidia_smi, run_probe

# doctor reads versions and runs tiny probes; it never trains. The command that does, named where users look.
SELFTEST_HINT = ("NEXT: `trainbox selftest` runs every kernel against eager and a 3-step sft/qlora/grpo on this "
                 "machine (~3 minutes, nothing downloaded)")


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
    lines.append(SELFTEST_HINT)
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
    from trainbox.dispatch import run_main

    sys.exit(run_main(main, prog="trainbox doctor"))
