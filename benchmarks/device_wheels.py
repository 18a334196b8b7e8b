"""Wheels for `train_throughput.py grpo --plain vllm` on the lent GPU machine (issue 31 item 4), in carry-sized parts.

    python benchmarks/device_wheels.py              # download, trim vLLM, cut into .whl/vllm-grpo/pN, print the calls
    python benchmarks/device_wheels.py --resolve    # re-resolve PINS with pip's resolver (prints a new list)

That machine has Python 3.12, torch 2.11.0+cu130, transformers 5.17, peft and accelerate, no vLLM, no TRL, no
network; a call carries at most 64 MiB, the working tree included, and the machine stays warm only 30 s between
calls (files under /tmp survive while it does). So the wheels travel in parts, one call each, appended to /tmp/vw
there; the last part's call joins the split wheels, checks every SHA-256 and installs with `pip --target /tmp/site`.

Why these versions: vLLM pins torch exactly, and the releases built against torch 2.11 are 0.20.0 to 0.26.0 (0.27+
pin torch 2.13); TRL 1.16 accepts vLLM 0.22.0 to 0.31.0; so vLLM 0.26.0, whose wheel on the default index is the
CUDA 13 build (its kernels link libcudart.so.13, like the machine's torch). PINS is vLLM 0.26.0 + TRL 1.16.0 with
their dependencies as pip resolves them for that machine, less what its image already holds and less DROPPED.

Nothing here is imported by the project; it only prepares files under the repo's git-ignored .whl/.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
CARRY_LIMIT = 64 * MIB  # what one call may move, the working tree included
PART_CAP = 60 * MIB

# pip download for the machine: CPython 3.12, x86-64, glibc 2.39 (Ubuntu 24.04); pip matches manylinux levels exactly.
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            *[a for n in ("2_39", "2_35", "2_34", "2_31", "2_28", "2_27", "2_26", "2_24", "2_17", "2_12", "2_5")
              for a in ("--platform", f"manylinux_{n}_x86_64")],
            "--platform", "manylinux2014_x86_64", "--platform", "manylinux2010_x86_64",
            "--platform", "manylinux1_x86_64"]  # fmt: skip

PINS = """
annotated-types==0.8.0 apache-tvm-ffi==0.1.10 astor==0.8.1 blake3==1.0.11 cachetools==8.0.2 cbor2==6.3.0
compressed-tensors==0.17.0 cuda-python==13.4.4 cuda-tile==1.7.0 datasets==5.2.0 depyf==0.20.0 dill==0.4.1
dnspython==2.9.2 docstring_parser==0.18.0 email-validator==2.4.0 fastapi==0.136.3 flashinfer-python==0.6.14
googleapis-common-protos==1.76.0 httpcore2==2.16.2 httptools==0.9.0 httpx2==2.16.2 ijson==3.6.0 interegular==0.3.3
jiter==0.19.0 jmespath==1.1.0 jsonschema-specifications==2025.9.1 jsonschema==4.26.0 lark==1.2.2 llguidance==1.7.6
lm-format-enforcer==0.11.3 loguru==0.7.3 model-hosting-container-standards==0.1.16 msgspec==0.22.0
multiprocess==0.70.19 nvidia-cudnn-frontend==1.28.0 nvtx==0.2.15 openai-harmony==0.0.8 openai==3.57.0
opentelemetry-api==1.45.2 opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2
opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-proto-grpc==1.45.2
opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp==1.45.2 opentelemetry-proto==1.45.2
opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions-ai==0.5.1 opentelemetry-semantic-conventions==0.66b2
outlines_core==0.2.14 partial-json-parser==0.2.1.1.post7 prometheus-fastapi-instrumentator==8.1.0 pybase64==1.5.1
pydantic_core==2.50.5 pydantic-extra-types==2.11.1 pydantic-settings==2.16.3 pydantic==2.14.4 python-dotenv==1.2.4
python-json-logger==4.2.0 python-multipart==0.0.34 pyzmq==27.3.0 referencing==0.37.0 rpds-py==2026.9.1
setproctitle==1.3.8 sniffio==1.3.1 sse-starlette==3.7.0 starlette==1.10.0 supervisor==4.3.0
torch_c_dlpack_ext==0.1.5 trl==1.16.0 truststore==0.10.5 typing-inspection==0.4.5 tzdata==2026.6 uvicorn==0.54.0
vllm==0.26.0
watchfiles==1.3.0 websockets==17.4 xgrammar==0.2.7
""".split()

# Declared dependencies of vLLM 0.26.0 left behind (540 MiB of wheels): none is imported at module level on the path
# a dense Llama takes on Hopper through `vllm.LLM` (FlashAttention 3, FlashInfer sampler, TRL's weight transfer),
# read from vLLM's and FlashInfer's sources; each is imported inside a function of another path, or try-guarded.
DROPPED = {
    "tokenspeed-mla": "MLA kernels (DeepSeek-style attention)", "tokenspeed-triton": "tokenspeed-mla's Triton fork",
    "nvidia-cutlass-dsl": "CuTe DSL: FA4 (Blackwell), GDN and DSA kernels; FlashInfer try-imports it",
    "nvidia-cutlass-dsl-libs-base": "CuTe DSL", "nvidia-cutlass-dsl-libs-core": "CuTe DSL",
    "nvidia-cutlass-dsl-libs-cu12": "CuTe DSL (CUDA 12)", "nvidia-cutlass-dsl-libs-cu13": "CuTe DSL (CUDA 13)",
    "quack-kernels": "CuTe DSL kernels", "humming-kernels": "quantised GEMM kernels",
    "nvidia-cuda-nvcc": "humming-kernels' compiler (the image has its own nvcc)", "nvidia-cuda-crt": "same",
    "nvidia-nvvm": "same", "nvidia-cuda-cccl": "same", "nvidia-cuda-nvdisasm": "same", "pyelftools": "same",
    "tilelang": "DSA kernels", "z3-solver": "tilelang's solver", "pynvvideocodec": "video decoding",
    "torchcodec": "video decoding", "mistral-common": "Mistral tokenizers", "pycountry": "mistral-common's data",
    "fastsafetensors": "load_format=fastsafetensors only (try-guarded import)",
    "anthropic": "the Anthropic-API server", "mcp": "the MCP tool server", "mcp-types": "same",
    "pyjwt": "mcp's", "cryptography": "pyjwt[crypto]'s, for mcp", "cffi": "cryptography's", "pycparser": "cffi's",
    "fastapi-cli": "fastapi[standard]'s command line", "fastapi-cloud-cli": "same", "sentry-sdk": "same",
    "rignore": "same", "fastar": "same", "detect-installer": "same", "agent-detector": "same", "rich-toolkit": "same",
}

# Members of the vLLM wheel not carried: (pattern, why). The MoE kernels (_moe_C) stay: gpt-oss needs them, and
# without them vLLM fails at engine start (`torch.ops._moe_C.topk_softmax` missing, seen on the device).
TRIM = [
    (r"vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so", "FlashAttention 2: before Hopper; sm90 takes FA3 (guarded import)"),
    (r"vllm/vllm-rs", "Rust frontend: used only with VLLM_USE_RUST_FRONTEND=1"),
    (r"vllm/third_party/deep_gemm/_C\.cpython-3(10|11|13|14)-.*\.so", "DeepGEMM for other Pythons"),
]

# The image's Python packages (names as read on the machine on 2026-11-17; typing-inspection, listed then, was
# missing on 2026-11-26: pinned instead) and the versions known of them: --resolve
# keeps them out of PINS and resolves against those versions.
PRESENT = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers
flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py
markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham
simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore
threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions urllib3 uvloop
wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp""".split()
PRESENT_VERSIONS = {"torch": "2.11.0", "torchvision": "0.26.0", "torchaudio": "2.11.0", "triton": "3.6.0",
                    "transformers": "5.17.0", "tokenizers": "0.23.2", "safetensors": "0.8.0",
                    "huggingface-hub": "1.33.0", "accelerate": "1.15.0"}
