"""doctor's checks, pure: facts in (the image record, nvidia-smi, the probes, installed versions, the fabric), rows out.

One function per check, each yielding its rows; CHECKS is their order, the order of the report, and `evaluate` walks
it. `exit_code` turns the rows into the verdict: broken wins over no-GPU, which wins over fallback; WARN and INFO rows
never change it. Tests feed these functions facts; doctor.py gathers the real ones (doctorprobes.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from trainbox.image import fabric, imageinfo
from trainbox.image.doctorprobes import PROBES, vkey
from trainbox.training import attention

EXIT_OK, EXIT_BROKEN, EXIT_NO_GPU, EXIT_FALLBACK = 0, 1, 3, 4
VERDICTS = {EXIT_OK: "ok", EXIT_BROKEN: "broken", EXIT_NO_GPU: "no-gpu", EXIT_FALLBACK: "fallback"}

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
# What the image expects
# ---------------------------------------------------------------------------------------------------------------
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


def same_version(recorded: str, found: str) -> bool:
    """'2.13.0' (record) matches '2.13.0+cu126' (wheel local label); a recorded local label must match exactly."""
    return found == recorded or ("+" not in recorded and found.split("+")[0] == recorded)


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


# ---------------------------------------------------------------------------------------------------------------
# The facts every check reads, and what follows from them (worked out once)
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Facts:
    info: dict | None
    smi: dict
    probes: dict[str, dict]
    installed: dict[str, str | None]
    record_error: str | None = None
    fabric: dict | None = None
    exp: dict[str, bool | None] = field(init=False)
    torch: dict = field(init=False)           # the torch probe
    torch_ok: bool = field(init=False)        # torch imports
    torch_gpu: bool = field(init=False)       # ... and can use a GPU here
    gpus: list[dict] = field(init=False)      # torch's devices, else nvidia-smi's
    image_cuda: str | None = field(init=False)
    cpu_image: bool = field(init=False)       # an image built without CUDA
    cc: tuple[int, ...] | None = field(init=False)   # the first GPU's compute capability

    def __post_init__(self):
        self.exp = expected(self.info)
        self.torch = self.probes.get("torch", {})
        self.torch_ok = "version" in self.torch and "error" not in self.torch
        self.torch_gpu = bool(self.torch_ok and self.torch.get("available"))
        self.gpus = self.torch.get("devices") or self.smi.get("gpus") or []
        self.image_cuda = (self.info or {}).get("cuda")
        self.cpu_image = self.info is not None and not self.image_cuda
        self.cc = tuple(self.gpus[0]["cc"]) if self.gpus and self.gpus[0].get("cc") else None


# ---------------------------------------------------------------------------------------------------------------
# The checks, in report order
# ---------------------------------------------------------------------------------------------------------------
def check_image_record(f: Facts) -> Iterator[Check]:
    if f.record_error:
        yield Check("image record", "fail", f.record_error)
    elif f.info is None:
        yield Check("image record", "info", f"none at {imageinfo.path()}: not a trainbox image; checking what's "
                                            "installed")
    else:
        yield Check("image record", "ok", f"{f.info.get('tag')} (cell {f.info.get('cell')})")


def check_torch(f: Facts) -> Iterator[Check]:
    t = f.torch
    if f.exp["torch"] is False:
        yield Check("torch", "info", "not in this image (light image)")
    elif not f.torch_ok:
        yield Check("torch", "fail" if f.exp["torch"] else "info", f"import failed: {t.get('error', 'not probed')}")
    elif f.image_cuda and not t.get("cuda"):
        yield Check("torch", "fail", f"torch {t['version']} is a CPU build but the image is for CUDA "
                                     f"{f.image_cuda}; rebuild the image")
    else:
        yield Check("torch", "ok", f"{t['version']} (CUDA {t.get('cuda') or 'none: CPU build'})")


def check_gpu(f: Facts) -> Iterator[Check]:
    t, smi_gpus = f.torch, f.smi.get("gpus") or []
    if not f.gpus:
        why = f.smi.get("error") or ("nvidia-smi not found" if not f.smi.get("found") else "nvidia-smi lists none")
        if f.cpu_image:  # what it was built for: CPU training works, nothing is missing
            yield Check("gpu", "ok", f"none visible ({why}); a CPU image: trains on CPU")
        else:
            yield Check("gpu", "no-gpu", f"no GPU visible ({why}); run with `docker run --gpus all` / a Slurm GPU "
                                         "allocation and an image env with NVIDIA_VISIBLE_DEVICES")
    elif smi_gpus and f.torch_ok and t.get("cuda") and not t.get("available"):
        yield Check("gpu", "fail", f"nvidia-smi sees {len(smi_gpus)} GPU(s) but torch can't use them "
                                   f"(torch CUDA {t.get('cuda')}, driver {f.smi.get('driver')}): see the driver row")
    else:
        names = {}
        for g in f.gpus:
            key = f"{g['name']} (sm{''.join(map(str, g['cc'] or []))})"
            names[key] = names.get(key, 0) + 1
        yield Check("gpu", "ok", ", ".join(f"{n}× {k}" for k, n in names.items()))
        if f.torch_gpu and t.get("op") is not True:
            yield Check("gpu op", "fail", f"a float16 matmul on the GPU failed: {t.get('error', 'wrong result')}")


def check_driver(f: Facts) -> Iterator[Check]:
    """The driver against the image's CUDA: too old, minor-version compatibility, or enough."""
    driver, image_cuda = f.smi.get("driver"), f.image_cuda
    if image_cuda and driver:
        need = (f.info or {}).get("min_driver") or MIN_DRIVER.get(image_cuda)
        floor = MINOR_COMPAT_FLOOR.get(image_cuda.split(".")[0])
        top = f.smi.get("cuda_max") or max_cuda_for_driver(driver) or "?"
        if floor and vkey(driver) < vkey(floor):
            yield Check("driver", "fail", f"driver {driver} (CUDA ≤ {top}) is too old for this CUDA {image_cuda} "
                                          f"image: needs ≥ {need} (at the very least {floor}); upgrade the driver or "
                                          "use an image with an older CUDA")
        elif need and vkey(driver) < vkey(need):
            yield Check("driver", "fallback", f"driver {driver} (CUDA ≤ {top}) is older than CUDA {image_cuda}'s "
                                              f"{need}: runs through minor-version compatibility (no PTX JIT); "
                                              "upgrade for full support")
        elif MIN_DRIVER.get(image_cuda) and vkey(driver) < vkey(MIN_DRIVER[image_cuda]):
            yield Check("driver", "ok", f"{driver} (CUDA ≤ {top}) runs this CUDA {image_cuda} image through CUDA "
                                        f"minor-version compatibility (any {image_cuda.split('.')[0]}.x driver ≥ "
                                        f"{need}; its wheels ship kernels for the GPU, no PTX JIT needed)")
        else:
            yield Check("driver", "ok", f"{driver} (CUDA ≤ {top}) ≥ {need} needed by CUDA {image_cuda}")
    elif image_cuda and f.gpus:
        yield Check("driver", "info", "driver version unknown (no nvidia-smi): can't compare with the image's CUDA")
    elif driver:
        top = f.smi.get("cuda_max") or max_cuda_for_driver(driver) or "?"
        yield Check("driver", "info", f"{driver} (CUDA ≤ {top})" + ("; the image is a CPU image" if f.info else ""))


