"""The fabric between GPUs and nodes: RDMA ports, GPUDirect RDMA, /dev/shm, libibverbs, and the transport NCCL picks.

Used by `doctor` (its fabric rows) and `nccl-check` (the transport line and what the links should give). Facts are
read without importing torch (sysfs, /dev, a ctypes load of libibverbs in a child); the NCCL probe (a 1-rank NCCL
process group in a child with NCCL_DEBUG=INFO, whose log says which network NCCL loaded) runs only where a GPU is.

Test hooks: TRAINBOX_FABRIC_ROOT (default `/`) is the root under which sys/class/infiniband, sys/module,
sys/class/net, dev/infiniband and dev/shm are read; TRAINBOX_IBVERBS names the verbs library (default libibverbs.so.1).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

IBVERBS = "libibverbs.so.1"
SHM_MIN_BYTES = 1 << 30  # below this NCCL's shared-memory transport and DataLoader workers run out (Docker: 64 MB)
PEERMEM_MODULES = ("nvidia_peermem", "nv_peer_mem")
NCCL_DEBUG_ENV = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET"}

FIX_USERSPACE = ("the image lacks RDMA userspace (libibverbs1, ibverbs-providers: rdma-core); use an image that "
                 "has it")
FIX_NO_HCA = ("no HCA visible in the container: under enroot/pyxis set MELLANOX_VISIBLE_DEVICES=all (the image sets "
              "it; the host needs enroot's 99-mellanox hook), under docker pass --device=/dev/infiniband "
              "--ulimit memlock=-1 --cap-add IPC_LOCK (or --privileged)")
FIX_SHM = "`docker run --ipc=host` or `--shm-size=16g` (Slurm/enroot containers share the host's /dev/shm)"


def root() -> Path:
    return Path(os.environ.get("TRAINBOX_FABRIC_ROOT") or "/")


def _read(p: Path) -> str | None:
    try:
        return p.read_text().strip()
    except OSError:
        return None


def gbps(rate: str | None) -> float | None:
    """sysfs port rate ('400 Gb/sec (4X NDR)', '25 Gb/sec (1X EDR)') -> Gb/s."""
    m = re.search(r"([\d.]+)\s*Gb/sec", rate or "")
    return float(m.group(1)) if m else None


def _state(text: str | None) -> str | None:
    """'4: ACTIVE' -> 'ACTIVE', '5: LinkUp' -> 'LinkUp'."""
    return text.split(":", 1)[-1].strip() if text else None


def rdma_ports(base: Path | None = None) -> list[dict]:
    """Every port of every RDMA device under sys/class/infiniband: link layer (InfiniBand, or Ethernet = RoCE),
    rate, state; the net device behind a RoCE port when sysfs names it."""
    base = base or root()
    ports = []
    ib = base / "sys/class/infiniband"
    try:
        devices = sorted(p for p in ib.iterdir())
    except OSError:
        return []
    for dev in devices:
        try:
            port_dirs = sorted((dev / "ports").iterdir(), key=lambda p: (len(p.name), p.name))
        except OSError:
            continue
        for port in port_dirs:
            link = _read(port / "link_layer")
            rate = _read(port / "rate")
            ndev = _read(port / "gid_attrs/ndevs/0")
            ports.append({"device": dev.name, "port": port.name, "link_layer": link,
                          "kind": "RoCE" if link == "Ethernet" else ("IB" if link == "InfiniBand" else link or "?"),
                          "rate": rate, "gbps": gbps(rate), "state": _state(_read(port / "state")),
                          "phys_state": _state(_read(port / "phys_state")), **({"netdev": ndev} if ndev else {})})
    return ports


def uverbs(base: Path | None = None) -> list[str]:
    """The verbs device nodes (dev/infiniband/uverbsN) the container was given: without them verbs sees no device."""
    try:
        return sorted(p.name for p in ((base or root()) / "dev/infiniband").iterdir() if p.name.startswith("uverbs"))
    except OSError:
        return []


def peermem(base: Path | None = None) -> str | None:
    for m in PEERMEM_MODULES:
        if ((base or root()) / "sys/module" / m).exists():
            return m
    return None


def shm_bytes(base: Path | None = None) -> int | None:
    try:
        st = os.statvfs((base or root()) / "dev/shm")
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def net_speed_mbps(iface: str, base: Path | None = None) -> int | None:
    """sys/class/net/IFACE/speed (Mb/s; -1 or unreadable for virtual interfaces) -> Mb/s or None."""
    text = _read((base or root()) / "sys/class/net" / iface / "speed")
    try:
        v = int(text or "")
    except ValueError:
        return None
    return v if v > 0 else None


_IBVERBS_CODE = r"""
import ctypes, json, sys
out = {}
try:
    lib = ctypes.CDLL(sys.argv[1])
    out['loaded'] = True
    try:
        lib.ibv_get_device_list.restype = ctypes.c_void_p
        lib.ibv_get_device_list.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.ibv_free_device_list.argtypes = [ctypes.c_void_p]
        n = ctypes.c_int(0)
        p = lib.ibv_get_device_list(ctypes.byref(n))
        if p:
            lib.ibv_free_device_list(p)
        out['devices'] = n.value
    except AttributeError as e:
        out['devices_error'] = str(e)
