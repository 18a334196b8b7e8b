"""The master-weight optimizer step alone (trainbox/training/kernels/precision.py): the one-pass kernel (masterstep.py) against
the op-by-op path (the bf16 gradient cast to float32, clipping's multiply, torch's fused AdamW, the copy into the bf16
weights), on every parameter of a train_throughput shape.

    python benchmarks/master_step.py                        # gpt-oss-2b's 1.9 B parameters
    python benchmarks/master_step.py --shape llama-1b --reps 20

One process, one GPU (about 3 x the shape's parameters x 18 bytes of memory). Right first, on small odd-sized
tensors in two groups (weight decay and none) with bf16, fp16 and float32 weights, max_grad_norm clipping, a changing
LR and 2 micro-batches on every other step: the weights and masters after 6 steps against torch's fused AdamW on
float32 copies fed the same gradients (float32 of the bf16 ones, clipped by torch's clip_grad_norm_); exit 1 when a
master differs by more than 1e-6 relative or a weight is not its master rounded. Then fast: each path's
clip + step on the shape's parameters (their shapes from the config, random bf16 gradients), --reps timed steps
alternating the paths after 2 warm-up steps each (CUDA events), and the bytes a step moves per parameter.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train_throughput as tt  # noqa: E402


@contextlib.contextmanager
def op_by_op():
    """precision.py's op-by-op path (the one-pass kernel declared unusable)."""
    from trainbox.training.kernels import masterstep

    real = masterstep.usable
    masterstep.usable = lambda inner: False
    try:
        yield
    finally:
        masterstep.usable = real


def check(device: str) -> float:
    """The largest relative difference of a master from torch's fused AdamW on float32 copies (see the docstring)."""
    import torch

    from trainbox.training.kernels.precision import MasterWeights

    torch.manual_seed(0)
    sizes = [(1,), (1023,), (1025,), (3, 700), (4096,), (17, 129)]
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    ours = [torch.nn.Parameter((torch.randn(s) * 0.1).to(dtypes[i % 3]).to(device)) for i, s in enumerate(sizes)]
    ref = [torch.nn.Parameter(p.detach().float().clone()) for p in ours]

    def groups(ps):
        return [{"params": ps[::2], "weight_decay": 0.1}, {"params": ps[1::2], "weight_decay": 0.0}]

    opt = MasterWeights(groups(ours), inner=torch.optim.AdamW, lr=1e-3, fused=True)
    opt_ref = torch.optim.AdamW(groups(ref), lr=1e-3, fused=True)
    for step in range(6):
        for group in opt.param_groups + opt_ref.param_groups:
            group["lr"] = 1e-3 * (1 + step) / 6
        micro = 2 if step % 2 else 1
        sums = [torch.zeros_like(r) for r in ref]
        for _ in range(micro):
            for p, r, s in zip(ours, ref, sums):
                g = (torch.randn(p.shape, device=device) * (10 if step == 3 else 0.1)).to(p.dtype)
                p.grad = g  # taken as a hook would: first kept as it is, then summed in float32
                opt._take(_master(opt, p), p)
                s.add_(g.float())
        for r, s in zip(ref, sums):
            r.grad = s
        opt.clip_master_grads(1.0)
        torch.nn.utils.clip_grad_norm_(ref, 1.0)
        opt.step()
        opt_ref.step()
    worst = 0.0
    for p, r in zip(ours, ref):
        m = _master(opt, p)
        worst = max(worst, ((m - r.detach()).abs().max() / r.detach().abs().max()).item())
        if not torch.equal(p.detach(), m.to(p.dtype)):
            print(f"  a weight ({p.dtype}, {tuple(p.shape)}) is not its master rounded", flush=True)
            worst = float("inf")
    return worst


def _master(opt, p):
    for q, m in opt._pairs():
        if q is p:
            return m
    raise KeyError("not a parameter of this optimizer")


