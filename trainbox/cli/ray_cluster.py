"""Ray on Slurm: Ray head on the first node, workers on the others; once all joined, your command on the head.

Run it as one Slurm task per node, the way RL frameworks (verl, OpenRLHF, NeMo-RL) expect their Ray cluster:
  srun --ntasks-per-node=1 [--container-image=/abs/x.sqsh] trainbox ray [OPTIONS] -- python my_driver.py ARGS
(or a job script: `python -m builder.slurm --entrypoint ray ... -- python my_driver.py`). Node 0 (the first host of
SLURM_JOB_NODELIST) starts the head (`ray start --head --block`), every other node a worker that joins it. The head
waits until `ray.nodes()` shows all SLURM_NNODES nodes alive (--timeout; else one error naming the missing nodes,
exit 1), then runs the command with RAY_ADDRESS=HEAD_IP:GCS_PORT (its `ray.init()` joins the cluster), stops its Ray
node when the command ends and exits with the command's code. Workers leave (exit 0) once the head's GCS is gone.

Ports: one block of 256 per job, the same on every node, below the kernel's ephemeral range (like the torchrun
launcher's port, common/launch.py): base B = --port-base, else 10000 + 256 * (job id modulo the number of
blocks that fit below the ephemeral range, skipping blocks holding torch's 29400/29500). B+0 GCS (RAY_ADDRESS),
B+1 Ray client server (ray://HEAD:B+1), B+2 dashboard (with --dashboard and ray[default]'s extra packages; the
image has Ray core), B+3 node manager, B+4 object manager, B+5 runtime-env agent, B+6 metrics export, B+7 dashboard agent gRPC,
B+8 dashboard agent HTTP, B+16..B+255 worker processes. Every line it prints starts with `[trainbox] ray`.
--gpu-free-head: the head node offers no GPUs (--num-gpus=0), so GPU tasks and actors land on the workers only.
Exit codes: the command's; 1 if the cluster did not form or a Ray node failed; 2 for bad options or no srun step.
Workers exit 0 when the head leaves or Slurm ends the step, so the step's exit code is the command's.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from common import launch
from common.errors import UsageError
from trainbox.cli.argtypes import OneLineParser, not_negative, positive

PROG = "trainbox ray"
BLOCK = 256
# Offsets in the block: (name, offset, `ray start` option, head only?)
PORTS = (
    ("gcs", 0, "--port", True),
    ("client", 1, "--ray-client-server-port", True),
    ("dashboard", 2, "--dashboard-port", True),
    ("node_manager", 3, "--node-manager-port", False),
    ("object_manager", 4, "--object-manager-port", False),
    ("runtime_env_agent", 5, "--runtime-env-agent-port", False),
    ("metrics_export", 6, "--metrics-export-port", False),
    ("dashboard_agent_grpc", 7, "--dashboard-agent-grpc-port", False),
    ("dashboard_agent_http", 8, "--dashboard-agent-listen-port", False),
)
WORKER_PORTS = (16, BLOCK - 1)  # --min-worker-port / --max-worker-port offsets
PROBE_S = 1.0
GONE_AFTER = 3  # consecutive failed probes of the head's GCS port: the cluster has ended


# `ray start` (Ray's own CLI) with its two fixed startup waits made patient: a loaded node misses them, and then the
# head's `ray start` fails and the cluster never forms (both 2-node jobs of four test runs on a 2-core machine running
# other work). A Ray without the function patched runs that part unpatched.
# 1. The raylet waits a fixed 15 s for the dashboard agent it spawns (a Python process) to write its HTTP port to a
#    file in the session directory, then aborts (node_manager.cc WaitForDashboardAgentPorts; no option sets it): the
#    agent's imports took 15.0 s there (raylet.err "Timed out waiting for file .../dashboard_agent_listen_port_<node>").
#    The port is ours (--dashboard-agent-listen-port, B+8), so it is written before the raylet starts, with Ray's own
#    persist_port; the agent writes it again once it is up. The other agent ports are passed on the raylet's command
#    line, which it does not wait for.
# 2. Ray's node startup then gives the raylet a fixed 30 s to register (node.py: raylet_start_wait_time_s = 30,
#    polling services.get_node). Each get_node call retries for up to RAYLET_WAIT_S while the raylet is alive, so
#    Ray's clock only runs out after that; a dead raylet fails at once.
RAYLET_WAIT_S = 180
RAY_START = f"""
import inspect
import time
import ray._private.services as services
import ray._raylet as rayletlib
from ray.scripts.scripts import main
raylet = []
start_raylet = getattr(services, "start_raylet", None)
persist_port = getattr(rayletlib, "persist_port", None)
def start_raylet_port_written(*args, **kwargs):
    bound = inspect.signature(start_raylet).bind(*args, **kwargs).arguments
    if bound.get("dashboard_agent_listen_port"):
        persist_port(bound["session_dir"], bound["node_id"], rayletlib.DASHBOARD_AGENT_LISTEN_PORT_NAME,
                     bound["dashboard_agent_listen_port"])
    info = start_raylet(*args, **kwargs)
    raylet.append(getattr(info, "process", None))
    return info