except OSError as e:
    out = {'loaded': False, 'error': str(e)}
print(json.dumps(out))
"""


def ibverbs(timeout: float = 30) -> dict:
    """Does libibverbs.so.1 load (in a child: a broken provider can't take the caller down), and how many verbs
    devices does it list (0 without providers or without /dev/infiniband)?"""
    name = os.environ.get("TRAINBOX_IBVERBS") or IBVERBS
    try:
        r = subprocess.run([sys.executable, "-c", _IBVERBS_CODE, name], capture_output=True, text=True,
                           timeout=timeout)
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, IndexError, json.JSONDecodeError) as e:
        return {"loaded": False, "error": f"probe failed: {e}"}


# ---------------------------------------------------------------------------------------------------------------
# NCCL's own word: its INIT/NET log
# ---------------------------------------------------------------------------------------------------------------
_NET_USING = re.compile(r"NCCL INFO Using network (.+?)\s*$", re.M)
_IB_USING = re.compile(r"NCCL INFO NET/IB\s*:\s*Using (.*?)(?:;\s*OOB (\S+))?\s*$", re.M)
_SOCKET_USING = re.compile(r"NCCL INFO NET/Socket\s*:\s*Using (.*?)\s*$", re.M)
_PLUGIN = re.compile(r"NCCL INFO NET/Plugin\s*:?\s*(.*?)\s*$", re.M)
_VIA = re.compile(r"NCCL INFO Channel \d+(?:/\d+)?\s*:.*?\bvia (\S+)", re.M)
# `Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read`, `... : 1[1] -> 2[0] [send] via NET/IB/0/GDRDMA`: which ranks.
_CHANNEL = re.compile(r"NCCL INFO Channel \d+(?:/\d+)?\s*:\s*(\d+)\[[^\]]*\]\s*->\s*(\d+)\[[^\]]*\].*?\bvia (\S+)",
                      re.M)
_VERSION = re.compile(r"NCCL INFO NCCL version (\S+)")
_ITEM = re.compile(r"\[\d+\]([^\s\[;]+)")


def parse_nccl_log(text: str) -> dict:
    """What NCCL's INIT/NET lines say: the network it loaded (IB, Socket, a plugin's), its devices, why not IB."""
    out: dict = {}
    if m := _VERSION.search(text):
        out["version"] = m.group(1)
    nets = _NET_USING.findall(text)
    if nets:
        out["network"] = nets[-1]
    if m := _IB_USING.search(text):
        out["ib_devices"] = _ITEM.findall(m.group(1))  # mlx5_0:1/IB, mlx5_1:1/RoCE
        if m.group(2):
            out["oob"] = m.group(2)
    if m := _SOCKET_USING.search(text):
        out["socket_ifaces"] = _ITEM.findall(m.group(1))  # eth0:10.0.0.2<0>
    plugin = _PLUGIN.findall(text)
    if plugin:
        out["plugin"] = plugin[-1]
    if re.search(r"Failed to open libibverbs", text):
        out["ibverbs_missing"] = True
    if re.search(r"NET/IB\s*:\s*No device found", text):
        out["ib_no_device"] = True
    via = []
    for v in _VIA.findall(text):
        if v not in via:
            via.append(v)
    if via:
        out["via"] = via  # P2P/CUMEM/read, SHM/direct/direct, NET/IB/0/GDRDMA, NET/Socket/0
    channels = []
    for src, dst, v in _CHANNEL.findall(text):
        if [int(src), int(dst), v] not in channels:
            channels.append([int(src), int(dst), v])
    if channels:
        out["channels"] = channels  # [from rank, to rank, transport]: tells a node's own links from the network's
    return out


def transport(parsed: dict) -> dict:
    """The inter-node transport from a parsed log: {"name": IB | Socket | <plugin network> | unknown, "ok": bool,
    "detail": ..., "why": the fix when multi-node traffic would go over TCP sockets}."""
    net = parsed.get("network")
    if net is None:
        if parsed.get("ib_devices"):
            net = "IB"
        elif parsed.get("socket_ifaces"):
            net = "Socket"
    if net is None:
        return {"name": "unknown", "ok": False, "detail": "NCCL's log names no network", "why": None}
    if net == "Socket":
        ifaces = ", ".join(i.split("<")[0] for i in parsed.get("socket_ifaces", [])) or "?"
        if parsed.get("ibverbs_missing"):
            why = FIX_USERSPACE
        elif parsed.get("ib_no_device"):
            why = FIX_NO_HCA
        else:
            why = "NCCL chose sockets although verbs loaded (NCCL_IB_DISABLE=1 or NCCL_NET=Socket set?)"
        return {"name": "Socket", "ok": False, "detail": f"TCP sockets over {ifaces}", "why": why}
    if net == "IB":
        devs = parsed.get("ib_devices") or []
        kinds = sorted({d.rsplit("/", 1)[-1] for d in devs if "/" in d})
        gdr = any("GDRDMA" in v for v in parsed.get("via", []))
        return {"name": "IB", "ok": True, "why": None,
                "detail": f"{'/'.join(kinds) or 'IB'} verbs on {', '.join(devs) or '?'}"
                          + (", GPUDirect RDMA in use" if gdr else "")}
    return {"name": net, "ok": True, "why": None, "detail": f"net plugin ({parsed.get('plugin') or net})"}


_NCCL_PROBE = r"""
import json, os, sys, tempfile
import torch
if not torch.cuda.is_available():
    print('@@TRAINBOX ' + json.dumps({'skipped': 'torch sees no GPU'}))
    sys.exit(0)
