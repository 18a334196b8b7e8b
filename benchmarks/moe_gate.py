"""gpt-oss's MoE gate, forward + backward: transformers' op-by-op `GptOssExperts._apply_gate` against moe.py's compiled
one (issue 31: the gpt-oss shape's MFU), at the slot count and width of the gpt-oss-2b benchmark step.

    python benchmarks/moe_gate.py      # 12 layers' worth: slots 32,742 (16,371 tokens x top-2), width 2 x 2048
    python benchmarks/moe_gate.py --slots 65536 --intermediate 2880

One process on one GPU, bfloat16, each row times its routing weight (as the experts call it). Variants: transformers'
gate (the weights multiplied after it), moe.compiled (the product: only the slot count symbolic) and the same function
compiled with every dim symbolic (how moe.py compiled it before 2026-11-28). The compiled ones are compiled first
(timed); then --reps rounds, alternating the order, each round `--layers` forward+backward passes over fresh gate/up
activations (as the layers of one step would). Printed per variant: median ms per round, GB/s of the bytes the fused
kernels must move, the memory autograd keeps for backward per layer (allocated after forward minus before, with the
input counted apart), and the largest difference from transformers' gate in float32 (output and gradient, 4,096 rows).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=32_742, help="rows of the gate/up activations (tokens x top-k)")
    ap.add_argument("--intermediate", type=int, default=2048, help="the experts' intermediate width")
    ap.add_argument("--layers", type=int, default=12, help="passes per timed round")
    ap.add_argument("--reps", type=int, default=7, help="timed rounds per variant")
    a = ap.parse_args()

    import torch
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from trainbox.training.kernels import moe

    if not torch.cuda.is_available():
        sys.exit("moe_gate.py needs a GPU")
    dev = torch.device("cuda")
    with torch.device("meta"):
        experts = GptOssExperts(GptOssConfig(intermediate_size=a.intermediate))
    alpha, limit = float(experts.alpha), float(experts.limit)
    compiled = moe.compiled()
    every_dim = torch.compile(moe.oss_gate, dynamic=True, fullgraph=True)  # how moe.py compiled it until 2026-11-28
    variants = {"transformers": lambda h, w: GptOssExperts._apply_gate(experts, h) * w.unsqueeze(-1),
                "compiled": lambda h, w: compiled(h, alpha, limit, w),
                "all-dims-symbolic": lambda h, w: every_dim(h, alpha, limit, w)}
    shape = (a.slots, 2 * a.intermediate)
    xs = [(torch.randn(shape, device=dev, dtype=torch.bfloat16) * 4) for _ in range(a.layers)]
    grad = torch.randn(a.slots, a.intermediate, device=dev, dtype=torch.bfloat16)
    weights = torch.rand(a.slots, device=dev, dtype=torch.bfloat16)  # the routing weights, folded into the gate

    def one_round(fn) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for x in xs:
            h = x.detach().requires_grad_()
            fn(h, weights).backward(grad)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3

    for name in ("compiled", "all-dims-symbolic"):
        t = time.perf_counter()
        one_round(variants[name])
        print(f"{name}: compile (first round, {a.layers} passes): {time.perf_counter() - t:.1f} s", flush=True)
    one_round(variants["transformers"])  # warm
    times: dict = {k: [] for k in variants}
    for r in range(a.reps):
        for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
            times[name].append(one_round(variants[name]))
    fused_bytes = a.layers * a.slots * a.intermediate * 16  # fwd: read 4, write 2; bwd: read 4 + 2, write 4
    for name, fn in variants.items():
        h = xs[0].detach().requires_grad_()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = fn(h, weights)
        kept = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
        del y
        ms = statistics.median(times[name])
        print(f"{name:>17}: {ms:7.2f} ms per {a.layers} layers (fwd+bwd)  {fused_bytes / ms / 1e6:7.0f} GB/s of the "
              f"fused bytes  kept for backward {kept / 2**20:7.1f} MiB a layer", flush=True)
    # Right, not only fast: both bfloat16 variants against transformers' gate in float32 (values and gradients).
    x, w = xs[0][:4096], weights[:4096]
    ref = {}
    for name, fn in (("float32", variants["transformers"]), *variants.items()):
        h = (x.float() if name == "float32" else x).detach().requires_grad_()
        y = fn(h, w.float() if name == "float32" else w)
        y.backward(grad[:4096].to(y.dtype))
        ref[name] = y.detach().float(), h.grad.float()
    for name in variants:
        dy, dg = ((ref[name][i] - ref["float32"][i]).abs().max().item() for i in (0, 1))
        print(f"{name:>17}: max |diff| vs float32: output {dy:.3g}, gradient {dg:.3g} "
              f"(of max {ref['float32'][0].abs().max().item():.3g} / {ref['float32'][1].abs().max().item():.3g})")
    t_hf, t_ours, t_all = (statistics.median(times[k]) for k in ("transformers", "compiled", "all-dims-symbolic"))
    print(f"SUMMARY moe_gate: compiled {t_ours:.2f} ms vs transformers {t_hf:.2f} ms per step's gates "
          f"= {t_hf / t_ours:.2f}x, {t_hf - t_ours:.1f} ms saved a step; every dim symbolic {t_all:.2f} ms")


if __name__ == "__main__":
    main()
