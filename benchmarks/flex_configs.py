"""FlexAttention's kernel block sizes on this GPU: forward+backward milliseconds per configuration, on one packed row.

On the device (one H100; about 2-4 minutes):

    python benchmarks/flex_configs.py --head-dim 256 --heads 8 --kv-heads 4 --softcap 50 --window 1024   # Gemma 2
    python benchmarks/flex_configs.py --head-dim 64 --heads 32 --kv-heads 8 --window 128 --lse           # gpt-oss

The row is what trainbox sft feeds the kernel: examples of the chat-length mix (train_throughput.lengths) packed into
--tokens positions, documents from position_ids, the same score_mod and block mask as trainbox_flex (flexattn.py),
bf16; query, key and value keep --tokens positions as in training (a length that is no multiple of 128, e.g. 16369,
times the kernel's bounds-checked variant). Each configuration is compiled afresh (torch._dynamo.reset), run 3
times, then timed over --iters calls with CUDA events; "default" is inductor's own choice (no kernel_options),
"autotune" is `mode=max-autotune-no-cudagraphs` (inductor benchmarks its candidates; its compile time is printed
too). A configuration that does not fit (shared memory) prints its error and is skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, num_stages): backward blocks (constraints: N1 % M1 == 0,
# M2 % N2 == 0) over inductor's forward default.
CONFIGS = [(m1, n1, m2, n2, w, s) for (m1, n1, m2, n2) in [(64, 64, 64, 64), (32, 64, 64, 32), (32, 128, 128, 32),
                                                         (64, 128, 128, 64), (32, 32, 32, 32)]
           for w in (4, 8) for s in (1, 2)]


def options(text: str) -> dict:
    """--options: a JSON object of FlexAttention kernel_options."""
    try:
        got = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({e})") from None
    if not isinstance(got, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a JSON object, e.g. '{{\"BLOCK_M\": 64}}'")
    return got


def row(tokens: int, device):
    import torch

    import train_throughput as tt

    lens, total = [], 0
    for n in tt.lengths("mix", 4096, 2048):
        if total + n > tokens:
            break
        lens.append(n)
        total += n
    lens.append(tokens - total)
    pos = torch.cat([torch.arange(n) for n in lens])[None].to(device)
    return pos, lens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--softcap", type=float, default=None)
    ap.add_argument("--window", type=int, default=None, help="also time the windowed layers (every other layer)")
    ap.add_argument("--lse", action="store_true", help="return the log-sum-exp and backpropagate into it (gpt-oss's "
                    "sinks, as trainbox_flex runs them)")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--no-autotune", action="store_true")
    ap.add_argument("--options", action="append", type=options, default=[], metavar="JSON",
                    help='also time these kernel_options, e.g. \'{"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 128, '
                         '"fwd_num_stages": 3}\' (fwd_/bwd_ prefixes: torch >= 2.9); repeatable')
    ap.add_argument("--no-sweep", dest="sweep", action="store_false", help="only the default, --options and autotune")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()

    import torch
    from torch.nn.attention import flex_attention as fa

    from trainbox.training.kernels import flexattn

    dev = torch.device("cuda")
    pos, lens = row(a.tokens, dev)
    docs = flexattn.padded_documents(pos, None, 1, a.tokens, dev)
    n = a.tokens
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, a.heads, n, a.head_dim, device=dev, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, a.kv_heads, n, a.head_dim, device=dev, dtype=torch.bfloat16, generator=g) for _ in "kv")
    grad = torch.randn_like(q)
    lse_grad = torch.randn(q.shape[:3], device=dev, generator=g)
    mod = flexattn.score_mod(a.head_dim ** -0.5, a.softcap, dev)
    windows = [None] + ([a.window] if a.window else [])
    masks = {w: flexattn.block_mask(docs, w, n) for w in windows}
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}: head dim {a.head_dim}, {a.heads}/{a.kv_heads} "
          f"heads, {len(lens)} examples in {a.tokens} tokens, softcap {a.softcap}, windows {windows}", flush=True)

    def step(fn, qq, kk, vv, w, opts):
        kw = dict(score_mod=mod, block_mask=masks[w], scale=1.0, enable_gqa=a.heads != a.kv_heads)
        if opts:
            kw["kernel_options"] = opts
        if not a.lse:
            fn(qq, kk, vv, **kw).backward(grad)
            return
        # gpt-oss: the sinks read the log-sum-exp, so it comes back and its gradient flows in (as in training)
        out, aux = fn(qq, kk, vv, return_aux=fa.AuxRequest(lse=True), **kw)
        torch.autograd.backward([out, aux.lse], [grad, lse_grad])

    def bench(label, fn, opts):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        ms = {}
        try:
            t0 = time.perf_counter()
            for w in windows:
                for _ in range(3):
                    step(fn, qq, kk, vv, w, opts)
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            for w in windows:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(a.iters):
                    step(fn, qq, kk, vv, w, opts)
                end.record()
                torch.cuda.synchronize()
                ms[str(w)] = start.elapsed_time(end) / a.iters
        except Exception as e:  # noqa: BLE001 - a configuration that does not fit is reported and skipped
            why = str(e).splitlines()[0][:120] if str(e) else ""
            print(f"{label:<28} FAILED {type(e).__name__}: {why}", flush=True)
            return None
        print(f"{label:<28} " + "  ".join(f"window {w}: {t:7.2f} ms" for w, t in ms.items())
              + f"  (compile + 3 calls {first:.1f} s)", flush=True)
        return {"label": label, "ms": ms, "first_s": first}

    results = []
    torch._dynamo.config.recompile_limit = 64
    runs = [("default", None)] + [(f"bwd {c[:4]} w{c[4]} s{c[5]}", dict(BLOCK_M1=c[0], BLOCK_N1=c[1], BLOCK_M2=c[2],
                                                                         BLOCK_N2=c[3], num_warps=c[4],
                                                                         num_stages=c[5])) for c in CONFIGS]
    runs = (runs if a.sweep else runs[:1]) + [(json.dumps(o, separators=(",", ":")), o) for o in a.options]
    for label, opts in runs:
        torch._dynamo.reset()
        r = bench(label, torch.compile(fa.flex_attention, fullgraph=True), opts)
        if r:
            r["options"] = opts
            results.append(r)
    if not a.no_autotune:
        torch._dynamo.reset()
        r = bench("autotune", torch.compile(fa.flex_attention, fullgraph=True, mode="max-autotune-no-cudagraphs"), None)
        if r:
            results.append(r)
    best = min(results, key=lambda r: sum(r["ms"].values()))
    base = next(r for r in results if r["label"] == "default")
    fast, slow = sum(best["ms"].values()), sum(base["ms"].values())
    print(f"SUMMARY best {best['label']} {fast:.2f} ms vs default {slow:.2f} ms ({slow / fast:.2f}x); options "
          f"{best.get('options')}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