def check_gpu_generation(f: Facts) -> Iterator[Check]:
    want, cc = (f.info or {}).get("gpu"), f.cc
    found = generation(cc, (f.info or {}).get("gpu_generations")) if cc else None
    if cc and want and found != want:
        yield Check("gpu generation", "fallback", f"image built for {want}, this GPU is {found} "
                                                  f"(sm{cc[0]}{cc[1]}); use the {found} image for full speed")


def check_attention(f: Facts) -> Iterator[Check]:
    """The kernel the trainers will pick here (attention.decide on the probes), against the image's default."""
    if f.info is not None and f.cc:
        choice = attention.decide(f.info, f.cc, lambda name: probed_usable(name, f.probes))
        yield Check("attention", "ok" if choice.name == f.info.get("attention_backend") else "fallback",
                    choice.line())
    elif f.info is not None:
        yield Check("attention", "ok" if f.cpu_image else "no-gpu",
                    f"image default {f.info.get('attention_backend')}; without a GPU: SDPA")


def check_nccl(f: Facts) -> Iterator[Check]:
    if f.torch_gpu:
        if f.torch.get("nccl"):
            yield Check("nccl", "ok", f.torch["nccl"])
        else:
            yield Check("nccl", "fail", f"torch.cuda.nccl.version() failed: {f.torch.get('nccl_error')}; "
                                        "multi-GPU training won't run")


def check_fabric(f: Facts) -> Iterator[Check]:
    """fabric.py's rows: RDMA ports, GPUDirect, /dev/shm, libibverbs, NCCL's network."""
    if f.fabric is not None:
        gpu_image = None if f.info is None else bool(f.image_cuda)
        for name, status, detail in fabric.rows(f.fabric, f.torch_gpu, gpu_image):
            yield Check(name, status, detail)


