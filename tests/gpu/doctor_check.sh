#!/usr/bin/env bash
# doctor on a real GPU (run through the device tool from the repo root; never in CI):
#   bash tests/gpu/doctor_check.sh [PYTHON]
# Writes image records that describe this host's own stack (versions read from its python), then checks doctor's
# verdicts: a record that matches → GPU rows OK (gpu, driver, torch op, NCCL); a Hopper/FA3 record without FA3
# installed → broken (exit 1) with the FA3 row failing; on a non-Hopper GPU, an FA3 image → SDPA fallback row.
set -euo pipefail
PY=${1:-$(command -v python3)}
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # keep carried wheels (trl, bitsandbytes, vllm) importable
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader
# the /proc fallback (containers without nvidia-smi) must read the same driver version
"$PY" -c "
import subprocess
from trainbox.image.doctorprobes import driver_from_proc
smi = subprocess.run(['nvidia-smi', '--query-gpu=driver_version', '--format=csv,noheader'], capture_output=True,
                     text=True).stdout.split()[0]
proc = driver_from_proc(open('/proc/driver/nvidia/version').read())
print('driver: nvidia-smi', smi, '/proc', proc)
assert proc == smi, (proc, smi)
"
"$PY" - "$tmp" <<'PYEOF'
import json, sys
from importlib import metadata
tmp = sys.argv[1]
vers = {}
for d in ("torch", "transformers", "trl", "peft", "accelerate", "bitsandbytes", "vllm", "flash-attn"):
    try:
        vers[d] = metadata.version(d)
    except metadata.PackageNotFoundError:
        pass
import torch
cc = torch.cuda.get_device_capability(0)
gen = {8: "ampere", 9: "hopper", 10: "blackwell", 12: "blackwell"}[cc[0]]
cuda = torch.version.cuda
base = {"cell": f"cu{cuda.replace('.', '')}-{gen}", "tag": f"cu{cuda.replace('.', '')}-{gen}-x86_64", "arch": "x86_64",
        "cuda": cuda, "gpu": gen, "cuda_arch_list": f"{cc[0]}.{cc[1]}", "min_driver": None,
        "python": sys.version.split()[0], "versions": vers}
json.dump(dict(base, attention_backend="fa2" if "flash-attn" in vers else "sdpa"), open(f"{tmp}/match.json", "w"))
json.dump(dict(base, attention_backend="fa3"), open(f"{tmp}/fa3.json", "w"))
PYEOF

echo "== doctor, record matching this host =="
set +e
TRAINBOX_IMAGE_INFO=$tmp/match.json "$PY" -m trainbox doctor; code=$?
TRAINBOX_IMAGE_INFO=$tmp/match.json "$PY" -m trainbox doctor --json > "$tmp/match.out"
echo "== doctor, FA3 image record =="
TRAINBOX_IMAGE_INFO=$tmp/fa3.json "$PY" -m trainbox doctor; code3=$?
TRAINBOX_IMAGE_INFO=$tmp/fa3.json "$PY" -m trainbox doctor --json > "$tmp/fa3.out"
echo "== doctor, no record =="
"$PY" -m trainbox doctor; echo "exit $?"
set -e

"$PY" - "$tmp" "$code" "$code3" <<'PYEOF'
import json, sys
tmp, code, code3 = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
m = json.load(open(f"{tmp}/match.out"))
rows = {c["name"]: c for c in m["checks"]}
fails = []
def want(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        fails.append(what)
want(code == m["exit_code"] == 0, f"matching record: exit 0 (got {code}; rows {[(c['name'], c['status']) for c in m['checks'] if c['status'] != 'ok']})")
for r in ("gpu", "driver", "nccl", "torch", "attention"):
    want(rows.get(r, {}).get("status") == "ok", f"matching record: {r} row OK ({rows.get(r)})")
want("gpu op" not in rows, "matching record: the float16 GPU matmul worked")
vp = m["host"]["probes"].get("vllm", {})
if "version" in vp:  # vllm installed here: its compiled ops must run on this GPU
    want(vp.get("op") is True and rows.get("vllm", {}).get("status") == "ok", f"vllm {vp['version']}: rms_norm op ran ({rows.get('vllm')})")
f = json.load(open(f"{tmp}/fa3.out"))
rows3 = {c["name"]: c for c in f["checks"]}
cc = m["host"]["probes"]["torch"]["devices"][0]["cc"]
fa3_installed = "error" not in f["host"]["probes"].get("fa3", {"error": "-"})
if cc[0] == 9 and not fa3_installed:
    want(code3 == 1 and rows3["flash-attn 3"]["status"] == "fail", f"FA3 record on Hopper without FA3: broken ({rows3['flash-attn 3']})")
elif cc[0] == 9:
    want(code3 == 0 and rows3["flash-attn 3"]["status"] == "ok", f"FA3 record on Hopper with FA3: ok ({rows3['flash-attn 3']})")
else:
    want(code3 == 4 and rows3["attention"]["status"] == "fallback", f"FA3 record on sm{cc[0]}{cc[1]}: SDPA fallback ({rows3['attention']})")
sys.exit(1 if fails else 0)
PYEOF
