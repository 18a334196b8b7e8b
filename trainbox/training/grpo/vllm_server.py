"""GRPO with a vLLM server beside the trainers: who serves, who trains, the health wait, the lease, the teardown.

TRL's `vllm_mode server` needs `trl vllm-serve` running somewhere the trainers reach; this module starts it as part
of the run instead of by hand (the open-r1 recipe: the last node serves). Two layouts, both opt-in:

- across nodes (`--vllm_server_nodes 1`, inside an srun step with one task per node, e.g. a job from
  `python -m builder.slurm --vllm-nodes 1`): the LAST node of the allocation runs `trl vllm-serve` over all its
  GPUs (tensor parallel); the other nodes are the trainers: torchrun with nnodes = N - 1, node ranks 0..N-2,
  rendezvous on the first node (launch.plan on the trainer nodes only). TRL's server serves from one node, so
  more than one server node is refused.
- on one node (`--vllm_server_gpus G`): the last G visible GPUs run the server (CUDA_VISIBLE_DEVICES), torchrun
  runs one trainer per remaining GPU, the trainers reach the server at 127.0.0.1.

Every trainer gets TRL's own options `--use_vllm true --vllm_mode server --vllm_server_host HOST
--vllm_server_port HTTP --vllm_group_port GROUP`; nothing of TRL's client or server is re-done here.

Ports (one home, here): HTTP `vllm_server_port` (TRL's default 8000) on the server node; the weight-sync NCCL group
`vllm_group_port` (TRL's default 51216; in TRL 1.16 the trainer's main rank hosts that group's store, so it is
bound on the first trainer node); the lease, trainbox's own, HTTP + 1 (8001) on the server node.

The lease is what makes teardown and failure certain. The server task listens on the lease port; the first trainer
node's launcher connects before it waits for the server's health and keeps the connection for its whole life.
- Trainers end (any way: exit, crash, kill): the kernel closes the connection, the server task stops the server
  and exits 0 (the trainers' exit code is the job's verdict; a failing task makes srun --kill-on-bad-exit=1 end
  the step).
- Server ends (vLLM crashed, OOM, killed): the server task exits with its code, which closes the lease; the
  launcher prints one `error: vLLM server ...` line, kills torchrun's processes and exits 1.
- Signals: SIGUSR1 (Slurm's warning before the time limit, the trainers' cue to save) is ignored by the server
  task and its server; after SIGTERM/SIGINT the task keeps serving until the trainers end (at most STOP_GRACE
  seconds; Slurm's SIGKILL bounds it too), and the server ending on such a signal is no failure. The trainer
  launcher, once it passed a preemption signal to its ranks, no longer kills them when the server goes.
- Nobody connects within the wait (`--vllm_server_wait`, seconds): the server task gives up, one line, exit 1.
The launcher's health wait (`GET http://HOST:HTTP/health`, vLLM's endpoint) is bounded by the same number of
seconds and names the host and port when it runs out.

`TRAINBOX_VLLM_SERVE_CMD` replaces the server command (shell words; `{port}` is filled in) for tests, where no vLLM
can run: they start a stand-in HTTP server instead.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from common import launch
from common.errors import UsageError

HTTP_PORT = 8000  # TRL's GRPOConfig.vllm_server_port / `trl vllm-serve --port`
GROUP_PORT = 51216  # TRL's GRPOConfig.vllm_group_port
LEASE_OFFSET = 1  # trainbox's lease port = HTTP port + 1
HEALTH_PATH = "/health"  # vLLM's server answers 200 once the model is loaded
DEFAULT_WAIT = 1200.0  # seconds: a large model's first load from a cold cache
STANDIN_ENV = "TRAINBOX_VLLM_SERVE_CMD"
STOP_GRACE = 120.0  # seconds the server task keeps serving after SIGTERM/SIGINT, for the trainers' last step and save


class ServerDown(Exception):
    """The vLLM server never answered or went away: one line for the user."""


@dataclass
class Roles:
    role: str  # "server" or "trainer"
    server_host: str  # as the trainers reach it
    http_port: int = HTTP_PORT
    group_port: int = GROUP_PORT
    tensor_parallel_size: int = 1  # of the server
    holds_lease: bool = False  # the first trainer node's launcher
    trainer_env: dict = field(default_factory=dict)  # Slurm variables launch.plan sees on a trainer node
    server_gpus: list[str] | None = None  # one-node split: CUDA_VISIBLE_DEVICES of the server / of the trainers
    trainer_gpus: list[str] | None = None

    @property
    def lease_port(self) -> int:
        return self.http_port + LEASE_OFFSET

    def trainer_args(self) -> list[str]:
        """TRL's own options that point every trainer rank at the server."""
        return ["--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_host", self.server_host,
                "--vllm_server_port", str(self.http_port), "--vllm_group_port", str(self.group_port)]


