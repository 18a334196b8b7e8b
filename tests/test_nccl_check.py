"""`trainbox nccl-check`: the real dispatcher and launcher with 2 gloo processes on CPU (one node, and two "nodes" on
one host through --nnodes/--master-addr), bad options (one `error:` line, exit 2), bandwidth arithmetic (NCCL-tests'
definitions), the transport line from NCCL's log, and a Slurm job rendered for it."""

from __future__ import annotations

import ast
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_fabric import LOG_IB, LOG_NO_DEVICE, LOG_NO_VERBS
from trainbox.cli import nccl_check

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--min-bytes", "4K", "--max-bytes", "32K", "--iters", "2", "--warmup", "1"]


def trainbox(args, timeout=120, **kw):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("NCCL_DEBUG", None)
    return subprocess.Popen([sys.executable, "-m", "trainbox", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def finish(p, timeout=120):
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


ROW = re.compile(r"^(all_reduce|all_gather)\s+(\d+) KiB\s+([\d.]+) (us|ms|s)\s+([\d.]+)\s+([\d.]+)$", re.M)


def check_table(out: str, n: int):
    rows = ROW.findall(out)
    assert [(op, int(kib)) for op, kib, *_ in rows] == [(op, k) for op in ("all_reduce", "all_gather")
                                                         for k in (4, 8, 16, 32)], out
    for op, kib, t, unit, alg, bus in rows:
        secs = float(t) * {"us": 1e-6, "ms": 1e-3, "s": 1}[unit]
        assert float(alg) == pytest.approx(int(kib) * 1024 / secs / 1e9, abs=0.011, rel=0.05)
        factor = 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n
        assert float(bus) == pytest.approx(float(alg) * factor, abs=0.011)
    assert "data check: ok" in out
    last = out.strip().splitlines()[-1]
    assert re.fullmatch(rf"nccl-check: {n} ranks, all_reduce busbw [\d.]+ GB/s at 32 KiB, transport gloo/TCP", last)


def test_two_gloo_ranks_on_one_node_through_the_dispatcher():
    code, out, err = finish(trainbox(["nccl-check", "--nproc-per-node", "2", *SMALL]))
    assert code == 0, err[-3000:]
    assert "nccl-check: 2 ranks on 1 node(s)" in out and "backend gloo" in out
    assert "transport: gloo over TCP" in out and "links should give: within a node" in out
    check_table(out, 2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_by_flags_on_one_host():
    """--nnodes 2 --master-addr: two launchers (node ranks 0 and 1), one rank each, meet at a c10d store."""
    port = str(free_port())
    flags = ["--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port]
    procs = [trainbox(["nccl-check", *flags, "--node-rank", str(r), *SMALL, "--ops", "all_reduce"]) for r in (0, 1)]
    (c0, out0, err0), (c1, out1, err1) = finish(procs[0]), finish(procs[1])
    assert c0 == 0 and c1 == 0, (err0[-2000:], err1[-2000:])
    # Global rank 0 reports. c10d's rendezvous hands out global ranks in arrival order, not by --node-rank, so it
    # is either launcher's: exactly one of them prints the table and the summary.
    reports = [out for out in (out0, out1) if "busbw" in out]
    assert len(reports) == 1, (out0[-2000:], out1[-2000:])
    assert reports[0].strip().splitlines()[-1].startswith("nccl-check: 2 ranks, all_reduce busbw")


@pytest.mark.parametrize("args,msg", [
    (["--iters", "0"], "--iters: must be at least 1"),
    (["--min-bytes", "banana"], "is not a size"),
    (["--ops", "broadcast"], "--ops 'broadcast': choose from all_reduce, all_gather"),
    (["--min-bytes", "2M", "--max-bytes", "1M"], "is larger than --max-bytes"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--nnodes", "2"], "needs --master-addr"),
])
def test_bad_options_are_one_error_line_and_exit_2(args, msg):
    code, out, err = finish(trainbox(["nccl-check", *args]), timeout=60)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainbox nccl-check: error: ") and msg in lines[0], err


def test_help_and_the_dispatcher_contract():
    code, out, err = finish(trainbox(["nccl-check", "--help"]), timeout=60)
    assert code == 0 and "--min-bytes" in out and "busbw" in out
    tree = ast.parse((ROOT / "trainbox/cli/nccl_check.py").read_text())
    assert [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    code, out, err = finish(trainbox(["--help"]), timeout=60)
    assert re.search(r"^  nccl-check +All-reduce and all-gather", out, re.M), out


def test_sizes_and_bandwidth_definitions():
    assert nccl_check.parse_size("1M") == 1 << 20 and nccl_check.parse_size("1GiB") == 1 << 30
    assert nccl_check.parse_size("4096") == 4096 and nccl_check.parse_size("1.5K") == 1536
    assert nccl_check.sizes(1 << 20, 1 << 30) == [1 << k for k in range(20, 31)]  # 1 MiB .. 1 GiB, 11 sizes
    assert nccl_check.busbw_factor("all_reduce", 8) == pytest.approx(1.75)
    assert nccl_check.busbw_factor("all_gather", 8) == pytest.approx(0.875)
    assert nccl_check.busbw_factor("all_reduce", 1) == 0.0


def test_transport_line_from_nccl_logs():
    from trainbox.image import fabric

    logs = lambda text, hosts: [{"host": h, "log": fabric.parse_nccl_log(text)} for h in hosts]  # noqa: E731
    short, text, warn = nccl_check.transport_line("nccl", 2, logs(LOG_IB, ["a", "a", "b", "b"]))
    assert short == "IB" and "inter-node IB" in text and "P2P/CUMEM/read" in text and warn is None
    short, text, warn = nccl_check.transport_line("nccl", 2, logs(LOG_NO_VERBS, ["a", "b"]))
    assert short == "Socket" and warn.startswith("WARNING: inter-node traffic went over TCP sockets on a, b")
    assert "lacks RDMA userspace" in warn
    short, text, warn = nccl_check.transport_line("nccl", 1, logs(LOG_NO_DEVICE, ["a"]))
    assert "one node" in short and "MELLANOX_VISIBLE_DEVICES=all" in warn
    assert nccl_check.transport_line("gloo", 2, [])[0] == "gloo/TCP"
    out = nccl_check.report([("all_reduce", 1 << 30, 0.01)], 16, ["a", "b"], 8, "nccl", "2.27.5",
                            logs(LOG_IB, ["a", "b"]), True, True)
    # 1 GiB in 10 ms: algbw 107.37 GB/s, busbw x 2*15/16
    assert "107.37      201.33" in out
    assert out.splitlines()[-1] == "nccl-check: 16 ranks, all_reduce busbw 201.33 GB/s at 1 GiB, transport IB"


def test_a_slurm_job_for_nccl_check(tmp_path):
    # the README's command (without sbatch), then extra options after --
    r = subprocess.run([sys.executable, "-m", "builder.slurm", "--tag", "cu129-hopper-x86_64", "--entrypoint",
                        "nccl-check", "--sqsh", "/shared/cu129-hopper-x86_64.sqsh", "--nodes", "2", "--gpus-per-node",
                        "8", "--partition", "gpu", "--time", "00:15:00", "-o", "nccl.sh"],
                       cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    job = (tmp_path / "nccl.sh").read_text()
    assert "ARGS=(nccl-check)" in job and "#SBATCH --nodes=2" in job and "--config" not in job
    r = subprocess.run([sys.executable, "-m", "builder.slurm", "--tag", "cu129-hopper-x86_64", "--entrypoint",
                        "nccl-check", "--sqsh", "/shared/cu129-hopper-x86_64.sqsh", "--nodes", "2",
                        "--gpus-per-node", "8", "--time", "00:15:00", "--", "--max-bytes", "256M"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "nccl-check" in r.stdout and "--max-bytes" in r.stdout
    assert "--config" not in r.stdout
    r = subprocess.run([sys.executable, "-m", "builder.slurm", "--tag", "t", "--entrypoint", "sft", "--sqsh",
                        "/s/t.sqsh"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no --config given" in r.stderr  # sft still needs its YAML
