"""doctor: verdicts from facts (pure), the driver table, and real runs: CPU host, no-torch python, fake nvidia-smi."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from trainbox.image import doctorchecks, doctorprobes, imageinfo
from trainbox.image.doctorchecks import EXIT_BROKEN, EXIT_FALLBACK, EXIT_NO_GPU, EXIT_OK, evaluate, exit_code

ROOT = Path(__file__).resolve().parents[1]


def record(**kw) -> dict:
    base = {"cell": "cu126-hopper", "tag": "cu126-hopper-x86_64", "arch": "x86_64", "cuda": "12.6", "gpu": "hopper",
            "cuda_arch_list": "9.0a", "attention_backend": "fa3", "min_driver": "560.28.03", "python": "3.12",
            "versions": {"torch": "2.13.0", "transformers": "5.17.0", "trl": "1.16.0", "peft": "0.21.2",
                         "accelerate": "1.15.0", "bitsandbytes": "0.50.2", "vllm": "0.31.0"}}
    base.update(kw)
    return base


def smi(name="NVIDIA H100 80GB HBM3", cc=(9, 0), driver="575.57.08", n=1, cuda_max="12.9"):
    gpus = [{"name": name, "cc": list(cc), "driver": driver, "memory_mib": 81559}] * n
    return {"found": True, "gpus": gpus, "driver": driver, "cuda_max": cuda_max}


def probes(cc=(9, 0), gpu=True, **over):
    p = {
        "torch": {"version": "2.13.0+cu126", "cuda": "12.6", "available": gpu, "op": True if gpu else None,
                  "devices": [{"name": "NVIDIA H100 80GB HBM3", "cc": list(cc)}] if gpu else [],
                  "nccl": "2.27.5" if gpu else None},
        "fa3": {"module": "flash_attn_interface", **({"op": True} if gpu and cc[0] == 9 else {})},
        "vllm": {"version": "0.31.0"},
        "bitsandbytes": {"version": "0.50.2", **({"op": True} if gpu else {})},
        "stack": {"transformers": "5.17.0", "trl": "1.16.0", "peft": "0.21.2", "accelerate": "1.15.0"},
    }
    p.update(over)
    return p


INSTALLED = {"torch": "2.13.0+cu126", "transformers": "5.17.0", "trl": "1.16.0", "peft": "0.21.2",
             "accelerate": "1.15.0", "bitsandbytes": "0.50.2", "vllm": "0.31.0"}


def rows(checks):
    return {c.name: c for c in checks}


def test_hopper_image_on_hopper_gpu_is_ok():
    checks = evaluate(record(), smi(), probes(), INSTALLED)
    assert exit_code(checks) == EXIT_OK, [(c.name, c.status, c.detail) for c in checks if c.status != "ok"]
    r = rows(checks)
    assert r["flash-attn 3"].status == "ok" and "GPU op ok" in r["flash-attn 3"].detail
    assert r["nccl"].detail == "2.27.5"
    assert "1× NVIDIA H100 80GB HBM3 (sm90)" in r["gpu"].detail


def test_hopper_image_on_ampere_falls_back_to_sdpa_and_says_so():
    checks = evaluate(record(), smi("NVIDIA A100-SXM4-80GB", (8, 0)), probes(cc=(8, 0)), INSTALLED)
    r = rows(checks)
    assert exit_code(checks) == EXIT_FALLBACK
    assert r["attention"].status == "fallback"
    assert "FlashAttention 3: needs a Hopper GPU (sm90); this GPU is sm80" in r["attention"].detail
    assert "attention: PyTorch SDPA" in r["attention"].detail
    assert r["gpu generation"].status == "fallback" and "use the ampere image" in r["gpu generation"].detail
    assert r["flash-attn 3"].status == "fallback"


def test_driver_too_old_for_the_image_cuda_is_broken():
    checks = evaluate(record(), smi(driver="520.61.05", cuda_max="11.8"), probes(), INSTALLED)
    r = rows(checks)
    assert exit_code(checks) == EXIT_BROKEN
    assert r["driver"].status == "fail"
    assert "too old for this CUDA 12.6 image" in r["driver"].detail and "560.28.03" in r["driver"].detail


def test_driver_below_toolkit_but_minor_compatible_is_a_fallback():
    checks = evaluate(record(), smi(driver="550.54.15", cuda_max="12.4"), probes(), INSTALLED)
    r = rows(checks)
    assert r["driver"].status == "fallback" and "minor-version compatibility" in r["driver"].detail
    assert exit_code(checks) == EXIT_FALLBACK


def test_min_driver_falls_back_to_the_table_when_the_record_has_none():
    checks = evaluate(record(min_driver=None, cuda="12.8"), smi(driver="565.57.01"), probes(), INSTALLED)
    assert rows(checks)["driver"].status == "fallback" and "570.26" in rows(checks)["driver"].detail


def test_gpu_seen_by_nvidia_smi_but_not_torch_is_broken():
    p = probes(gpu=False)
    checks = evaluate(record(), smi(), p, INSTALLED)
    assert exit_code(checks) == EXIT_BROKEN
    assert "torch can't use them" in rows(checks)["gpu"].detail


def test_cpu_host_is_no_gpu_not_broken():
    p = probes(gpu=False, fa3={"error": "ImportError: libcuda.so.1: cannot open shared object file"})
    checks = evaluate(record(), {"found": False, "gpus": []}, p, INSTALLED)
    r = rows(checks)
    assert exit_code(checks) == EXIT_NO_GPU
    assert r["gpu"].status == "no-gpu" and "--gpus all" in r["gpu"].detail
    assert r["flash-attn 3"].status == "no-gpu"  # needs the driver: not a defect of the image


def test_gpu_image_on_a_cpu_host_stays_no_gpu_and_a_cpu_image_there_is_ok():
    no_smi = {"found": False, "gpus": []}
    gpu_image = evaluate(record(), no_smi, probes(gpu=False), INSTALLED)
    assert exit_code(gpu_image) == EXIT_NO_GPU
    cpu = record(cuda=None, gpu=None, cuda_arch_list=None, attention_backend="sdpa", min_driver=None,
                 versions={"torch": "2.13.0"})
    checks = evaluate(cpu, no_smi, probes(gpu=False), {"torch": "2.13.0"})
    assert exit_code(checks) == EXIT_OK, checks
    assert rows(checks)["gpu"].status == "ok" and rows(checks)["attention"].status == "ok"
    assert exit_code(evaluate(None, no_smi, probes(gpu=False), INSTALLED)) == EXIT_NO_GPU  # outside any image


def test_failures_beat_no_gpu():
    p = probes(gpu=False, vllm={"error": "ImportError: cannot import name 'X' from 'torch'"})
    checks = evaluate(record(), {"found": False, "gpus": []}, p, INSTALLED)
    assert rows(checks)["vllm"].status == "fail" and exit_code(checks) == EXIT_BROKEN


def test_expected_fa3_missing_on_hopper_is_broken():
    p = probes(fa3={"error": "ModuleNotFoundError: No module named 'flash_attn_3'"})
    checks = evaluate(record(), smi(), p, INSTALLED)
    assert rows(checks)["flash-attn 3"].status == "fail" and exit_code(checks) == EXIT_BROKEN


def test_tiny_op_wrong_result_is_broken():
    p = probes(bitsandbytes={"version": "0.50.2", "op": False})
    assert exit_code(evaluate(record(), smi(), p, INSTALLED)) == EXIT_BROKEN


def test_crashing_probe_is_a_failed_row():
    p = probes(vllm={"error": "crashed (killed by signal 11): Segmentation fault"})
    r = rows(evaluate(record(), smi(), p, INSTALLED))
    assert r["vllm"].status == "fail" and "signal 11" in r["vllm"].detail


def test_versions_against_the_record():
    inst = dict(INSTALLED, trl="1.17.0", vllm=None)
    r = rows(evaluate(record(), smi(), probes(), inst))
    assert r["version trl"].status == "fallback" and "found 1.17.0" in r["version trl"].detail
    assert r["version vllm"].status == "fail"
    assert doctorchecks.same_version("2.13.0", "2.13.0+cu126") and not doctorchecks.same_version("2.13.0+cu129", "2.13.0+cu126")


def test_light_image_without_torch():
    info = record(cuda=None, gpu=None, cuda_arch_list=None, attention_backend="sdpa", min_driver=None,
                  versions={"jupyterlab": "4.6.6"})
    checks = evaluate(info, {"found": False, "gpus": []}, {}, {"jupyterlab": "4.6.6"})
    r = rows(checks)
    assert r["torch"].status == "info" and "not in this image" in r["torch"].detail
    assert exit_code(checks) == EXIT_OK  # a CPU image on a CPU host lacks nothing


def test_driver_table_and_matrix_agree():
    assert doctorchecks.max_cuda_for_driver("570.124.06") == "12.8"
    assert doctorchecks.max_cuda_for_driver("535.104.05") == "12.2"
    assert doctorchecks.max_cuda_for_driver("580.159.04") == "13.0"
    assert doctorchecks.max_cuda_for_driver("470.82.01") is None
    matrix = ROOT / "matrix.toml"
    if matrix.exists():  # the matrix's per-CUDA minimum driver is CUDA minor-version compatibility's floor
        for cuda, spec in tomllib.loads(matrix.read_text())["cuda"].items():
            assert doctorchecks.MINOR_COMPAT_FLOOR[cuda.split(".")[0]] == spec["min_driver"], cuda


@pytest.mark.parametrize("text,err", [
    ("{not json", "invalid JSON at line 1"),
    ("[]", "expected a JSON object"),
    ('{"cell": "x"}', "missing key(s)"),
])
def test_imageinfo_rejects_broken_records(tmp_path, monkeypatch, text, err):
    f = tmp_path / "image.json"
    f.write_text(text)
    monkeypatch.setenv("TRAINBOX_IMAGE_INFO", str(f))
    with pytest.raises(imageinfo.ImageInfoError, match=err.replace("(", r"\(").replace(")", r"\)")):
        imageinfo.load()


def test_imageinfo_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINBOX_IMAGE_INFO", str(tmp_path / "absent.json"))
    with pytest.raises(imageinfo.ImageInfoError, match="no such file"):
        imageinfo.load()
    f = tmp_path / "image.json"
    f.write_text(json.dumps(record()))
    monkeypatch.setenv("TRAINBOX_IMAGE_INFO", str(f))
    assert imageinfo.load()["cell"] == "cu126-hopper"
    assert imageinfo.capabilities(record(cuda_arch_list="8.0;8.6;9.0+PTX")) == [(8, 0), (8, 6), (9, 0)]
    assert imageinfo.has_ptx(record(cuda_arch_list="8.0;8.6;9.0+PTX"))
    assert imageinfo.version_of(record(), "Torch") == "2.13.0"


# ---------------------------------------------------------------------------------------------------------------
# Real runs
# ---------------------------------------------------------------------------------------------------------------
def run_doctor(python, rec: dict | str | None, tmp_path, path_prepend=None):
    env = {k: v for k, v in os.environ.items() if k != "TRAINBOX_IMAGE_INFO"}
    env["PYTHONPATH"] = str(ROOT)
    if rec is not None:
        f = tmp_path / "image.json"
        f.write_text(rec if isinstance(rec, str) else json.dumps(rec))
        env["TRAINBOX_IMAGE_INFO"] = str(f)
    # a CI box has no nvidia-smi; keep it that way unless a fake one is given
    env["PATH"] = os.pathsep.join([str(path_prepend)] if path_prepend else []) + os.pathsep + "/usr/bin:/bin"
    r = subprocess.run([str(python), "-m", "trainbox", "doctor", "--json"], env=env, capture_output=True,
                       text=True, timeout=900, cwd=tmp_path)
    return r.returncode, json.loads(r.stdout) if r.stdout.strip().startswith("{") else r


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
    """A python with no site packages at all (like the light image: no torch, no transformers)."""
    d = tmp_path_factory.mktemp("barevenv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(d)], check=True)
    py = d / "bin" / "python"
    assert subprocess.run([py, "-c", "import torch"], capture_output=True).returncode != 0
    return py


def test_cpu_host_with_the_venv_stack(tmp_path):
    """This machine: CPU torch, the smoke stack; a CPU image record matching what is installed -> exit 0: a CPU
    image on a CPU host trains (the smoke image's own training tests show it), so nothing is missing."""
    vers = {d: metadata.version(d) for d in ("torch", "transformers", "trl", "peft", "accelerate", "bitsandbytes")}
    rec = record(cell="cpu-smoke", tag="cpu-smoke-x86_64", cuda=None, gpu=None, cuda_arch_list=None,
                 attention_backend="sdpa", min_driver=None, versions=vers)
    code, out = run_doctor(sys.executable, rec, tmp_path)
    assert code == EXIT_OK, out
    assert out["verdict"] == "ok" and out["exit_code"] == EXIT_OK
    r = {c["name"]: c for c in out["checks"]}
    assert r["gpu"]["status"] == "ok" and "trains on CPU" in r["gpu"]["detail"]
    assert not [c for c in out["checks"] if c["status"] == "fail"], out["checks"]
    assert r["torch"]["status"] == "ok" and r["trl"]["detail"] == vers["trl"]
    assert r["versions"]["detail"] == f"{len(vers)} of {len(vers)} match the record"
    assert r["flash-attn 3"]["detail"] == "not in this image"


def test_no_torch_python_and_broken_record(bare_python, tmp_path):
    light = record(cell="light", cuda=None, gpu=None, cuda_arch_list=None, attention_backend="sdpa",
                   min_driver=None, versions={})
    code, out = run_doctor(bare_python, light, tmp_path)
    assert code == EXIT_OK, out
    assert {c["name"]: c for c in out["checks"]}["torch"]["detail"] == "not in this image (light image)"
    code, out = run_doctor(bare_python, "{oops", tmp_path)
    assert code == EXIT_BROKEN, out
    row = {c["name"]: c for c in out["checks"]}["image record"]
    assert row["status"] == "fail" and "invalid JSON" in row["detail"]
    code, out = run_doctor(bare_python, None, tmp_path)  # outside any image: facts only
    assert code == EXIT_NO_GPU and out["image"] is None


FAKE_SMI = """#!/bin/sh
case "$*" in
  *--query-gpu*) for i in 0 1; do echo 'NVIDIA A100-SXM4-80GB, 8.0, 550.54.15, 81920'; done ;;
  *) printf '| NVIDIA-SMI 550.54.15    Driver Version: 550.54.15      CUDA Version: 12.4     |\\n' ;;
esac
"""


def test_nvidia_smi_output_is_parsed(bare_python, tmp_path):
    """Real nvidia-smi CSV/header formats (from a fake on PATH): a Hopper cu126 image on 2 A100s, driver 550."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "nvidia-smi").write_text(FAKE_SMI)
    (bindir / "nvidia-smi").chmod(0o755)
    rec = record(attention_backend="sdpa", versions={})
    code, out = run_doctor(bare_python, rec, tmp_path, path_prepend=bindir)
    smi_out = out["host"]["nvidia_smi"]
    assert smi_out["gpus"][0] == {"name": "NVIDIA A100-SXM4-80GB", "cc": [8, 0], "driver": "550.54.15",
                                  "memory_mib": 81920}
    assert len(smi_out["gpus"]) == 2 and smi_out["cuda_max"] == "12.4"
    r = {c["name"]: c for c in out["checks"]}
    assert r["gpu"]["detail"] == "2× NVIDIA A100-SXM4-80GB (sm80)"
    assert r["driver"]["status"] == "fallback" and "CUDA ≤ 12.4" in r["driver"]["detail"]
    assert r["gpu generation"]["status"] == "fallback"
    assert code == EXIT_FALLBACK, out["checks"]


def test_table_output(bare_python, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), PATH="/usr/bin:/bin")
    env.pop("TRAINBOX_IMAGE_INFO", None)
    r = subprocess.run([str(bare_python), "-m", "trainbox", "doctor"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == EXIT_NO_GPU
    assert "CHECK" in r.stdout and "NO-GPU" in r.stdout and "VERDICT: no-gpu (exit 3)" in r.stdout


def test_driver_version_from_proc_when_nvidia_smi_is_absent():
    x86 = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
           "GCC version: gcc 12\n")
    open_ = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (dvs-builder@U16)\n"
    arm = "NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  570.124.06  Release Build\n"
    assert doctorprobes.driver_from_proc(x86) == "550.54.15"
    assert doctorprobes.driver_from_proc(open_) == "580.159.04"
    assert doctorprobes.driver_from_proc(arm) == "570.124.06"
    assert doctorprobes.driver_from_proc("garbage") is None
    # torch sees the GPU, nvidia-smi is absent, the driver comes from /proc: the driver check still runs
    checks = evaluate(record(), {"found": False, "gpus": [], "driver": "520.61.05"}, probes(), INSTALLED)
    assert rows(checks)["driver"].status == "fail"


def test_a_cu129_image_runs_on_the_gh200_570_driver_by_minor_version_compatibility():
    """The GH200 box of the user stories: CUDA 12.8, driver 570.148.08; the cu129 image's record says 525.60.13."""
    checks = evaluate(record(cuda="12.9", min_driver="525.60.13"), smi(driver="570.148.08", cuda_max="12.8"),
                      probes(), INSTALLED)
    d = {c.name: c for c in checks}["driver"]
    assert d.status == "ok" and "minor-version compatibility" in d.detail and "525.60.13" in d.detail
    checks = evaluate(record(cuda="13.0", min_driver="580.65.06"), smi(driver="570.148.08", cuda_max="12.8"),
                      probes(), INSTALLED)
    assert {c.name: c for c in checks}["driver"].status == "fail"


def test_doctor_warns_about_a_package_changed_against_the_constraints():
    """A pinned package installed at another version (PIP_CONSTRAINT= pip install ...) is a WARN naming it."""
    pins = {"torch": ("torch", "2.13.0+cpu"), "peft": ("peft", "0.21.2"), "gone": ("gone", "1.0")}
    assert doctorchecks.constraints_check({}, {}, "/etc/trainbox/constraints.txt") is None  # not an image: no row
    ok = doctorchecks.constraints_check(pins, {"torch": "2.13.0+cpu", "peft": "0.21.2", "gone": "1.0"},
                                  "/etc/trainbox/constraints.txt")
    assert ok.status == "ok" and "3 pins" in ok.detail
    warn = doctorchecks.constraints_check(pins, {"torch": "2.12.0", "peft": "0.21.2", "gone": "1.0"},
                                    "/etc/trainbox/constraints.txt")
    assert warn.status == "warn" and "torch 2.12.0 (pinned 2.13.0+cpu)" in warn.detail and "peft" not in warn.detail
    assert warn.detail.endswith("`pip install torch==2.13.0+cpu`")
    assert doctorchecks.exit_code([warn]) == doctorchecks.EXIT_OK


def test_gpu_generation_comes_from_the_image_record():
    """The record's gpu_generations (matrix.toml's GPU axis, written by render) names the GPU: a generation this
    code has no table entry for is still named, and the rendered record of a real cell is what doctor reads."""
    table = {"hopper": ["9.0"], "nextgen": ["13.0"]}
    assert doctorchecks.generation((13, 0), table) == "nextgen" and doctorchecks.generation((13, 0)) == "sm130"
    assert doctorchecks.generation((9, 0), table) == "hopper" and doctorchecks.generation((8, 6), {"ampere": ["8.0"]}) == "ampere"
    checks = evaluate(record(gpu_generations=table), smi("NVIDIA Next", (13, 0)), probes(cc=(13, 0)), INSTALLED)
    assert "this GPU is nextgen (sm130); use the nextgen image" in rows(checks)["gpu generation"].detail
    rendered = json.loads((ROOT / "images" / "cu130-hopper-x86_64" / "image.json").read_text())
    assert doctorchecks.generation((12, 0), rendered["gpu_generations"]) == "blackwell"
    assert doctorchecks.generation((9, 0), rendered["gpu_generations"]) == "hopper"
