"""GPU check for `grpo`: a few GRPO steps with the gsm8k preset on a local model (or a ~100M Llama built here, no hub);
prints steps/s, tokens/s (prompt + completion tokens) and peak GPU memory from the entrypoint's summary line.

    python tests/gpu/grpo_bench.py [--model PATH] [--mode full|lora|qlora] [--steps 10] [--batch 8]
                                   [--num-generations 8] [--completion 256] [--json out.json]

Rollouts are whatever `grpo` picks (vLLM colocate when vllm is importable, else transformers generate); the chosen
one is reported in the result. The random model rarely stops early, so completions run to --completion tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import tempfile
from pathlib import Path

from common import build_model, report, run_entrypoint


def write_gsm8k(path: Path, rows: int) -> Path:
    """gsm8k-shaped rows: a word problem and a worked answer ending in `#### N`."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(rows):
            a, b = rng.randint(2, 500), rng.randint(2, 500)
            f.write(json.dumps({
                "question": f"Natalia sold {a} clips in April and {b} clips in May. How many clips did she sell?",
                "answer": f"She sold {a} + {b} = <<{a}+{b}={a + b}>>{a + b} clips.\n#### {a + b}",
            }) + "\n")
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="saved model directory; default: build a ~100M Llama locally")
    ap.add_argument("--mode", choices=("full", "lora", "qlora"), default="full")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8, help="per-device batch size (completions per step per GPU)")
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--completion", type=int, default=256, help="max_completion_length")
    ap.add_argument("--work", help="work directory (default: a temporary one)")
    ap.add_argument("--json", help="also write the result here")
    a = ap.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="grpo-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    model = a.model or str(build_model(work / "llama-100m"))
    data = write_gsm8k(work / "gsm8k.jsonl", rows=max(64, a.steps * a.batch))
    args = ["--model_name_or_path", model, "--dataset", str(data), "--preset", "gsm8k", "--mode", a.mode,
            "--output_dir", str(work / "out"), "--max_steps", str(a.steps), "--per_device_train_batch_size",
            str(a.batch), "--num_generations", str(a.num_generations), "--max_completion_length", str(a.completion),
            "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none", "--resume", "never",
            "--disable_tqdm", "true", "--bf16", "true", "--dtype", "bfloat16"]  # fmt: skip
    log = work / "grpo.log"
    result = run_entrypoint("grpo", args, log)
    text = log.read_text()
    result["mode"] = a.mode
    if m := re.search(r"rollouts: ([^;]+)", text):
        result["rollouts"] = m.group(1)
    if m := re.search(r"grpo: loaded: ([^\n]+)", text):
        result["loaded"] = m.group(1)
    # Per-step generation vs. update split from the Trainer's own log lines (`step_time` is TRL's).
    steps = [float(x) for x in re.findall(r"'step_time': '([\d.]+)'", text)]
    if steps:
        result["step_time_s_median"] = sorted(steps)[len(steps) // 2]
    return report(result, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
