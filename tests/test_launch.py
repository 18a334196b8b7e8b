"""launch: Slurm host lists, the launch plan from Slurm env or flags, the torchrun command line."""

import shutil
import subprocess
from types import SimpleNamespace

import pytest

from entrypoints import launch
from entrypoints.errors import UsageError


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


def test_several_gpus_on_one_host_start_torchrun():
    p = launch.plan(flags(), {"TEST_GPUS": "4"})
    assert (p.mode, p.nnodes, p.nproc_per_node, p.master_addr) == ("torchrun", 1, 4, "127.0.0.1")


def test_slurm_one_task_per_node():
    env = {**SRUN, "SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_NODEID": "1", "TEST_GPUS": "8"}
    p = launch.plan(flags(), env)
    assert p.mode == "torchrun"
    assert (p.nnodes, p.nproc_per_node, p.node_rank, p.master_addr) == (2, 8, 1, "gpu03")
    assert p.rdzv_id == "4242" and p.master_port == 20000 + 4242
    cmd = launch.torchrun_command(p, "entrypoints.sft", ["--max_steps", "3"])
    joined = " ".join(cmd)
    assert "-m torch.distributed.run --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d" in joined
    assert "--rdzv-endpoint gpu03:24242 --rdzv-id 4242" in joined
    assert joined.endswith("-m entrypoints.sft --max_steps 3")
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
                     "MASTER_ADDR": "cpu1", "MASTER_PORT": "24242"}  # fmt: skip


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


def test_flags_one_node_gets_a_free_port():
    p = launch.plan(flags(nproc_per_node=2), {})
    assert p.mode == "torchrun" and p.master_port != launch.DEFAULT_PORT and p.master_port > 0


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
