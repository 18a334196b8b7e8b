"""Unsloth's Llama-3.1 GRPO notebook, scaled down to a tiny local model, on one GPU (issue 21 item 2).

    python benchmarks/unsloth_grpo.py [--steps 20] [--out DIR] [--work DIR]

Takes the notebook's own code path (images/notebooks/unsloth/Llama3.1_(8B)-GRPO.ipynb): FastLanguageModel
.from_pretrained (4-bit) -> FastLanguageModel.get_peft_model -> trl's GRPOConfig/GRPOTrainer as patched by Unsloth,
with the notebook's reward functions and GRPOConfig fields copied verbatim; only the sizes are scaled down (steps,
lengths) and `fast_inference=False` where vLLM does not import (generation then goes through Unsloth's own
`generate`). Nothing is downloaded: the model is a 4-layer Llama (hidden 512) built here with a BPE tokenizer trained
here, and the data is synthetic GSM8K-format word problems ("... #### 42").

A random model would score zero on every reward, so a first process (which never imports Unsloth, as Unsloth must be
imported before transformers to patch it) teaches the tiny model the notebook's <reasoning>/<answer> format with a
short plain-PyTorch SFT on part of the synthetic set; GRPO then starts from rewards that are not all zero.

Prints and writes to --out: versions, one JSON line per optimizer step (seconds, each reward function's mean, the
reward's mean/std, completion length), then a summary (s/step after the first step, peak GPU memory).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The tiny shape: head_dim 64 and sizes that are multiples of 64, which Unsloth's Triton kernels and bitsandbytes'
# 4-bit blocks take; big enough that the kernels do real work, small enough to build and teach in seconds.
SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=1024, rope_theta=500000.0)

# ---- from the notebook (cell 10), verbatim --------------------------------------------------------------------------
SYSTEM_PROMPT = """
Respond in the following format:
<reasoning>
...
</reasoning>
<answer>
...
</answer>
"""

XML_COT_FORMAT = """\
<reasoning>
{reasoning}
</reasoning>
<answer>
{answer}
</answer>
"""


def extract_xml_answer(text: str) -> str:
    answer = text.split("<answer>")[-1]
    answer = answer.split("</answer>")[0]
    return answer.strip()


def extract_hash_answer(text: str) -> str | None:
    if "####" not in text:
        return None
    return text.split("####")[1].strip()


def correctness_reward_func(prompts, completions, answer, **kwargs) -> list[float]:
    responses = [completion[0]['content'] for completion in completions]
    q = prompts[0][-1]['content']
    extracted_responses = [extract_xml_answer(r) for r in responses]
    print('-'*20, f"Question:\n{q}", f"\nAnswer:\n{answer[0]}", f"\nResponse:\n{responses[0]}", f"\nExtracted:\n{extracted_responses[0]}")
    return [2.0 if r == a else 0.0 for r, a in zip(extracted_responses, answer)]


def int_reward_func(completions, **kwargs) -> list[float]:
    responses = [completion[0]['content'] for completion in completions]
    extracted_responses = [extract_xml_answer(r) for r in responses]
    return [0.5 if r.isdigit() else 0.0 for r in extracted_responses]


def strict_format_reward_func(completions, **kwargs) -> list[float]:
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\n$"
    responses = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, r) for r in responses]
    return [0.5 if match else 0.0 for match in matches]


def soft_format_reward_func(completions, **kwargs) -> list[float]:
    """Reward function that checks if the completion has a specific format."""
    pattern = r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>"
    responses = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, r) for r in responses]
    return [0.5 if match else 0.0 for match in matches]


def count_xml(text) -> float:
    count = 0.0
    if text.count("<reasoning>\n") == 1:
        count += 0.125
    if text.count("\n</reasoning>\n") == 1:
        count += 0.125
    if text.count("\n<answer>\n") == 1:
        count += 0.125
        count -= len(text.split("\n</answer>\n")[-1])*0.001
    if text.count("\n</answer>") == 1:
        count += 0.125
        count -= (len(text.split("\n</answer>")[-1]) - 1)*0.001
    return count


def xmlcount_reward_func(completions, **kwargs) -> list[float]:
    contents = [completion[0]["content"] for completion in completions]
    return [count_xml(c) for c in contents]
# ---- end of the notebook's code -------------------------------------------------------------------------------------


NAMES = ["Natalia", "Weng", "Betty", "Julie", "James", "Albert", "Ken", "Alexis", "Tina", "Mark"]
ITEMS = ["clips", "apples", "books", "pencils", "cookies", "stamps", "marbles", "shells"]


def gsm8k_rows(n: int, seed: int) -> list[dict]:
    """Word problems in openai/gsm8k's `main` layout: question, and answer = worked steps + '#### N'."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        who, what = rng.choice(NAMES), rng.choice(ITEMS)
        a, b = rng.randint(2, 60), rng.randint(2, 40)
        if rng.random() < 0.5:
            q = f"{who} has {a} {what} and gets {b} more. How many {what} does {who} have now?"
            steps, res = f"{who} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {what}.", a + b
        else:
            a += b
            q = f"{who} had {a} {what} and gave away {b}. How many {what} are left?"
            steps, res = f"{who} has {a} - {b} = <<{a}-{b}={a - b}>>{a - b} {what} left.", a - b
        rows.append({"question": q, "answer": f"{steps}\n#### {res}"})
    return rows


