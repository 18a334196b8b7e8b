"""selftest's training rows: a 3-step `sft`, `qlora` and `grpo` (once per rollout engine the image has) on a tiny
model built on the spot, through the commands' own mains in one child process (the imports, TRL's above all, are
most of a tiny run's time: paid once), as tests/test_zoo.py runs them. A row passes when its command exits 0, every
logged loss is finite, sft's and qlora's last loss is below their first, and what it saved loads again and gives
finite logits. `fault` (TRAINBOX_SELFTEST_FAULT names the row) damages the saved weights before the reload.

One GPU (the first visible): the NCCL row covers the others; the trainers would otherwise start torchrun across all
of them. Outside the child: `engines()` says which grpo rows can run here.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from common import errors
from trainbox.image import tinymodel

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
ROWS = ("train-sft", "train-qlora", "train-grpo-transformers", "train-grpo-static", "train-grpo-vllm")
COMMON = ["--logging_steps", "1", "--disable_tqdm", "true", "--report_to", "none", "--dataloader_num_workers", "0",
          "--max_steps", "3", "--save_steps", "3"]
# Rollout engines: grpo's options that pick each (grpo/rollouts.py), and what each needs.
ENGINES = {
    "train-grpo-transformers": ["--use_vllm", "false", "--static_decode", "false"],
    "train-grpo-static": ["--use_vllm", "false", "--static_decode", "true"],
    "train-grpo-vllm": ["--use_vllm", "true", "--vllm_mode", "colocate", "--static_decode", "false",
                  "--vllm_gpu_memory_utilization", "0.2", "--vllm_max_model_length", "256"],
}
# Set by the parent: a file that exists once the vllm-engine row's own vLLM is gone (two engines starting at once on
# one GPU would each see the other's memory as taken).
VLLM_FREE_ENV = "TRAINBOX_SELFTEST_VLLM_FREE"


def engines(gpu: bool, has_vllm: bool) -> dict[str, str | None]:
    """grpo row -> None when it can run here, else why not (the parent's SKIP reason)."""
    return {"train-grpo-transformers": None,
            "train-grpo-static": None if gpu else "no GPU here: the static decoder is a CUDA-graphed decode step",
            "train-grpo-vllm": (None if gpu and has_vllm else "vllm is not installed" if not has_vllm
                          else "no GPU here: vLLM needs one")}


def jobs(work: Path, gpu: bool) -> dict[str, tuple[str, list[str], Path]]:
    """row -> (command, argv, what it saves)."""
    model = tinymodel.write(work / "model", "llama", head_dim=64 if gpu else 16)
    chat, dolly = tinymodel.chat_data(work / "chat.jsonl"), tinymodel.dolly_data(work / "dolly.jsonl")
    gsm8k = tinymodel.gsm8k_data(work / "gsm8k.jsonl")
    out = work / "out"
    sft_like = ["--max_length", "64", "--per_device_train_batch_size", "2", "--learning_rate", "5e-3", *COMMON]
    table = {
        "train-sft": ("sft", ["--model_name_or_path", str(model), "--dataset", str(chat), "--output_dir",
                              str(out / "sft"), *sft_like], out / "sft"),
        "train-qlora": ("qlora", ["--model_name_or_path", str(model), "--dataset", str(dolly), "--output_dir",
                                  str(out / "qlora"), "--merge", *sft_like], out / "qlora" / "merged"),
    }
    for row, engine in ENGINES.items():
        table[row] = ("grpo", ["--model_name_or_path", str(model), "--dataset", str(gsm8k), "--preset", "gsm8k",
                               "--reward_funcs", "trainbox.image.selftesttrain:varied",
                               "--learning_rate", "1e-4", "--output_dir", str(out / row), "--num_generations", "4",
                               "--per_device_train_batch_size", "4", "--max_completion_length", "8",
                               *([] if gpu else ["--bf16", "false"]), *engine, *COMMON], out / row)
    return table


def varied(completions, **kwargs) -> list[float]:
    """grpo's reward here: distinct characters of a completion, so a random policy's 4 samples differ in reward and
    the loss has an advantage to follow (the gsm8k preset's rewards are all 0 for it: no gradient)."""
    texts = [c if isinstance(c, str) else " ".join(m.get("content") or "" for m in c) for c in completions]
    return [len(set(t)) / 8.0 for t in texts]


def logged(output_dir: Path, key: str) -> list[float]:
    state = json.loads((output_dir / "checkpoint-3" / "trainer_state.json").read_text())
    return [float(e[key]) for e in state["log_history"] if key in e]


def reload(saved: Path, fault: bool) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    if fault:  # the planted fault: the weights on disk cut short
        weights = saved / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    # On the GPU the run trained on: the trainers' kernels (Liger's, patched into the model classes of this process)
    # are Triton's, CUDA only; a reload on the CPU here failed in them on the device, not in what was saved.
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).to(dev)
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7, 8]], device=dev)).logits
    if not bool(torch.isfinite(logits).all()):
        raise ValueError(f"the model saved to {saved} gives non-finite logits")
    return saved.name


