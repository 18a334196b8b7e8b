"""trainbox selftest on this CPU machine: what can run runs and passes, every GPU row is SKIP with its reason, a planted
fault turns its row FAIL with exit 1, --json parses; the driver row's verdicts from facts (pure); bad input is one
line and exit 2; doctor points to it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import sidebyside
from common import commands
from trainbox.image import selftestchecks

ROOT = Path(__file__).resolve().parents[1]


def selftest(*args: str, env: dict | None = None, tmp: Path) -> subprocess.CompletedProcess:
    base = {"PATH": "/usr/bin:/bin", "HOME": str(tmp), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
            "TMPDIR": str(tmp)}
    # --timeout: a child's limit well above its seconds here (under a loaded machine's contention, not a hang)
    return subprocess.run([sys.executable, "-m", "trainbox", "selftest", "--timeout", "500", *args], cwd=ROOT,
                          env={**base, **(env or {})}, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The whole CPU selftest (--json) and a planted fault in one attention row, side by side."""
    a, b = tmp_path_factory.mktemp("whole"), tmp_path_factory.mktemp("fault")
    whole, fault = sidebyside.in_parallel([
        lambda: selftest("--json", tmp=a),
        lambda: selftest("--only", "attention-sdpa,train-sft", env={"TRAINBOX_SELFTEST_FAULT": "attention-sdpa"},
                         tmp=b)])
    return whole, fault, b


def test_cpu_selftest_passes_what_runs_and_skips_the_gpu_rows_with_a_reason(runs):
    whole, _, _ = runs
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    report = json.loads(whole.stdout)
    rows = {r["row"]: r for r in report["rows"]}
    assert list(rows) == list(selftestchecks.ROWS) and report["verdict"] == "pass" and report["exit_code"] == 0
    assert report["image"] is None  # outside an image: the image's own row says so
    assert rows["driver"]["status"] == "SKIP" and "no image record" in rows["driver"]["reason"]
    for name, r in rows.items():
        if name in selftestchecks.CPU_ROWS:
            assert r["status"] == "PASS", r
        elif name != "driver":
            assert r["status"] == "SKIP" and r["reason"], r
    assert "no GPU" in rows["attention-fa3"]["reason"] and "no GPU" in rows["nccl"]["reason"]
    assert "loss" in rows["train-sft"]["reason"] and "reloaded" in rows["train-qlora"]["reason"]
    assert "packed" in rows["attention-flex"]["reason"] and "sinks" in rows["attention-flex"]["reason"]


def test_a_planted_fault_fails_its_row_with_the_reason_and_exit_1(runs):
    _, fault, tmp = runs
    assert fault.returncode == 1, fault.stdout[-3000:] + fault.stderr[-3000:]
    lines = {ln.split()[0]: ln for ln in fault.stdout.splitlines() if ln.split() and ln.split()[0] in
             selftestchecks.ROWS}
    assert list(lines) == ["attention-sdpa", "train-sft"]
    assert " FAIL " in lines["attention-sdpa"] and "logits off by" in lines["attention-sdpa"], fault.stdout
    assert " PASS " in lines["train-sft"]  # the fault is that row's alone
    assert "selftest: 1 PASS, 1 FAIL, 0 SKIP" in fault.stdout and "FAILED (exit 1)" in fault.stdout
    logs = fault.stdout.split("the children's logs: ")[1].strip()
    assert (Path(logs) / "attention-sdpa.log").is_file()  # kept for the failed row's reader


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    for args, env, says in [(("--only", "attention-fa9"), {}, "--only"),
                            ((), {"TRAINBOX_SELFTEST_FAULT": "nope"}, "TRAINBOX_SELFTEST_FAULT=nope"),
                            (("--timeout", "0"), {}, "must be at least 1")]:
        r = selftest(*args, env=env, tmp=tmp_path)
        assert r.returncode == 2 and r.stdout == "", r
        assert len(r.stderr.strip().splitlines()) == 1 and "error:" in r.stderr and says in r.stderr, r.stderr
        assert "attention-fa3" in r.stderr or "--timeout" in args  # names the rows to choose from
    assert not list(tmp_path.glob("trainbox-selftest-*"))  # refused before any folder was made


INFO = {"cell": "cu130-hopper", "tag": "cu130-hopper-x86_64", "arch": "x86_64", "cuda": "13.0", "gpu": "hopper",
        "cuda_arch_list": "9.0a", "attention_backend": "fa3", "min_driver": "580.65.06", "python": "3.12",
        "versions": {}}


@pytest.mark.parametrize("info, smi, planted, status, says", [
    (INFO, {"driver": "580.95.05", "gpus": [{}]}, False, "PASS", "580.95.05"),
    (INFO, {"driver": "570.148.08", "gpus": [{}]}, False, "FAIL", "too old"),
    (INFO, {"driver": "580.95.05", "gpus": [{}]}, True, "FAIL", "418.0"),     # the planted fault
    (INFO, {"found": False, "gpus": []}, False, "SKIP", "no NVIDIA driver"),
    ({**INFO, "cuda": None}, {"driver": "580.95.05"}, False, "SKIP", "CPU image"),
    (None, {"driver": "580.95.05"}, False, "SKIP", "no image record"),
])
def test_driver_row_is_doctors_check_against_the_image_floor(info, smi, planted, status, says):
    row = selftestchecks.driver_row(info, None, smi, planted)
    assert row.status == status and says in row.reason, row


def test_a_broken_image_record_fails_the_driver_row(tmp_path):
    bad = tmp_path / "image.json"
    bad.write_text("{")
    r = selftest("--only", "driver", env={"TRAINBOX_IMAGE_INFO": str(bad)}, tmp=tmp_path)
    assert r.returncode == 1 and "invalid JSON" in r.stdout, r.stdout + r.stderr


def test_cpu_skips_are_known_before_any_child_starts():
    """Every row but the CPU ones is skipped without a GPU, grpo's engines by what they need."""
    why = selftestchecks.skips(selftestchecks.ROWS, gpu=False, has_vllm=False, planted=None)
    assert set(why) | set(selftestchecks.CPU_ROWS) | {"driver"} == set(selftestchecks.ROWS)
    assert not set(why) & set(selftestchecks.CPU_ROWS)
    gpu = selftestchecks.skips(selftestchecks.ROWS, gpu=True, has_vllm=False, planted=None)
    assert set(gpu) == {"train-grpo-vllm", "vllm-engine"} and all("vllm is not installed" == w for w in gpu.values())
    assert selftestchecks.skips(selftestchecks.ROWS, gpu=True, has_vllm=True, planted=None) == {}


def test_selftest_is_a_listed_command_and_doctor_points_to_it():
    assert "selftest" in commands.names(public=True)
    from trainbox.cli import doctor

    text = doctor.render(None, {"hostname": "h", "machine": "x86_64", "python": "3.11", "nvidia_smi": {}},
                         [doctor.Check("torch", "ok", "2.13.0")], 0)
    assert "trainbox selftest" in text.splitlines()[-1]


def test_children_leave_a_launchers_rank_variables_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    env = selftestchecks.child_env(tmp_path, one_gpu=True)
    assert "RANK" not in env and "SLURM_PROCID" not in env and env["CUDA_VISIBLE_DEVICES"] == "2"
    assert env["HF_HUB_OFFLINE"] == "1" and env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)
    assert selftestchecks.child_env(tmp_path, one_gpu=False)["CUDA_VISIBLE_DEVICES"] == "2,3"
