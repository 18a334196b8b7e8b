"""A real Slurm (Debian slurm-wlm + munge) on this machine, for the job-script tests: one node, plus optional nodes in
their own network namespaces.

`python -m devenv.slurm up [--netns-nodes N]|down|status`. `up` installs slurm-wlm and munge with apt when they are missing
(root on Debian/Ubuntu only), starts munged if no munged answers, writes a minimal slurm.conf into a fresh temp dir
(state, spool, logs, pids there too; ports picked free so a system Slurm is never disturbed), starts slurmctld and
slurmd, and waits until the node is idle. It prints the SLURM_CONF to export. Idempotent: a cluster started earlier
that still answers is reused. `down` stops exactly the processes `up` started (by pid, from the state file) and
removes the temp dir.

`--netns-nodes N` adds nodes tbx1..tbxN (partition `netns`; the default partition keeps the host node): each runs
its own slurmd in a network namespace joined to a bridge on this host (NETNS_SUBNET, nothing else is routed), in its
own UTS namespace whose hostname is the node name, with /etc/hosts naming the nodes and the controller (`ip netns
exec` would mount /etc/netns/NS/hosts over it; we bind it in a private mount namespace). So a job's tasks see several hosts, and torchrun, gloo and the c10d
rendezvous resolve and reach each other over the namespaces' addresses only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from builder.errors import UserError, reports_user_errors
from devenv.common import State, apt_install, logger, pid_alive, stop_pid, wait, which

MUNGE_SOCKET = Path("/run/munge/munge.socket.2")
MUNGE_KEY = Path("/etc/munge/munge.key")
APT = {"slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "sbatch": "slurm-client", "munged": "munge"}
# The netns nodes' private link: 10.213.77.1 is this host's side (the controller), .11, .12, ... the nodes.
NETNS_SUBNET = "10.213.77"
BRIDGE = "tbx-slurm0"
NETNS_PARTITION = "netns"
FIRST_JOB_ID = 13000


def netns_node(i: int) -> dict:
    """Name, network namespace, veth and address of netns node i (1-based)."""
    return {"name": f"tbx{i}", "ns": f"trainbox-slurm-{i}", "veth": f"tbx-slurm-v{i}",
            "addr": f"{NETNS_SUBNET}.{10 + i}"}


STATE = State("slurm")
_log = logger("slurm")


def load_state() -> dict:
    return STATE.load()


def munge_answers() -> bool:
    if not shutil.which("munge") or not shutil.which("unmunge"):
        return False
    try:
        cred = subprocess.run(["munge", "-n"], capture_output=True, timeout=5)
        if cred.returncode != 0:
            return False
        return subprocess.run(["unmunge"], input=cred.stdout, capture_output=True, timeout=5).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _ensure_munge(state: dict) -> None:
    if munge_answers():
        return
    if os.geteuid() != 0:
        raise UserError("munged is not running and starting it needs root; start it (systemctl start munge) "
                        "or run as root")
    if not MUNGE_KEY.exists():
        MUNGE_KEY.parent.mkdir(parents=True, exist_ok=True)
        if shutil.which("mungekey"):
            subprocess.run(["mungekey", "--create", "--keyfile", str(MUNGE_KEY)], check=True)
        else:
            MUNGE_KEY.write_bytes(os.urandom(128))
    # munged refuses a key or dirs that others can read: owned by munge, key mode 400 (measured here).
    for d in (Path("/run/munge"), Path("/var/lib/munge"), Path("/var/log/munge"), MUNGE_KEY.parent):
        d.mkdir(parents=True, exist_ok=True)
        shutil.chown(d, "munge", "munge")
    os.chmod("/run/munge", 0o755)
    os.chmod(MUNGE_KEY.parent, 0o700)
    shutil.chown(MUNGE_KEY, "munge", "munge")
    os.chmod(MUNGE_KEY, 0o400)
    munged = which("munged")
    r = subprocess.run(["runuser", "-u", "munge", "--", munged], capture_output=True, text=True)
    if r.returncode != 0:
        raise UserError(f"munged did not start: {r.stderr.strip()}")
    wait(munge_answers, "munged", 20)
    pid_file = Path("/run/munge/munged.pid")
    state["munged_pid"] = int(pid_file.read_text().strip()) if pid_file.exists() else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_conf(d: Path, node: str, cpus: int, netns_nodes: int = 0) -> Path:
    for sub in ("state", "spool", "log", "run"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    conf = d / "slurm.conf"
    # With netns nodes the controller must be reachable from inside them: this host's bridge address.
    ctl_addr = f"{NETNS_SUBNET}.1" if netns_nodes else "127.0.0.1"
    extra = "".join(f"NodeName={n['name']} NodeAddr={n['addr']} CPUs={cpus} State=UNKNOWN\n"
                    for n in map(netns_node, range(1, netns_nodes + 1)))
    if netns_nodes:
        extra += f"PartitionName={NETNS_PARTITION} Nodes=tbx[1-{netns_nodes}] MaxTime=INFINITE State=UP\n"
    conf.write_text(f"""\
