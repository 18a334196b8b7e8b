"""All-reduce and all-gather across every rank of the job: bandwidth per size, the transport NCCL used, the links.

Run it before a big job, the way you will run the job: `trainbox nccl-check` on one node (one rank per GPU), under
srun one task per node (the Slurm-aware launcher starts torchrun on each node), or with --nnodes/--master-addr.
Message sizes double from --min-bytes to --max-bytes (1 MiB to 1 GiB; 64 MiB on CPU unless given); each is timed
over --iters after --warmup, the slowest rank's time counts. Bandwidths as NCCL-tests defines them: algbw = size /
time; busbw = algbw * 2(n-1)/n for all-reduce, algbw * (n-1)/n for all-gather (size = the gathered buffer).
The transport comes from NCCL's own INIT/NET/P2P log (NCCL_DEBUG=INFO into a file, unless you set NCCL_DEBUG
yourself): its Channel lines name what each pair of ranks used (P2P, SHM, NET/Socket, NET/IB);
what the links should give from sysfs (RDMA port rates, a socket NIC's speed) and nvidia-smi (NVLink). Without a GPU
it runs on gloo (TCP). Exit 0 with a one-line summary; 1 if a collective gave a wrong result; 2 for bad options.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import launch
from common.errors import UsageError
from trainbox.cli.argtypes import OneLineParser, not_negative, port, positive
from trainbox.image import fabric
from trainbox.run import ranks

PROG = "trainbox nccl-check"
OPS = ("all_reduce", "all_gather")
DEFAULT_MIN, DEFAULT_MAX, CPU_DEFAULT_MAX = 1 << 20, 1 << 30, 64 << 20
ELEM = 4  # float32, NCCL-tests' default type
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.I)


def parse_size(text: str) -> int:
    """'1M', '1MiB', '1MB' (binary, as NCCL-tests reads -b/-e), '4096' -> bytes."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 1M, 256K, 1G, 4096)")
    n = float(m.group(1)) * 1024 ** " kmgt".index((m.group(2) or " ").lower())
    if n < ELEM:
        raise argparse.ArgumentTypeError(f"{text!r} is below {ELEM} bytes (one float32)")
    return int(n)


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                      formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--min-bytes", type=parse_size, default=None, help="smallest message (default 1M)")
    p.add_argument("--max-bytes", type=parse_size, default=None, help="largest message (default 1G; 64M on CPU)")
    p.add_argument("--iters", type=positive, default=20, help="timed iterations per size (default 20)")
    p.add_argument("--warmup", type=not_negative, default=5, help="untimed iterations first (default 5)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {', '.join(OPS)} (default both)")
    p.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                   help="auto: nccl where a GPU is, else gloo")
    g = p.add_argument_group("launcher (else from Slurm, else one node with every visible GPU)")
    g.add_argument("--nnodes", type=positive, default=None)
    g.add_argument("--nproc-per-node", type=positive, default=None)
    g.add_argument("--node-rank", type=not_negative, default=None)
    g.add_argument("--master-addr", default=None)
    g.add_argument("--master-port", type=port, default=None)
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    a = parser().parse_args(argv)
    ops = [o.strip().replace("-", "_") for o in a.ops.split(",") if o.strip()]
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        raise UsageError(f"--ops {a.ops!r}: choose from {', '.join(OPS)}")
    a.ops = ops
    if a.min_bytes is not None and a.max_bytes is not None and a.min_bytes > a.max_bytes:
        raise UsageError(f"--min-bytes ({a.min_bytes}) is larger than --max-bytes ({a.max_bytes})")
    return a


