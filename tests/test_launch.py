"""launch: Slurm host lists, the launch plan from Slurm env or flags, the torchrun command line."""

import shutil
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest
from hypothesis import given, strategies as st

from common import launch
from common.errors import UsageError


def flags(**kw):
    return SimpleNamespace(**{f: kw.get(f) for f in launch.LAUNCH_FIELDS})


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch):
    # Plans must not depend on the test machine's GPUs; GPU counts are passed through the env.
    monkeypatch.setattr(launch, "local_procs", lambda env: int(env.get("TEST_GPUS", "1")))
    monkeypatch.setattr(shutil, "which", lambda name: None)  # our own host-list parser, not scontrol


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("gpu-a[1-2],gpu-b7", ["gpu-a1", "gpu-a2", "gpu-b7"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("a,b[009-011],c", ["a", "b009", "b010", "b011", "c"]),
    ],
)
def test_expand_hostlist(nodelist, hosts):
    assert launch.expand_hostlist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[01-03", "node01]", "node[a-b]"])
def test_bad_hostlist(bad):
    with pytest.raises(UsageError, match="SLURM_JOB_NODELIST"):
        launch.expand_hostlist(bad)


def test_scontrol_is_preferred(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/scontrol")
    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        return SimpleNamespace(stdout="hostA\nhostB\n")

    monkeypatch.setattr(subprocess, "run", fake_run)
    assert launch.slurm_hosts({"SLURM_JOB_NODELIST": "whatever[1-2]"}) == ["hostA", "hostB"]
    assert seen == [["scontrol", "show", "hostnames", "whatever[1-2]"]]


SRUN = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "gpu[03-04]"}


def test_under_torchrun_trains_here():
    p = launch.plan(flags(nnodes=2), {"TORCHELASTIC_RUN_ID": "x", **SRUN})
    assert p.mode == "train" and p.env == {}


def test_single_process_default():
    assert launch.plan(flags(), {}).mode == "train"


def test_several_gpus_on_one_host_start_torchrun_standalone():
    p = launch.plan(flags(), {"TEST_GPUS": "4"})
    assert (p.mode, p.nnodes, p.nproc_per_node, p.standalone) == ("torchrun", 1, 4, True)
    cmd = " ".join(launch.torchrun_command(p, "trainbox.cli.sft", []))
    # torchrun binds its store on port 0 and keeps it: no port of ours, no probe that a second run could race.
    assert "--nnodes 1 --nproc-per-node 4 --standalone" in cmd and "--rdzv-endpoint" not in cmd


def test_slurm_one_task_per_node():
    env = {**SRUN, "SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_NODEID": "1", "TEST_GPUS": "8"}
    p = launch.plan(flags(), env)
    assert p.mode == "torchrun"
    assert (p.nnodes, p.nproc_per_node, p.node_rank, p.master_addr) == (2, 8, 1, "gpu03")
    assert p.rdzv_id == "4242" and p.master_port == 10000 + 4242 and p.is_host is False
    cmd = launch.torchrun_command(p, "trainbox.cli.sft", ["--max_steps", "3"])
    joined = " ".join(cmd)
    assert "-m torch.distributed.run --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d" in joined
    # Node 1 never hosts the store; node 0 always does (a taken port is an error there, not another job's store).
    assert "--rdzv-endpoint gpu03:14242 --rdzv-id 4242 --rdzv-conf is_host=false" in joined
    p0 = launch.plan(flags(), {**env, "SLURM_NODEID": "0"})
    assert "--rdzv-conf is_host=true" in " ".join(launch.torchrun_command(p0, "trainbox.cli.sft", []))
    assert joined.endswith("-m trainbox.cli.sft --max_steps 3")
    assert "--signals-to-handle SIGINT,SIGHUP,SIGQUIT" in joined  # not SIGTERM: ranks checkpoint, torchrun waits


def test_slurm_gpus_on_node_fallback(monkeypatch):
    monkeypatch.undo()  # the real local_procs, with torch seeing no GPU on this machine
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    assert launch.local_procs({"SLURM_GPUS_ON_NODE": "4"}) == 4
    assert launch.local_procs({}) == 1


