"""The fabric (trainbox/image/fabric.py): RDMA ports from a fake sysfs tree, GPUDirect, /dev/shm, libibverbs, NCCL's
INIT/NET log lines (NCCL's own wording), doctor's fabric rows and WARNINGs, and a real doctor run on a fake tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainbox.cli import doctor
from trainbox.image import doctorchecks, fabric

ROOT = Path(__file__).resolve().parents[1]

# Lines as NCCL prints them (host:pid:tid [dev] NCCL INFO ...), one block per situation.
LOG_NO_VERBS = """\
gpu-a:4242:4242 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.2<0>
gpu-a:4242:4242 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so.
gpu-a:4242:4242 [0] NCCL INFO cudaDriverVersion 12080
NCCL version 2.27.5+cuda12.9
gpu-a:4242:4290 [0] NCCL INFO Failed to open libibverbs.so[.1]
gpu-a:4242:4290 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.2<0>
gpu-a:4242:4290 [0] NCCL INFO Using network Socket
"""
LOG_NO_DEVICE = """\
gpu-a:4242:4290 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so.
gpu-a:4242:4290 [0] NCCL INFO NET/IB : No device found.
gpu-a:4242:4290 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.2<0>
gpu-a:4242:4290 [0] NCCL INFO Using network Socket
"""
LOG_IB = """\
gpu-a:4242:4242 [0] NCCL INFO NCCL version 2.27.5+cuda12.9
gpu-a:4242:4290 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so.
gpu-a:4242:4290 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/RoCE ; OOB eth0:10.0.0.2<0>
gpu-a:4242:4290 [0] NCCL INFO Using network IB
gpu-a:4242:4291 [1] NCCL INFO Channel 00/0 : 1[1] -> 2[0] [send] via NET/IB/0/GDRDMA
gpu-a:4242:4291 [1] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
"""


def test_the_log_parser_reads_nccl_lines():
    p = fabric.parse_nccl_log(LOG_NO_VERBS)
    assert p["network"] == "Socket" and p["ibverbs_missing"] and p["socket_ifaces"] == ["eth0:10.0.0.2<0>"]
    assert p["plugin"].startswith("Could not find: libnccl-net.so")
    t = fabric.transport(p)
    assert t["name"] == "Socket" and not t["ok"] and "lacks RDMA userspace" in t["why"]
    assert "eth0" in t["detail"]

    p = fabric.parse_nccl_log(LOG_NO_DEVICE)
    assert p["ib_no_device"] and not p.get("ibverbs_missing")
    t = fabric.transport(p)
    assert t["name"] == "Socket" and "MELLANOX_VISIBLE_DEVICES=all" in t["why"]
    assert "--device=/dev/infiniband" in t["why"] and "IPC_LOCK" in t["why"]

    p = fabric.parse_nccl_log(LOG_IB)
    assert p["network"] == "IB" and p["version"] == "2.27.5+cuda12.9"
    assert p["ib_devices"] == ["mlx5_0:1/IB", "mlx5_1:1/RoCE"] and p["oob"] == "eth0:10.0.0.2<0>"
    assert p["via"] == ["NET/IB/0/GDRDMA", "P2P/CUMEM/read"]
    t = fabric.transport(p)
    assert t["ok"] and t["name"] == "IB" and "GPUDirect RDMA in use" in t["detail"]
    assert "IB/RoCE" in t["detail"]

    # a net plugin (AWS EFA's aws-ofi-nccl) names its own network
    t = fabric.transport(fabric.parse_nccl_log(
        "x:1:1 [0] NCCL INFO NET/Plugin: Loaded net plugin Libfabric (v8)\nx:1:1 [0] NCCL INFO Using network Libfabric\n"))
    assert t["ok"] and t["name"] == "Libfabric"
    assert fabric.transport({})["name"] == "unknown"


def make_port(root: Path, dev: str, port: int, link: str, rate: str, state: str, netdev: str | None = None):
    d = root / "sys/class/infiniband" / dev / "ports" / str(port)
    d.mkdir(parents=True)
    (d / "link_layer").write_text(link + "\n")
    (d / "rate").write_text(rate + "\n")
    (d / "state").write_text(state + "\n")
    (d / "phys_state").write_text("5: LinkUp\n" if "ACTIVE" in state else "3: Disabled\n")
    if netdev:
        (d / "gid_attrs/ndevs").mkdir(parents=True)
        (d / "gid_attrs/ndevs/0").write_text(netdev + "\n")


@pytest.fixture
def ib_tree(tmp_path):
    """An IB port and a RoCE port, their uverbs nodes, nvidia_peermem loaded."""
    make_port(tmp_path, "mlx5_0", 1, "InfiniBand", "400 Gb/sec (4X NDR)", "4: ACTIVE")
    make_port(tmp_path, "mlx5_1", 1, "Ethernet", "200 Gb/sec (4X HDR)", "4: ACTIVE", netdev="ens5f0")
    (tmp_path / "dev/infiniband").mkdir(parents=True)
    for n in ("uverbs0", "uverbs1", "rdma_cm"):
        (tmp_path / "dev/infiniband" / n).write_text("")
    (tmp_path / "sys/module/nvidia_peermem").mkdir(parents=True)
    return tmp_path


def rowmap(f, gpu=True, gpu_image=True):
    return {n: (s, d) for n, s, d in fabric.rows(f, gpu, gpu_image)}


VERBS_OK = {"loaded": True, "devices": 2}
SHM_BIG = 64 << 30


def test_ib_and_roce_ports_from_sysfs(ib_tree):
    ports = fabric.rdma_ports(ib_tree)
    assert [(p["device"], p["port"], p["kind"], p["gbps"], p["state"]) for p in ports] == [
        ("mlx5_0", "1", "IB", 400.0, "ACTIVE"), ("mlx5_1", "1", "RoCE", 200.0, "ACTIVE")]
    assert ports[1]["netdev"] == "ens5f0"
    assert fabric.uverbs(ib_tree) == ["uverbs0", "uverbs1"] and fabric.peermem(ib_tree) == "nvidia_peermem"
    assert fabric.link_summary(ports) == "2 × mixed rates IB/RoCE = 75 GB/s per node"
    f = {"rdma": ports, "uverbs": ["uverbs0", "uverbs1"], "peermem": "nvidia_peermem", "shm_bytes": SHM_BIG,
         "ibverbs": VERBS_OK, "nccl": {"ok": True, "log": fabric.parse_nccl_log(LOG_IB)}}
    r = rowmap(f)
    assert r["rdma devices"][0] == "ok"
    assert "mlx5_0 port 1: IB, 400 Gb/sec (4X NDR), ACTIVE" in r["rdma devices"][1]
    assert "mlx5_1 port 1: RoCE (ens5f0), 200 Gb/sec (4X HDR), ACTIVE" in r["rdma devices"][1]
    assert r["gpudirect rdma"] == ("ok", "nvidia_peermem loaded: NICs read and write GPU memory directly")
    assert r["/dev/shm"] == ("ok", "64 GiB")
    assert r["libibverbs"][0] == "ok" and "lists 2 verbs device(s)" in r["libibverbs"][1]
    assert r["nccl transport"][0] == "ok" and r["nccl transport"][1].startswith("inter-node: IB")


def test_ports_without_uverbs_nodes_or_active_state_warn(tmp_path):
    make_port(tmp_path, "mlx5_0", 1, "InfiniBand", "400 Gb/sec (4X NDR)", "4: ACTIVE")
    f = {"rdma": fabric.rdma_ports(tmp_path), "uverbs": fabric.uverbs(tmp_path), "peermem": None,
         "shm_bytes": SHM_BIG, "ibverbs": {"loaded": True, "devices": 0}, "nccl": {"skipped": "no GPU"}}
    r = rowmap(f, gpu=False)
    assert r["rdma devices"][0] == "warn" and "--device=/dev/infiniband" in r["rdma devices"][1]
    assert r["gpudirect rdma"][0] == "info" and "modprobe nvidia_peermem" in r["gpudirect rdma"][1]
    assert "no providers" in r["libibverbs"][1]
    assert r["nccl transport"][0] == "info" and "skipped" in r["nccl transport"][1]  # CPU: skipped, not failed
    down = tmp_path / "down"
    make_port(down, "mlx5_0", 1, "InfiniBand", "10 Gb/sec (4X SDR)", "1: DOWN")
    r = rowmap({**f, "rdma": fabric.rdma_ports(down), "uverbs": ["uverbs0"]})
    assert r["rdma devices"][0] == "warn" and "no port is ACTIVE" in r["rdma devices"][1]
    assert fabric.link_summary(fabric.rdma_ports(down)) is None


def test_no_device_small_shm_and_no_verbs(tmp_path):
    f = {"rdma": fabric.rdma_ports(tmp_path), "uverbs": [], "peermem": None, "shm_bytes": 64 << 20,
         "ibverbs": {"loaded": False, "error": "libibverbs.so.1: cannot open shared object file"},
         "nccl": {"ok": True, "log": fabric.parse_nccl_log(LOG_NO_VERBS)}}
    r = rowmap(f)
    assert r["rdma devices"][0] == "info" and "none visible" in r["rdma devices"][1]
    assert "gpudirect rdma" not in r
    assert r["/dev/shm"][0] == "warn" and "64 MiB" in r["/dev/shm"][1]
    assert "--shm-size" in r["/dev/shm"][1] and "--ipc=host" in r["/dev/shm"][1]
    assert r["libibverbs"][0] == "warn" and "lacks RDMA userspace" in r["libibverbs"][1]
    assert r["nccl transport"][0] == "warn" and "TCP sockets" in r["nccl transport"][1]
    assert "lacks RDMA userspace" in r["nccl transport"][1]
    # the userspace is there, the HCA isn't: the fix is the container's devices
    f2 = {**f, "ibverbs": {"loaded": True, "devices": 0}, "nccl": {"log": fabric.parse_nccl_log(LOG_NO_DEVICE)}}
    r = rowmap(f2)
    assert r["libibverbs"][0] == "ok"
    assert r["nccl transport"][0] == "warn" and "MELLANOX_VISIBLE_DEVICES=all" in r["nccl transport"][1]
    # a CPU image doesn't need verbs
    assert rowmap(f, gpu=False, gpu_image=False)["libibverbs"][0] == "info"
    # a probe that could not run is a WARN row with its reason
    r = rowmap({**f, "nccl": {"error": "NCCL probe exited 1: RuntimeError: boom", "log": {}}})
    assert r["nccl transport"] == ("warn", "could not ask NCCL: NCCL probe exited 1: RuntimeError: boom")


def test_warn_rows_never_change_doctor_exit_code():
    from tests.test_doctor import INSTALLED, probes, record, smi

    f = {"rdma": [], "uverbs": [], "peermem": None, "shm_bytes": 64 << 20, "ibverbs": {"loaded": False, "error": "x"},
         "nccl": {"log": fabric.parse_nccl_log(LOG_NO_VERBS)}}
    checks = doctorchecks.evaluate(record(), smi(), probes(), INSTALLED, fabric_facts=f)
    warns = {c.name for c in checks if c.status == "warn"}
    assert warns == {"/dev/shm", "libibverbs", "nccl transport"}
    assert doctorchecks.exit_code(checks) == doctorchecks.EXIT_OK
    text = doctor.render(record(), {"hostname": "h", "machine": "x86_64", "python": "3.12", "nvidia_smi": smi()},
                         checks, doctorchecks.EXIT_OK)
    assert "WARN" in text and "VERDICT: ok (exit 0)" in text and "3 WARN row(s) name a fix" in text


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
    d = tmp_path_factory.mktemp("barevenv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(d)], check=True)
    return d / "bin" / "python"


def test_doctor_reads_a_fake_fabric_tree(bare_python, ib_tree):
    """A real doctor run (no torch: fast) on the fake tree: rows as above, the verbs library from the env hook."""
    env = {k: v for k, v in os.environ.items() if k != "TRAINBOX_IMAGE_INFO"}
    env.update(PYTHONPATH=str(ROOT), PATH="/usr/bin:/bin", TRAINBOX_FABRIC_ROOT=str(ib_tree),
               TRAINBOX_IBVERBS="libtrainbox-absent.so.1", TRAINBOX_IMAGE_INFO=str(ib_tree / "none.json"))
    (ib_tree / "dev/shm").mkdir(parents=True)
    r = subprocess.run([str(bare_python), "-m", "trainbox", "doctor", "--json"], env=env, capture_output=True,
                       text=True, timeout=120, cwd=ib_tree)
    out = json.loads(r.stdout)
    rows = {c["name"]: c for c in out["checks"]}
    assert rows["rdma devices"]["status"] == "ok" and "RoCE (ens5f0)" in rows["rdma devices"]["detail"]
    assert rows["gpudirect rdma"]["status"] == "ok"
    assert rows["libibverbs"]["status"] in ("info", "warn") and "does not load" in rows["libibverbs"]["detail"]
    assert rows["nccl transport"]["status"] == "info" and "skipped" in rows["nccl transport"]["detail"]
    assert out["host"]["fabric"]["rdma"][0]["device"] == "mlx5_0"
    assert out["exit_code"] == r.returncode