def one(row: str, command: str, argv: list[str], saved: Path, fault: bool) -> tuple[str, str]:
    import importlib

    from common import commands

    if row == "train-grpo-vllm" and os.environ.get(VLLM_FREE_ENV):
        while not os.path.exists(os.environ[VLLM_FREE_ENV]):
            time.sleep(0.5)
    rc = importlib.import_module(commands.qualified(command)).main(argv)
    if rc != 0:
        return FAIL, f"`trainbox {command}` exited {rc} (its log is above in the child's output)"
    out = saved.parent if command == "qlora" else saved
    got = logged(out, "loss")
    if len(got) != 3 or not all(math.isfinite(x) for x in got):
        return FAIL, f"losses {got}: expected 3 finite ones"
    if command != "grpo" and not got[-1] < got[0]:
        return FAIL, f"loss did not fall in 3 steps: {', '.join(f'{x:.3f}' for x in got)}"
    # GRPO's loss need not fall (its advantages are normalised per group): the policy must get a gradient
    norms = logged(out, "grad_norm")
    if command == "grpo" and not any(math.isfinite(x) and x > 0 for x in norms):
        return FAIL, f"no gradient reached the policy in 3 steps (grad norms {norms})"
    try:
        reload(saved, fault)
    except Exception as e:  # noqa: BLE001 - the row's verdict
        return FAIL, f"saved, but the reload failed: {errors.brief(e)}"
    trend = ("loss " + " -> ".join(f"{x:.3f}" for x in got) if command != "grpo" else
             "losses finite, grad norm " + " -> ".join(f"{x:.3g}" for x in norms))
    return PASS, f"3 steps, {trend}; saved and reloaded" + (" (merged adapter)" if command == "qlora" else "")


def main(argv: list[str]) -> int:
    """Child: `python -m trainbox.image.selftesttrain WORK ROW... [--fault ROW] [--gpu]`; prints one
    `SELFTEST-ROW {json}` line a row."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m trainbox.image.selftesttrain")
    p.add_argument("work", type=Path)
    p.add_argument("rows", nargs="+", choices=ROWS)
    p.add_argument("--fault")
    p.add_argument("--gpu", action="store_true")
    a = p.parse_args(argv)
    fault = a.fault
    table = jobs(a.work, a.gpu)
    for row in a.rows:
        t0 = time.monotonic()
        try:
            status, reason = one(row, *table[row], fault == row)
        except Exception as e:  # noqa: BLE001 - the row fails with the reason, the next rows still run
            status, reason = FAIL, errors.brief(e)
        print("SELFTEST-ROW " + json.dumps({"row": row, "status": status, "reason": reason,
                                            "seconds": round(time.monotonic() - t0, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
