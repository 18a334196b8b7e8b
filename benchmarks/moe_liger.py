"""One MoE experts layer three ways, forward + backward on one packed step's tokens (bf16): transformers' own
`grouped_mm`, trainbox's `trainbox_grouped_mm` (moe.py), and Liger's fused MoE (what Liger's SwiGLU patch binds to a
Mixtral or Qwen3-MoE experts module: LigerExperts.forward). Same weights, tokens and routing for all three; each one's
output and gradients against the model's own (eager) experts in float32 (relative max error).

    python benchmarks/moe_liger.py                       # Mixtral-like: 8 experts, top-2
    python benchmarks/moe_liger.py --shapes qwen3-moe    # Qwen3-MoE-like: 128 experts, top-8 (did not finish in 5
                                                         # minutes on an H200: its float32 reference loops over experts)

Prints ms per forward+backward (CUDA events, median of --reps after 3 warm-up calls, the order rotated each round)
and the peak memory each adds over the inputs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {  # name: (config class, its arguments)
    "mixtral": ("MixtralConfig", dict(hidden_size=2048, intermediate_size=5632, num_local_experts=8,
                                      num_experts_per_tok=2)),
    "qwen3-moe": ("Qwen3MoeConfig", dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                                         num_experts_per_tok=8)),
}


def layer(shape: str, impl: str):
    import torch
    import transformers

    from trainbox.training.kernels import moe

    cls, kw = SHAPES[shape]
    conf = getattr(transformers, cls)(num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=4, **kw)
    conf._experts_implementation = {"trainbox": moe.NAME, "eager": "eager"}.get(impl, "grouped_mm")
    mod = __import__(f"transformers.models.{conf.model_type}.modeling_{conf.model_type}", fromlist=["x"])
    experts_cls = next(getattr(mod, n) for n in dir(mod) if n.endswith("Experts") and "Sparse" not in n)
    torch.manual_seed(0)
    m = experts_cls(conf).cuda()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.02)
    if impl == "liger":
        from liger_kernel.transformers.monkey_patch import _patch_swiglu_module
        from liger_kernel.transformers.swiglu import LigerExperts

        _patch_swiglu_module(m, LigerExperts)
    return m, conf


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", nargs="+", default=["mixtral"], choices=list(SHAPES))
    opts = ap.parse_args(argv)
    import torch

    from trainbox.training.kernels import moe

    moe.register()
    for shape in opts.shapes:
        layers = {impl: layer(shape, impl) for impl in ("grouped_mm", "trainbox", "liger")}
        conf = layers["grouped_mm"][1]
        e, k = getattr(conf, "num_local_experts", None) or conf.num_experts, conf.num_experts_per_tok
        g = torch.Generator(device="cuda").manual_seed(1)
        x = torch.randn(opts.tokens, conf.hidden_size, device="cuda", generator=g)
        logits = torch.randn(opts.tokens, e, device="cuda", generator=g)
        w, idx = torch.topk(logits.softmax(-1), k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        dy = torch.randn(opts.tokens, conf.hidden_size, device="cuda", generator=g)

        def run(impl, dtype=torch.bfloat16):
            m = layers[impl][0].to(dtype)
            for p in m.parameters():
                p.grad = None
            xx = x.to(dtype).clone().requires_grad_(True)
            out = m(xx, idx, w.to(dtype))  # (routing weights without grad: the router is not part of this layer)
            out.backward(dy.to(dtype))
            return out, [xx.grad] + [p.grad for p in m.parameters()]

        layers["eager"] = layer(shape, "eager")
        ref_out, ref_grads = run("eager", torch.float32)
        ref_out, ref_grads = ref_out.detach().clone(), [t.clone() for t in ref_grads]
        del layers["eager"]
        errs = {}
        for impl in layers:
            out, grads = run(impl)
            errs[impl] = [float((a.float() - b).abs().max() / b.abs().max()) for a, b in
                          zip([out] + grads, [ref_out] + ref_grads)]
        times = {impl: [] for impl in layers}
        for impl in layers:
            for _ in range(3):
                run(impl)
        peaks = {}
        for r in range(opts.reps):
            order = list(layers)[r % 3:] + list(layers)[: r % 3]
            for impl in order:
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                run(impl)
                b.record()
                b.synchronize()
                times[impl].append(a.elapsed_time(b))
                peaks[impl] = (torch.cuda.max_memory_allocated() - base) / 2**30
        print(f"\n# {shape}: {opts.tokens:,} tokens, hidden {conf.hidden_size}, {e} experts top-{k}; errors vs float32 "
              "eager: out, d input, d gate_up, d down (relative max)", flush=True)
        for impl in layers:
            print(f"{impl:12s} {statistics.median(times[impl]):8.3f} ms fwd+bwd  peak +{peaks[impl]:.2f} GiB   "
                  + " ".join(f"{v:.4f}" for v in errs[impl]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
