"""How a training entrypoint gets its processes: train here, or start torchrun (c10d rendezvous) from Slurm or flags.

`plan(launch_args, env)` decides, in this order:
1. under torchrun (TORCHELASTIC_RUN_ID set) -> train in this process;
2. explicit `--nnodes/--nproc-per-node/--master-addr/--master-port/--node-rank` -> torchrun with those
   (missing ones from Slurm when inside an srun step, else nnodes 1, GPUs visible or 1, 127.0.0.1:29500);
3. inside an srun step (SLURM_JOB_ID + SLURM_STEP_ID): one task per node -> torchrun per node with
   nnodes = SLURM_NNODES, nproc = GPUs visible / SLURM_GPUS_ON_NODE / 1 on CPU, master = first host of
   SLURM_JOB_NODELIST, port below (`slurm_port`), rdzv id = job id, node 0 hosts the store; several tasks per
   node -> each task is one rank (RANK/LOCAL_RANK/WORLD_SIZE/MASTER_* from SLURM_PROCID/LOCALID/NTASKS), trains here;
4. RANK/WORLD_SIZE/MASTER_ADDR already set by another launcher -> train here;
5. more than one GPU visible -> torchrun on this host; else a single process.
torchrun runs as a child, not exec'd: SIGTERM/SIGUSR1 (Slurm preemption, `docker stop`) are forwarded to the
workers, which checkpoint and exit 0; torchrun itself ignores both so it does not kill them mid-save.

Rendezvous ports. One node: `torchrun --standalone` (its c10d store binds port 0, the kernel picks a free port and
torchrun holds it: nothing to probe, nothing to race). Several nodes need one port that every node knows in advance:
1. `--master-port` when given;
2. Slurm's reserved ports when the step has them (`srun --resv-ports`, SLURM_STEP_RESV_PORTS): Slurm hands each
   step its own, so these cannot collide;
3. else a port from the job id, `slurm_port`: 10000 + job id modulo the window [10000, start of the kernel's
   ephemeral range) (read from /proc/sys/net/ipv4/ip_local_port_range, 32768 by default), skipping torch's default
   ports 29400/29500. Never an ephemeral port (an outgoing connection of anything on the node may hold one); two jobs
   on one node collide only if their ids are a whole window (about 22,700 jobs) apart. Node 0 hosts the c10d store
   explicitly (`--rdzv-conf is_host=...`), so even that case fails loudly (address in use) instead of torchrun's
   fallback silently joining the other job's store.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field

from .errors import UsageError


@dataclass
class LaunchArguments:
    """Launcher flags shared by every training entrypoint (else derived from Slurm, else one process)."""
    nnodes: int | None = field(default=None, metadata={"help": "launcher: number of nodes (else from Slurm, else 1)"})
    nproc_per_node: int | None = field(default=None, metadata={"help": "launcher: processes per node (GPUs, or 1 on CPU)"})
    node_rank: int | None = field(default=None, metadata={"help": "launcher: this node's rank (else SLURM_NODEID)"})
    master_addr: str | None = field(default=None, metadata={"help": "launcher: rendezvous host (else first Slurm node)"})
    master_port: int | None = field(default=None, metadata={"help": "launcher: rendezvous port"})

DEFAULT_PORT = 29500
# The window of job-id ports starts here (below: well-known and common service ports, Jupyter's 8888 included) and
# ends where the kernel's ephemeral range begins; torchrun's and torch.distributed's own defaults are skipped.
PORT_WINDOW_START = 10000
TORCH_DEFAULT_PORTS = (29400, 29500)
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
TORCHRUN_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"  # not SIGTERM: see _signals_flag
# Set once run_torchrun passed a preemption signal on (others, e.g. vllm_server's watch, then let the ranks save).
SIGNALLED = threading.Event()
LAUNCH_FIELDS = ("nnodes", "nproc_per_node", "node_rank", "master_addr", "master_port")
# What plan() reads inside an srun step with one task per node; a job script that clears the environment (enroot
# start) passes these names through. Empty counts as unset.
SLURM_STEP_ENV = ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_JOB_NODELIST", "SLURM_NNODES", "SLURM_JOB_NUM_NODES",
                  "SLURM_NODEID", "SLURM_STEP_RESV_PORTS", "SLURM_GPUS_ON_NODE")


@dataclass
class Plan:
    mode: str  # "train" (in this process) or "torchrun"
    reason: str
    nnodes: int = 1
    nproc_per_node: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_PORT
    rdzv_id: str = "trainbox"
    env: dict = field(default_factory=dict)  # variables to set before training (one Slurm task per rank)
    standalone: bool = False  # one node: torchrun --standalone picks and holds its own free port
    is_host: bool | None = None  # multi-node under Slurm: does this node host the c10d store (node 0)?


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(nodelist: str) -> list[str]:
    """Slurm's compressed host list (`node[01-03,07],gpu-a[1-2]`) -> host names, in order."""
    parts, depth, cur = [], 0, ""
    for ch in nodelist.strip():
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise UsageError(f"SLURM_JOB_NODELIST {nodelist!r}: unbalanced ']'")
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth != 0:
        raise UsageError(f"SLURM_JOB_NODELIST {nodelist!r}: unbalanced '['")
    parts.append(cur)
    hosts: list[str] = []
    for part in filter(None, (p.strip() for p in parts)):
        hosts += _expand_one(part, nodelist)
    return hosts