def check_stack(f: Facts) -> Iterator[Check]:
    """transformers, TRL, PEFT, accelerate: installed versions (the stack probe reads metadata, imports nothing)."""
    stack = f.probes.get("stack") or {}
    for mod in ALIASES["stack"]:
        e = bool(imageinfo.version_of(f.info, mod)) if f.info is not None else None
        if mod in stack:
            yield Check(mod, "ok", stack[mod])
        elif f"{mod}_error" in stack or "error" in stack:
            err = stack.get(f"{mod}_error") or stack["error"]
            if not e and err.startswith("ModuleNotFoundError"):
                yield Check(mod, "info", "not installed" if e is None else "not in this image")
            else:
                yield Check(mod, "fail" if e else "info", f"import failed: {err}")
        elif e is False:
            yield Check(mod, "info", "not in this image")


OPTIONAL = {"fa3": "flash-attn 3", "fa2": "flash-attn 2", "vllm": "vllm", "bitsandbytes": "bitsandbytes"}


def check_optional(f: Facts) -> Iterator[Check]:
    """FA3, FA2, vLLM, bitsandbytes: imported, and their tiny GPU op where a GPU is allowed."""
    cc = f.cc
    for name, label in OPTIONAL.items():
        e = f.exp[name]
        p = f.probes.get(name)
        if e is False:
            yield Check(label, "info", "not in this image")
            continue
        if p is None:
            continue
        if "error" in p:
            needs_driver = not f.gpus and re.search(r"libcuda|CUDA driver|no NVIDIA driver|nvidia", p["error"], re.I)
            if needs_driver:
                yield Check(label, "no-gpu", f"needs the NVIDIA driver to import ({p['error']})")
            elif name == "fa3" and e and cc and cc[0] != 9:
                yield Check(label, "fallback", f"unusable on sm{cc[0]}{cc[1]} ({p['error']})")
            elif not e and p["error"].startswith("ModuleNotFoundError"):
                yield Check(label, "info", "not installed")
            else:
                yield Check(label, "fail" if e else "info", f"import failed: {p['error']}")
            continue
        ver = p.get("version") or p.get("module") or ", ".join(f"{k} {v}" for k, v in p.items() if k != "op")
        if p.get("op") is False:
            yield Check(label, "fail", f"{ver}: imports but its tiny GPU op gave a wrong result")
        elif name == "fa3" and cc and cc[0] != 9:
            yield Check(label, "fallback", f"{ver} imports, but FA3 kernels need Hopper (sm90): training uses SDPA "
                                           "here")
        else:
            yield Check(label, "ok", f"{ver}" + (", GPU op ok" if p.get("op") else ""))


def check_versions(f: Facts) -> Iterator[Check]:
    """The installed versions against the image record's."""
    versions = (f.info or {}).get("versions") or {}
    for dist, recorded in sorted(versions.items()):
        found = f.installed.get(dist)
        if found is None:
            yield Check(f"version {dist}", "fail", f"record says {recorded}, not installed; rebuild or re-pull the "
                                                   "image")
        elif not same_version(str(recorded), found):
            yield Check(f"version {dist}", "fallback", f"record says {recorded}, found {found} (changed after the "
                                                       "build?)")
    if f.info is not None and f.info.get("versions"):
        ok = [d for d in versions if f.installed.get(d) and same_version(str(versions[d]), f.installed[d])]
        if ok:
            yield Check("versions", "ok", f"{len(ok)} of {len(versions)} match the record")


CHECKS: tuple[Callable[[Facts], Iterator[Check]], ...] = (
    check_image_record, check_torch, check_gpu, check_driver, check_gpu_generation, check_attention, check_nccl,
    check_fabric, check_stack, check_optional, check_versions)


def evaluate(info: dict | None, smi: dict, probes: dict[str, dict], installed: dict[str, str | None],
             record_error: str | None = None, fabric_facts: dict | None = None) -> list[Check]:
    """Every check's rows, in CHECKS order."""
    facts = Facts(info, smi, probes, installed, record_error, fabric_facts)
    return [row for check in CHECKS for row in check(facts)]


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


def exit_code(checks: list[Check]) -> int:
    statuses = {c.status for c in checks}
    if "fail" in statuses:
        return EXIT_BROKEN
    if "no-gpu" in statuses:
        return EXIT_NO_GPU
    if "fallback" in statuses:
        return EXIT_FALLBACK
    return EXIT_OK