get_node = getattr(services, "get_node", None)
def patient_get_node(*args, **kwargs):
    end = time.monotonic() + {RAYLET_WAIT_S}
    while True:
        try:
            return get_node(*args, **kwargs)
        except RuntimeError:
            dead = any(p is not None and p.poll() is not None for p in raylet)
            if dead or time.monotonic() >= end:
                raise
            time.sleep(0.5)
if start_raylet is not None and persist_port is not None:
    services.start_raylet = start_raylet_port_written
if get_node is not None:
    services.get_node = patient_get_node
main()
"""


def log(msg: str) -> None:
    print(f"[trainbox] ray {msg}", flush=True)


def _port_base(text: str) -> int:
    v = positive(text)
    if not 1024 <= v <= 65535 - BLOCK:
        raise argparse.ArgumentTypeError(f"must be 1024..{65535 - BLOCK} (the block is {BLOCK} ports), got {v}")
    return v


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, usage=f"{PROG} [OPTIONS] -- COMMAND [ARGS...]",
                      description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                      formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--gpu-free-head", action="store_true", help="the head node offers no GPUs to Ray (--num-gpus=0)")
    p.add_argument("--num-gpus", type=not_negative, default=None, help="GPUs per node for Ray (default: Ray detects)")
    p.add_argument("--num-cpus", type=positive, default=None, help="CPUs per node for Ray (default: Ray detects)")
    p.add_argument("--port-base", type=_port_base, default=None, help=f"first port of the {BLOCK}-port block "
                   "(default: from the job id, below the ephemeral range)")
    p.add_argument("--dashboard", action="store_true", help="start Ray's dashboard on the head (port B+2; needs "
                   "ray[default]'s extra packages, which the image lacks)")
    p.add_argument("--timeout", type=positive, default=300, help="seconds to wait for every node (default 300)")
    return p


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" in argv:
        i = argv.index("--")
        opts, command = argv[:i], argv[i + 1:]
    else:
        opts, command = argv, []
    a = parser().parse_args(opts)
    if not command:
        raise UsageError(f"no command given: {PROG} [OPTIONS] -- COMMAND (e.g. -- python my_driver.py); it runs "
                         "on the head once every node has joined")
    return a, command


def port_base(env, ephemeral: tuple[int, int] | None = None) -> int:
    """The job's block of ports, the same on every node (see the module docstring)."""
    start, end = launch.PORT_WINDOW_START, (ephemeral or launch.ephemeral_range())[0]
    blocks = [start + i * BLOCK for i in range((end - start) // BLOCK)]
    blocks = [b for b in blocks if not any(b <= p < b + BLOCK for p in launch.TORCH_DEFAULT_PORTS)]
    if len(blocks) < 4:
        raise UsageError(f"the kernel's ephemeral port range starts at {end} ({launch.EPHEMERAL_RANGE_FILE}), leaving "
                         f"no room for Ray's ports above {start}; pass --port-base PORT")
    job = launch._int_env(env, "SLURM_JOB_ID") or 0
    return blocks[job % len(blocks)]


def ports(base: int) -> dict[str, int]:
    out = {name: base + off for name, off, _, _ in PORTS}
    out["min_worker"], out["max_worker"] = base + WORKER_PORTS[0], base + WORKER_PORTS[1]
    return out


def start_command(base: int, head: bool, ip: str, head_addr: str, a: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-c", RAY_START, "start", "--block", "--disable-usage-stats",
           f"--node-ip-address={ip}"]
    cmd += ["--head", f"--include-dashboard={str(a.dashboard).lower()}"] if head else [f"--address={head_addr}"]
    for name, off, flag, head_only in PORTS:
        if head or not head_only:
            cmd.append(f"{flag}={base + off}")
    cmd += [f"--min-worker-port={base + WORKER_PORTS[0]}", f"--max-worker-port={base + WORKER_PORTS[1]}"]
    num_gpus = 0 if (head and a.gpu_free_head) else a.num_gpus
    if num_gpus is not None:
        cmd.append(f"--num-gpus={num_gpus}")
    if a.num_cpus is not None:
        cmd.append(f"--num-cpus={a.num_cpus}")
    return cmd


def resolve(host: str) -> str | None:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def route_ip(peer: str, port: int) -> str | None:
    """This node's address on the route to `peer` (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, port))
            return s.getsockname()[0]
    except OSError:
        return None


def reachable(ip: str, port: int, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=timeout):
            return True
    except OSError:
        return False


def _stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """`ray start --block` stops the processes it started on SIGTERM; its process group is killed if it hangs.
    grace 0: kill at once (a worker whose head is gone: its SIGTERM drain would wait 30 s for the dead GCS)."""
    if proc.poll() is None and grace > 0:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    proc.wait()


class HeadExited(RuntimeError):
    """The head's `ray start` ended before the cluster formed."""


HEAD_WATCH_S = 2.0   # how long a dead head may go unnoticed by a wait that is not stuck in Ray's C++ client


def _watch_head(proc: subprocess.Popen, done: threading.Event) -> None:
    """ray.init() and ray.nodes() can block for good once the head's GCS is gone (seen on a loaded node: the head's
    `ray start` died and the wait never returned). Only a thread can see that; it ends the process: one line, exit 1."""
    while not done.wait(HEAD_WATCH_S):
        if proc.poll() is not None and not done.wait(HEAD_WATCH_S):   # the wait itself did not notice in time
            log(f"error: the head's `ray start` exited {proc.returncode} while this node waited for the cluster "
                "(its output is above)")
            _stop(proc, grace=0)   # what it left in its process group
            sys.stderr.flush()
            os._exit(1)


def wait_for_nodes(addr: str, hosts: list[str], timeout: float, proc: subprocess.Popen) -> list[dict]:
    """Poll ray.nodes() until len(hosts) nodes are alive; raise RuntimeError naming the missing ones. A head whose
    `ray start` exits meanwhile ends the wait (HeadExited) or, where Ray's client blocks, this process (exit 1)."""
    done = threading.Event()
    threading.Thread(target=_watch_head, args=(proc, done), daemon=True, name="head-watch").start()
    try:
        return _wait_for_nodes(addr, hosts, timeout, proc)
    finally:
        done.set()


def _wait_for_nodes(addr: str, hosts: list[str], timeout: float, proc: subprocess.Popen) -> list[dict]:
    import ray

    end = time.monotonic() + timeout
    while True:  # the GCS answers before the head's raylet has registered (slow on a loaded node): retry
        try:
            ray.init(address=addr, logging_level="WARNING", log_to_driver=False, configure_logging=False)
            break
        except (ConnectionError, RuntimeError) as e:
            ray.shutdown()
            if proc.poll() is not None:
                raise HeadExited(f"the head's `ray start` exited {proc.returncode}") from None
            if time.monotonic() >= end:
                raise RuntimeError(f"can't connect to the head's Ray node at {addr}: {' '.join(str(e).split())}")
            time.sleep(1)
    try:
        while True:
            alive = [n for n in ray.nodes() if n.get("Alive")]
            if len(alive) >= len(hosts):
                return alive
            if proc.poll() is not None:
                raise HeadExited(f"the head's `ray start` exited {proc.returncode} before every node joined")
            if time.monotonic() >= end:
                ips = {n.get("NodeManagerAddress") for n in alive}
                missing = [h for h in hosts if resolve(h) not in ips] or ["(unknown)"]
                raise RuntimeError(f"only {len(alive)} of {len(hosts)} nodes joined in {timeout:.0f} s (joined: "
                                   f"{', '.join(sorted(filter(None, ips))) or 'none'}); missing: {', '.join(missing)}"
                                   "; see their [trainbox] ray lines (firewall? ports in use?)")
            time.sleep(0.5)
    finally:
        ray.shutdown()


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return env


def run_head(a, command, hosts, base, env) -> int:
    ip = resolve(hosts[0])
    if (ip is None or ip.startswith("127.")) and len(hosts) > 1:
        ip = route_ip(resolve(hosts[1]) or hosts[1], base) or ip
    ip = ip or "127.0.0.1"
    gcs = f"{ip}:{base}"
    p = ports(base)
    log(f"head on {socket.gethostname()} ({ip}): GCS {gcs}, client {p['client']}, dashboard {p['dashboard']}, "
        f"workers {p['min_worker']}-{p['max_worker']}{', no GPUs (GPU-free head)' if a.gpu_free_head else ''}; "
        f"waiting for {len(hosts)} node(s)")
    t0 = time.monotonic()
    end = t0 + a.timeout
    proc = subprocess.Popen(start_command(base, True, ip, gcs, a), env=env, start_new_session=True,
                            stdout=sys.stdout, stderr=sys.stderr)
    try:
        try:
            while not reachable(ip, base):
                if proc.poll() is not None:
                    raise HeadExited(f"the head's `ray start` exited {proc.returncode} (port {base} in use? see above)")
                if time.monotonic() >= end:
                    raise RuntimeError(f"the head's GCS {gcs} did not come up in {a.timeout} s")
                time.sleep(0.5)
            alive = wait_for_nodes(gcs, hosts, max(1.0, end - time.monotonic()), proc)
        except RuntimeError as e:
            # No second try for the head: the workers would take its restart for the end of the cluster.
            log(f"error: {e}")
            return 1
        names = ", ".join(sorted(f"{n.get('NodeManagerHostname')} {n.get('NodeManagerAddress')}" for n in alive))
        log(f"cluster up: {len(alive)}/{len(hosts)} nodes in {time.monotonic() - t0:.1f} s ({names}); "
            f"RAY_ADDRESS={gcs}; running: {' '.join(command)}")
        try:
            rc = subprocess.call(command, env=dict(env, RAY_ADDRESS=gcs))
        except OSError as e:
            log(f"error: can't run {command[0]}: {e.strerror}")
            return 127 if isinstance(e, FileNotFoundError) else 126
        rc = 128 - rc if rc < 0 else rc
        log(f"command exited {rc}; stopping the cluster")
        return rc
    finally:
        _stop(proc)


def run_worker(a, rank, hosts, base, env) -> int:
    head_ip = resolve(hosts[0]) or hosts[0]
    gcs = f"{head_ip}:{base}"
    end = time.monotonic() + a.timeout
    while not reachable(head_ip, base):
        if time.monotonic() >= end:
            log(f"error: node {rank}: the head's GCS {gcs} did not answer in {a.timeout} s")
            return 1
        time.sleep(0.5)
    ip = route_ip(head_ip, base) or resolve(socket.gethostname()) or "127.0.0.1"
    log(f"worker node {rank} on {socket.gethostname()} ({ip}) joins {gcs}")
    cmd = start_command(base, False, ip, gcs, a)
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=sys.stdout, stderr=sys.stderr)
    head_gone = False
    try:
        misses = 0
        while misses < GONE_AFTER:
            time.sleep(PROBE_S)
            misses = 0 if reachable(head_ip, base) else misses + 1
            if proc.poll() is not None and misses == 0:
                # Ray gives its raylet 30 s to register, which a loaded node can miss: try again until --timeout.
                if time.monotonic() >= end:
                    log(f"error: node {rank}: `ray start` exited {proc.returncode} while the head is up")
                    return 1
                log(f"node {rank}: `ray start` exited {proc.returncode}; starting it again")
                proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=sys.stdout, stderr=sys.stderr)
        log(f"worker node {rank}: the head is gone; leaving")
        head_gone = True
        return 0
    except KeyboardInterrupt:  # SIGTERM: Slurm ends the step and SIGKILLs after KillWait (30 s by default),
        head_gone = True       # which a 30 s drain would reach: its 137 would become the job's exit code
        raise
    finally:
        _stop(proc, grace=0 if head_gone else 30.0)