def _expand_one(part: str, whole: str) -> list[str]:
    start = part.find("[")
    if start < 0:
        return [part]
    end = part.index("]", start)
    prefix, body, rest = part[:start], part[start + 1 : end], part[end + 1 :]
    out = []
    for item in body.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise UsageError(f"SLURM_JOB_NODELIST {whole!r}: cannot read range {item!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        width = len(lo)  # zero padding as written: node[01-03] -> node01..node03
        for n in range(int(lo), int(hi) + 1):
            for tail in _expand_one(rest, whole):
                out.append(f"{prefix}{n:0{width}d}{tail}")
    return out


def slurm_hosts(env) -> list[str]:
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
    if not nodelist:
        raise UsageError("inside Slurm but SLURM_JOB_NODELIST is empty; pass --master-addr HOST")
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True
            ).stdout.split()
            if out:
                return out
        except (subprocess.SubprocessError, OSError):
            pass  # fall back to our own parser
    return expand_hostlist(nodelist)


def local_procs(env) -> int:
    """Processes per node: visible GPUs, else SLURM_GPUS_ON_NODE, else 1 (CPU)."""
    try:
        import torch

        n = torch.cuda.device_count()
        if n > 0:
            return n
    except ImportError:  # pragma: no cover
        pass
    try:
        return max(1, int(env.get("SLURM_GPUS_ON_NODE", "") or 0))
    except ValueError:
        return 1


def _int_env(env, *names) -> int | None:
    for n in names:
        v = env.get(n)
        if v not in (None, ""):
            try:
                return int(str(v).split("(")[0].split(",")[0])
            except ValueError:
                raise UsageError(f"environment variable {n}={v!r} is not a number") from None
    return None


def _in_srun(env) -> bool:
    return bool(env.get("SLURM_JOB_ID")) and env.get("SLURM_STEP_ID") not in (None, "")