def slurm_roles(env, server_nodes: int, gpus_on_node: int, http_port: int = HTTP_PORT,
                group_port: int = GROUP_PORT) -> Roles:
    """Across nodes: the last `server_nodes` nodes of the step serve, the others train (a pure function of env)."""
    if server_nodes != 1:
        raise UsageError(f"--vllm_server_nodes {server_nodes}: `trl vllm-serve` serves from one node; use 1 "
                         "(or --vllm_server_gpus G on one node)")
    if not (env.get("SLURM_JOB_ID") and env.get("SLURM_STEP_ID") not in (None, "")):
        raise UsageError("--vllm_server_nodes needs an srun step with one task per node (a job from "
                         "`python -m builder.slurm --vllm-nodes 1`); on one node use --vllm_server_gpus G")
    hosts = launch.slurm_hosts(env)
    nnodes = launch._int_env(env, "SLURM_NNODES", "SLURM_JOB_NUM_NODES", "SLURM_STEP_NUM_NODES") or len(hosts)
    ntasks = launch._int_env(env, "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS") or nnodes
    if ntasks != nnodes:
        raise UsageError(f"--vllm_server_nodes needs one Slurm task per node, the step has {ntasks} tasks on "
                         f"{nnodes} nodes (srun --ntasks-per-node=1)")
    if nnodes <= server_nodes:
        raise UsageError(f"--vllm_server_nodes {server_nodes} on a {nnodes}-node allocation leaves no node to train; "
                         "ask for more nodes or use --vllm_server_gpus G on one node")
    node = launch._int_env(env, "SLURM_NODEID") or 0
    trainers, servers = hosts[: nnodes - server_nodes], hosts[nnodes - server_nodes : nnodes]
    roles = Roles("server" if node >= len(trainers) else "trainer", servers[0], http_port, group_port,
                  tensor_parallel_size=max(1, gpus_on_node), holds_lease=node == 0)
    # launch.plan on a trainer node sees only the trainer nodes: nnodes, node ranks, first host, the same port.
    roles.trainer_env = {"SLURM_NNODES": str(len(trainers)), "SLURM_JOB_NUM_NODES": str(len(trainers)),
                         "SLURM_STEP_NUM_NODES": str(len(trainers)), "SLURM_NTASKS": str(len(trainers)),
                         "SLURM_STEP_NUM_TASKS": str(len(trainers)), "SLURM_JOB_NODELIST": ",".join(trainers),
                         "SLURM_NODELIST": ",".join(trainers)}
    return roles


def local_roles(visible: list[str], server_gpus: int, http_port: int = HTTP_PORT,
                group_port: int = GROUP_PORT) -> Roles:
    """One node: the last `server_gpus` of the visible GPUs serve, the rest train; the server at 127.0.0.1."""
    if server_gpus < 1:
        raise UsageError(f"--vllm_server_gpus must be at least 1, got {server_gpus}")
    if len(visible) <= server_gpus:
        raise UsageError(f"--vllm_server_gpus {server_gpus} with {len(visible)} GPU(s) visible leaves none to train; "
                         "use fewer server GPUs, or a node of its own (--vllm_server_nodes 1 in a Slurm job)")
    return Roles("trainer", "127.0.0.1", http_port, group_port, tensor_parallel_size=server_gpus, holds_lease=True,
                 server_gpus=visible[-server_gpus:], trainer_gpus=visible[:-server_gpus])