def main(argv: list[str]) -> int:
    return main_env(argv, _environment())


def main_env(argv: list[str], env: dict[str, str]) -> int:
    a, command = parse(argv)
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise UsageError("Ray is not installed here: the GPU images have it (matrix.toml's stack.gpu), the smoke/CPU "
                         "images don't; in bare mode use a Python environment with ray")
    if not launch._in_srun(env):
        raise UsageError(f"{PROG} runs inside a Slurm step with one task per node: srun --ntasks-per-node=1 {PROG} "
                         "-- COMMAND (or a job from `python -m builder.slurm --entrypoint ray`)")
    nnodes = launch._int_env(env, "SLURM_NNODES", "SLURM_JOB_NUM_NODES") or 1
    ntasks = launch._int_env(env, "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS")
    if ntasks is not None and ntasks != nnodes:
        raise UsageError(f"{PROG} needs one task per node, got {ntasks} tasks on {nnodes} nodes: srun "
                         "--ntasks-per-node=1")
    hosts = launch.slurm_hosts(env)[:nnodes]
    rank = launch._int_env(env, "SLURM_NODEID") or 0
    base = a.port_base or port_base(env)
    stop = {"sig": None}

    def on_signal(signum, _frame):  # Slurm's preemption/time-limit signals: end this node cleanly
        stop["sig"] = signum
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    # SIGUSR1 (the job's warning before its time limit) is the driver's to act on (Slurm signals every process of
    # the step): a no-op handler here, not SIG_IGN, which the command would inherit.
    signal.signal(signal.SIGUSR1, lambda *_: None)
    try:
        return run_head(a, command, hosts, base, env) if rank == 0 else run_worker(a, rank, hosts, base, env)
    except KeyboardInterrupt:
        sig = stop["sig"] or signal.SIGINT
        log(f"node {rank}: stopped by {signal.Signals(sig).name}")
        # A worker's SIGTERM: Slurm ends the step (the head's command failed under --kill-on-bad-exit, scancel, the
        # time limit). The head reports the outcome; a worker's 143 would mask the command's exit code.
        return 128 + sig if rank == 0 else 0


if __name__ == "__main__":
    from trainbox.dispatch import run_main

    sys.exit(run_main(main, prog=PROG))
