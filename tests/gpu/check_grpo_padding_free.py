"""GPU check for grpo's padding-free policy forward: on a Llama-3.2-1B-shaped model (random init, built here), a
GRPO-shaped batch (64 rows: prompts of 50-300 tokens left-padded, completions of 20-512 tokens right-padded) is scored
twice, forward + backward as in a training step: TRL's padded path (SDPA) and the packed path (the kernel
attention.choose() gives this GPU). Prints the max log-prob difference on completion tokens and both timings.

    python tests/gpu/check_grpo_padding_free.py [--rows 64] [--chunk 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


def main() -> int:
    import datasets
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    import train_throughput as bench
    from trainbox.image import imageinfo
    from trainbox.training import attention
    from trainbox.training.grpo.padding_free import PaddingFreeGRPOTrainer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=16, help="TRL's scoring chunk (per_device_train_batch_size)")
    ap.add_argument("--json")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="grpo-pf-"))
    bench.make_tokenizer(work)
    tok = AutoTokenizer.from_pretrained(work)
    choice = attention.choose(None, imageinfo.load())  # the image's kernel default, as the trainers take it
    print(choice.line(), flush=True)
    torch.manual_seed(0)
    conf = LlamaConfig(**bench.SHAPES["llama-1b"], pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with torch.device("cuda"):
        model = LlamaForCausalLM(conf).to(torch.bfloat16)
    model.set_attn_implementation("sdpa")
    args = GRPOConfig(output_dir=str(work / "o"), num_generations=2, per_device_train_batch_size=a.chunk,
                      max_completion_length=512, bf16=True, report_to="none", gradient_checkpointing=False)
    trainer = PaddingFreeGRPOTrainer(model=model, reward_funcs=lambda completions, **k: [0.0] * len(completions),
                                     args=args, processing_class=tok,
                                     train_dataset=datasets.Dataset.from_list([{"prompt": "w1 w2"}] * 4))
    rng = random.Random(0)
    prompts = [[rng.randrange(7, 4000) for _ in range(rng.randint(50, 300))] for _ in range(a.rows)]
    completions = [[rng.randrange(7, 4000) for _ in range(rng.choice([rng.randint(20, 200), 512]))]
                   for _ in range(a.rows)]
    p, c = max(map(len, prompts)), max(map(len, completions))
    ids = torch.tensor([[0] * (p - len(x)) + x + y + [0] * (c - len(y)) for x, y in zip(prompts, completions)]).cuda()
    mask = torch.tensor([[0] * (p - len(x)) + [1] * (len(x) + len(y)) + [0] * (c - len(y))
                         for x, y in zip(prompts, completions)]).cuda()
    cmask = mask[:, p:]
    real = int(mask.sum())

    def step(impl, method):
        trainer.model.set_attn_implementation(impl)
        trainer.model.zero_grad(set_to_none=True)
        logps, _, _ = method(trainer, trainer.model, ids, mask, c, batch_size=a.chunk)
        (logps * cmask).sum().backward()
        return logps.detach()

    def timed(impl, method, n=5):
        step(impl, method)  # warm-up (kernels, allocator)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            out = step(impl, method)
        end.record()
        end.synchronize()
        return out, start.elapsed_time(end) / 1000 / n

    padded, t_pad = timed("sdpa", GRPOTrainer._get_per_token_logps_and_entropies)
    packed, t_pack = timed(choice.impl, PaddingFreeGRPOTrainer._get_per_token_logps_and_entropies)
    padded2, t_pad2 = timed("sdpa", GRPOTrainer._get_per_token_logps_and_entropies)
    keep = cmask.bool()
    diff = (packed[keep].float() - padded[keep].float()).abs()
    res = {"kernel": choice.impl, "rows": a.rows, "positions_padded": ids.numel(), "real_tokens": real,
           "padding_share": round(1 - real / ids.numel(), 3), "padded_s": round((t_pad + t_pad2) / 2, 4),
           "packed_s": round(t_pack, 4), "speedup": round((t_pad + t_pad2) / 2 / t_pack, 2),
           "max_abs_logp_diff": round(diff.max().item(), 4), "mean_abs_logp_diff": round(diff.mean().item(), 5)}
    print("RESULT " + json.dumps(res), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res))
    return 0 if res["mean_abs_logp_diff"] < 0.05 else 1


if __name__ == "__main__":
    raise SystemExit(main())