def visible_gpus(env) -> list[str]:
    """The GPU ids this process may use, as CUDA_VISIBLE_DEVICES names them (else 0..count-1)."""
    given = env.get("CUDA_VISIBLE_DEVICES")
    if given not in (None, ""):
        return [g.strip() for g in given.split(",") if g.strip()]
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except ImportError:  # pragma: no cover
        return []


def serve_command(model: str, roles: Roles, extra: str | None = None) -> list[str]:
    """`trl vllm-serve` with TRL's option names (the stand-in from TRAINBOX_VLLM_SERVE_CMD in tests)."""
    standin = os.environ.get(STANDIN_ENV)
    if standin:
        return [w.replace("{port}", str(roles.http_port)) for w in shlex.split(standin)]
    words = shlex.split(extra or "")
    cmd = ["trl", "vllm-serve", "--model", model, "--host", "0.0.0.0", "--port", str(roles.http_port)]
    if not any(w.split("=")[0] in ("--tensor_parallel_size", "--tensor-parallel-size") for w in words):
        cmd += ["--tensor_parallel_size", str(roles.tensor_parallel_size)]
    return cmd + words


def healthy(host: str, port: int, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{HEALTH_PATH}", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_healthy(host: str, port: int, wait: float, gone=lambda: None, interval: float = 1.0) -> float:
    """Until GET /health answers 200; `gone()` returns why the server can no longer come (or None). Seconds taken."""
    start = time.monotonic()
    while True:
        why = gone()
        if why:
            raise ServerDown(f"vLLM server at {host}:{port} {why} before it answered {HEALTH_PATH}")
        if healthy(host, port):
            return time.monotonic() - start
        if time.monotonic() - start >= wait:
            raise ServerDown(f"vLLM server at {host}:{port} did not answer {HEALTH_PATH} within {wait:.0f} s "
                             f"(--vllm_server_wait); see the server node's log")
        time.sleep(interval)


# ---------------------------------------------------------------- the server side


def serve(cmd: list[str], roles: Roles, wait: float, env=None) -> int:
    """Server task: run `cmd` as a child, hold the lease port; stop the child when the trainers' lease closes.

    Returns 0 when the trainers ended; the child's code (1 if that was 0) when the server ended first; 1 when no
    trainer connected within `wait` seconds. Always one line saying which.
    """
    try:
        ls = socket.create_server(("0.0.0.0", roles.lease_port))
    except OSError as e:
        print(f"error: cannot listen on the lease port {roles.lease_port} (vllm_server_port + 1): "
              f"{e.strerror or e}; choose another --vllm_server_port", flush=True)
        return 1
    print(f"[trainbox] vllm server: {shlex.join(cmd)} (HTTP {roles.http_port}, lease {roles.lease_port})", flush=True)
    # SIGUSR1 (Slurm's warning before the time limit) is the trainers' cue to checkpoint: the server keeps
    # serving them until they are done, so neither this task nor the server may die of it.
    proc = subprocess.Popen(cmd, env=env, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGUSR1, signal.SIG_IGN))
    stop = {"sig": None}

    def on_signal(signum, frame):
        stop["sig"], stop["at"] = signum, time.monotonic()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    old[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    conn = None
    started = time.monotonic()
    try:
        ls.settimeout(0.5)
        while True:
            rc = proc.poll()
            if rc is not None and stop["sig"]:  # scancel/preemption reached the server too: not a failure
                print(f"[trainbox] vllm server: stopped after {signal.Signals(stop['sig']).name} (code {rc})",
                      flush=True)
                return 0
            if rc is not None:
                print(f"error: vLLM server exited with code {rc} ({shlex.join(cmd[:2])}); trainers stop", flush=True)
                return rc or 1
            if stop["sig"] and time.monotonic() - stop["at"] > STOP_GRACE:
                print(f"[trainbox] vllm server: {signal.Signals(stop['sig']).name} {STOP_GRACE:.0f} s ago, the "
                      "trainers still connected: stopping the server", flush=True)
                return 0
            if conn is None:
                try:
                    conn, peer = ls.accept()
                    conn.settimeout(0.5)
                    print(f"[trainbox] vllm server: trainers connected from {peer[0]}", flush=True)
                except TimeoutError:
                    if time.monotonic() - started > wait:
                        print(f"error: no trainer connected to the lease port {roles.lease_port} within {wait:.0f} s; "
                              "stopping the vLLM server", flush=True)
                        return 1
                continue
            try:
                if conn.recv(64) == b"":
                    print("[trainbox] vllm server: trainers finished, stopping the server", flush=True)
                    return 0
            except TimeoutError:
                continue
            except OSError:
                print("[trainbox] vllm server: trainers' connection dropped, stopping the server", flush=True)
                return 0
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        stop_process(proc)
        for s in (conn, ls):
            if s is not None:
                s.close()


def stop_process(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM to the child's session (vLLM's workers too), SIGKILL after `grace` seconds."""
    if proc.poll() is not None:
        return
    for sig, timeout in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=timeout)
            return
        except subprocess.TimeoutExpired:
            continue


# ---------------------------------------------------------------- the trainer side


class Watch:
    """The trainer launcher's view of the server: the lease connection (across nodes) or the child (one node).

    `gone()` says why the server is no longer there (or None). `start()` runs a thread that, once the server goes,
    prints the one error line and kills this process's descendants (torchrun and the ranks).
    """

    def __init__(self, roles: Roles, wait: float, proc: subprocess.Popen | None = None):
        self.roles, self.proc, self.sock, self.failed = roles, proc, None, None
        self._done = threading.Event()
        if proc is None and roles.holds_lease:
            self.sock = connect_lease(roles.server_host, roles.lease_port, wait)

    def gone(self) -> str | None:
        if self.proc is not None:
            rc = self.proc.poll()
            return None if rc is None else f"exited with code {rc}"
        if self.sock is not None:
            try:
                self.sock.setblocking(False)
                try:
                    if self.sock.recv(1) == b"":
                        return "went away (its node task ended)"
                except BlockingIOError:
                    return None
                except OSError as e:
                    return f"went away ({e.strerror or e})"
            finally:
                self.sock.setblocking(True)
        return None

    def start(self) -> None:
        def run():
            while not self._done.wait(1.0):
                why = self.gone()
                if why and launch.SIGNALLED.is_set():  # preempted: the ranks are saving; let them finish
                    print(f"[trainbox] vLLM server at {self.roles.server_host}:{self.roles.http_port} {why} after a "
                          "preemption signal; the ranks finish their save", file=sys.stderr, flush=True)
                    return
                if why:
                    self.failed = (f"vLLM server at {self.roles.server_host}:{self.roles.http_port} {why} during "
                                   "training; stopping the trainers")
                    print(f"error: {self.failed}", file=sys.stderr, flush=True)
                    for pid in launch.descendants(os.getpid()):
                        if self.proc is not None and pid == self.proc.pid:
                            continue
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    return

        threading.Thread(target=run, name="vllm-server-watch", daemon=True).start()

    def close(self) -> None:
        self._done.set()
        if self.sock is not None:
            self.sock.close()  # the server task sees EOF: it stops the server
        if self.proc is not None:
            stop_process(self.proc)


def connect_lease(host: str, port: int, wait: float, interval: float = 1.0) -> socket.socket:
    start = time.monotonic()
    while True:
        try:
            return socket.create_connection((host, port), timeout=5.0)
        except OSError as e:
            if time.monotonic() - start >= wait:
                raise ServerDown(f"vLLM server node {host} never opened its lease port {port} within {wait:.0f} s "
                                 f"({e.strerror or e}); see the server node's log") from None
            time.sleep(interval)
