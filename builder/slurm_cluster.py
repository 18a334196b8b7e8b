"""A real one-node Slurm (Debian slurm-wlm + munge) on this machine, for the job-script tests.

`python -m builder.slurm_cluster up|down|status`. `up` installs slurm-wlm and munge with apt when they are missing
(root on Debian/Ubuntu only), starts munged if no munged answers, writes a minimal slurm.conf into a fresh temp dir
(state, spool, logs, pids there too; ports picked free so a system Slurm is never disturbed), starts slurmctld and
slurmd, and waits until the node is idle. It prints the SLURM_CONF to export. Idempotent: a cluster started earlier
that still answers is reused. `down` stops exactly the processes `up` started (by pid, from the state file) and
removes the temp dir.
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
import time
from pathlib import Path

from builder.errors import UserError, reports_user_errors
from builder.procs import pid_alive, stop_pid

MUNGE_SOCKET = Path("/run/munge/munge.socket.2")
MUNGE_KEY = Path("/etc/munge/munge.key")
APT = {"slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "sbatch": "slurm-client", "munged": "munge"}


def _log(msg: str) -> None:
    print(f"[slurm] {msg}", file=sys.stderr, flush=True)


def _state_path() -> Path:
    base = Path(os.environ.get("TRAINBOX_CACHE") or Path.home() / ".cache" / "trainbox") / "slurm"
    base.mkdir(parents=True, exist_ok=True)
    return base / "state.json"


def load_state() -> dict:
    try:
        return json.loads(_state_path().read_text())
    except (OSError, ValueError):
        return {}


def _save_state(state: dict) -> None:
    p = _state_path()
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(p)


def _which(cmd: str) -> str | None:
    return shutil.which(cmd) or next((f"{d}/{cmd}" for d in ("/usr/sbin", "/sbin") if Path(d, cmd).exists()), None)


def _apt_install(packages: list[str]) -> None:
    if not packages:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise UserError(f"missing {' '.join(packages)}; install them (apt-get install -y {' '.join(packages)}) "
                        "as root, then run again")
    _log(f"apt-get install -y {' '.join(packages)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for argv in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "--no-install-recommends",
                                                *packages]):
        r = subprocess.run(argv, env=env, capture_output=True, text=True)
        if r.returncode != 0:
            raise UserError(f"{' '.join(argv)} failed: {r.stderr.strip()[-1500:]}")


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
    munged = _which("munged")
    r = subprocess.run(["runuser", "-u", "munge", "--", munged], capture_output=True, text=True)
    if r.returncode != 0:
        raise UserError(f"munged did not start: {r.stderr.strip()}")
    _wait(munge_answers, "munged", 20)
    pid_file = Path("/run/munge/munged.pid")
    state["munged_pid"] = int(pid_file.read_text().strip()) if pid_file.exists() else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(pred, what: str, timeout: float, log: Path | None = None) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.3)
    tail = ""
    if log and log.exists():
        tail = "; last log lines:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:])
    raise UserError(f"{what} did not come up within {timeout:.0f} s{tail}")


def write_conf(d: Path, node: str, cpus: int) -> Path:
    for sub in ("state", "spool", "log", "run"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    conf = d / "slurm.conf"
    conf.write_text(f"""\
# Written by builder/slurm_cluster.py: a one-node test cluster; everything lives under {d}.
ClusterName=trainbox
SlurmctldHost={node}(127.0.0.1)
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
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
    return conf


def _env(conf: str) -> dict:
    return dict(os.environ, SLURM_CONF=conf)


def node_idle(conf: str) -> bool:
    r = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=_env(conf), capture_output=True, text=True)
    return r.returncode == 0 and r.stdout.strip() != "" and all(
        s.strip().rstrip("*") in ("idle", "mix", "alloc") for s in r.stdout.split())


def answers(state: dict) -> bool:
    conf = state.get("conf")
    if not conf or not Path(conf).exists() or not pid_alive(state.get("slurmctld_pid")):
        return False
    r = subprocess.run(["scontrol", "ping"], env=_env(conf), capture_output=True, text=True)
    return r.returncode == 0 and "UP" in r.stdout and node_idle(conf)


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def up(cpus: int | None = None) -> dict:
    """Start (or reuse) the cluster; returns {"conf": SLURM_CONF path, "node": name, "dir": temp dir}."""
    state = load_state()
    if answers(state):
        return {k: state[k] for k in ("conf", "node", "dir")}
    if state.get("dir"):  # a stale or half-started cluster: stop what is left of it first
        down()
        state = load_state()
    missing = sorted({pkg for cmd, pkg in APT.items() if not _which(cmd)} | (
        {"munge"} if not _which("munge") else set()))
    _apt_install(missing)
    if os.geteuid() != 0:
        raise UserError("the test Slurm runs its daemons as root (SlurmUser=root); run as root")
    _ensure_munge(state)
    d = Path(tempfile.mkdtemp(prefix="trainbox-slurm-"))
    node = socket.gethostname().split(".")[0]
    conf = write_conf(d, node, cpus or os.cpu_count() or 1)
    state.update(dir=str(d), conf=str(conf), node=node)
    _save_state(state)
    env = _env(str(conf))
    for daemon in ("slurmctld", "slurmd"):
        # Both daemonize and write their pid files.
        # slurmctld -c: clear old state; slurmd -N: our NodeName even if the host name resolves differently.
        argv = [_which(daemon), "-f", str(conf)] + (["-c"] if daemon == "slurmctld" else ["-N", node])
        r = subprocess.run(argv, env=env, capture_output=True, text=True)
        log = d / "log" / f"{daemon}.log"
        if r.returncode != 0:
            raise UserError(f"{daemon} did not start (exit {r.returncode}): {r.stderr.strip()} -- see {log}")
        pid_file = d / "run" / f"{daemon}.pid"
        _wait(lambda: _read_pid(pid_file) is not None, f"{daemon} pid file", 30, log)
        state[f"{daemon}_pid"] = _read_pid(pid_file)
        _save_state(state)
    _wait(lambda: node_idle(str(conf)), f"node {node} (idle in sinfo)", 60, d / "log" / "slurmd.log")
    _log(f"up: export SLURM_CONF={conf}")
    return {"conf": str(conf), "node": node, "dir": str(d)}


def down() -> None:
    """Stop what up() started (slurmd, slurmctld, munged if we started it) and remove the temp dir."""
    state = load_state()
    stop_pid(state.get("slurmd_pid"), log=_log, what="slurmd")
    stop_pid(state.get("slurmctld_pid"), log=_log, what="slurmctld")
    stop_pid(state.get("munged_pid"), log=_log, what="munged")
    if state.get("dir", "").startswith(tempfile.gettempdir()):
        shutil.rmtree(state["dir"], ignore_errors=True)
    _state_path().unlink(missing_ok=True)


def status() -> dict:
    state = load_state()
    return {"up": answers(state), **state}


@reports_user_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m builder.slurm_cluster", description=__doc__.split("\n")[0])
    p.add_argument("action", choices=["up", "down", "status"])
    p.add_argument("--cpus", type=int, default=None, help="CPUs of the node (default: this machine's)")
    a = p.parse_args(argv)
    if a.action == "up":
        info = up(a.cpus)
        print(f"export SLURM_CONF={info['conf']}")
    elif a.action == "down":
        down()
    else:
        print(json.dumps(status(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
