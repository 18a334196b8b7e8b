"""Unsloth's side of the benchmarks, each its own process, configured as Unsloth's notebooks show (issue 63).

    python benchmarks/unsloth_sides.py sft  MODEL DATA.jsonl OUT [--steps 20] [--max-length 1024] [--batch 4]
                                            [--rank 16] [--packing true|false]
    python benchmarks/unsloth_sides.py grpo MODEL PROMPTS.jsonl OUT [--steps 3] [--max-seq-length 1024]
                                            [--max-prompt-length 256] [--num-generations 6] [--rank 32]
                                            [--fast-inference auto|true|false] [--gpu-memory-utilization 0.9]

Run by benchmarks/train_throughput.py qlora (sft) and benchmarks/grpo_notebook.py (grpo) with the measuring hook
(train_throughput.MEASURE) on the path and BENCH_FIRST_IMPORT=unsloth: Unsloth patches transformers and TRL when it
is imported, so the hook imports it before transformers; its TRL (<= 1.15) lives in a site of its own.

sft: FastLanguageModel.from_pretrained(load_in_4bit) on the local bf16 model (quantized as it loads), get_peft_model
on the seven linear projections with Unsloth's gradient checkpointing ("unsloth": activations offloaded), TRL's
SFTTrainer/SFTConfig as Unsloth patches them (its Llama-3.1 8B notebook's optimizer and schedule), chat `messages`
rows, packing on by default. grpo: the Llama-3.1 8B GRPO notebook's cells 8 and 12 (images/notebooks/unsloth), on
local prompts with the gsm8k preset's five rewards (trainbox.training.grpo.rewards: the notebook's, the same functions as
the other sides), vLLM (`fast_inference`) only where it imports.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def sft(a) -> None:
    from unsloth import FastLanguageModel  # first (the hook has imported it already where it runs)
    # isort: split

    from datasets import load_dataset
    from trl import SFTConfig, SFTTrainer

    model, tokenizer = FastLanguageModel.from_pretrained(model_name=a.model, max_seq_length=a.max_length,
                                                         load_in_4bit=True, dtype=None)
    # The notebook's LoRA (dropout 0 and no bias: the settings its fused LoRA kernels take), alpha = 2r like
    # trainbox qlora's and the plain script's, so the three train the same adapter.
    model = FastLanguageModel.get_peft_model(model, r=a.rank, target_modules=TARGETS, lora_alpha=2 * a.rank,
                                             lora_dropout=0, bias="none", use_gradient_checkpointing="unsloth",
                                             random_state=3407, max_seq_length=a.max_length)
    data = load_dataset("json", data_files=a.data, split="train")
    args = SFTConfig(output_dir=a.out, per_device_train_batch_size=a.batch, gradient_accumulation_steps=1,
                     warmup_steps=5, max_steps=a.steps, learning_rate=2e-4, logging_steps=1, optim="adamw_8bit",
                     weight_decay=0.01, lr_scheduler_type="linear", seed=3407, report_to="none",
                     max_length=a.max_length, packing=a.packing == "true", save_strategy="no", disable_tqdm=True)
    trainer = SFTTrainer(model=model, processing_class=tokenizer, train_dataset=data, args=args)
    print(f"unsloth sft: {type(trainer).__name__}, packing={trainer.args.packing}, "
          f"padding_free={getattr(trainer.args, 'padding_free', None)}", flush=True)
    trainer.train()


def grpo(a) -> None:
    from unsloth import FastLanguageModel  # first: it patches transformers and trl on import
    # isort: split

    from datasets import load_dataset

    from trainbox.training.grpo import rewards

    fast = a.fast_inference == "true" or a.fast_inference == "auto" and importlib.util.find_spec("vllm") is not None
    print(f"unsloth grpo: fast_inference={fast} (vllm {'importable' if importlib.util.find_spec('vllm') else 'absent'})",
          flush=True)
    # Cell 8: max_seq_length 1024, lora_rank 32, 4-bit, vLLM inside when fast_inference.
    model, tokenizer = FastLanguageModel.from_pretrained(model_name=a.model, max_seq_length=a.max_seq_length,
                                                         load_in_4bit=True, fast_inference=fast,
                                                         max_lora_rank=a.rank,
                                                         gpu_memory_utilization=a.gpu_memory_utilization)
    model = FastLanguageModel.get_peft_model(model, r=a.rank, target_modules=TARGETS, lora_alpha=a.rank,
                                             use_gradient_checkpointing="unsloth", random_state=3407)
    data = load_dataset("json", data_files=a.data, split="train")
    from trl import GRPOConfig, GRPOTrainer

    # Cell 12, with max_steps and saving ours to choose.
    args = GRPOConfig(learning_rate=5e-6, adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.001, warmup_ratio=0.1,
                      lr_scheduler_type="cosine", optim="paged_adamw_8bit", logging_steps=1,
                      per_device_train_batch_size=1, gradient_accumulation_steps=1,
                      num_generations=a.num_generations, max_prompt_length=a.max_prompt_length,
                      max_completion_length=a.max_seq_length - a.max_prompt_length, max_steps=a.steps,
                      save_strategy="no", max_grad_norm=0.1, report_to="none", output_dir=a.out, seed=a.seed,
                      disable_tqdm=True)
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, args=args, train_dataset=data,
                          reward_funcs=[rewards.xmlcount, rewards.soft_format, rewards.strict_format,
                                        rewards.int_format, rewards.correctness])
    print(f"unsloth grpo: {type(trainer).__name__}, batch {trainer.args.per_device_train_batch_size}, "
          f"{trainer.args.num_generations} generations, completions <= {trainer.args.max_completion_length}",
          flush=True)
    trainer.train()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    s = sub.add_parser("sft")
    g = sub.add_parser("grpo")
    for p in (s, g):
        p.add_argument("model")
        p.add_argument("data")
        p.add_argument("out")
    s.add_argument("--steps", type=int, default=20)
    s.add_argument("--max-length", type=int, default=1024)
    s.add_argument("--batch", type=int, default=4)
    s.add_argument("--rank", type=int, default=16)
    s.add_argument("--packing", choices=["true", "false"], default="true")
    g.add_argument("--steps", type=int, default=3)
    g.add_argument("--max-seq-length", type=int, default=1024)
    g.add_argument("--max-prompt-length", type=int, default=256)
    g.add_argument("--num-generations", type=int, default=6)
    g.add_argument("--rank", type=int, default=32)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--fast-inference", choices=["auto", "true", "false"], default="auto")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="cell 8's vLLM share (fast_inference)")
    a = ap.parse_args()
    {"sft": sft, "grpo": grpo}[a.what](a)


if __name__ == "__main__":
    main()
