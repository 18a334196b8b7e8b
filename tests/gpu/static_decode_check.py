"""The static decoder (trainbox/training/grpo/static_decode.py) on a GPU for every zoo architecture: does its decode step
compile into a CUDA graph (or fall back, said on stderr), and is its greedy decode what a full float32 forward
predicts (cache, windows, softcaps, sinks, experts)? Also the ms per step of a second, already compiled run.

Usage: python tests/gpu/static_decode_check.py [NAME ...]
Prints one line per architecture: compiled yes/no, tokens checked, mismatches beyond near-ties, ms/step.
Exit 1 when any architecture mismatches or did not compile.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main(names: list[str]) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from tiny import make_tokenizer
    from trainbox.training.grpo.static_decode import StaticDecoder
    from zoo import ZOO, make_config

    torch.backends.cuda.matmul.allow_tf32 = False
    tok = make_tokenizer()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, len(tok), (n,), generator=g).tolist() for n in (5, 13, 22, 40)]
    bad = 0
    for name in names or sorted(ZOO):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(make_config(name, tok), dtype=torch.float32).cuda().eval()
        dec = StaticDecoder(model, max_new=40, pad_id=tok.pad_token_id, eos_ids=[], temperature=1e-6,
                            dtype=torch.float32)
        out = dec.generate(prompts)
        checked = wrong = 0
        for prompt, completion in zip(prompts, out, strict=True):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + completion], device="cuda")).logits[0]
            top = logits[len(prompt) - 1 : -1].topk(2, -1)
            for j, t in enumerate(completion):
                checked += 1
                wrong += t != top.indices[j, 0].item() and (top.values[j, 0] - top.values[j, 1]).item() > 1e-3
        torch.cuda.synchronize()
        t = time.perf_counter()
        dec.generate(prompts)
        torch.cuda.synchronize()
        ms = 1000 * (time.perf_counter() - t) / 40
        bad += bool(wrong) or not dec.compile
        print(f"{name:<15} compiled {'yes' if dec.compile else 'NO'}  tokens {checked}  mismatches {wrong}  "
              f"{ms:.2f} ms/step (float32, 4 rows, compiled run)", flush=True)
    return 1 if bad else 0


def each(names: list[str]) -> int:
    """One process per architecture: dynamo's recompile limit counts the decode step's code across models."""
    import subprocess

    from zoo import ZOO

    return max(subprocess.run([sys.executable, __file__, "--one", name]).returncode for name in names or sorted(ZOO))


if __name__ == "__main__":
    argv = sys.argv[1:]
    raise SystemExit(main(argv[1:]) if argv[:1] == ["--one"] else each(argv))