# Resolved as stubs: their own dependencies (CUDA libraries) are the machine's, and the index may lack their pins.
STUBBED = ("torch", "torchvision", "torchaudio", "triton")

BENCH = ("export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1; "
         "set -o pipefail; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; "
         "timeout 570 python3 benchmarks/train_throughput.py grpo --plain vllm --steps {steps} --runs {runs} "
         "--work /tmp/bench 2>&1 | tee $OUT/log.txt; cp /tmp/bench/grpo-results.json $OUT/ 2>/dev/null; true")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def fail(msg: str) -> None:
    print(f"device_wheels: {msg}", file=sys.stderr)
    sys.exit(2)


def pip(*args: str) -> None:
    r = subprocess.run([sys.executable, "-m", "pip", *args])
    if r.returncode:
        fail(f"pip {args[0]} failed (exit {r.returncode}); see its output above")


def resolve() -> None:
    """Print PINS anew: pip's resolver for the machine, the image's torch family as dependency-free stubs."""
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        for name in STUBBED:
            dist, ver = name.replace("-", "_"), f"{PRESENT_VERSIONS[name]}+stub"
            info = f"{dist}-{ver}.dist-info"
            with zipfile.ZipFile(t / f"{dist}-{ver}-py3-none-any.whl", "w") as z:
                z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n")
                z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
                z.writestr(f"{info}/RECORD", "")
        (t / "c.txt").write_text("".join(f"{n}=={v}{'+stub' if n in STUBBED else ''}\n"
                                         for n, v in PRESENT_VERSIONS.items()))
        pip("install", "-q", "--dry-run", "--ignore-installed", "--report", str(t / "r.json"), "--target",
            str(t / "t"), "--find-links", tmp, "-c", str(t / "c.txt"), *PLATFORM, "vllm==0.26.0", "trl==1.16.0")
        report = json.loads((t / "r.json").read_text())
    got = [(i["metadata"]["name"], i["metadata"]["version"]) for i in report["install"]]
    skip = {norm(n) for n in PRESENT} | set(DROPPED)
    pins = sorted((f"{n}=={v}" for n, v in got if norm(n) not in skip), key=norm)
    print(f"# {len(pins)} pins ({len(got)} resolved, less the image's packages and DROPPED)\n" + " ".join(pins))


