"""SFT's loss head alone: TRL's fused LM head (trl.kernels.ChunkedLogProbFunction, what `trl sft` and trainbox sft ran
before) against trainbox's one-pass head (trainbox/training/kernels/losshead.py), forward + backward of SFT's loss
(-sum of log-probabilities / tokens) on bf16 tensors of a training step's shape.

    python benchmarks/loss_head.py                  # 16,371 tokens (a mix step), hidden 2048, 128k vocab
    python benchmarks/loss_head.py --softcap 30     # Gemma 2's final-logit softcap
    python benchmarks/loss_head.py --tokens 8192 --hidden 4096 --vocab 128256 --reps 10

One process, one GPU. Each head: 3 warm-up calls (the compile), then --reps timed calls alternating with the other
head (CUDA events around forward + backward), the peak memory above what the inputs hold, and the kernels of one
profiled call by time. Right: both heads' log-probabilities and gradients against float32 math on the same bf16
inputs (max abs error, relative to the reference's largest value); exit 1 when ours is over 2x TRL's (+1e-3).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def heads(softcap):
    from trl.kernels import ChunkedLogProbFunction

    from trainbox.training.kernels import losshead

    outputs = losshead.OUTPUTS

    def trl(h, w, t):
        return ChunkedLogProbFunction.apply(h, w, None, t, 1.0, 32768, softcap, 1.0, outputs)

    def ours(h, w, t):
        return losshead.one_pass().apply(h, w, t, 1.0, softcap, 1.0, outputs)

    return {"trl": trl, "ours": ours}


def step(fn, h, w, t):
    """SFT's loss through `fn`, backward; the log-probabilities and the two gradients."""
    h.grad = w.grad = None
    lp, *_ = fn(h, w, t)
    (-lp.sum() / len(t)).backward()
    return lp.detach(), h.grad, w.grad


def reference(h, w, t, softcap):
    """float32 math on the bf16 inputs: log-probabilities and the gradients of -sum(log p) / tokens."""
    import torch

    hf = h.detach().float().requires_grad_(True)
    wf = w.detach().float().requires_grad_(True)
    lp = torch.empty(len(t), device=h.device)
    for s in range(0, len(t), 2048):  # chunks: the float32 logits of 16k tokens x 128k would be 8 GiB at once
        z = hf[s:s + 2048] @ wf.t()
        if softcap:
            z = softcap * torch.tanh(z / softcap)
        lps = z.log_softmax(-1).gather(-1, t[s:s + 2048, None]).squeeze(-1)
        (-lps.sum() / len(t)).backward()
        lp[s:s + 2048] = lps.detach()
    return lp, hf.grad, wf.grad


def kernels(fn, h, w, t, top: int):
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(fn, h, w, t)
        torch.cuda.synchronize()
    by: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            entry = by.setdefault(e.name, [0.0, 0])
            entry[0] += e.device_time
            entry[1] += 1
    total = sum(v[0] for v in by.values())
    rows = sorted(by.items(), key=lambda kv: -kv[1][0])[:top]
    return total / 1e3, [(us / 1e3, n, name[:110]) for name, (us, n) in rows]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16371)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--softcap", type=float, default=None)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--top", type=int, default=8)
    opts = ap.parse_args(argv)

    import torch

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    h = (torch.randn(opts.tokens, opts.hidden, device=dev, generator=g)).bfloat16().requires_grad_(True)
    w = (torch.randn(opts.vocab, opts.hidden, device=dev, generator=g) * opts.hidden ** -0.5 * 2).bfloat16()
    w.requires_grad_(True)
    t = torch.randint(0, opts.vocab, (opts.tokens,), device=dev, generator=g)
    fns = heads(opts.softcap)
    print(f"loss_head: {opts.tokens} tokens x hidden {opts.hidden} x vocab {opts.vocab}, softcap {opts.softcap}, "
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)

    ref = reference(h, w, t, opts.softcap)
    errors = {}
    for name, fn in fns.items():
        got = step(fn, h, w, t)
        errs = errors[name] = [float((a.float() - b).abs().max()) / float(b.abs().max()) for a, b in zip(got, ref)]
        print(f"  {name:5s} vs float32: log-prob {errs[0]:.2e}  d hidden {errs[1]:.2e}  d weight {errs[2]:.2e} "
              "(max abs error / reference's max)", flush=True)
    ours, theirs = step(fns["ours"], h, w, t), step(fns["trl"], h, w, t)
    print("  ours vs trl: " + "  ".join(f"{k} {float((a.float() - b.float()).abs().max()):.2e}"
                                        for k, a, b in zip(("log-prob", "d hidden", "d weight"), ours, theirs)))
    del ref, ours, theirs

    for fn in fns.values():
        for _ in range(3):
            step(fn, h, w, t)
    times = {k: [] for k in fns}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for i in range(opts.reps):
        for name in (list(fns) if i % 2 == 0 else list(fns)[::-1]):
            torch.cuda.synchronize()
            start.record()
            step(fns[name], h, w, t)
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end))
    flops = 6 * opts.tokens * opts.hidden * opts.vocab  # the head's useful GEMMs: forward + two gradients
    for name, fn in fns.items():
        h.grad = w.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(fn, h, w, t)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        med = statistics.median(times[name])
        total, top = kernels(fn, h, w, t, opts.top)
        print(f"  {name:5s} {med:7.2f} ms forward+backward (median of {opts.reps}; runs "
              f"{', '.join(f'{x:.1f}' for x in times[name])})  {flops / med / 1e9:6.1f} TFLOP/s useful  "
              f"peak +{peak:.2f} GiB  kernels {total:.2f} ms", flush=True)
        for ms, n, kname in top:
            print(f"      {ms:7.2f} ms x{n:<4d} {kname}")
    m = {k: statistics.median(v) for k, v in times.items()}
    print(f"SUMMARY loss_head: ours {m['ours']:.2f} ms vs trl {m['trl']:.2f} ms = {m['trl'] / m['ours']:.2f}x")
    worse = [k for k, o, r in zip(("log-prob", "d hidden", "d weight"), errors["ours"], errors["trl"])
             if o > 2 * r + 1e-3]
    if worse:
        print(f"MISMATCH: ours is over 2x TRL's error against float32 (+1e-3) in {', '.join(worse)}")
    return 1 if worse else 0


if __name__ == "__main__":
    raise SystemExit(main())