# Written by devenv/slurm.py: a test cluster; everything lives under {d}.
ClusterName=trainbox
# Job ids from {FIRST_JOB_ID}: a job-id port of the old `20000 + id % 20000` kind would be ephemeral (>= 32768), so
# the job tests see whether the launcher keeps the rendezvous below the kernel's ephemeral range.
FirstJobId={FIRST_JOB_ID}
SlurmctldHost={node}({ctl_addr})
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
SlurmdParameters=config_overrides
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
{extra}""")
    return conf


def _env(conf: str) -> dict:
    return dict(os.environ, SLURM_CONF=conf)


def node_idle(conf: str) -> bool:
    r = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=_env(conf), capture_output=True, text=True)
    return r.returncode == 0 and r.stdout.strip() != "" and all(
        s.strip().rstrip("*") in ("idle", "mix", "alloc") for s in r.stdout.split())


def answers(state: dict, netns_nodes: int = 0) -> bool:
    """The cluster in `state` answers, every node is up, and it has at least `netns_nodes` netns nodes."""
    conf = state.get("conf")
    if not conf or not Path(conf).exists() or not pid_alive(state.get("slurmctld_pid")):
        return False
    if state.get("netns_nodes", 0) < netns_nodes:
        return False
    r = subprocess.run(["scontrol", "ping"], env=_env(conf), capture_output=True, text=True)
    return r.returncode == 0 and "UP" in r.stdout and node_idle(conf)


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise UserError(f"ip {' '.join(args)} failed: {r.stderr.strip()} (the netns nodes need root and iproute2)")
    return r


def _netns_up(n: int, controller: str) -> None:
    """Bridge on this host + one namespace per node (veth on the bridge, lo up, its own /etc/hosts)."""
    _netns_down(n)  # leftovers of a run that died
    _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("addr", "add", f"{NETNS_SUBNET}.1/24", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    nodes = [netns_node(i) for i in range(1, n + 1)]
    hosts = "127.0.0.1 localhost\n" + f"{NETNS_SUBNET}.1 {controller}\n" + "".join(
        f"{x['addr']} {x['name']}\n" for x in nodes)
    for x in nodes:
        _ip("netns", "add", x["ns"])
        _ip("link", "add", x["veth"], "type", "veth", "peer", "name", "eth0", "netns", x["ns"])
        _ip("link", "set", x["veth"], "master", BRIDGE, "up")
        _ip("-n", x["ns"], "addr", "add", f"{x['addr']}/24", "dev", "eth0")
        _ip("-n", x["ns"], "link", "set", "eth0", "up")
        _ip("-n", x["ns"], "link", "set", "lo", "up")
        etc = Path("/etc/netns") / x["ns"]
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(hosts)


def _netns_down(n: int) -> None:
    for x in map(netns_node, range(1, n + 1)):
        _ip("netns", "del", x["ns"], check=False)  # its veth goes with it
        shutil.rmtree(Path("/etc/netns") / x["ns"], ignore_errors=True)
    _ip("link", "del", BRIDGE, check=False)


# The nice value of the test nodes' slurmd, which their job steps inherit (Slurm's PropagatePrioProcess=0, the
# default). A real node runs its job alone; this host also runs the test suite's other worker and image builds, which
# starved a 2-node Ray job's raylet past Ray's fixed 30 s registration wait (CI, 2 cores). Favoured, the job's
# processes get the CPU they would have on a node of their own.
NODE_NICE = -10


def _favoured() -> None:
    try:
        os.nice(NODE_NICE)
    except OSError:  # no CAP_SYS_NICE: the node runs at the caller's priority
        pass


def _start_daemon(argv: list[str], env: dict, pid_file: Path, log: Path, what: str, favoured: bool = False) -> int:
    # The daemons fork into the background and write their pid files.
    r = subprocess.run(argv, env=env, capture_output=True, text=True, preexec_fn=_favoured if favoured else None)
    if r.returncode != 0:
        raise UserError(f"{what} did not start (exit {r.returncode}): {r.stderr.strip()} -- see {log}")
    wait(lambda: _read_pid(pid_file) is not None, f"{what} pid file", 30, log_file=log)
    return _read_pid(pid_file)


def up(cpus: int | None = None, netns_nodes: int = 0) -> dict:
    """Start (or reuse) the cluster; returns {"conf": SLURM_CONF path, "node": name, "dir": temp dir,
    "netns_nodes": [names]}. A running cluster with fewer netns nodes than asked is restarted."""
    state = load_state()
    if answers(state, netns_nodes):
        return _info(state)
    if state.get("dir"):  # a stale, half-started or smaller cluster: stop what is left of it first
        down()
        state = load_state()
    missing = sorted({pkg for cmd, pkg in APT.items() if not which(cmd)} | (
        {"munge"} if not which("munge") else set()) | ({"iproute2"} if netns_nodes and not which("ip") else set()))
    apt_install(missing, _log, then="run `make slurm` again")
    if os.geteuid() != 0:
        raise UserError("the test Slurm runs its daemons as root (SlurmUser=root); run as root")
    _ensure_munge(state)
    d = Path(tempfile.mkdtemp(prefix="trainbox-slurm-"))
    node = socket.gethostname().split(".")[0]
    cpus = cpus or os.cpu_count() or 1
    conf = write_conf(d, node, cpus, netns_nodes)
    state.update(dir=str(d), conf=str(conf), node=node, netns_nodes=netns_nodes)
    STATE.save(state)
    if netns_nodes:
        _netns_up(netns_nodes, node)
    env = _env(str(conf))
    slurmctld, slurmd = which("slurmctld"), which("slurmd")
    # slurmctld -c: clear old state. slurmd -N: our NodeName even if the host name resolves differently.
    state["slurmctld_pid"] = _start_daemon([slurmctld, "-f", str(conf), "-c"], env, d / "run" / "slurmctld.pid",
                                           d / "log" / "slurmctld.log", "slurmctld")
    STATE.save(state)
    (d / "spool" / node).mkdir(parents=True, exist_ok=True)
    state["slurmd_pid"] = _start_daemon([slurmd, "-f", str(conf), "-N", node], env, d / "run" / f"slurmd-{node}.pid",
                                        d / "log" / f"slurmd-{node}.log", "slurmd", favoured=True)
    STATE.save(state)
    state["netns_slurmd_pids"] = {}
    for x in map(netns_node, range(1, netns_nodes + 1)):
        # Own network namespace, hostname (UTS) and /etc/hosts (a private mount namespace; not `ip netns exec`,
        # which also remounts /sys without the cgroup tree slurmd needs).
        (d / "spool" / x["name"]).mkdir(parents=True, exist_ok=True)
        argv = ["nsenter", f"--net=/run/netns/{x['ns']}", "unshare", "--uts", "--mount", "sh", "-c",
                'mount --bind "$1" /etc/hosts && hostname "$0" && exec "$2" -f "$3" -N "$0"',
                x["name"], f"/etc/netns/{x['ns']}/hosts", slurmd, str(conf)]
        state["netns_slurmd_pids"][x["name"]] = _start_daemon(
            argv, env, d / "run" / f"slurmd-{x['name']}.pid", d / "log" / f"slurmd-{x['name']}.log",
            f"slurmd {x['name']} (netns {x['ns']})", favoured=True)
        STATE.save(state)
    wait(lambda: node_idle(str(conf)), "every node idle in sinfo", 60, log_file=d / "log" / f"slurmd-{node}.log")
    _log(f"up: export SLURM_CONF={conf}")
    return _info(state)


def _info(state: dict) -> dict:
    names = [netns_node(i)["name"] for i in range(1, state.get("netns_nodes", 0) + 1)]
    return {"conf": state["conf"], "node": state["node"], "dir": state["dir"], "netns_nodes": names,
            "netns_partition": NETNS_PARTITION if names else None}


def down() -> None:
    """Stop what up() started (slurmds, slurmctld, munged if we started it), remove the namespaces and the temp dir."""
    state = load_state()
    for name, pid in (state.get("netns_slurmd_pids") or {}).items():
        stop_pid(pid, _log, f"slurmd {name}")
    stop_pid(state.get("slurmd_pid"), _log, "slurmd")
    stop_pid(state.get("slurmctld_pid"), _log, "slurmctld")
    stop_pid(state.get("munged_pid"), _log, "munged")
    if state.get("netns_nodes"):
        _netns_down(state["netns_nodes"])
    if state.get("dir", "").startswith(tempfile.gettempdir()):
        shutil.rmtree(state["dir"], ignore_errors=True)
    STATE.clear()


def status() -> dict:
    state = load_state()
    return {"up": answers(state), **state}


@reports_user_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m devenv.slurm", description=__doc__.split("\n")[0])
    p.add_argument("action", choices=["up", "down", "status"])
    p.add_argument("--cpus", type=int, default=None, help="CPUs of each node (default: this machine's)")
    p.add_argument("--netns-nodes", type=int, default=0,
                   help=f"also start N nodes in their own network namespaces (partition {NETNS_PARTITION})")
    a = p.parse_args(argv)
    if a.netns_nodes < 0:
        raise UserError(f"--netns-nodes must be 0 or more, got {a.netns_nodes}")
    if a.action == "up":
        info = up(a.cpus, a.netns_nodes)
        print(f"export SLURM_CONF={info['conf']}")
    elif a.action == "down":
        down()
    else:
        print(json.dumps(status(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