def sizes(lo: int, hi: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 2
    return out


def busbw_factor(op: str, n: int) -> float:
    return (2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n) if n > 1 else 0.0


def fmt_bytes(n: int) -> str:
    return fabric.human_bytes(n)


def fmt_time(s: float) -> str:
    return f"{s * 1e6:.1f} us" if s < 1e-3 else (f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s")


# ---------------------------------------------------------------------------------------------------------------
# What the links should give
# ---------------------------------------------------------------------------------------------------------------
def nvlink_gbs() -> tuple[int, float] | None:
    """(links, GB/s per direction) of GPU 0 from `nvidia-smi nvlink -s -i 0` ('Link 0: 26.562 GB/s'), or None."""
    try:
        r = subprocess.run(["nvidia-smi", "nvlink", "-s", "-i", "0"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    speeds = [float(x) for x in re.findall(r"Link \d+:\s*([\d.]+)\s*GB/s", r.stdout)]
    return (len(speeds), sum(speeds)) if speeds else None


def expected_links(nnodes: int, local_world: int, cuda: bool, parsed: dict, peer: bool | None) -> list[str]:
    out = []
    if local_world > 1:
        if not cuda:
            out.append("within a node: shared memory / loopback TCP (gloo): unknown")
        else:
            nv = nvlink_gbs()
            if nv:
                out.append(f"within a node: NVLink, {nv[0]} links, {nv[1]:.0f} GB/s per GPU per direction")
            elif peer:
                out.append("within a node: GPU peer access (NVLink or PCIe P2P; speed unknown)")
            elif peer is False:
                out.append("within a node: no GPU peer access: copies through host memory (PCIe, speed unknown)")
            else:
                out.append("within a node: unknown")
    if nnodes > 1:
        net = (parsed.get("network") or "").lower()
        ports = fabric.rdma_ports()
        summary = fabric.link_summary(ports)
        if cuda and net == "ib" and summary:
            out.append(f"between nodes: RDMA {summary}")
        elif net == "socket" or not cuda:
            ifaces = [i.split(":")[0] for i in parsed.get("socket_ifaces", [])]
            speeds = [(i, fabric.net_speed_mbps(i)) for i in ifaces]
            known = [f"{i} {s / 1000:g} Gb/s = {s / 8000:g} GB/s" for i, s in speeds if s]
            out.append("between nodes: TCP " + (", ".join(known) if known else "(NIC speed unknown)"))
        else:
            out.append(f"between nodes: {summary or 'unknown'}")
    return out or ["unknown (one process: nothing to cross)"]


# ---------------------------------------------------------------------------------------------------------------
# The ranks
# ---------------------------------------------------------------------------------------------------------------
def _nccl_log_setup() -> Path | None:
    """NCCL's INIT/NET lines into a file of this process (read after the run), unless the user set NCCL_DEBUG."""
    if os.environ.get("NCCL_DEBUG"):
        return None
    path = Path(tempfile.gettempdir()) / f"trainbox-nccl-check.{socket.gethostname()}.{os.getpid()}.log"
    # P2P too: where the Channel lines (which transport each pair of ranks used) belong besides INIT.
    os.environ.update(fabric.NCCL_DEBUG_ENV, NCCL_DEBUG_SUBSYS=fabric.NCCL_DEBUG_ENV["NCCL_DEBUG_SUBSYS"] + ",P2P",
                      NCCL_DEBUG_FILE=str(path))
    return path


def run_ranks(a: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if a.backend == "nccl" and not cuda:
        raise UsageError("--backend nccl needs a GPU, and torch sees none here; use --backend gloo or auto")
    use_nccl = a.backend == "nccl" or (a.backend == "auto" and cuda)
    backend = "nccl" if use_nccl else "gloo"
    lo = a.min_bytes or DEFAULT_MIN
    hi = a.max_bytes or (DEFAULT_MAX if use_nccl else max(lo, CPU_DEFAULT_MAX))
    if lo > hi:
        raise UsageError(f"--min-bytes ({lo}) is larger than the largest size ({hi}); pass --max-bytes")
    log_path = _nccl_log_setup() if use_nccl else None

    local_rank = ranks.local_rank()
    device = torch.device("cuda", local_rank) if use_nccl else torch.device("cpu")
    store = None
    if os.environ.get("WORLD_SIZE") and os.environ.get("MASTER_ADDR"):
        init = {"init_method": "env://"}
    else:  # one process: a file store, nothing to listen on
        fd, store = tempfile.mkstemp(prefix="trainbox-nccl-check-")
        os.close(fd)
        os.unlink(store)
        init = {"init_method": f"file://{store}", "rank": 0, "world_size": 1}
    if use_nccl:
        torch.cuda.set_device(device)
        init["device_id"] = device
    dist.init_process_group(backend, **init)
    try:
        return _bench(a, dist, torch, device, backend, lo, hi, log_path)
    finally:
        dist.destroy_process_group()
        if store and os.path.exists(store):
            os.unlink(store)


def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bench(a, dist, torch, device, backend, lo, hi, log_path) -> int:
    rank, n = dist.get_rank(), dist.get_world_size()
    host = socket.gethostname()
    hosts = [None] * n
    dist.all_gather_object(hosts, host)
    nodes = list(dict.fromkeys(hosts))
    local_world = hosts.count(host)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    # A correctness check first: a wrong sum is a broken fabric, whatever its speed.
    x = torch.full((1024,), float(rank + 1), device=device)
    dist.all_reduce(x)
    g = torch.empty(n * 4, device=device)
    gather(g, torch.full((4,), float(rank), device=device))
    _sync(torch, device)
    want = n * (n + 1) / 2
    ok = bool((x == want).all().item()) and g.view(n, 4).mean(1).tolist() == [float(r) for r in range(n)]

    results = []  # (op, size, seconds)
    for op in a.ops:
        for size in sizes(lo, hi):
            count = max(size // ELEM, 1)
            if op == "all_gather":
                count = max(count - count % n, n)
                inp = torch.zeros(count // n, device=device)
                out = torch.empty(count, device=device)
                run = lambda: gather(out, inp)  # noqa: E731
            else:
                buf = torch.zeros(count, device=device)
                run = lambda: dist.all_reduce(buf)  # noqa: E731
            for _ in range(a.warmup):
                run()
            _sync(torch, device)
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(a.iters):
                run()
            _sync(torch, device)
            dt = torch.tensor([(time.perf_counter() - t0) / a.iters], device=device, dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank's time is the job's
            results.append((op, count * ELEM, dt.item()))
            del run
    ok_all = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(ok_all, op=dist.ReduceOp.MIN)

    parsed = fabric.parse_nccl_log(log_path.read_text(errors="replace")) if log_path and log_path.exists() else {}
    if log_path:
        log_path.unlink(missing_ok=True)
    logs = [None] * n
    dist.all_gather_object(logs, {"host": host, "log": parsed})
    if rank != 0:
        return 0 if ok_all.item() else 1

    peer = None
    if backend == "nccl" and torch.cuda.device_count() > 1:
        peer = bool(torch.cuda.can_device_access_peer(0, 1))
    nccl_version = ".".join(map(str, torch.cuda.nccl.version())) if backend == "nccl" else None
    print(report(results, n, nodes, local_world, backend, nccl_version, logs, peer, bool(ok_all.item())), flush=True)
    return 0 if ok_all.item() else 1


# What each of NCCL's transports is, for the transport line (the `via` word of its Channel lines).
KINDS = {"P2P": "GPU peer access (NVLink or PCIe)", "SHM": "through host shared memory",
         "NET/Socket": "TCP sockets", "NET/IB": "RDMA verbs"}


def family(via: str) -> str:
    """`P2P/CUMEM/read` -> P2P/CUMEM, `SHM/direct/direct` -> SHM, `NET/Socket/0` -> NET/Socket."""
    return "SHM" if via.startswith("SHM") else "/".join(via.split("/")[:2])


def describe(vias: list[str]) -> str:
    return ", ".join(f"{v} ({next((k for p, k in KINDS.items() if v.startswith(p)), 'see NCCL')})" for v in vias)


def split_links(logs: list[dict]) -> tuple[list[str], list[str]]:
    """(transports between ranks of one host, transports between hosts) from every rank's Channel lines; `logs`
    are in rank order. A log without ranked lines falls back to NET/ = between hosts."""
    hosts = [entry.get("host") if entry else None for entry in logs]
    intra, inter = [], []
    for entry in logs:
        log = (entry or {}).get("log") or {}
        if "channels" not in log:
            for v in log.get("via", []):
                side = inter if v.startswith("NET/") else intra
                side.append(v) if v not in side else None
            continue
        for src, dst, v in log["channels"]:
            same = src < len(hosts) and dst < len(hosts) and hosts[src] is not None and hosts[src] == hosts[dst]
            side = intra if same else inter
            side.append(v) if v not in side else None
    return intra, inter


def transport_line(backend: str, nnodes: int, logs: list[dict]) -> tuple[str, str, str | None]:
    """(short name for the summary, the transport line, a WARNING or None) from every rank's parsed NCCL log.
    Within a node it names what NCCL's Channel lines say the ranks used, the network included (NCCL_P2P_DISABLE=1
    NCCL_SHM_DISABLE=1: NET/Socket)."""
    if backend != "nccl":
        return "gloo/TCP", "gloo over TCP (no NCCL without a GPU)", None
    parsed = [entry["log"] for entry in logs if entry and entry.get("log")]
    if not parsed:
        how = "NCCL_DEBUG is set by you: see NCCL's own log" if os.environ.get("NCCL_DEBUG") else "no NCCL log read"
        return "unknown", f"unknown ({how})", None
    per_node = {}
    for entry in logs:
        if entry and entry.get("log"):
            per_node.setdefault(entry["host"], fabric.transport(entry["log"]))
    names = sorted({t["name"] for t in per_node.values()})
    intra, _ = split_links(logs)
    inter = next(iter(per_node.values()))
    text = f"inter-node {'/'.join(names)} ({inter['detail']})"
    if intra:
        text += f"; within a node {describe(intra)}"
    warning = None
    if nnodes > 1:
        short = "/".join(names)
        socket_nodes = [h for h, t in per_node.items() if t["name"] == "Socket"]
        if socket_nodes:
            why = per_node[socket_nodes[0]]["why"]
            warning = (f"WARNING: inter-node traffic went over TCP sockets on {', '.join(socket_nodes)}: {why}")
    else:
        measured = (", ".join(dict.fromkeys(family(v) for v in intra)) if intra
                    else "one GPU" if len(logs) == 1 else "unknown (NCCL's log names no channel)")
        short = f"{measured} (one node; inter-node would be {'/'.join(names)})"
        text = (f"one node: {describe(intra) if intra else measured}; inter-node would use {'/'.join(names)} "
                f"({inter['detail']})")
        if inter["name"] == "Socket":
            warning = f"WARNING: a multi-node job would run over TCP sockets: {inter['why']}"
    return short, text, warning


def report(results, n, nodes, local_world, backend, nccl_version, logs, peer, ok) -> str:
    short, tline, warning = transport_line(backend, len(nodes), logs)
    parsed = next((e["log"] for e in logs if e and e.get("log")), {})
    lines = [f"nccl-check: {n} ranks on {len(nodes)} node(s) ({', '.join(nodes[:4])}"
             + (f", +{len(nodes) - 4}" if len(nodes) > 4 else "") + f"), backend {backend}"
             + (f", NCCL {nccl_version}" if nccl_version else ""),
             f"transport: {tline}"]
    lines += [f"links should give: {e}" for e in expected_links(len(nodes), local_world, backend == "nccl",
                                                                 parsed, peer)]
    lines.append("data check: " + ("ok (all_reduce sum and all_gather order right on every rank)" if ok else
                                   "WRONG RESULT on some rank: the fabric or a driver is broken"))
    lines += ["", f"{'op':<11} {'size':>9} {'time':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}"]
    for op, size, t in results:
        alg = size / t / 1e9 if t > 0 else 0.0
        lines.append(f"{op:<11} {fmt_bytes(size):>9} {fmt_time(t):>10} {alg:>11.2f} "
                     f"{alg * busbw_factor(op, n):>11.2f}")
    if warning:
        lines += ["", warning]
    top = {}
    for op, size, t in results:
        if size >= top.get(op, (0, 0))[0]:
            top[op] = (size, (size / t / 1e9 if t > 0 else 0.0) * busbw_factor(op, n))
    op = "all_reduce" if "all_reduce" in top else next(iter(top))
    size, bus = top[op]
    lines += ["", f"nccl-check: {n} ranks, {op} busbw {bus:.2f} GB/s at {fmt_bytes(size)}, transport {short}"
              + ("" if ok else ", DATA CHECK FAILED")]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    a = parse(argv)
    p = launch.plan(a, os.environ)
    if p.mode == "torchrun":
        return launch.run_torchrun(p, "trainbox.cli.nccl_check", argv)
    launch.apply_env(p, os.environ)
    return run_ranks(a)


if __name__ == "__main__":
    from trainbox.dispatch import run_main

    sys.exit(run_main(main, prog=PROG))