def download(dest: Path) -> list[Path]:
    """PINS' wheels in dest (pip skips those already there), one per pin, matched by name and version."""
    dest.mkdir(parents=True, exist_ok=True)
    pip("download", "-q", "--no-deps", "-d", str(dest), *PLATFORM, *PINS)
    have = {}
    for p in dest.glob("*.whl"):
        name, ver, *_ = parse_wheel_filename(p.name)
        have[(name, ver)] = p
    want = [(canonicalize_name(n), Version(v)) for n, v in (s.split("==") for s in PINS)]
    missing = [f"{n}=={v}" for n, v in want if (n, v) not in have]
    if missing:
        fail(f"no wheel in {dest} for {missing}")
    return [have[w] for w in want]


def trim(wheel: Path, out: Path) -> Path:
    """The wheel less TRIM's members (its RECORD too), same name, so pip installs it as usual."""
    out.mkdir(parents=True, exist_ok=True)
    target = out / wheel.name
    drop = re.compile("|".join(f"(?:{p})" for p, _ in TRIM))
    tmp = target.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as dst:
        for info in src.infolist():
            if drop.fullmatch(info.filename):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(keepends=True)
                                if not drop.fullmatch(line.split(b",")[0].decode()))
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    tmp.replace(target)
    return target


def tree_bytes() -> int:
    """What travels besides the carried parts: tracked and untracked-not-ignored files, and shared/."""
    r = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "-c", "-o", "--exclude-standard"],
                       capture_output=True, check=True)
    files = {ROOT / f for f in r.stdout.decode().split("\0") if f}
    files |= set((ROOT / "shared").rglob("*")) if (ROOT / "shared").is_dir() else set()
    return sum(f.stat().st_size for f in files if f.is_file() and not f.is_symlink())


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(MIB):
            h.update(chunk)
    return h.hexdigest()


