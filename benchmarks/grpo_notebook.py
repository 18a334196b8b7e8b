"""GRPO at Unsloth's Llama-3.1-8B notebook's size: trainbox grpo vs Unsloth's GRPO vs TRL's GRPOTrainer (issue 63).

    python benchmarks/grpo_notebook.py [--steps 4] [--skip 1] [--side-timeout 150] [--sides trl unsloth ours] [--vllm]
                                       [--unsloth-site DIR] [--work DIR] [--dry-run]

The notebook's settings on every side: the Llama-3.1-8B shape (random init, bf16 on disk, 4-bit nf4 as it loads),
LoRA r 32 (alpha 32) on the seven projections, 6 generations of one prompt a step, prompts up to 256 tokens,
completions up to 768 (a random model never ends one: every rollout is 768 tokens), the gsm8k preset's five rewards
(trainbox.training.grpo.rewards), the same prompts (benchmarks/train_throughput.write_prompts) and seed.
  trl      `trl grpo` with --load_in_4bit --use_peft (TRL's docs), transformers generate; with --vllm, vLLM colocate.
  unsloth  benchmarks/unsloth_sides.py grpo: the notebook's cells 8 and 12 (fast_inference only with --vllm).
  ours     `trainbox grpo --mode qlora` with its defaults for that setup (its rollout engine: vLLM colocate where
           vllm imports, else its static decoder where the merged bf16 copy fits, else transformers generate).
Without --vllm nothing needs vLLM; with it (vLLM carried: benchmarks/device_wheels.py) the vLLM variants run instead.

Measured like train_throughput.py (its sitecustomize hook, BENCH_SKIP first steps untimed): steps/s, the generation
share of a step (TRL's profiled `*generate*` sections over the step's time; Unsloth's trainer is TRL's, rewritten),
peak allocated memory and, with vLLM's own pool in it, the most the process held on the GPU at a step's end.
Prints one `GRPO8B` row per side and a SUMMARY line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import train_throughput as tt  # noqa: E402  (benchmarks/ is no package: its folder goes on the path first)

REWARDS = ["correctness", "int_format", "strict_format", "soft_format", "xmlcount"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def commands(a, model: Path, data: Path, work: Path) -> dict:
    """Each side's argv and environment."""
    py = sys.executable
    shared = ["--num_generations", "6", "--per_device_train_batch_size", "6", "--max_completion_length",
              str(a.max_seq_length - a.max_prompt_length), "--max_steps", str(a.steps), "--logging_steps", "1",
              "--save_strategy", "no", "--report_to", "none", "--seed", "0", "--disable_tqdm", "true"]
    lora = ["--lora_r", "32", "--lora_alpha", "32", "--lora_target_modules", *TARGETS]
    trl = [py, "-m", "trl.cli.main", "grpo", "--model_name_or_path", str(model), "--dataset_name", str(data),
           "--output_dir", str(work / "o-trl"), "--load_in_4bit", "true", "--use_bnb_nested_quant", "true",
           "--bnb_4bit_quant_type", "nf4", "--use_peft", "true", "--dtype", "bfloat16", *lora, *shared,
           "--reward_funcs", *[f"trainbox.training.grpo.rewards.{r}" for r in REWARDS],
           *(["--use_vllm", "true", "--vllm_mode", "colocate"] if a.vllm else [])]
    ours = [py, "-m", "trainbox", "grpo", "--model_name_or_path", str(model), "--dataset", str(data / "train.jsonl"),
            "--output_dir", str(work / "o-ours"), "--mode", "qlora", *lora, *shared, "--max_prompt_tokens",
            str(a.max_prompt_length), "--resume", "never", "--reward_funcs",
            ",".join(f"rewards:{r}" for r in REWARDS)]
    unsloth = [py, str(ROOT / "benchmarks" / "unsloth_sides.py"), "grpo", str(model), str(data / "train.jsonl"),
               str(work / "o-unsloth"), "--steps", str(a.steps), "--max-seq-length", str(a.max_seq_length),
               "--max-prompt-length", str(a.max_prompt_length), "--fast-inference", "true" if a.vllm else "false"]
    env = {"BENCH_SKIP": str(a.skip), "BENCH_PHASES": "1", "BENCH_DEVICE_MEM": "1", "BENCH_EACH_STEP": "1"}
    site = [a.unsloth_site] if a.unsloth_site else [os.environ.get("PYTHONPATH", "")]
    unsloth_env = {**env, "BENCH_FIRST_IMPORT": "unsloth",
                   "PYTHONPATH": os.pathsep.join([str(work / "_measure"), str(ROOT), *site])}
    return {"trl": (trl, env), "unsloth": (unsloth, unsloth_env), "ours": (ours, env)}


