"""trainbox_grouped_mm (trainbox/training/kernels/moe.py) on a GPU against float32 eager experts: gpt-oss with the compiled gate
(routing weights folded in), Mixtral and Qwen3-MoE (their own gates), bf16.

Usage: python tests/gpu/moe_check.py [--tokens 4096] [--json FILE]      (torch with CUDA, transformers; no trl)

Each model: the zoo's architecture (4 experts, top-2) at width 512 (random biases for gpt-oss), one forward + backward
of loss = sum(logits * W) for a fixed random W over --tokens tokens. Reference: float32 eager experts. Rows: bf16
trainbox_grouped_mm and, as the bound bf16 rounding alone sets, bf16 transformers' grouped_mm. Columns: max |logit
diff| and max |grad diff| over all parameters, each relative to that parameter's largest gradient. OK: ours within 2x
transformers' bf16 bound (+0.02). Exit 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import zoo  # noqa: E402

WIDE = dict(hidden_size=512, intermediate_size=512, moe_intermediate_size=512, num_attention_heads=8,
            num_key_value_heads=4, head_dim=64, vocab_size=1000)


def run(model, ids, weight):
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    (logits.float() * weight).sum().backward()
    return logits.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--json")
    a = ap.parse_args()

    import torch
    import transformers

    from trainbox.training.kernels import moe

    if not torch.cuda.is_available():
        sys.exit("moe_check.py needs a GPU")
    moe.register()
    rows, bad = [], 0
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"{'model':<10} | {'ours bf16 logit':>15} {'grad':>8} | {'theirs bf16 logit':>17} {'grad':>8} | ok")
    for name in ("gpt-oss", "mixtral", "qwen3-moe"):
        cls, extra, _ = zoo.ZOO[name]
        conf = getattr(transformers, cls)(**{**zoo.COMMON, **extra, **WIDE})
        torch.manual_seed(0)
        base = transformers.AutoModelForCausalLM.from_config(conf).float().cuda()
        for n, p in base.named_parameters():
            if "bias" in n:
                torch.nn.init.normal_(p, std=0.2)
        g = torch.Generator(device="cuda").manual_seed(1)
        ids = torch.randint(0, conf.vocab_size, (a.tokens // 512, 512), device="cuda", generator=g)
        weight = torch.randn(ids.shape[0], ids.shape[1], conf.vocab_size, device="cuda", generator=g)
        got = {}
        for label, impl, dtype in (("ref", "eager", torch.float32), ("ours", moe.NAME, torch.bfloat16),
                                   ("theirs", "grouped_mm", torch.bfloat16)):
            m = copy.deepcopy(base).to(dtype)
            m.set_experts_implementation(impl)
            got[label] = run(m, ids, weight)
        ref_logits, ref_grads = got["ref"]
        row = {"model": name}
        for label in ("ours", "theirs"):
            logits, grads = got[label]
            row[label] = (float((logits - ref_logits).abs().max()),
                          max(float((grads[n] - r).abs().max() / r.abs().max().clamp_min(1e-12))
                              for n, r in ref_grads.items()))
        ok = all(row["ours"][i] <= 2 * row["theirs"][i] + 0.02 for i in (0, 1))
        bad += not ok
        rows.append({**row, "ok": ok})
        print(f"{name:<10} | {row['ours'][0]:15.4f} {row['ours'][1]:8.4f} | {row['theirs'][0]:17.4f} "
              f"{row['theirs'][1]:8.4f} | {'OK' if ok else 'MISMATCH'}", flush=True)
    print("RESULT " + json.dumps({"mismatches": bad, "rows": rows}))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
