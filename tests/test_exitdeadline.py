"""A rank whose training returned leaves within the exit deadline (trainbox/run/exitdeadline.py), even when a thread
holds its exit: every thread's stack is printed and the run's own exit code kept. Real processes through the trainer
skeleton (runner.run_trainer), as torchrun's workers run it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import docsfiles
from trainbox.run import exitdeadline

ROOT = Path(__file__).resolve().parents[1]

# A trainer whose train() leaves a non-daemon thread blocked forever: Python's exit waits for it (threading._shutdown),
# the way a library thread or exit handler held rank 1 of a 2-node job past torchrun's exit barrier.
HELD = textwrap.dedent('''
    import atexit, ctypes, sys, threading
    from common import launch
    from trainbox.run import exitdeadline
    from trainbox.training import runner

    exitdeadline.EXIT_GRACE_S = float(sys.argv[2])
    exitdeadline.BACKSTOP_S = 1.0

    def hold_the_gil():  # libc's sleep through PyDLL keeps the GIL, as a native destructor joining a thread did
        ctypes.PyDLL(None).sleep(60)

    class Options:
        output_dir = None

    def blocked_forever():
        threading.Event().wait()

    def train(options):
        if sys.argv[3] == "held":
            threading.Thread(target=blocked_forever, name="held-by-test").start()
        if sys.argv[3] == "gil":
            atexit.register(hold_the_gil)
        return int(sys.argv[1])

    raise SystemExit(runner.run_trainer("dummy", [], lambda argv: (launch.LaunchArguments(), Options()),
                                        lambda options, plan: None, train))
''')


def _rank(tmp_path: Path, code: int, grace: float, mode: str) -> subprocess.CompletedProcess:
    """Rank 1 of 2 running HELD; a process still there after 120 s fails the test (subprocess's TimeoutExpired)."""
    script = tmp_path / "held.py"
    script.write_text(HELD)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(PYTHONPATH=str(ROOT), RANK="1", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="29999")
    return subprocess.run([sys.executable, str(script), str(code), str(grace), mode], capture_output=True, text=True,
                          env=env, timeout=120)


# The three single-rank runs below, started together on a module-scoped pool: each is a python start-up (most of its
# seconds) plus a wait of a few seconds, so run in a row they cost the sum. Each has its own folder; a test reads
# its own run's result (the subprocess timeout of 120 s still bounds each).
RANK_RUNS = {"held": dict(code=3, grace=2), "gil": dict(code=3, grace=2), "clean": dict(code=0, grace=600)}


@pytest.fixture(scope="module")
def rank_runs(tmp_path_factory):
    pool = ThreadPoolExecutor(max_workers=len(RANK_RUNS))
    runs = {mode: pool.submit(_rank, tmp_path_factory.mktemp(mode), mode=mode, **kw) for mode, kw in RANK_RUNS.items()}
    yield {mode: run.result for mode, run in runs.items()}
    pool.shutdown(wait=True)


def test_a_rank_held_at_exit_leaves_with_its_code_and_the_stacks(rank_runs):
    r = rank_runs["held"]()
    assert r.returncode == 3, r.stderr
    assert "[trainbox] rank 1: training ended 2s ago and this process has not exited" in r.stderr, r.stderr
    assert "leaving with exit code 3" in r.stderr
    # What held it: the blocked thread by name and function, and the main thread waiting for it at exit.
    assert "thread held-by-test:" in r.stderr and "in blocked_forever" in r.stderr, r.stderr
    assert "thread MainThread:" in r.stderr and "_shutdown" in r.stderr, r.stderr


def test_a_rank_whose_gil_is_held_at_exit_still_leaves(rank_runs):
    """The deadline thread cannot run without the GIL; faulthandler's watchdog (a C thread) dumps the stacks and
    exits 1 a little later, instead of the rank hanging for good."""
    r = rank_runs["gil"]()
    assert r.returncode == 1, r.stderr
    assert "has not exited" not in r.stderr, r.stderr  # the Python deadline never got the GIL
    assert "Timeout (0:00:03)!" in r.stderr and "in hold_the_gil" in r.stderr, r.stderr


def test_a_rank_that_exits_cleanly_does_not_wait_for_the_deadline(rank_runs):
    # The deadline thread is a daemon: a clean exit never waits for its 600 s (_rank's 120 s timeout would fail).
    r = rank_runs["clean"]()
    assert r.returncode == 0, r.stderr
    assert "has not exited" not in r.stderr


# Two real gloo ranks meet at the end (runsummary.leave_process_group); rank 1 is then held by a thread.
MEET = textwrap.dedent('''
    import sys, threading
    import torch.distributed as dist
    from trainbox.run import exitdeadline, runsummary

    exitdeadline.EXIT_GRACE_S = 2.0
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
    if rank == 1:
        threading.Thread(target=threading.Event().wait, name="held-by-test").start()
    runsummary.leave_process_group()
    print(f"rank {rank} left the group", flush=True)
''')


def test_a_non_main_rank_is_bounded_from_the_final_meeting_on(tmp_path):
    script = tmp_path / "meet.py"
    script.write_text(MEET)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(ROOT)
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), str(tmp_path / "store")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:  # a rank held for good (the deadline gone) must not outlive the test
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "rank 0 left the group" in outs[0][0] and "has not exited" not in outs[0][1], outs[0]
    # Rank 1 finished its part, then was held: the deadline armed at the meeting ended it with the run's code (0).
    assert "rank 1 left the group" in outs[1][0], outs[1]
    assert "training ended 2s ago and this process has not exited" in outs[1][1], outs[1][1]
    assert "thread held-by-test:" in outs[1][1], outs[1][1]


def test_the_readme_states_the_deadline_the_code_keeps():
    text = " ".join(docsfiles.text().split())
    assert f"has not exited {exitdeadline.EXIT_GRACE_S:.0f} s later" in text