def ephemeral_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux default 32768-60999)."""
    try:
        lo, hi = (int(x) for x in open(path).read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def slurm_port(env, ephemeral: tuple[int, int] | None = None) -> int:
    """The rendezvous port of a Slurm job, the same on every node: see the module docstring."""
    resv = str(env.get("SLURM_STEP_RESV_PORTS") or "").strip()
    if resv:
        m = re.match(r"^(\d+)", resv)  # "12000-12003", "12000,12005" or "12000": the first one is ours
        if not m:
            raise UsageError(f"SLURM_STEP_RESV_PORTS={resv!r} is not a port range; pass --master-port PORT")
        return int(m.group(1))
    job = _int_env(env, "SLURM_JOB_ID")
    start, end = PORT_WINDOW_START, (ephemeral or ephemeral_range())[0]
    skip = sorted(p for p in TORCH_DEFAULT_PORTS if start <= p < end)
    size = end - start - len(skip)
    if size < 1000:
        raise UsageError(f"the kernel's ephemeral port range starts at {end} ({EPHEMERAL_RANGE_FILE}), leaving no "
                         f"room for rendezvous ports above {start}; pass --master-port PORT or use srun --resv-ports")
    port = start + job % size
    for p in skip:  # ascending: each skipped port below moves the result up by one
        if port >= p:
            port += 1
    return port


def plan(launch_args, env) -> Plan:
    env = dict(env)
    if env.get("TORCHELASTIC_RUN_ID"):
        return Plan("train", "under torchrun")
    flags = {f: getattr(launch_args, f, None) for f in LAUNCH_FIELDS}
    for f in ("nnodes", "nproc_per_node"):
        if flags[f] is not None and flags[f] < 1:
            raise UsageError(f"--{f.replace('_', '-')} must be at least 1, got {flags[f]}")
    in_srun = _in_srun(env)

    if any(v is not None for v in flags.values()):
        nnodes = flags["nnodes"] or (_int_env(env, "SLURM_NNODES", "SLURM_JOB_NUM_NODES") if in_srun else None) or 1
        node_rank = flags["node_rank"]
        if node_rank is None:
            node_rank = (_int_env(env, "SLURM_NODEID") if in_srun else None) or 0
        if not 0 <= node_rank < nnodes:
            raise UsageError(f"--node-rank {node_rank} is outside 0..{nnodes - 1} (--nnodes {nnodes})")
        master = flags["master_addr"] or (slurm_hosts(env)[0] if in_srun else "127.0.0.1")
        if nnodes > 1 and not flags["master_addr"] and not in_srun:
            raise UsageError(f"--nnodes {nnodes} needs --master-addr HOST (the node every rank can reach)")
        nproc = flags["nproc_per_node"] or local_procs(env)
        if nnodes == 1 and not flags["master_port"] and not flags["master_addr"]:
            # One node, no endpoint asked for: torchrun picks and holds a free port (two runs on a host never race).
            return Plan("torchrun", "launcher flags, one node", nproc_per_node=nproc, master_port=0,
                        rdzv_id="standalone", standalone=True)
        port = flags["master_port"] or (slurm_port(env) if in_srun else DEFAULT_PORT)
        return Plan(
            "torchrun",
            "launcher flags",
            nnodes=nnodes,
            nproc_per_node=nproc,
            node_rank=node_rank,
            master_addr=master,
            master_port=port,
            rdzv_id=env.get("SLURM_JOB_ID") or f"trainbox-{master}-{port}",
            # Derived from Slurm (first node = node 0): node 0 hosts; given by hand: torchrun's own host check.
            is_host=(node_rank == 0) if in_srun and not flags["master_addr"] else None,
        )

    if in_srun:
        nnodes = _int_env(env, "SLURM_NNODES", "SLURM_JOB_NUM_NODES", "SLURM_STEP_NUM_NODES") or 1
        ntasks = _int_env(env, "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS") or nnodes
        master = slurm_hosts(env)[0]
        port = slurm_port(env)
        if ntasks > nnodes:
            local_world = _int_env(env, "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE")
            run_env = {
                "RANK": str(_int_env(env, "SLURM_PROCID") or 0),
                "LOCAL_RANK": str(_int_env(env, "SLURM_LOCALID") or 0),
                "WORLD_SIZE": str(ntasks),
                "LOCAL_WORLD_SIZE": str(local_world or max(1, ntasks // nnodes)),
                "MASTER_ADDR": master,
                "MASTER_PORT": str(port),
            }
            return Plan("train", f"Slurm, one task per rank ({ntasks} tasks)", nnodes=nnodes, master_addr=master,
                        master_port=port, env=run_env)
        return Plan(
            "torchrun",
            f"Slurm, one task per node ({nnodes} nodes)",
            nnodes=nnodes,
            nproc_per_node=local_procs(env),
            node_rank=(node := _int_env(env, "SLURM_NODEID") or 0),
            master_addr=master,
            master_port=port,
            rdzv_id=env["SLURM_JOB_ID"],
            is_host=node == 0,
        )

    if env.get("WORLD_SIZE") and env.get("RANK") and env.get("MASTER_ADDR"):
        return Plan("train", "RANK/WORLD_SIZE set by another launcher")
    n = local_procs(env)
    if n > 1:
        return Plan("torchrun", f"{n} GPUs on this host", nproc_per_node=n, master_port=0, rdzv_id="standalone",
                    standalone=True)
    return Plan("train", "single process")


def apply_env(p: Plan, environ) -> None:
    for k, v in p.env.items():
        environ[k] = v


def torchrun_command(p: Plan, module: str, argv: list[str]) -> list[str]:
    if p.standalone:
        rdzv = ["--standalone"]
    else:
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{p.master_addr}:{p.master_port}", "--rdzv-id", p.rdzv_id]
        if p.is_host is not None:
            rdzv += ["--rdzv-conf", f"is_host={str(p.is_host).lower()}"]
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(p.nnodes),
        "--nproc-per-node", str(p.nproc_per_node),
        *rdzv,
        # A failed rank fails the job; restarts come from rerunning (resume from the last checkpoint).
        "--max-restarts", "0",
        *_signals_flag(),
        "-m", module, *argv,
    ]  # fmt: skip


def _signals_flag() -> list[str]:
    """torchrun kills its workers on SIGTERM (Slurm's scancel signals every process of the step, torchrun too);
    the workers must get to checkpoint instead. Newer torchrun sets its handled signals from this flag (it
    overwrites TORCHELASTIC_SIGNALS_TO_HANDLE); older ones have no flag and read the variable."""
    return ["--signals-to-handle", TORCHRUN_SIGNALS] if torchrun_has_option("--signals-to-handle") else []


@functools.cache
def torchrun_has_option(option: str) -> bool:
    """Asked of torchrun's own argument parser: an option it doesn't know stays among the leftovers."""
    from torch.distributed.run import get_args_parser

    _, rest = get_args_parser().parse_known_args([option, "x", "train.py"])
    return option not in rest


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...)."""
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _ranks(torchrun_pid: int, module: str) -> list[int]:
    """The rank processes under torchrun: descendants running `-m MODULE` (whatever wrapper, e.g. numactl, sits
    between), so compile workers and other helpers never get a stray signal."""
    import psutil

    found = []
    for pid in descendants(torchrun_pid):
        try:
            if module in psutil.Process(pid).cmdline():
                found.append(pid)
        except psutil.Error:  # gone meanwhile, or not ours to read
            continue
    return found


def _ignore_preempt_signals():
    # In torchrun (before exec): ignore SIGTERM/SIGUSR1 so it waits for the workers' checkpoint instead of
    # killing them; the workers install their own handlers at start-up.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def run_torchrun(p: Plan, module: str, argv: list[str]) -> int:
    cmd = torchrun_command(p, module, argv)
    print(
        f"[trainbox] launch ({p.reason}): torchrun nnodes={p.nnodes} nproc_per_node={p.nproc_per_node} "
        f"node_rank={p.node_rank} rdzv=" + ("standalone (torchrun picks a free port)" if p.standalone else
                                              f"c10d {p.master_addr}:{p.master_port} id={p.rdzv_id}"),
        flush=True,
    )
    env = dict(os.environ)
    # torchrun must not re-register SIGTERM (its handler kills the workers); keep its other signals.
    env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = TORCHRUN_SIGNALS
    proc = subprocess.Popen(cmd, env=env, preexec_fn=_ignore_preempt_signals)

    def forward(signum, frame):
        SIGNALLED.set()
        ranks = _ranks(proc.pid, module)
        # Said out loud: when a preemption does not stop training, this line tells which side dropped it.
        os.write(2, f"[trainbox] launcher got {signal.Signals(signum).name}: SIGUSR1 to ranks {ranks}\n".encode())
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        while True:
            try:
                # Poll, not one blocking waitpid: once CUDA has started threads here, the kernel may deliver
                # SIGTERM to one of them, and Python runs our handler only when the main thread runs bytecode.
                return proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                continue
            except KeyboardInterrupt:
                continue  # torchrun got the same SIGINT from the terminal and stops its workers
    finally:
        for s, h in old.items():
            signal.signal(s, h)
