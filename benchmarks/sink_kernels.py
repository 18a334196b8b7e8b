"""gpt-oss's attention (learned sinks, 128-token window on every other layer) on its two packed kernels: FlexAttention
(trainbox_flex) against torch's varlen FlashAttention with the sinks applied from its log-sum-exp (trainbox_varlen,
varlen_sinks.py). Forward+backward milliseconds per layer call on one packed row, and each kernel's error against
float32 dense math.

On the device (one GPU; about a minute, FlexAttention's compile included):

    python benchmarks/sink_kernels.py                        # gpt-oss-2b's attention: 32/8 heads of 64
    python benchmarks/sink_kernels.py --tokens 16384 --iters 20 --json /tmp/sinks.json

The row is what trainbox sft feeds the kernels (flex_configs.row: the chat-length mix packed into --tokens
positions). Timed: each kernel's product entry point as the attention function calls it (flexattn.fused_forward,
varlen_sinks.attention) with the row's documents and block masks built once beforehand (training builds them once a
forward for all layers), three calls first, then --iters calls between CUDA events, a window of None (full layers)
and --window. Error: on a --check-tokens row, output and dq/dk/dv/dsinks of each bf16 kernel against float32 dense
math (flexattn.dense with the sinks), the largest difference relative to the reference's largest value.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def kernels():
    """label -> fn(q, k, v, sinks, pos, cu, max_len, scale, window): q (tokens, heads, dim) -> (tokens, heads, dim)."""
    from trainbox.training.kernels import flexattn, varlen_sinks

    def flex(q, k, v, sinks, pos, cu, max_len, scale, window):
        t = (x.transpose(0, 1)[None] for x in (q, k, v))  # the models' (batch, heads, seq, dim)
        return flexattn.fused_forward(*t, pos, None, scale, window, None, sinks)[0]

    def varlen(q, k, v, sinks, pos, cu, max_len, scale, window):
        return varlen_sinks.attention(q, k, v, sinks, cu, cu, max_len, max_len, scale, window)

    def bare(q, k, v, sinks, pos, cu, max_len, scale, window):  # the floor: the kernel without the sinks
        import torch

        left, right = varlen_sinks._bounds(window)
        return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale,
                                                       window_size_left=left, window_size_right=right)[0]

    return {"flex": flex, "varlen+sinks": varlen, "varlen, no sinks": bare}


def inputs(tokens: int, heads: int, kv_heads: int, dim: int, dtype, seed: int = 0):
    import torch

    from flex_configs import row

    pos, lens = row(tokens, torch.device("cuda"))
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(tokens, heads, dim, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(tokens, kv_heads, dim, device="cuda", generator=g).to(dtype) for _ in "kv")
    sinks = torch.randn(heads, device="cuda", generator=g).to(dtype)
    return q, k, v, sinks, pos, cu, max(lens)


def reference(q, k, v, sinks, pos, scale, window):
    """float32 dense math: (out, grads of q, k, v, sinks) for loss = sum(out * grad_out)."""
    from trainbox.training.kernels import flexattn

    q, k, v, sinks = (t.float().detach().requires_grad_(True) for t in (q, k, v, sinks))
    docs = flexattn.documents(pos, None, 1, q.shape[0], q.device)
    out, lse = flexattn.dense(*(t.transpose(0, 1)[None] for t in (q, k, v)), docs, scale, window, None)
    return flexattn.with_sinks(out, lse, sinks)[0].transpose(0, 1), (q, k, v, sinks)


def profile(step, label: str, calls: int = 5) -> None:
    """The kernels of `calls` calls of step(), GPU time per call, largest first."""
    import torch
    from torch.profiler import ProfilerActivity

    with torch.profiler.profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    rows = [(e.device_time_total / calls / 1e3, e.count // calls, e.key) for e in prof.key_averages()
            if e.device_time_total > 0]
    for ms, n, name in sorted(rows, reverse=True)[:12]:
        print(f"    {label}: {ms:6.3f} ms x{n:<3} {name[:110]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=16384, help="the timed row (default: 8 rows of 2,048)")
    ap.add_argument("--check-tokens", type=int, default=2048, help="the row checked against dense math")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="also list each kernel's GPU time per call (torch.profiler)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()

    import torch

    from trainbox.training import attention

    attention.register(attention.FLEX)
    attention.register(attention.VARLEN)
    scale = a.head_dim ** -0.5
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}: {a.heads}/{a.kv_heads} heads of "
          f"{a.head_dim}, window {a.window}, {a.tokens} tokens timed, {a.check_tokens} checked", flush=True)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "error": {}, "ms": {}}
    windows = (None, a.window)

    q, k, v, sinks, pos, cu, max_len = inputs(a.check_tokens, a.heads, a.kv_heads, a.head_dim, torch.bfloat16, 1)
    grad_out = torch.randn(q.shape, device="cuda")
    for w in windows:
        ref, leaves = reference(q, k, v, sinks, pos, scale, w)
        ref.backward(grad_out)
        want = [ref.detach()] + [t.grad for t in leaves]
        for label, fn in kernels().items():
            if "no sinks" in label:
                continue
            xs = [t.detach().clone().requires_grad_(True) for t in (q, k, v, sinks)]
            out = fn(*xs, pos, cu, max_len, scale, w)
            out.float().backward(grad_out)
            got = [out.detach()] + [t.grad for t in xs]
            errs = {n: float((g.float() - r).abs().max() / r.abs().max()) for n, g, r in
                    zip(("out", "dq", "dk", "dv", "dsinks"), got, want)}
            results["error"][f"{label} window {w}"] = errs
            print(f"{label:<14} window {str(w):<5} error vs float32: "
                  + "  ".join(f"{n} {e:.4f}" for n, e in errs.items()), flush=True)

    q, k, v, sinks, pos, cu, max_len = inputs(a.tokens, a.heads, a.kv_heads, a.head_dim, torch.bfloat16)
    grad_out = torch.randn(q.shape, device="cuda", dtype=torch.bfloat16)
    for label, fn in kernels().items():
        xs = [t.detach().clone().requires_grad_(True) for t in (q, k, v, sinks)]
        t0 = time.perf_counter()
        for w in windows:
            for _ in range(3):
                fn(*xs, pos, cu, max_len, scale, w).backward(grad_out)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        ms = {}
        for w in windows:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(a.iters):
                fn(*xs, pos, cu, max_len, scale, w).backward(grad_out)
            end.record()
            torch.cuda.synchronize()
            ms[str(w)] = start.elapsed_time(end) / a.iters
        results["ms"][label] = ms
        if a.profile:
            profile(lambda: fn(*xs, pos, cu, max_len, scale, windows[0]).backward(grad_out), label)
        print(f"{label:<14} fwd+bwd per call: " + "  ".join(f"window {w}: {t:6.3f} ms" for w, t in ms.items())
              + f"  (first 3 calls of each {first:.1f} s)", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    print("RESULT " + json.dumps(results["ms"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
