"""GPU check for grpo's static decoder under adapters (qlora, lora): the copy holds the 4-bit base dequantized with
the LoRA adapter merged in (static_decode.source_weights), its decode step compiles into a CUDA graph, its greedy
tokens are what the PEFT policy's own forward predicts, and against transformers' generate on the same policy.

    python tests/gpu/decoder_adapters_check.py [--mode qlora|lora] [--hidden 1024] [--layers 8] [--rows 6]
                                               [--new 128] [--json out.json]

A Llama shape (random init, bf16) loaded in 4-bit nf4 (qlora) or bf16 (lora), LoRA r16 on all linear layers with
B off zero; prompts of 40-75 random tokens. Prints the first generate (compile + capture), a second one (ms a
token for all rows), the sync (dequantize + merge) time, transformers' generate of the same rows and length, and
the greedy agreement over each row's first 16 tokens (both sides bf16: near-ties may differ). Exit 1 when under
90 % agree or the step did not compile.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("qlora", "lora"), default="qlora")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=6)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--json")
    a = ap.parse_args()
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    from trainbox.training.grpo import static_decode

    path = tempfile.mkdtemp(prefix="decoder-adapters-")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=a.hidden, intermediate_size=a.hidden * 11 // 4,
                                 num_hidden_layers=a.layers, num_attention_heads=a.hidden // 128,
                                 num_key_value_heads=max(1, a.hidden // 256), vocab_size=32000)
                     ).to(torch.bfloat16).save_pretrained(path)
    quant = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.bfloat16) if a.mode == "qlora" else None)
    base = AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, dtype=torch.bfloat16,
                                                device_map={"": 0})
    policy = get_peft_model(base, LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear"))
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    prompts = [torch.randint(5, 32000, (40 + 7 * i,)).tolist() for i in range(a.rows)]
    dec = static_decode.StaticDecoder(policy, max_new=a.new, pad_id=0, eos_ids=[], temperature=1e-6,
                                      uncompiled_fallback=False)
    t0 = time.perf_counter()
    out = dec.generate(prompts)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    dec.generate(prompts)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    dec.sync(policy)
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    agree = total = 0
    with torch.no_grad():
        for prompt, completion in zip(prompts, out):
            ids = torch.tensor([prompt + completion[:16]], device="cuda")
            pred = policy(input_ids=ids).logits[0, len(prompt) - 1 : len(prompt) + 15].argmax(-1).tolist()
            agree += sum(x == y for x, y in zip(pred, completion[:16]))
            total += 16
        ids = torch.tensor([prompts[0]] * a.rows, device="cuda")
        g0 = time.perf_counter()
        policy.generate(input_ids=ids, max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False)
        torch.cuda.synchronize()
        g1 = time.perf_counter()
    res = {"mode": a.mode, "gpu": torch.cuda.get_device_name(), "first_generate_s": t1 - t0,
           "decoder_ms_per_token": 1000 * (t2 - t1) / a.new, "sync_ms": 1000 * (t3 - t2),
           "transformers_ms_per_token": 1000 * (g1 - g0) / a.new, "greedy_agree": agree / total,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    print(f"{a.mode}: first generate {res['first_generate_s']:.1f} s (compile + capture); decoder "
          f"{res['decoder_ms_per_token']:.2f} ms a token for {a.rows} rows vs transformers' generate "
          f"{res['transformers_ms_per_token']:.2f}; sync {res['sync_ms']:.0f} ms; greedy agreement {agree}/{total}; "
          f"peak {res['peak_gib']:.2f} GiB", flush=True)
    print("RESULT " + json.dumps(res), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0 if res["greedy_agree"] >= 0.9 else 1


if __name__ == "__main__":
    raise SystemExit(main())
