"""Where a decode step of trainbox's static decoder (trainbox/training/grpo/static_decode.py) spends its GPU time, and what
fused sibling projections (q/k/v, gate/up as one GEMM) and compile modes change (issue 31 item 4).

    python benchmarks/decode_probe.py                       # plain vs fused, alternated, then one profiled rollout each
    python benchmarks/decode_probe.py --modes reduce-overhead max-autotune

One process, the float32 policy loaded once (train_throughput.py's shape), one decoder per variant, each compiled
by its first rollout (timed: the compile), then --reps rollouts per variant in alternation (16 rows x 256 tokens,
hf_rollout.py's prompts, no end token). Printed per variant: median ms per decode step, and from one profiled
rollout the GPU kernel time per step, kernels per step and the largest kernels by share.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import ROOT, SHAPES, make_model  # noqa: E402
from vllm_rollout import COMPLETION, prompt_rows as prompts  # noqa: E402

sys.path.insert(0, str(ROOT))


def profile(dec, tok, top: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    rows = prompts(tok, 99)
    with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        dec.generate(rows)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in kernels)  # us
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.device_time)
    steps = COMPLETION - 1
    print(f"    kernels: {len(kernels) / steps:.0f} a step, {total / steps / 1000:.3f} ms GPU a step "
          f"({total / 1000:.1f} ms a rollout, prefill included)", flush=True)
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"      {100 * sum(times) / total:5.1f} %  {len(times) / steps:6.1f}/step  "
              f"{statistics.mean(times):7.1f} us  {name[:110]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES))
    ap.add_argument("--fuse", nargs="*", default=["plain", "fused"], choices=["plain", "fused"])
    ap.add_argument("--modes", nargs="*", default=["reduce-overhead"], help="torch.compile modes (CUDA graphs: "
                    "reduce-overhead, max-autotune)")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--top", type=int, default=14, help="kernels listed per profile")
    ap.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "vllm-rollout"))
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainbox.training.grpo.static_decode import StaticDecoder

    path = make_model(Path(a.work) / a.shape, a.shape)
    tok = AutoTokenizer.from_pretrained(path)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    print(f"# decode_probe: {a.shape} shape, 16 rows x {COMPLETION} tokens, {torch.cuda.get_device_name()}",
          flush=True)
    decoders = {}
    for mode in a.modes:
        for fuse in a.fuse:
            name = f"{fuse}/{mode}"
            dec = StaticDecoder(policy, max_new=COMPLETION, pad_id=tok.pad_token_id, eos_ids=[],
                                uncompiled_fallback=False, fuse=fuse == "fused")
            dec._fit(16, 512)
            dec.step = torch.compile(dec._step, mode=mode, fullgraph=True)
            t = time.perf_counter()
            out = dec.generate(prompts(tok, 0))
            torch.cuda.synchronize()
            print(f"  {name:<28} first rollout (compile) {time.perf_counter() - t:6.1f} s, "
                  f"{len({tuple(c) for c in out})} distinct rows", flush=True)
            decoders[name] = dec
    times: dict[str, list[float]] = {n: [] for n in decoders}
    for rep in range(a.reps):
        order = list(decoders) if rep % 2 == 0 else list(decoders)[::-1]
        for name in order:
            dec = decoders[name]
            torch.cuda.synchronize()
            t = time.perf_counter()
            dec.sync(policy)
            dec.generate(prompts(tok, rep + 1))
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t)
    for name, dec in decoders.items():
        med = statistics.median(times[name])
        print(f"  {name:<28} {med:.3f} s/rollout  {1000 * med / COMPLETION:.2f} ms/step  "
              f"runs {[round(x, 3) for x in times[name]]}", flush=True)
        profile(dec, tok, a.top)


if __name__ == "__main__":
    main()
