"""Colocated vLLM's rollout as TRL's GRPOTrainer drives it (issue 31 item 4), timed per decode step, for engine and
sampling variants: where the 0.58 s of `vLLM.generate` in a GRPO step goes, and what shortens it.

    python benchmarks/vllm_rollout.py                        # TRL 1.16's colocate engine and sampling params
    python benchmarks/vllm_rollout.py --engine 'eager={"enforce_eager": true}' 'v2=VLLM_USE_V2_MODEL_RUNNER=1' \
        --sampling 'nodetok={"detokenize": false}' 'nolp={"logprobs": null}'

The engine is built with the keyword arguments TRL's VLLMGeneration passes in colocate mode (external launcher,
max_num_seqs = the generation batch, max_num_batched_tokens 4096, processed logprobs, vLLM's memory share), the model
is train_throughput.py's Llama-3.2-1B shape, the prompts are its GRPO prompts (2 prompts x 8 generations, as
`train_throughput.py grpo`), and every completion runs to 256 tokens (a random model never says its end token).
Each engine variant runs in a process of its own (items NAME=VALUE set that process's environment; a JSON object
adds LLM keyword arguments); each sampling variant is timed on every engine after two warm-up rollouts. Printed: ms per
decode step (a rollout's wall time / 256) and, from one profiled rollout, the share of the wall time the GPU was busy.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_throughput import ROOT, WORDS, make_model, split_env  # noqa: E402

COMPLETION = 256
PROMPTS, GENERATIONS = 2, 8
# TRL 1.16 GRPOTrainer -> VLLMGeneration (colocate): the LLM's arguments and the sampling parameters it builds.
TRL_ENGINE = dict(tensor_parallel_size=1, gpu_memory_utilization=0.3, max_num_seqs=PROMPTS * GENERATIONS,
                  distributed_executor_backend="external_launcher", seed=0, max_num_batched_tokens=4096,
                  logprobs_mode="processed_logprobs", model_impl="vllm")
TRL_SAMPLING = dict(n=1, repetition_penalty=1.0, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                    max_tokens=COMPLETION, logprobs=0)


def prompt_ids(model: Path) -> list[list[int]]:
    """train_throughput's GRPO prompts (system prompt + 40-160 words), chat-templated, each repeated GENERATIONS
    times as TRL's sampler repeats them."""
    from transformers import AutoTokenizer

    return prompt_rows(AutoTokenizer.from_pretrained(model))


