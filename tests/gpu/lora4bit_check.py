"""GPU check for qlora's two memory/speed paths: the fused 4-bit LoRA (kernels/lora4bit.py) against PEFT's own
forward, and the checkpointed inputs offloaded to the host (kernels/ckptoffload.py) against kept on the GPU.

    python tests/gpu/lora4bit_check.py [--tokens 8192] [--layers 8] [--hidden 2048] [--steps 6] [--json out.json]

One Llama shape (random init, bf16, nf4 + double quant as it loads, LoRA r16 alpha 32 dropout 0 on all linear layers,
adapters in bf16 as TRL makes them, non-reentrant checkpointing), four variants in this process on the same batch:
peft, fused, peft+offload, fused+offload. Each: the loss, every LoRA gradient's relative difference to peft's (the
fused path sums in another order in bf16; the offload changes no arithmetic; peft runs twice for the floor), forward+backward ms (CUDA events, after 2
warm-up steps) and peak allocated GiB over the steps. Exit 1 when a fused gradient is off by more than 2e-2, an
offloaded one differs from its on-GPU twin's by over twice the run-to-run floor (peft run twice; 1e-3 at least), or the offload saved no memory.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def build(path: Path, a) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=a.hidden, intermediate_size=a.hidden * 7 // 2, num_hidden_layers=a.layers,
                      num_attention_heads=a.hidden // 128, num_key_value_heads=max(1, a.hidden // 512),
                      vocab_size=32000, max_position_embeddings=a.tokens)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)


def variant(path: Path, ids, fused: bool, offload: bool, steps: int) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from trainbox.training.kernels import ckptoffload, lora4bit

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, dtype=torch.bfloat16,
                                                 device_map={"": 0}, attn_implementation="sdpa")
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                             task_type="CAUSAL_LM"))
    for n, p in model.named_parameters():
        if p.requires_grad:  # TRL's bf16 adapters; B off zero so both adapter gradients are exercised
            p.data = (p.data if "lora_A" in n else torch.randn_like(p.data) * 1e-2).to(torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model.train()
    if fused:
        assert lora4bit.apply(model) > 0
    if offload:
        assert ckptoffload.install(model) > 0
    grads, ms, loss = None, [], None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for step in range(steps + 2):
        model.zero_grad(set_to_none=True)
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        t1.record()
        torch.cuda.synchronize()
        if step >= 2:
            ms.append(t0.elapsed_time(t1))
        if step == 0:
            loss = out.loss.item()
            grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    off = getattr(model.get_base_model(), "_trainbox_offloader", None)
    res = {"loss": loss, "ms": sorted(ms)[len(ms) // 2], "peak_gib_over_weights": peak,
           "weights_gib": base / 2**30, "offloaded_gib": off.moved / 2**30 if off else 0.0}
    del model, out
    torch.cuda.empty_cache()
    return res, grads


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192, help="tokens in the batch (2 rows)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json")
    a = ap.parse_args()
    import torch

    path = Path(tempfile.mkdtemp(prefix="lora4bit-")) / "model"
    build(path, a)
    torch.manual_seed(2)
    ids = torch.randint(0, 32000, (2, a.tokens // 2), device="cuda")
    results, grads = {}, {}
    for name, fused, offload in (("peft", False, False), ("peft-again", False, False), ("fused", True, False),
                                 ("peft+offload", False, True), ("fused+offload", True, True)):
        results[name], grads[name] = variant(path, ids, fused, offload, a.steps)

    def rel(x, y):
        return max(((x[n] - y[n]).norm() / y[n].norm().clamp_min(1e-12)).item() for n in y)

    # run to run, the same path differs too (attention's backward sums with atomics): the floor the others are held to
    floor = rel(grads["peft-again"], grads["peft"])
    failures = []
    for name, r in results.items():
        twin = name.replace("+offload", "")
        r["grad_rel_vs_peft"] = rel(grads[name], grads["peft"])
        if name != twin:
            r["grad_rel_vs_on_gpu"] = rel(grads[name], grads[twin])
            r["peak_saved_gib"] = results[twin]["peak_gib_over_weights"] - r["peak_gib_over_weights"]
            if r["grad_rel_vs_on_gpu"] > max(2 * floor, 1e-3):  # the same arithmetic: within the run-to-run floor
                failures.append(f"{name}: gradients differ from {twin}'s ({r['grad_rel_vs_on_gpu']:.2e})")
            if r["peak_saved_gib"] <= 0:
                failures.append(f"{name}: no memory saved")
        if r["grad_rel_vs_peft"] > 2e-2:
            failures.append(f"{name}: gradients {r['grad_rel_vs_peft']:.2e} off PEFT's")
        print(f"{name:<14} loss {r['loss']:.5f}  {r['ms']:8.1f} ms  peak {r['peak_gib_over_weights']:6.2f} GiB over "
              f"{r['weights_gib']:.2f} of weights  offloaded {r['offloaded_gib']:.2f} GiB  grad rel vs peft "
              f"{r['grad_rel_vs_peft']:.2e}" + (f"  vs on-GPU {r['grad_rel_vs_on_gpu']:.1e}  saved "
                                               f"{r['peak_saved_gib']:.2f} GiB" if name != twin else ""), flush=True)
    print(f"run-to-run floor (peft vs peft-again): {floor:.2e}", flush=True)
    result = {"floor": floor, "shape": vars(a), "gpu": torch.cuda.get_device_name(), "results": results, "failures": failures}
    print("RESULT " + json.dumps(result), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
