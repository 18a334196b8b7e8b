"""GRPO's rollout through transformers' own `generate` (no vLLM), for cache/compile/dtype variants: can a
CUDA-graphed static-cache decode on the policy's own weights beat colocated vLLM's 0.5-0.9 s rollout (issue 31
item 4; vllm_rollout.py measures vLLM's side on the same shape and prompts)?

    python benchmarks/hf_rollout.py                 # every variant, median of --reps rollouts each

Variants (each in one process, in this order):
  trl       what TRL's GRPOTrainer runs without vLLM: float32 weights under bf16 autocast, dynamic cache, compile off
  bf16      a bfloat16 copy of the weights, dynamic cache
  static    the bfloat16 copy, a static cache of fixed length (prompt budget + completion), transformers' auto-compile
            of the decode step (torch.compile, mode reduce-overhead = CUDA graphs)
  ours      trainbox's engine (trainbox/training/grpo/static_decode.py) on the float32 policy: a bfloat16 decoder copy
            synced before each rollout, a static cache of fixed rows and length, the prefill uncompiled, then one
            decode step (forward + sampling) compiled once and replayed as a CUDA graph for every token
Each rollout is 2 prompts x 8 generations x 256 sampled tokens (temperature 1, no end token, as vllm_rollout.py), on
train_throughput.py's Llama-3.2-1B shape (or `--shape`); every rollout draws new prompts (40-160 words), so prompt
lengths change between rollouts as they do between GRPO steps. Printed: the first rollout (compile included), the
median of the rest, ms per decode step, and how many of the 16 completions differ (sampling must not repeat itself).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import ROOT, SHAPES, make_model  # noqa: E402
from vllm_rollout import COMPLETION, GENERATIONS, PROMPTS, prompt_rows as prompts  # noqa: E402

PROMPT_BUDGET = 512  # the static cache holds this many prompt tokens + COMPLETION
VARIANTS = ("trl", "bf16", "static", "ours")


def child(name: str, model_dir: str, reps: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, StaticCache

    tok = AutoTokenizer.from_pretrained(model_dir)
    dtype = torch.float32 if name in ("trl", "ours") else torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).cuda().eval()
    gen = GenerationConfig(max_new_tokens=COMPLETION, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                           pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=None,
                           disable_compile=name != "static")

    def rollout(seed: int) -> tuple[float, int]:
        rows = prompts(tok, seed)
        width = max(map(len, rows))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows], device="cuda")
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device="cuda")
        kwargs = {}
        if name == "static":
            kwargs["past_key_values"] = StaticCache(config=model.config, max_cache_len=PROMPT_BUDGET + COMPLETION)
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=name == "trl"):
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen, **kwargs)
        torch.cuda.synchronize()
        return (time.perf_counter() - t, (out.shape[1] - width) * out.shape[0],
                len({tuple(r) for r in out[:, width:].tolist()}))

    if name == "ours":
        rollout = ours_rollout(model, tok, prompts)
    first, tokens, distinct = rollout(0)
    times = [rollout(seed)[0] for seed in range(1, reps + 1)]
    print("RESULT " + json.dumps(dict(variant=name, first_s=first, rollout_s=statistics.median(times), runs=times,
                                      tokens=tokens, distinct=distinct,
                                      peak_gib=torch.cuda.max_memory_allocated() / 2**30)),
          flush=True)


def ours_rollout(model, tok, make_prompts):
    """The `ours` variant (trainbox/training/grpo/static_decode.py): returns rollout(seed) -> (seconds, tokens, distinct),
    the time including the weight sync from the float32 policy that a GRPO step does."""
    import torch

    from trainbox.training.grpo.static_decode import StaticDecoder

    dec = StaticDecoder(model, max_new=COMPLETION, pad_id=tok.pad_token_id, eos_ids=[])

    def rollout(seed: int):
        rows = make_prompts(tok, seed)
        torch.cuda.synchronize()
        t = time.perf_counter()
        dec.sync(model)
        out = dec.generate(rows)
        torch.cuda.synchronize()
        return time.perf_counter() - t, sum(map(len, out)), len({tuple(c) for c in out})

    return rollout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES), help="train_throughput.py's model shapes")
    ap.add_argument("--reps", type=int, default=5, help="timed rollouts per variant after the first (median)")
    ap.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "vllm-rollout"))
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(a.child[0], a.child[1], a.reps)
    model = make_model(Path(a.work) / a.shape, a.shape)
    print(f"# hf_rollout: {a.shape} shape, {PROMPTS} prompts x {GENERATIONS} generations x {COMPLETION} tokens, "
          f"transformers generate; median of {a.reps} after a first rollout", flush=True)
    for name in a.variants:
        p = subprocess.run([sys.executable, __file__, "--reps", str(a.reps), "--child", name, str(model)], cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT),
                                                                             os.environ.get("PYTHONPATH", "")])},
                           stdout=subprocess.PIPE, text=True)
        lines = [json.loads(x[7:]) for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode or not lines:
            print(f"  {name}: FAILED (exit {p.returncode})", flush=True)
            continue
        r = lines[0]
        print(f"  {name:<7} {r['rollout_s']:.3f} s/rollout  {1000 * r['rollout_s'] / COMPLETION:.2f} ms/step  "
              f"first {r['first_s']:.1f} s  tokens {r['tokens']} ({r['distinct']} distinct rows)  "
              f"peak {r['peak_gib']:.1f} GiB  runs {[round(x, 3) for x in r['runs']]}", flush=True)


if __name__ == "__main__":
    main()