def prompt_rows(tok, seed: int = 0) -> list[list[int]]:
    """prompt_ids with a loaded tokenizer and another draw of questions per seed (hf_rollout.py's rollouts)."""
    from trainbox.training.grpo.rewards import SYSTEM_PROMPT

    rng = random.Random(seed)
    rows = []
    for _ in range(PROMPTS):
        question = " ".join(f"w{rng.randrange(WORDS)}" for _ in range(rng.randint(40, 160)))
        ids = tok.apply_chat_template([{"role": "system", "content": SYSTEM_PROMPT},
                                       {"role": "user", "content": question}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        rows += [list(ids)] * GENERATIONS
    return rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child(spec: dict) -> None:
    """One engine: build it, time every sampling variant, print one RESULT line per variant."""
    import torch

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    from vllm import LLM, SamplingParams

    model = Path(spec["model"])
    t = time.time()
    llm = LLM(model=str(model), **{**TRL_ENGINE, **spec["engine"]})
    built = time.time() - t
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids(model)]
    for name, extra in spec["sampling"]:
        params = SamplingParams(**{**TRL_SAMPLING, **extra})
        for _ in range(2):
            llm.generate(prompts, sampling_params=params, use_tqdm=False)
        times, tokens = [], 0
        for _ in range(spec["reps"]):
            torch.cuda.synchronize()
            t = time.perf_counter()
            out = llm.generate(prompts, sampling_params=params, use_tqdm=False)
            times.append(time.perf_counter() - t)
            tokens = sum(len(o.outputs[0].token_ids) for o in out)
        busy = gpu_busy(llm, prompts, params)
        wall = statistics.median(times)
        print("RESULT " + json.dumps(dict(engine=spec["name"], sampling=name, rollout_s=wall,
                                          ms_per_step=1000 * wall / COMPLETION, tokens=tokens, gpu_busy=busy,
                                          build_s=built, runs=times)), flush=True)


def gpu_busy(llm, prompts, params) -> float | None:
    """Share of one rollout's wall time covered by GPU kernels (torch.profiler; kernels inside CUDA graphs count)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            torch.cuda.synchronize()
            t = time.perf_counter()
            llm.generate(prompts, sampling_params=params, use_tqdm=False)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    except Exception as e:  # the profiler is a diagnosis: its failure must not hide the timings
        print(f"profiler failed: {e}", flush=True)
        return None
    covered, end = 0.0, None
    for s, e in spans:  # union of kernel intervals (microseconds)
        if end is None or s > end:
            covered += e - s
            end = e
        elif e > end:
            covered += e - end
            end = e
    return covered / 1e6 / wall if wall else None


def variants(items: list[str], what: str) -> list[tuple[str, list[str]]]:
    """LABEL=ITEMS with ITEMS a JSON object and/or NAME=VALUE environment items, separated by spaces."""
    out = []
    for text in items:
        label, sep, rest = text.partition("=")
        if not sep or not label:
            sys.exit(f"--{what} {text!r}: write LABEL=ITEMS, e.g. eager='{{\"enforce_eager\": true}}'")
        out.append((label, rest))
    return out


def parse_items(label: str, rest: str) -> tuple[dict, dict]:
    env, kwargs = {}, {}
    rest = rest.strip()
    if "{" in rest:
        start, end = rest.index("{"), rest.rindex("}") + 1
        try:
            kwargs = json.loads(rest[start:end])
        except json.JSONDecodeError as e:
            sys.exit(f"{label}: not a JSON object: {e}")
        rest = rest[:start] + rest[end:]
    env, leftover = split_env(rest.split())
    if leftover:
        sys.exit(f"{label}: {leftover} is neither a JSON object nor NAME=VALUE")
    return env, kwargs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", nargs="*", default=[],
                    help="more engines after TRL's: LABEL='{\"llm_kwarg\": ...} NAME=VALUE ...'")
    ap.add_argument("--sampling", nargs="*", default=[],
                    help="more sampling variants after TRL's: LABEL='{\"sampling_param\": ...}'")
    ap.add_argument("--reps", type=int, default=5, help="timed rollouts per variant (median reported)")
    ap.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "vllm-rollout"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(json.loads(a.child))
    work = Path(a.work)
    model = make_model(work / "llama-1b", "llama-1b")
    sampling = [("trl", {})]
    for label, rest in variants(a.sampling, "sampling"):
        env, kwargs = parse_items(label, rest)
        if env:
            sys.exit(f"--sampling {label}: environment items belong to --engine")
        sampling.append((label, kwargs))
    engines = [("trl", {}, {})] + [(label, *parse_items(label, rest)) for label, rest in variants(a.engine, "engine")]
    print(f"# vllm_rollout: llama-1b shape, {PROMPTS} prompts x {GENERATIONS} generations x {COMPLETION} tokens, "
          f"TRL 1.16 colocate engine/sampling; median of {a.reps}", flush=True)
    log = work / "vllm_rollout.log"
    results = []
    for name, env, kwargs in engines:
        spec = dict(name=name, model=str(model), engine=kwargs, sampling=sampling, reps=a.reps)
        with open(log, "a") as f:
            f.write(f"\n===== engine {name}: {kwargs} {env}\n")
            f.flush()
            p = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT),
                                                                                 os.environ.get("PYTHONPATH", "")]),
                                    "TOKENIZERS_PARALLELISM": "false", **env},
                               stdout=subprocess.PIPE, stderr=f, text=True)
        lines = [json.loads(x[7:]) for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode or not lines:
            print(f"engine {name}: FAILED (exit {p.returncode}); last lines of {log}:", flush=True)
            os.system(f"tail -n 25 {log}")
            continue
        for r in lines:
            busy = f"{100 * r['gpu_busy']:.0f} %" if r.get("gpu_busy") is not None else "?"
            print(f"  engine {r['engine']:<10} sampling {r['sampling']:<10} {r['rollout_s']:.3f} s/rollout  "
                  f"{r['ms_per_step']:.2f} ms/step  GPU busy {busy}  tokens {r['tokens']}  "
                  f"(engine built in {r['build_s']:.0f} s)", flush=True)
        results += lines
    json.dump(results, open(work / "vllm_rollout.json", "w"), indent=1)


if __name__ == "__main__":
    main()