def cut(files: list[Path], budget: int) -> list[list[tuple[Path, int, int]]]:
    """The files as one stream cut every `budget` bytes: parts of (file, offset, length); a file crossing a cut is
    split there, so the number of parts is the least possible."""
    parts: list[list[tuple[Path, int, int]]] = [[]]
    room = budget
    for f in files:
        size, off = f.stat().st_size, 0
        while off < size:
            if room == 0:
                parts.append([])
                room = budget
            n = min(room, size - off)
            parts[-1].append((f, off, n))
            off, room = off + n, room - n
    return parts


STEP = """#!/bin/bash
# Call {k} of {n}: part {k} of the vLLM + TRL wheels into /tmp/vw{last_note}.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
{start}
got=$(ls /tmp/vw/.got-p* 2>/dev/null | wc -l)
[ "$got" = {before} ] || {{ echo "/tmp/vw holds $got of the {before} earlier parts: the machine was given back" \
    "between calls; start again at call 1"; exit 3; }}
cp "$here"/*.whl* /tmp/vw/ && touch /tmp/vw/.got-p{k}
echo "part {k}/{n} in /tmp/vw: $(du -sm /tmp/vw | cut -f1) MiB"
"""

FINISH = """cd /tmp/vw
for first in *.whl.000; do
    [ -e "$first" ] || continue
    w=${first%.000}; cat "$w".[0-9][0-9][0-9] > "$w"; rm "$w".[0-9][0-9][0-9]
done
cp "$here/SHA256SUMS" . && sha256sum --quiet -c SHA256SUMS
rm -rf /tmp/site
python3 -m pip install -q --root-user-action=ignore --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site /tmp/vw/*.whl
export PYTHONPATH=/tmp/site
command -v nvcc || ls /usr/local/cuda*/bin/nvcc ||
    echo "no nvcc: FlashInfer's JIT sampler can't build (VLLM_USE_FLASHINFER_SAMPLER=0 avoids it)"
python3 -m pip check 2>&1 | head -40 || true
python3 -c "import torch, vllm, trl, flashinfer, datasets as d; print('import ok:', *(f'{m.__name__} {m.__version__}'
    for m in (torch, vllm, trl, flashinfer, d)))"
"""


def chunk_index(parts, f: Path, k: int) -> int:
    """Which piece of f part k holds (0 for the piece in the first part that has f)."""
    return sum(1 for part in parts[: k - 1] for g, _, _ in part if g == f)


