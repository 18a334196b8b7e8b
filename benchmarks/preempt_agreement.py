"""Figures, not a test: what the preemption agreement costs each optimizer step, across two "nodes" (network
namespaces, gloo over their veth link), blocking all-reduce (before) vs the overlapped one (preemption.FlagAgreement).

    python -m devenv.slurm up --netns-nodes 2      # the namespaces trainbox-slurm-1/2 (root)
    python benchmarks/preempt_agreement.py [--steps 200] [--grad-mb 4] [--jitter-ms 2] [--phase sleep|busy]
        [--json OUT]

One process per namespace (nsenter --net), world 2, gloo on eth0. Each simulated step: a gradient all-reduce on the
default group (what DDP/FSDP does in backward: the ranks leave it together), then a local "optimizer" phase of
random length per rank (0..jitter ms; sleeping or busy), then the agreement call at the step end, timed alone
(perf_counter_ns). The blocking variant is the preemption code before the change (then lifecycle.py's), verbatim: its
time includes waiting for the slowest rank. The overlapped one's is local: enqueueing the next reduction and collecting
the previous one.
Rank 0 sets its flag at step `--signal-at`: the last lines say at which step each variant stopped on each rank.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from devenv import slurm as devslurm  # noqa: E402

PORT = 29650


def blocking_agree(flag: bool, group=None) -> bool:
    """lifecycle._agree (now preemption.py) before the change (one blocking MAX all-reduce at every step end)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def worker(a) -> None:
    import torch
    import torch.distributed as dist

    from trainbox.run import preemption

    rank = a.rank
    dist.init_process_group("gloo", init_method=f"tcp://{a.master}:{PORT}", rank=rank, world_size=2)
    group = dist.new_group(backend="gloo")  # the flag's own group, as preemption.flag_group() gives it
    grad = torch.ones(a.grad_mb * 1024 * 1024 // 4)
    rng = random.Random(1000 + rank)
    out = {}
    for variant in ("blocking", "overlapped"):
        agreement = None if variant == "blocking" else preemption.FlagAgreement(group)
        costs, steps, stopped = [], [], None
        dist.barrier()
        for step in range(1, a.warmup + a.steps + 1):
            t0 = time.perf_counter_ns()
            dist.all_reduce(grad)  # backward's gradient sync
            # The optimizer phase, uneven across ranks: sleeping (a GPU-bound step: the CPU waits on the device) or
            # busy (a CPU-bound one; on a 2-core host the busy ranks then compete with gloo's threads).
            (busy if a.phase == "busy" else time.sleep)(rng.uniform(0, a.jitter_ms) / 1000)
            flag = rank == 0 and step >= a.warmup + a.signal_at
            t1 = time.perf_counter_ns()
            stop = blocking_agree(flag, group) if agreement is None else agreement.step(flag)
            t2 = time.perf_counter_ns()
            if step > a.warmup:
                costs.append((t2 - t1) / 1000)
                steps.append((t2 - t0) / 1000)
            if stop:
                stopped = step - a.warmup
                break
        if agreement is not None:
            agreement.close()
        costs.sort()
        out[variant] = {"steps_timed": len(costs), "stopped_at": stopped, "signal_at": a.signal_at,
                        "mean_us": statistics.fmean(costs), "p50_us": costs[len(costs) // 2],
                        "p99_us": costs[min(len(costs) - 1, int(len(costs) * 0.99))], "max_us": costs[-1],
                        "step_mean_us": statistics.fmean(steps)}
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, **out}), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="timed steps per variant (the flag is raised near the end)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--grad-mb", type=int, default=4, help="gradient all-reduced per step (MiB)")
    p.add_argument("--jitter-ms", type=float, default=2.0, help="per-rank optimizer phase, uniform 0..this")
    p.add_argument("--phase", choices=("sleep", "busy"), default="sleep", help="how the optimizer phase waits")
    p.add_argument("--signal-at", type=int, default=None, help="timed step at which rank 0 is signalled")
    p.add_argument("--json")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--master", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.signal_at is None:
        a.signal_at = a.steps - 5
    if a.rank is not None:
        worker(a)
        return 0
    if devslurm.load_state().get("netns_nodes", 0) < 2:
        print("needs the two network namespaces: python -m devenv.slurm up --netns-nodes 2", file=sys.stderr)
        return 2
    nodes = [devslurm.netns_node(i) for i in (1, 2)]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="eth0", PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen(["nsenter", f"--net=/run/netns/{n['ns']}", sys.executable, __file__, "--rank", str(r),
                               "--master", nodes[0]["addr"], "--steps", str(a.steps), "--warmup", str(a.warmup),
                               "--grad-mb", str(a.grad_mb), "--jitter-ms", str(a.jitter_ms), "--phase", a.phase,
                               "--signal-at", str(a.signal_at)], env=env, stdout=subprocess.PIPE, text=True)
             for r, n in enumerate(nodes)]
    results = [json.loads(pr.communicate(timeout=600)[0].strip().splitlines()[-1]) for pr in procs]
    if any(pr.returncode for pr in procs):
        print("a rank failed", file=sys.stderr)
        return 1
    print(f"{a.steps} steps, gradient {a.grad_mb} MiB all-reduced per step, optimizer phase 0..{a.jitter_ms} ms per "
          f"rank ({a.phase}); agreement call per step (microseconds), two netns nodes over gloo:")
    for variant in ("blocking", "overlapped"):
        for r in results:
            v = r[variant]
            print(f"  {variant:<10} rank {r['rank']}: mean {v['mean_us']:8.1f}  p50 {v['p50_us']:8.1f}  "
                  f"p99 {v['p99_us']:8.1f}  max {v['max_us']:8.1f}   step mean {v['step_mean_us']:8.1f}   "
                  f"signal at step {v['signal_at']}, stopped at {v['stopped_at']}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