def shape_params(shape: str) -> list[tuple[int, ...]]:
    """The shape of every parameter of a train_throughput shape, from its config on the meta device."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    conf = getattr(transformers, tt.CONFIG_CLASS.get(shape, "LlamaConfig"))(**tt.SHAPES[shape])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(conf)
    return [tuple(p.shape) for p in model.parameters()]


def timed(opt, params, grads, reps: int, events: list) -> None:
    import torch

    for _ in range(reps):
        for p, g in zip(params, grads):
            p.grad = g
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        opt.clip_master_grads(1.0)
        opt.step()
        end.record()
        events.append((start, end))


def main(argv: list[str] | None = None) -> int:
    import torch

    from trainbox.training.kernels.precision import MasterWeights

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="gpt-oss-2b", choices=sorted(tt.SHAPES))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--block", type=int, nargs=2, metavar=("ELEMENTS", "WARPS"),
                    help="the kernel's tile: elements a program updates and its warps (masterstep.BLOCK, WARPS)")
    ap.add_argument("--device", default="cuda", help="cuda; cpu runs only the check, through the op-by-op path")
    opts = ap.parse_args(argv)
    if opts.block:
        from trainbox.training.kernels import masterstep

        masterstep.BLOCK, masterstep.WARPS = opts.block

    worst = check(opts.device)
    ok = worst <= 1e-6
    verdict = "OK" if ok else "MISMATCH"
    print(f"check: max relative master diff vs torch's fused AdamW on float32 {worst:.2e} ({verdict})", flush=True)
    if opts.device != "cuda":
        return 0 if ok else 1

    shapes = shape_params(opts.shape)
    n = sum(torch.Size(s).numel() for s in shapes)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02) for s in shapes]
    grads = [torch.randn(s, device="cuda", dtype=torch.bfloat16) * 1e-3 for s in shapes]
    def groups(ps):  # the Trainer's groups: no decay on biases and norms
        return [{"params": [p for p in ps if p.ndim > 1], "weight_decay": 0.01},
                {"params": [p for p in ps if p.ndim <= 1], "weight_decay": 0.0}]

    opt = MasterWeights(groups(params), inner=torch.optim.AdamW, lr=1e-5, fused=True)
    # the memory plan's bf16-moment rung: the same kernel writing both moments in bf16 with stochastic rounding
    params16 = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt16 = MasterWeights(groups(params16), inner=torch.optim.AdamW, lr=1e-5, fused=True, moments=torch.bfloat16)
    runs = {"one-pass": [], "op-by-op": [], "bf16-moments": []}
    for rnd in range(2):
        for label in (["one-pass", "op-by-op", "bf16-moments"] if rnd == 0 else ["bf16-moments", "op-by-op",
                                                                               "one-pass"]):
            o, ps = (opt16, params16) if label == "bf16-moments" else (opt, params)
            with op_by_op() if label == "op-by-op" else contextlib.nullcontext():
                timed(o, ps, grads, 2, [])
                timed(o, ps, grads, opts.reps // 2, runs[label])
    torch.cuda.synchronize()
    ms = {k: statistics.median(s.elapsed_time(e) for s, e in v) for k, v in runs.items()}
    from trainbox.training.kernels import masterstep

    print(f"{opts.shape}: {n / 1e9:.2f} B parameters in {len(shapes)} tensors, bf16 weights, float32 masters; "
          f"tile {masterstep.BLOCK} elements, {masterstep.WARPS} warps")
    for label, bytes_per in (("op-by-op", 2 + 6 + 8 + 28 + 6), ("one-pass", 2 + 28), ("bf16-moments", 2 + 20)):
        print(f"  {label:<12} {ms[label]:7.2f} ms clip + step (median of {len(runs[label])})  "
              f"{bytes_per} bytes/parameter -> {bytes_per * n / ms[label] / 1e6:6.0f} GB/s", flush=True)
    print(f"SUMMARY master_step {opts.shape}: one-pass {ms['one-pass']:.2f} ms vs op-by-op {ms['op-by-op']:.2f} ms "
          f"= {ms['op-by-op'] / ms['one-pass']:.2f}x; with bf16 moments {ms['bf16-moments']:.2f} ms", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