def write_parts(parts, out: Path, sums: str) -> list[Path]:
    for old in out.glob("p[0-9]*"):
        shutil.rmtree(old)
    dirs = []
    for k, part in enumerate(parts, 1):
        d = out / f"p{k}"
        d.mkdir(parents=True)
        for f, off, n in part:
            whole = off == 0 and n == f.stat().st_size
            name = f.name if whole else f"{f.name}.{chunk_index(parts, f, k):03d}"  # joined in order by `cat`
            with open(f, "rb") as src, open(d / name, "wb") as dst:
                src.seek(off)
                dst.write(src.read(n))
        last = k == len(parts)
        (d / "step.sh").write_text(STEP.format(
            k=k, n=len(parts), before=k - 1, last_note="; then join, check and install into /tmp/site" if last else "",
            start="rm -rf /tmp/vw /tmp/site; mkdir -p /tmp/vw" if k == 1 else "") + (FINISH if last else ""))
        if last:
            (d / "SHA256SUMS").write_text(sums)
        dirs.append(d)
    return dirs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--resolve", action="store_true", help="re-resolve PINS with pip and print them; nothing else")
    ap.add_argument("--out", default=str(ROOT / ".whl" / "vllm-grpo"),
                    help="folder for the downloads (dl/, trimmed/) and the parts (p1, p2, ...); must be git-ignored")
    ap.add_argument("--part-mib", type=float, default=None,
                    help="bytes per part in MiB (default: 64 MiB less the working tree less 1 MiB, at most 60)")
    ap.add_argument("--no-trim", action="store_true", help="carry the whole vLLM wheel (FA2, Rust frontend)")
    ap.add_argument("--steps", type=int, default=12, help="the benchmark's --steps")
    ap.add_argument("--runs", type=int, default=2,
                    help="the benchmark's --runs in its first call (plain, ours: fits 570 s with cold JIT caches)")
    a = ap.parse_args()
    if a.resolve:
        return resolve()
    out = Path(a.out).resolve()
    try:
        rel = out.relative_to(ROOT)
    except ValueError:
        fail(f"--out {out} is outside the repo {ROOT}: a call carries only paths inside the repo")
    if subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", str(out / "p1")]).returncode != 0:
        fail(f"{out} is not git-ignored: its parts would be committed and travel twice; "
             f"add it to .git/info/exclude or pick --out under {ROOT / '.whl'}")
    tree = tree_bytes()
    budget = int(a.part_mib * MIB) if a.part_mib else min(PART_CAP, CARRY_LIMIT - tree - MIB)
    if budget <= 0 or CARRY_LIMIT - tree - budget < 64 * 1024:  # step.sh and SHA256SUMS ride with the parts
        fail(f"no room: the working tree is {tree / MIB:.1f} MiB and parts would be {budget / MIB:.1f} MiB "
             f"of a {CARRY_LIMIT // MIB} MiB call; lower --part-mib")

    wheels = download(out / "dl")
    if not a.no_trim:
        wheels = [trim(w, out / "trimmed") if w.name.startswith("vllm-") else w for w in wheels]
    wheels.sort(key=lambda p: -p.stat().st_size)  # the big ones first: fewer of the small ones end up split
    sums = "".join(f"{sha256(w)}  {w.name}\n" for w in wheels)
    dirs = write_parts(cut(wheels, budget), out, sums)

    total = sum(w.stat().st_size for w in wheels)
    print(f"# {len(wheels)} wheels, {total / MIB:.1f} MiB{'' if a.no_trim else ' (vLLM trimmed)'}; working tree "
          f"{tree / MIB:.1f} MiB; parts of at most {budget / MIB:.1f} MiB -> {len(dirs)} calls + 1 benchmark call")
    for w in wheels[:12]:
        print(f"#   {w.stat().st_size / MIB:7.1f} MiB  {w.name}")
    print("# Make the calls back to back (the machine goes back 30 s after a call, and /tmp/vw with it); a call that")
    print("# finds earlier parts missing says so and exits 3: start again at call 1.")
    for k, d in enumerate(dirs, 1):
        print(f"call {k}: carry [\"{rel / d.name}\"]  command: bash {rel / d.name}/step.sh")
    print(f"call {len(dirs) + 1}: carry []  timeout_s 600  command: {BENCH.format(steps=a.steps, runs=a.runs)}")
    print(f"call {len(dirs) + 2} (optional, while warm: compile and JIT caches kept): the same with --runs 4")
    held = 90 + 20 * len(dirs) + 60 + 590
    print(f"# device time, roughly: start 90 s + {len(dirs)} x ~20 s transfer and copy + ~60 s install and import "
          f"check + up to 590 s benchmark = ~{held} s held (a one-GPU machine counts 50%: ~{held // 2} s)")


if __name__ == "__main__":
    main()
