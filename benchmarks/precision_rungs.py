"""The memory plan's precision rungs (issue 60) against the float32-master path: the same model, the same batches.

    python benchmarks/precision_rungs.py [--steps 300] [--lr 3e-5] [--out DIR]

Each rung the one-GPU memory plan may take (trainbox/training/memplan.py) builds its optimizer with the project's own
classes (precision.MasterWeights; torchao's AdamW8bit, the optimizer transformers builds for `adamw_torch_8bit`):
- masters+adamw: bf16 weights, float32 masters, torch's fused AdamW (the default wherever it fits; the reference)
- masters+bf16:  bf16 weights, float32 masters, AdamW's moments in bf16 with stochastic rounding (masterstep.py's
                 one-pass kernel; 14 bytes a parameter instead of 18: an 8B model without checkpointing on an H200)
- masters+8bit:  bf16 weights, float32 masters, torchao's 8-bit AdamW states (12 bytes a parameter instead of 18)
- sr+8bit:       bf16 weights updated with stochastic rounding, 8-bit states (6 bytes: the 80 GB card's 8B rung)
- float32:       float32 weights under bf16 autocast, torch's fused AdamW (TRL's path; a second exact reference)
- bf16-plain:    bf16 weights and a plain AdamW (the control: updates below half a bf16 step round away; the
                 comparison must be able to fail)
The model is a random-init Llama shape (~0.45 B) trained as a causal LM on token streams drawn from a fixed random
Markov chain (learnable structure, so the loss falls for hundreds of steps); gradient clipping at 1.0 as the Trainer
does; one seed, one data order for every rung. Prints the loss every 25 steps per rung, then each rung's mean loss over
the last 50 steps and its relative difference from masters+adamw (target: within 1 %), and steps/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=12,
             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)
RUNGS = ["masters+adamw", "masters+bf16", "masters+8bit", "sr+8bit", "float32", "bf16-plain"]


def batches(steps: int, batch: int, length: int, vocab: int, seed: int = 0):
    """Token rows from a random sparse Markov chain: each token has 8 likely successors."""
    import torch

    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, 8), generator=g)
    out = []
    for _ in range(steps):
        rows = torch.empty(batch, length, dtype=torch.long)
        rows[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        pick = torch.randint(0, 8, (batch, length), generator=g)
        for t in range(1, length):
            rows[:, t] = succ[rows[:, t - 1], pick[:, t]]
        out.append(rows)
    return out


def build(rung: str, lr: float):
    import torch
    import transformers
    from torchao.optim import AdamW8bit

    from trainbox.training.kernels.precision import MasterWeights

    torch.manual_seed(0)
    conf = transformers.LlamaConfig(**SHAPE)
    dtype = torch.float32 if rung == "float32" else torch.bfloat16
    model = transformers.LlamaForCausalLM(conf).to("cuda", dtype)
    model.config._attn_implementation = "sdpa"
    params = [p for p in model.parameters() if p.requires_grad]
    kw = dict(lr=lr, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)
    if rung == "masters+adamw":
        opt = MasterWeights(params, inner=torch.optim.AdamW, fused=True, **kw)
    elif rung == "masters+bf16":
        opt = MasterWeights(params, inner=torch.optim.AdamW, fused=True, moments=torch.bfloat16, **kw)
    elif rung == "masters+8bit":
        opt = MasterWeights(params, inner=AdamW8bit, **kw)
    elif rung == "sr+8bit":
        opt = AdamW8bit(params, bf16_stochastic_round=True, **kw)
    else:
        opt = torch.optim.AdamW(params, fused=True, **kw)
    return model, opt


def train(rung: str, data, lr: float) -> dict:
    import torch

    model, opt = build(rung, lr)
    losses, t0 = [], None
    for i, rows in enumerate(data):
        if i == 5:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        x = rows.cuda(non_blocking=True)
        with torch.autocast("cuda", torch.bfloat16, enabled=rung == "float32"):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        if hasattr(opt, "clip_master_grads"):
            opt.clip_master_grads(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    torch.cuda.synchronize()
    rate = (len(data) - 5) / (time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30
    del model, opt
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return {"losses": [float(v) for v in torch.stack(losses).cpu()], "steps_per_s": rate, "peak_gib": peak}


def kernel_check() -> str:
    """masterstep's bf16-moment kernel against reference_step (the same update in torch ops) on one weight, 20
    steps of the same gradients: the masters' largest difference relative to the distance they moved."""
    import torch

    from trainbox.training.kernels import masterstep

    out = {}
    for how in ("kernel", "reference"):  # the same start and gradients for both
        m = torch.randn(1 << 20, device="cuda", generator=torch.Generator("cuda").manual_seed(123))
        start = m.clone()
        w = m.to(torch.bfloat16)
        inner = torch.optim.AdamW([m], lr=1e-3, fused=True, weight_decay=0.01)
        group = inner.param_groups[0]
        for i in range(20):
            g = torch.randn(m.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(i)).bfloat16()
            if how == "kernel":
                assert masterstep.step(inner, group, [w], [g], [m], None, moments=torch.bfloat16, seed=i)
            else:
                masterstep.reference_step(inner, group, [w], [g], [m], None, torch.bfloat16)
        out[how] = (m, start)
    (mk, s0), (mr, _) = out["kernel"], out["reference"]
    return (f"kernel vs reference_step, 20 steps on 1M elements: max |difference| {float((mk - mr).abs().max()):.2e}"
            f", {float((mk - mr).norm() / (mr - s0).norm()):.2e} of the distance moved")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--rungs", nargs="+", default=RUNGS, choices=RUNGS)
    ap.add_argument("--out", default=None, help="folder for results.json")
    a = ap.parse_args()
    import torch

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; shape {SHAPE}; {a.steps} steps x "
          f"{a.batch} x {a.length} tokens, lr {a.lr} constant, clip 1.0, seed 0", flush=True)
    print(kernel_check(), flush=True)
    data = batches(a.steps, a.batch, a.length, SHAPE["vocab_size"])
    res = {}
    for rung in a.rungs:
        res[rung] = r = train(rung, data, a.lr)
        shown = " ".join(f"{r['losses'][i]:.4f}" for i in range(0, a.steps, 25))
        print(f"{rung:14s} loss every 25 steps: {shown}; {r['steps_per_s']:.2f} steps/s, peak {r['peak_gib']:.1f} GiB",
              flush=True)
    tail = min(50, a.steps // 2)
    ref = sum(res["masters+adamw"]["losses"][-tail:]) / tail if "masters+adamw" in res else None
    print(f"\n| rung | mean loss, last {tail} steps | vs masters+adamw | steps/s | peak GiB |\n|---|---|---|---|---|")
    for rung, r in res.items():
        mean = sum(r["losses"][-tail:]) / tail
        rel = f"{100 * (mean - ref) / ref:+.2f} %" if ref else "-"
        print(f"| {rung} | {mean:.4f} | {rel} | {r['steps_per_s']:.2f} | {r['peak_gib']:.1f} |")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "precision_rungs.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main()