def generation_share(res: dict) -> float | None:
    """Seconds a step spends in the profiled generate sections over the step's seconds (None: none profiled)."""
    gen = sum(v for k, v in res.get("phases", {}).items() if "generate" in k)
    per_step = res["seconds"] / max(1, res["steps"])
    return gen / per_step if gen else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps a side (default 4: 1 untimed, 3 timed)")
    ap.add_argument("--skip", type=int, default=1, help="first steps not timed (compilation, CUDA graphs, caches)")
    ap.add_argument("--sides", nargs="+", default=["trl", "unsloth", "ours"], choices=["trl", "unsloth", "ours"],
                    help="which sides run, in this order")
    ap.add_argument("--side-timeout", type=float, default=150,
                    help="seconds a side may take (load included); past it the side is killed and the steps it "
                         "finished are reported")
    ap.add_argument("--vllm", action="store_true", help="the vLLM variants (needs vllm importable on every side)")
    ap.add_argument("--max-seq-length", type=int, default=1024, help="the notebook's max_seq_length")
    ap.add_argument("--max-prompt-length", type=int, default=256, help="the notebook's max_prompt_length")
    ap.add_argument("--unsloth-site", default=os.environ.get("BENCH_UNSLOTH_SITE"),
                    help="the folder Unsloth and its TRL <= 1.15 are installed in, the Unsloth side's PYTHONPATH "
                         "instead of the inherited one (default: $BENCH_UNSLOTH_SITE)")
    ap.add_argument("--work", default=None, help="work folder (the 8B model is made there once and kept)")
    ap.add_argument("--dry-run", action="store_true", help="write the prompts, print each side's command, stop")
    a = ap.parse_args()
    if a.steps <= a.skip + 1:
        ap.error(f"--steps {a.steps} leaves fewer than 2 timed steps after --skip {a.skip}: raise --steps")
    if a.vllm and importlib.util.find_spec("vllm") is None:
        ap.error("--vllm: vllm does not import here; carry it first (benchmarks/device_wheels.py) or drop --vllm")
    work = Path(a.work or tempfile.mkdtemp(prefix="grpo8b-"))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "grpo8b.log"
    data = tt.write_prompts(work / "data-grpo8b", 64 * a.steps)
    model = work / "llama-8b"
    cmds = commands(a, model, data, work)
    if a.dry_run:
        for who in a.sides:
            argv, env = cmds[who]
            print(f"{who}: {' '.join(f'{k}={v}' for k, v in env.items())} {shlex.join(argv)}")
        return
    tt.make_model(model, "llama-8b")
    print(f"# grpo at the notebook's size: llama-8b shape (random init), 4-bit nf4, LoRA r32 on {len(TARGETS)} "
          f"projections, 6 generations, prompts <= {a.max_prompt_length}, completions <= "
          f"{a.max_seq_length - a.max_prompt_length}; {'vLLM' if a.vllm else 'no vLLM'}; {a.steps} steps, first "
          f"{a.skip} untimed", flush=True)
    results = {}
    for who in a.sides:
        argv, env = cmds[who]
        res = tt.run(f"grpo8b-{who}", argv, work, log, env, a.side_timeout)
        if tt.usable(res):
            res["steps_per_s"] = res["steps"] / res["seconds"]
            res["generation_share"] = generation_share(res)
            print(f"RESULT {json.dumps({k: v for k, v in res.items() if k not in ('losses', 'rewards')})}",
                  flush=True)
        results[who] = res
    print("GRPO8B side      steps/s   s/step  generation  peak alloc GiB  peak held GiB  completion len", flush=True)
    for who, r in results.items():
        if "steps_per_s" not in r:
            print(f"GRPO8B {who:<9} FAILED (see {log})", flush=True)
            continue
        share = f"{100 * r['generation_share']:9.0f} %" if r["generation_share"] is not None else "      n/a  "
        lens = [v for _, v in r.get("series", {}).get("completions/mean_length", [])]
        print(f"GRPO8B {who:<9} {r['steps_per_s']:8.3f} {1 / r['steps_per_s']:8.2f} {share} "
              f"{r['peak_gib']:15.2f} {r['peak_device_gib']:14.2f}  {sum(lens) / len(lens) if lens else 0:13.0f}"
              + (f"  (cut at --side-timeout: {r['steps']} timed step(s))" if r.get("cut") else ""), flush=True)
    ok = {w: r for w, r in results.items() if "steps_per_s" in r}
    if "ours" in ok:
        vs = [f"{ok['ours']['steps_per_s'] / r['steps_per_s']:.2f}x {w} (peak {ok['ours']['peak_device_gib']:.1f} "
              f"vs {r['peak_device_gib']:.1f} GiB held)" for w, r in ok.items() if w != "ours"]
        print("SUMMARY grpo8b: ours " + "; ".join(vs), flush=True)
    json.dump(results, open(work / "grpo8b-results.json", "w"), indent=1, default=str)


if __name__ == "__main__":
    main()