def notebook_prompts(rows: list[dict]):
    """The notebook's get_gsm8k_questions(), fed from local rows instead of load_dataset('openai/gsm8k')."""
    from datasets import Dataset

    data = Dataset.from_list(rows)
    return data.map(lambda x: {
        'prompt': [
            {'role': 'system', 'content': SYSTEM_PROMPT},
            {'role': 'user', 'content': x['question']}
        ],
        'answer': extract_hash_answer(x['answer'])
    })


def make_model(model_dir: Path, sft_steps: int) -> None:
    """Tokenizer + tiny Llama, taught the answer format by plain SFT; runs in its own process (no Unsloth)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from tests.tiny import CHAT_TEMPLATE, SPECIAL

    rows = gsm8k_rows(4000, seed=1)
    texts = [SYSTEM_PROMPT + r["question"] + XML_COT_FORMAT.format(reasoning=r["answer"].split("\n####")[0],
                                                                   answer=extract_hash_answer(r["answer"]))
             for r in rows]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=1024, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>",
                                        eos_token="<|end|>")
    tokenizer.chat_template = CHAT_TEMPLATE

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=False, **SHAPE)
    model = LlamaForCausalLM(config).cuda()
    # Whole chat turns, the assistant's in the notebook's XML format, ending in eos so generation stops.
    seqs = [tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": r["question"]},
         {"role": "assistant", "content": XML_COT_FORMAT.format(reasoning=r["answer"].split("\n####")[0],
                                                                answer=extract_hash_answer(r["answer"]))}],
        tokenize=True, return_dict=False) for r in rows]
    seqs = [s["input_ids"] if isinstance(s, dict) else s for s in seqs]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-3, total_steps=sft_steps, pct_start=0.1)
    t0, rng = time.perf_counter(), random.Random(0)
    for step in range(sft_steps):
        batch = rng.sample(seqs, 64)
        width = max(map(len, batch))
        ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        for i, s in enumerate(batch):
            ids[i, : len(s)] = torch.tensor(s)
        ids = ids.cuda()
        labels = ids.masked_fill(ids == tokenizer.pad_token_id, -100)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long(), labels=labels).loss
        loss.backward()
        opt.step(), sched.step(), opt.zero_grad()
        if step % 100 == 0 or step == sft_steps - 1:
            print(f"format SFT step {step} loss {loss.item():.3f}", flush=True)
    print(f"format SFT: {sft_steps} steps in {time.perf_counter() - t0:.1f} s; prompt+answer length "
          f"{min(map(len, seqs))}-{max(map(len, seqs))} tokens", flush=True)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.to(torch.bfloat16).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for name in ["torch", "triton", "transformers", "trl", "peft", "accelerate", "datasets", "bitsandbytes",
                 "unsloth", "unsloth_zoo", "torchao", "xformers", "vllm"]:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def grpo(args, model_dir: Path, out: Path) -> None:
    from unsloth import FastLanguageModel  # first, as the notebook does: it patches transformers and trl
    # isort: split

    import torch
    from transformers import TrainerCallback

    try:
        import vllm  # noqa: F401
        fast_inference = True
    except Exception as e:  # noqa: BLE001 - any import failure means the notebook's vLLM path is not there
        fast_inference = False
        print(f"vLLM does not import ({type(e).__name__}: {e}): fast_inference=False", flush=True)

    info = {"versions": versions(), "gpu": torch.cuda.get_device_name(0), "fast_inference": fast_inference,
            "shape": SHAPE, "steps": args.steps}
    print(json.dumps(info), flush=True)

    # Cell 8, scaled: max_seq_length 1024 -> args.max_seq_length; lora_rank 32 as published.
    max_seq_length = args.max_seq_length
    lora_rank = 32
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=str(model_dir),
        max_seq_length=max_seq_length,
        load_in_4bit=True,
        fast_inference=fast_inference,
        max_lora_rank=lora_rank,
        gpu_memory_utilization=0.9,
    )
    model = FastLanguageModel.get_peft_model(
        model,
        r=lora_rank,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        lora_alpha=lora_rank,
        use_gradient_checkpointing="unsloth",
        random_state=3407,
    )
    info["model_class"] = type(model).__name__
    info["base_class"] = type(model.base_model.model).__name__
    info["quantized_linears"] = sum("4bit" in type(m).__name__ for m in model.modules())

    dataset = notebook_prompts(gsm8k_rows(args.rows, seed=2))

    # Cell 12, scaled: max_prompt_length 256 -> args.max_prompt_length, max_steps/save_steps 250 -> args.steps.
    max_prompt_length = args.max_prompt_length
    from trl import GRPOConfig, GRPOTrainer
    training_args = GRPOConfig(
        learning_rate=args.learning_rate,
        adam_beta1=0.9,
        adam_beta2=0.99,
        weight_decay=0.001,
        warmup_ratio=0.1,
        lr_scheduler_type="cosine",
        optim="paged_adamw_8bit",
        logging_steps=1,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=1,
        num_generations=args.num_generations,
        max_prompt_length=max_prompt_length,
        max_completion_length=max_seq_length - max_prompt_length,
        max_steps=args.steps,
        save_steps=args.steps,
        max_grad_norm=0.1,
        report_to="none",
        output_dir=str(Path(args.work) / "outputs"),
    )
    info["grpo_config"] = {k: getattr(training_args, k, None) for k in [
        "learning_rate", "warmup_steps", "lr_scheduler_type", "optim", "per_device_train_batch_size",
        "gradient_accumulation_steps", "num_generations", "max_completion_length", "max_steps", "max_grad_norm",
        "temperature", "beta", "loss_type"]}
    info["grpo_config"]["optim"] = str(info["grpo_config"]["optim"])
    info["grpo_config"]["lr_scheduler_type"] = str(info["grpo_config"]["lr_scheduler_type"])
    print(json.dumps(info["grpo_config"]), flush=True)

    steps_file = (out / "steps.jsonl").open("w")

    class Record(TrainerCallback):
        """One line per optimizer step: wall seconds since the last step end, and what the trainer logged."""

        def on_train_begin(self, *a, **k):
            torch.cuda.synchronize()
            self.t = time.perf_counter()

        def on_log(self, a, state, control, logs=None, **k):
            if logs is None or "loss" not in logs and not any(key.startswith("reward") for key in logs):
                return
            torch.cuda.synchronize()
            now = time.perf_counter()
            row = {"step": state.global_step, "seconds": round(now - self.t, 3), **{
                key: float(f"{v:.4g}") if isinstance(v, float) else v for key, v in logs.items()
                if key.startswith(("reward", "completions/mean_length", "loss", "kl", "grad_norm", "learning_rate"))}}
            self.t = now
            steps_file.write(json.dumps(row) + "\n")
            steps_file.flush()
            print("STEP " + json.dumps(row), flush=True)

    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=[
            xmlcount_reward_func,
            soft_format_reward_func,
            strict_format_reward_func,
            int_reward_func,
            correctness_reward_func,
        ],
        args=training_args,
        train_dataset=dataset,
        callbacks=[Record()],
    )
    info["trainer_class"] = type(trainer).__name__
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    steps_file.close()

    rows = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    after_first = [r["seconds"] for r in rows[1:]]
    summary = {
        **info,
        "steps_done": len(rows),
        "train_seconds": round(total, 1),
        "s_per_step_after_first": round(sum(after_first) / len(after_first), 3) if after_first else None,
        "first_step_s": rows[0]["seconds"] if rows else None,
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3),
        "reward_per_step": [r.get("reward") for r in rows],
        "correctness_per_step": [r.get("rewards/correctness_reward_func/mean") for r in rows],
    }
    summary["steps_with_gradient"] = sum(1 for r in rows if r.get("grad_norm"))
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    fns = ["xmlcount", "soft_format", "strict_format", "int", "correctness"]
    print("step  seconds  reward  reward_std  " + "  ".join(fns) + "  grad_norm")
    for r in rows:
        print(f"{r['step']:>4}  {r['seconds']:>7.3f}  {r.get('reward', 0):>6.3f}  {r.get('reward_std', 0):>10.3f}  "
              + "  ".join(f"{r.get(f'rewards/{f}_reward_func/mean', 0):>{len(f)}.3f}" for f in fns)
              + f"  {r.get('grad_norm', 0):>9.4f}")
    print("SUMMARY " + json.dumps(summary, default=str), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="GRPO optimizer steps (the notebook: 250)")
    p.add_argument("--num-generations", type=int, default=6, help="completions per prompt (the notebook: 6)")
    p.add_argument("--max-seq-length", type=int, default=384, help="the notebook: 1024")
    p.add_argument("--max-prompt-length", type=int, default=128, help="the notebook: 256")
    p.add_argument("--learning-rate", type=float, default=5e-6, help="the notebook: 5e-6")
    p.add_argument("--rows", type=int, default=500, help="synthetic GSM8K rows for GRPO")
    p.add_argument("--sft-steps", type=int, default=600, help="plain SFT steps that teach the tiny model the format")
    p.add_argument("--out", default=os.environ.get("OUT", "out/unsloth_grpo"), help="where the figures go")
    p.add_argument("--work", default=None, help="model, checkpoints and Unsloth's compile cache (default: a temp dir)")
    p.add_argument("--make-model", metavar="DIR", help=argparse.SUPPRESS)  # the first process's job
    args = p.parse_args()
    if args.make_model:
        make_model(Path(args.make_model), args.sft_steps)
        return
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    args.work = str(Path(args.work or tempfile.mkdtemp(prefix="unsloth-grpo-")).resolve())
    model_dir = Path(args.work) / "tiny-llama"
    # Offline: the model is local, and a hub lookup would only time out on a machine with no network.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if not (model_dir / "config.json").exists():
        subprocess.run([sys.executable, __file__, "--make-model", str(model_dir), "--sft-steps",
                        str(args.sft_steps)], check=True, cwd=ROOT)
    os.chdir(args.work)  # Unsloth writes unsloth_compiled_cache/ into the working directory
    grpo(args, model_dir, out)


if __name__ == "__main__":
    main()
