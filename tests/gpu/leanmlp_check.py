"""leanmlp (the gated MLP's product recomputed in backward) on a GPU against Liger's own MLP: same outputs and
gradients, less memory kept for backward.

Usage: python tests/gpu/leanmlp_check.py [--tokens 16384]      (torch with CUDA, transformers, liger-kernel)

For Gemma 2's GeGLU and Llama's SwiGLU MLP (hidden 2048, intermediate 8192, bf16): one forward+backward of the same
input through Liger's MLP and through the same module after leanmlp.apply; max |diff| of the output and of every
gradient (input, gate/up/down weights) relative to the largest value, and the memory the forward keeps for
backward (allocated after forward minus before). Exit 1 when a diff is over 1e-2 or nothing was saved.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def run(kind: str, tokens: int) -> dict:
    import torch
    from liger_kernel.transformers.geglu import LigerGEGLUMLP
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
    from transformers import Gemma2Config, LlamaConfig

    from trainbox.training.kernels import leanmlp

    torch.manual_seed(0)
    if kind == "geglu":
        conf = Gemma2Config(hidden_size=2048, intermediate_size=8192, hidden_activation="gelu_pytorch_tanh")
        ref = LigerGEGLUMLP(conf)
    else:
        ref = LigerSwiGLUMLP(LlamaConfig(hidden_size=2048, intermediate_size=8192))
    ref = ref.cuda().to(torch.bfloat16)
    lean = copy.deepcopy(ref)
    assert leanmlp.apply(lean) == 1
    x0 = torch.randn(1, tokens, 2048, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(1, tokens, 2048, device="cuda", dtype=torch.bfloat16)
    out, kept = {}, {}
    for name, m in (("liger", ref), ("lean", lean)):
        x = x0.clone().requires_grad_(True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = m(x)
        kept[name] = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
        (y.float() * g.float()).sum().backward()
        out[name] = {"y": y.detach().float(), "x": x.grad.float(),
                     **{p: getattr(m, p).weight.grad.float() for p in ("gate_proj", "up_proj", "down_proj")}}
        del y, x
    diffs = {k: float((out["lean"][k] - out["liger"][k]).abs().max() / out["liger"][k].abs().max().clamp_min(1e-9))
             for k in out["liger"]}
    return {"kind": kind, "tokens": tokens, "rel_diff": diffs, "kept_gib": {k: v / 2**30 for k, v in kept.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    a = ap.parse_args()
    bad = False
    for kind in ("geglu", "swiglu"):
        r = run(kind, a.tokens)
        ok = max(r["rel_diff"].values()) < 1e-2 and r["kept_gib"]["lean"] < r["kept_gib"]["liger"]
        bad |= not ok
        print(f"{kind}: {'OK' if ok else 'FAIL'} kept for backward {r['kept_gib']['liger']:.2f} GiB (liger) -> "
              f"{r['kept_gib']['lean']:.2f} GiB (lean); max rel diff "
              + ", ".join(f"{k} {v:.2e}" for k, v in r["rel_diff"].items()), flush=True)
        print("RESULT " + json.dumps(r), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