def test_slurm_several_tasks_per_node_each_task_is_a_rank():
    env = {**SRUN, "SLURM_JOB_NODELIST": "cpu1", "SLURM_NNODES": "1", "SLURM_NTASKS": "2",
           "SLURM_PROCID": "1", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2"}  # fmt: skip
    p = launch.plan(flags(), env)
    assert p.mode == "train"
    assert p.env == {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                     "MASTER_ADDR": "cpu1", "MASTER_PORT": "14242"}  # fmt: skip


def test_batch_script_without_srun_is_not_a_launch():
    env = {"SLURM_JOB_ID": "1", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]"}
    assert launch.plan(flags(), env).mode == "train"


def test_explicit_flags_two_nodes():
    p = launch.plan(flags(nnodes=2, nproc_per_node=1, master_addr="127.0.0.1", master_port=29611, node_rank=1), {})
    assert (p.mode, p.nnodes, p.nproc_per_node, p.node_rank, p.master_port) == ("torchrun", 2, 1, 1, 29611)
    assert p.rdzv_id == "trainbox-127.0.0.1-29611"


def test_flags_override_slurm():
    env = {**SRUN, "SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_NODEID": "0"}
    p = launch.plan(flags(nproc_per_node=2), env)
    assert (p.nnodes, p.nproc_per_node, p.master_addr, p.rdzv_id) == (2, 2, "gpu03", "4242")


def test_flags_one_node_is_standalone_unless_an_endpoint_is_given():
    p = launch.plan(flags(nproc_per_node=2), {})
    assert (p.mode, p.standalone) == ("torchrun", True)
    p = launch.plan(flags(nproc_per_node=2, master_port=29611), {})
    assert not p.standalone and p.is_host is None
    assert "--rdzv-endpoint 127.0.0.1:29611" in " ".join(launch.torchrun_command(p, "m", []))


# ------------------------------------------------------------------ rendezvous ports under Slurm

def _port(job, eph=(32768, 60999), **extra):
    return launch.slurm_port({"SLURM_JOB_ID": str(job), **extra}, eph)


def test_job_ids_20000_apart_get_different_ports():
    assert _port(4242) != _port(24242) != _port(44242)  # the old 20000 + id % 20000 gave all three 24242


@given(st.integers(min_value=0, max_value=2**32), st.integers(min_value=12000, max_value=61000))
def test_job_ports_stay_below_the_ephemeral_range_and_off_torchs_defaults(job, eph_start):
    port = _port(job, (eph_start, 65000))
    assert launch.PORT_WINDOW_START <= port < eph_start and port not in launch.TORCH_DEFAULT_PORTS


def test_consecutive_jobs_sharing_a_node_never_collide():
    window = 32768 - launch.PORT_WINDOW_START - len(launch.TORCH_DEFAULT_PORTS)
    start = 10**6 - 5000
    ports = [_port(j) for j in range(start, start + window)]
    assert len(set(ports)) == window


def test_slurm_reserved_ports_win():
    assert _port(4242, SLURM_STEP_RESV_PORTS="12000-12003") == 12000
    assert _port(4242, SLURM_STEP_RESV_PORTS="13001") == 13001
    with pytest.raises(UsageError, match="SLURM_STEP_RESV_PORTS"):
        _port(4242, SLURM_STEP_RESV_PORTS="junk")


def test_no_room_below_the_ephemeral_range_says_what_to_do():
    with pytest.raises(UsageError, match="--master-port"):
        _port(1, (10500, 60999))


def test_the_kernels_ephemeral_range_is_read(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t60999\n")
    assert launch.ephemeral_range(str(f)) == (40000, 60999)
    lo, hi = launch.ephemeral_range()  # this machine's own
    assert 1024 <= lo <= hi <= 65535


# ------------------------------------------------------------------ torchrun's options, process trees

def test_torchrun_options_come_from_its_own_parser():
    assert launch.torchrun_has_option("--standalone") and launch.torchrun_has_option("--rdzv-conf")
    assert not launch.torchrun_has_option("--no-such-option")


def test_ranks_are_found_among_descendants_by_module():
    """A real tree: launcher -> sh -> python -m fake.rank (+ a helper that must not get signals)."""
    code = "import time; time.sleep(30)"
    p = subprocess.Popen(["sh", "-c", f'{sys.executable} -c "{code}" -m fake.rank & '
                                      f'{sys.executable} -c "{code}" helper & wait'])
    try:
        deadline = time.monotonic() + 10
        while len(launch.descendants(p.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        kids = launch.descendants(p.pid)
        assert len(kids) == 2
        (rank,) = launch._ranks(p.pid, "fake.rank")
        assert "fake.rank" in psutil.Process(rank).cmdline()
    finally:
        for pid in launch.descendants(p.pid):
            psutil.Process(pid).kill()
        p.wait(timeout=10)
    assert launch.descendants(p.pid) == []


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"nnodes": 2}, "needs --master-addr"),
        ({"nnodes": 2, "master_addr": "h", "node_rank": 2}, "outside 0..1"),
        ({"nproc_per_node": 0}, "at least 1"),
    ],
)
def test_bad_flags(kw, needle):
    with pytest.raises(UsageError, match=needle):
        launch.plan(flags(**kw), {})


def test_other_launcher_env_trains_here():
    assert launch.plan(flags(), {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}).mode == "train"