import torch.distributed as dist
fd, store = tempfile.mkstemp(prefix='trainbox-nccl-probe-')
os.close(fd)
os.unlink(store)
torch.cuda.set_device(0)
dist.init_process_group('nccl', init_method='file://' + store, rank=0, world_size=1)
t = torch.ones(1, device='cuda')
dist.all_reduce(t)
torch.cuda.synchronize()
dist.destroy_process_group()
print('@@TRAINBOX ' + json.dumps({'ok': t.item() == 1.0, 'nccl': '.'.join(map(str, torch.cuda.nccl.version()))}))
"""


def nccl_probe(timeout: float = 180) -> dict:
    """A 1-rank NCCL process group in a child with NCCL_DEBUG=INFO: its log says which network NCCL loads (it
    initialises its net transport even for one rank). Only call where a GPU is."""
    env = {k: v for k, v in os.environ.items() if k not in ("NCCL_DEBUG_FILE",)}
    env.update(NCCL_DEBUG_ENV)
    try:
        r = subprocess.run([sys.executable, "-c", _NCCL_PROBE], capture_output=True, text=True, env=env,
                           timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"NCCL probe: {e}"}
    text = r.stdout + "\n" + r.stderr
    result = None
    for line in r.stdout.splitlines():
        if line.startswith("@@TRAINBOX "):
            result = json.loads(line.split(" ", 1)[1])
    if result is None:
        tail = [ln for ln in r.stderr.strip().splitlines() if "NCCL INFO" not in ln][-1:] or ["no output"]
        return {"error": f"NCCL probe exited {r.returncode}: {tail[0]}", "log": parse_nccl_log(text)}
    if "skipped" in result:
        return result
    return {**result, "log": parse_nccl_log(text)}


# ---------------------------------------------------------------------------------------------------------------
# Facts and rows
# ---------------------------------------------------------------------------------------------------------------
def facts(nccl: bool = False) -> dict:
    """Everything above, cheap first; the NCCL probe only when asked (a GPU is there)."""
    base = root()
    out = {"rdma": rdma_ports(base), "uverbs": uverbs(base), "peermem": peermem(base), "shm_bytes": shm_bytes(base),
           "ibverbs": ibverbs()}
    out["nccl"] = nccl_probe() if nccl else {"skipped": "no GPU"}
    return out


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{int(n)} B"


def link_summary(ports: list[dict]) -> str | None:
    """What the ACTIVE RDMA ports should give a node: '2 × 400 Gb/s IB = 100 GB/s per node'."""
    active = [p for p in ports if p.get("state") == "ACTIVE" and p.get("gbps")]
    if not active:
        return None
    total = sum(p["gbps"] for p in active)
    kinds = "/".join(sorted({p["kind"] for p in active}))
    rates = sorted({p["gbps"] for p in active})
    each = f"{rates[0]:g} Gb/s" if len(rates) == 1 else "mixed rates"
    return f"{len(active)} × {each} {kinds} = {total / 8:g} GB/s per node"


def rows(f: dict, gpu: bool, gpu_image: bool | None) -> list[tuple[str, str, str]]:
    """doctor's fabric rows (name, status, detail). `gpu`: torch can use a GPU here; `gpu_image`: the image is a
    CUDA image (None outside an image). WARN rows never change doctor's exit code: one node trains without RDMA."""
    out = []
    ports = f.get("rdma") or []
    verbs = f.get("ibverbs") or {}
    if ports:
        text = "; ".join(f"{p['device']} port {p['port']}: {p['kind']}"
                         + (f" ({p['netdev']})" if p.get("netdev") else "")
                         + f", {p.get('rate') or 'rate ?'}, {p.get('state') or '?'}" for p in ports)
        if not any(p.get("state") == "ACTIVE" for p in ports):
            out.append(("rdma devices", "warn", f"{text}: no port is ACTIVE (cable, switch or subnet manager)"))
        elif not f.get("uverbs"):
            out.append(("rdma devices", "warn", f"{text}; but no /dev/infiniband/uverbs* in the container: "
                                                + FIX_NO_HCA))
        else:
            out.append(("rdma devices", "ok", text))
    else:
        out.append(("rdma devices", "info", "none visible (/sys/class/infiniband is empty or absent)"))

    if ports:
        pm = f.get("peermem")
        out.append(("gpudirect rdma", "ok" if pm else "info",
                    f"{pm} loaded: NICs read and write GPU memory directly" if pm else
                    "nvidia_peermem not loaded: NCCL stages GPU<->NIC copies through host memory unless it can use "
                    "DMA-BUF (open kernel driver, Linux >= 5.12); on the host: `modprobe nvidia_peermem`"))

    shm = f.get("shm_bytes")
    if shm is None:
        out.append(("/dev/shm", "warn", f"not mounted: NCCL and DataLoader workers need it; {FIX_SHM}"))
    elif shm < SHM_MIN_BYTES:
        out.append(("/dev/shm", "warn", f"{human_bytes(shm)}: NCCL needs more than Docker's 64 MB default "
                                        f"(it fails or hangs with several GPUs); {FIX_SHM}"))
    else:
        out.append(("/dev/shm", "ok", human_bytes(shm)))

    if verbs.get("loaded"):
        n = verbs.get("devices")
        tail = f", lists {n} verbs device(s)" if n is not None else ""
        if n == 0 and ports:
            tail += " (no providers for them: ibverbs-providers missing?, or no /dev/infiniband)"
        out.append(("libibverbs", "ok", f"{IBVERBS} loads{tail}"))
    elif gpu_image or (gpu_image is None and gpu):
        out.append(("libibverbs", "warn", f"{IBVERBS} does not load ({verbs.get('error', '?')}): {FIX_USERSPACE}; "
                                          "a multi-node job would run over TCP sockets"))
    else:
        out.append(("libibverbs", "info", f"{IBVERBS} does not load: no RDMA ("
                                          + ("a CPU image: not needed)" if gpu_image is False else "no GPU here)")))

    n = f.get("nccl") or {}
    if "skipped" in n or not gpu:
        out.append(("nccl transport", "info", f"skipped: {n.get('skipped') or 'no GPU'} (NCCL needs a GPU to ask)"))
    elif "error" in n and not (n.get("log") or {}).get("network"):
        out.append(("nccl transport", "warn", f"could not ask NCCL: {n['error']}"))
    else:
        t = transport(n.get("log") or {})
        if t["ok"]:
            out.append(("nccl transport", "ok", f"inter-node: {t['name']} ({t['detail']})"))
        elif t["name"] == "Socket":
            out.append(("nccl transport", "warn", f"inter-node: {t['detail']}: a multi-node job would run over TCP "
                                                  f"sockets; {t['why']}"))
        else:
            out.append(("nccl transport", "warn", f"inter-node: unknown ({t['detail']})"))
    return out
