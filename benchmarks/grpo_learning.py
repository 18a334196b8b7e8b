"""GRPO that learns: a small model taught arithmetic word problems, then trainbox grpo vs TRL's GRPOTrainer (issue 63).

    python benchmarks/grpo_learning.py [--steps 100] [--seeds 0 1] [--sft-steps 1500] [--sft-target 0.3] [--lr 1e-4]
                                       [--max-completion 64] [--run-timeout S] [--vllm]
                                       [--work DIR] [--smoke]

The model's recipe (regenerate it with this script; nothing is downloaded):
  data       synthetic word problems of 1-3 additions/subtractions ("Mia has 12 shells. She finds 7 more. ...
             How many shells does Mia have now?"), the prompt as the gsm8k preset makes it (its system prompt +
             the question), the answer in the notebook's format: "<reasoning>\\n12 + 7 = 19\\n...\\n</reasoning>\\n
             <answer>\\n14\\n</answer>\\n" and EOS, so answers end at lengths that vary with the number of steps.
  tokenizer  byte-level BPE (1,024 tokens) trained here on that text, tests/tiny.py's chat template and specials.
  model      Llama, 4 layers, hidden 512, 8 heads (4 KV), MLP 1536 (~20 M parameters), seed 0.
  SFT        plain PyTorch, loss on the answer only, AdamW at 1e-3 (50 warm-up steps), batch 64, until 30 % of
             128 held-out problems sampled at temperature 1 come out right (--sft-target, checked every 100 steps
             from step 300; at most --sft-steps); then 256 held-out: accuracy, share ending in EOS, lengths.
Then GRPO from that checkpoint with the correctness reward (2.0 for the right number in <answer>), --steps steps,
4 prompts x 8 generations a step, completions up to 64 tokens, temperature 1, the same learning rate, prompts and
seed on both sides, each of --seeds:
  ours  `trainbox grpo` (full fine-tuning: its static decoder; with --vllm also `--use_vllm true`, vLLM colocate)
  trl   `trl grpo` with its defaults (transformers generate; with --vllm also vLLM colocate as TRL's docs show)
Measured with train_throughput.py's hook. Prints the reward per 10 steps of every run (LEARN rows), completion
lengths per 10 steps (LENGTH rows), steps/s, and TRL's sampler-vs-policy diagnostics (sampling/*: the sampler's
log-probs of the sampled tokens against the policy's own) where an engine reports them (vLLM); SUMMARY lines last.
--smoke: a CPU run of every piece at toy sizes (2 layers, hidden 64, a few steps), to check the script, not learning.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import train_throughput as tt  # noqa: E402  (benchmarks/ is no package: its folder goes on the path first)

NAMES = ["Mia", "Tom", "Ava", "Leo", "Zoe", "Sam", "Ivy", "Max", "Eli", "Ana", "Ben", "Kim"]
ITEMS = ["shells", "apples", "books", "coins", "cards", "pens", "stamps", "marbles"]
SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=512, rope_theta=10000.0)
SMOKE_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0)


def problem(rng: random.Random) -> dict:
    """One word problem: question, the worked lines, the answer (never negative)."""
    who, what = rng.choice(NAMES), rng.choice(ITEMS)
    total = rng.randint(5, 40)
    sentences, lines = [f"{who} has {total} {what}."], []
    for _ in range(rng.randint(1, 3)):
        if total > 3 and rng.random() < 0.5:
            n = rng.randint(1, min(total - 1, 30))
            sentences.append(rng.choice([f"{who} gives away {n}.", f"{who} loses {n}.", f"{who} sells {n}."]))
            lines.append(f"{total} - {n} = {total - n}")
            total -= n
        else:
            n = rng.randint(1, 30)
            sentences.append(rng.choice([f"{who} finds {n} more.", f"{who} buys {n} more.", f"{who} gets {n} more."]))
            lines.append(f"{total} + {n} = {total + n}")
            total += n
    sentences.append(f"How many {what} does {who} have now?")
    return {"question": " ".join(sentences), "lines": lines, "answer": str(total)}


def completion(p: dict) -> str:
    """The notebook's answer format (its XML_COT_FORMAT)."""
    return "<reasoning>\n" + "\n".join(p["lines"]) + "\n</reasoning>\n<answer>\n" + p["answer"] + "\n</answer>\n"


def prompt(p: dict) -> list[dict]:
    from trainbox.training.grpo.rewards import SYSTEM_PROMPT

    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": p["question"]}]


def problems(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [problem(rng) for _ in range(n)]


def write_prompts(path: Path, rows: list[dict]) -> Path:
    """GRPO rows as both trainers read them: prompt messages and the answer column the correctness reward reads."""
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "train.jsonl", "w") as f:
        for p in rows:
            f.write(json.dumps({"prompt": prompt(p), "answer": p["answer"]}) + "\n")
    return path


def make_tokenizer(rows: list[dict]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.tiny import CHAT_TEMPLATE, SPECIAL
    from trainbox.training.grpo.rewards import SYSTEM_PROMPT

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [SYSTEM_PROMPT] + [p["question"] + "\n" + completion(p) for p in rows]
    tok.train_from_iterator(texts, trainer=trainers.BpeTrainer(
        vocab_size=1024, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>",
                                        eos_token="<|end|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def encode(tokenizer, p: dict) -> tuple[list[int], int]:
    """Prompt ids as the trainers make them (chat template, generation prompt) + the answer's ids + EOS; and where
    the answer starts (the loss is on the answer only)."""
    head = tokenizer.apply_chat_template(prompt(p), add_generation_prompt=True, tokenize=True, return_dict=False)
    head = head["input_ids"] if isinstance(head, dict) else list(head)
    tail = tokenizer(completion(p), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return head + tail, len(head)


def sample(model, tokenizer, rows: list[dict], device: str, max_new: int) -> dict:
    """Temperature-1 samples (as GRPO draws them) on held-out problems: accuracy, EOS share, answer lengths."""
    import torch

    from trainbox.training.grpo.rewards import extract_xml_answer

    tokenizer.padding_side = "left"
    right, ended, lens = 0, 0, []
    model.eval()
    for i in range(0, len(rows), 64):
        chunk = rows[i:i + 64]
        texts = [tokenizer.apply_chat_template(prompt(p), add_generation_prompt=True, tokenize=False) for p in chunk]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        with torch.no_grad():
            out = model.generate(**batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        for p, ids in zip(chunk, out[:, batch["input_ids"].shape[1]:].tolist()):
            n = ids.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in ids else len(ids)
            ended += tokenizer.eos_token_id in ids
            lens.append(n)
            right += extract_xml_answer(tokenizer.decode(ids[:n], skip_special_tokens=True)) == p["answer"]
    model.train()
    lens.sort()
    return {"accuracy": right / len(rows), "eos": ended / len(rows), "len_min": lens[0],
            "len_median": lens[len(lens) // 2], "len_max": lens[-1]}


def make_model(path: Path, a) -> dict:
    """The recipe above; the model and tokenizer saved in `path` (kept if there), its held-out figures returned."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    device = "cpu" if a.smoke else "cuda"
    held = problems(16 if a.smoke else 256, seed=3)
    if (path / "sft.json").is_file():
        return json.loads((path / "sft.json").read_text())
    rows = problems(2000 if a.smoke else 20000, seed=1)
    tokenizer = make_tokenizer(rows)
    seqs = [encode(tokenizer, p) for p in rows]
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=False, **(SMOKE_SHAPE if a.smoke else SHAPE))
    model = LlamaForCausalLM(config).to(device)
    batch_size = 16 if a.smoke else 64
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    # A constant rate after a short warm-up: the SFT stops where the model gets some answers right, not at a
    # schedule's end (GRPO needs groups with some right and some wrong).
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 50))
    check = [a.sft_steps // 2] if a.smoke else list(range(299, a.sft_steps, 100))
    t0, rng, step, acc = time.perf_counter(), random.Random(0), 0, None
    for step in range(a.sft_steps):
        batch = rng.sample(seqs, batch_size)
        width = max(len(s) for s, _ in batch)
        ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        for i, (s, start) in enumerate(batch):
            ids[i, : len(s)] = torch.tensor(s)
            labels[i, start: len(s)] = torch.tensor(s[start:])
        ids, labels = ids.to(device), labels.to(device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = model(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id).long(), labels=labels).loss
        loss.backward()
        opt.step(), sched.step(), opt.zero_grad()
        if step % 100 == 0 or step == a.sft_steps - 1:
            print(f"SFT step {step} loss {loss.item():.3f}", flush=True)
        if step in check:
            acc = sample(model, tokenizer, held[:128], device, a.max_completion)
            print(f"SFT step {step}: held-out at temperature 1: {json.dumps(acc)}", flush=True)
            if acc["accuracy"] >= a.sft_target:
                break
    params = sum(p.numel() for p in model.parameters())
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    figures = {"sft_steps": step + 1, "sft_seconds": round(time.perf_counter() - t0, 1), "params": params,
               "answer_tokens": [min(len(s) - k for s, k in seqs), max(len(s) - k for s, k in seqs)],
               **sample(model, tokenizer, held, device, a.max_completion)}
    model.save_pretrained(path)  # float32: both trainers load it as they would any checkpoint
    tokenizer.save_pretrained(path)
    (path / "sft.json").write_text(json.dumps(figures))
    return figures


def commands(a, model: Path, data: Path, work: Path, seed: int) -> dict:
    py = sys.executable
    per_step = 8 if a.smoke else 32
    shared = ["--model_name_or_path", str(model), "--per_device_train_batch_size", str(per_step),
              "--num_generations", "4" if a.smoke else "8", "--max_completion_length", str(a.max_completion),
              "--temperature", "1.0", "--learning_rate", str(a.lr), "--max_steps", str(a.steps), "--logging_steps",
              "1", "--save_strategy", "no", "--report_to", "none", "--seed", str(seed), "--disable_tqdm", "true"]
    ours = [py, "-m", "trainbox", "grpo", "--dataset", str(data / "train.jsonl"), "--resume", "never",
            "--reward_funcs", "rewards:correctness", *shared]
    trl = [py, "-m", "trl.cli.main", "grpo", "--dataset_name", str(data), "--reward_funcs",
           "trainbox.training.grpo.rewards.correctness", *shared]
    if a.smoke:  # CPU: no bf16 autocast there
        trl += ["--bf16", "false"]
    out = {"trl": trl, "ours": ours}
    if a.vllm:
        out["ours-vllm"] = ours + ["--use_vllm", "true"]
        out["trl-vllm"] = trl + ["--use_vllm", "true", "--vllm_mode", "colocate"]
    return {who: argv + ["--output_dir", str(work / f"o-{who}-{seed}")] for who, argv in out.items()}


def per10(points: list, steps: int) -> list[float | None]:
    """Mean of the logged values in steps 1-10, 11-20, ..."""
    out = []
    for lo in range(1, steps + 1, 10):
        vals = [v for s, v in points if lo <= s < lo + 10]
        out.append(sum(vals) / len(vals) if vals else None)
    return out


def last10(points: list) -> tuple[float | None, int, int]:
    """(mean, first step, last step) of the last ten logged values."""
    tail = sorted(points)[-10:]
    if not tail:
        return None, 0, 0
    return sum(v for _, v in tail) / len(tail), tail[0][0], tail[-1][0]


def fmt3(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def table(tag: str, curves: dict, steps: int, fmt: str) -> None:
    print(f"{tag} steps    " + " ".join(f"{k:>14}" for k in curves), flush=True)
    cols = {k: per10(v, steps) for k, v in curves.items()}
    for i, lo in enumerate(range(1, steps + 1, 10)):
        cells = [format(c[i], fmt) if c[i] is not None else "-" for c in cols.values()]
        print(f"{tag} {lo:>3}-{min(lo + 9, steps):<4} " + " ".join(f"{x:>14}" for x in cells), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100, help="GRPO steps a run")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--sft-steps", type=int, default=1500, help="most SFT steps (it stops at --sft-target)")
    ap.add_argument("--sft-target", type=float, default=0.3,
                    help="SFT stops once this share of held-out problems is answered right at temperature 1 (checked "
                         "every 100 steps from step 300)")
    ap.add_argument("--lr", type=float, default=1e-4, help="GRPO learning rate, both sides")
    ap.add_argument("--max-completion", type=int, default=64,
                    help="completion cap (the SFT answers are ~20-40 tokens; a rollout past it is cut, no EOS)")
    ap.add_argument("--vllm", action="store_true", help="also each side with vLLM colocate (vllm must import)")
    ap.add_argument("--run-timeout", type=float, default=None,
                    help="seconds a GRPO run may take; past it it is killed and its steps so far reported")
    ap.add_argument("--work", default=None, help="work folder (the SFT model is kept there and reused)")
    ap.add_argument("--smoke", action="store_true", help="CPU, toy sizes: checks the script end to end")
    a = ap.parse_args()
    if a.smoke:
        a.steps, a.sft_steps, a.seeds, a.max_completion = min(a.steps, 4), min(a.sft_steps, 30), a.seeds[:1], 32
    if a.steps < 2:
        ap.error(f"--steps {a.steps}: at least 2 (one untimed, one timed)")
    work = Path(a.work or tempfile.mkdtemp(prefix="grpo-learn-"))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "grpo_learning.log"
    model = work / "model"
    figures = make_model(model, a)
    print(f"SFT model {model}: {figures['params'] / 1e6:.1f} M parameters, {figures['sft_steps']} steps in "
          f"{figures['sft_seconds']} s; answers {figures['answer_tokens'][0]}-{figures['answer_tokens'][1]} tokens; "
          f"held-out at temperature 1: accuracy {100 * figures['accuracy']:.1f} %, ending in EOS "
          f"{100 * figures['eos']:.1f} %, lengths {figures['len_min']}/{figures['len_median']}/{figures['len_max']} "
          "(min/median/max)", flush=True)
    if not a.smoke and not 0.05 <= figures["accuracy"] <= 0.9:
        print(f"WARNING: the SFT model answers {100 * figures['accuracy']:.0f} % right: GRPO's groups need some right "
              "and some wrong answers to learn from; raise --sft-steps (too few right) or lower --sft-target (too "
              "many) in a fresh --work", flush=True)
    data = write_prompts(work / "data", problems(max(512, 4 * a.steps), seed=2))
    env = {"BENCH_SKIP": "1" if a.smoke else "3", "BENCH_PHASES": "1", "BENCH_EACH_STEP": "1"}
    results = {}
    for seed in a.seeds:
        cmds = commands(a, model, data, work, seed)
        # Alternated: trl first for seed 0, ours first for seed 1.
        for who in (list(cmds) if seed % 2 == 0 else list(cmds)[::-1]):
            label = f"{who}-s{seed}"
            res = tt.run(label, cmds[who], work, log, env, a.run_timeout)
            if tt.usable(res):
                res["steps_per_s"] = res["steps"] / res["seconds"]
                print(f"  {label:<14} {res['steps_per_s']:.2f} steps/s, reward first 10 "
                      f"{per10(res['rewards'], a.steps)[0]} -> last 10 {per10(res['rewards'], a.steps)[-1]}"
                      + (" (cut at --run-timeout)" if res.get("cut") else ""), flush=True)
            results[label] = res
    ok = {k: r for k, r in results.items() if "steps_per_s" in r}
    table("LEARN", {k: r["rewards"] for k, r in ok.items()}, a.steps, ".3f")
    table("LENGTH", {k: r["series"].get("completions/mean_length", []) for k, r in ok.items()}, a.steps, ".1f")
    table("CLIPPED", {k: r["series"].get("completions/clipped_ratio", []) for k, r in ok.items()}, a.steps, ".2f")
    diag = {k: r["series"][name] for k, r in ok.items() for name in ["sampling/sampling_logp_difference/mean"]
            if name in r["series"]}
    if diag:
        table("SAMPLER-LOGP-DIFF", diag, a.steps, ".4f")
        ratio = {k: r["series"]["sampling/importance_sampling_ratio/mean"] for k, r in ok.items()
                 if "sampling/importance_sampling_ratio/mean" in r["series"]}
        table("IS-RATIO", ratio, a.steps, ".4f")
    missing = [k for k in ok if k not in diag]
    if missing:
        print(f"# sampling/* not reported by {', '.join(missing)}: TRL logs the sampler's log-probs against the "
              "policy's only when vLLM samples (transformers generate and the static decoder return none)", flush=True)
    for who in dict.fromkeys(k.rsplit("-s", 1)[0] for k in results):
        runs = [ok[k] for k in ok if k.rsplit("-s", 1)[0] == who]
        failed = [k for k in results if k.rsplit("-s", 1)[0] == who and k not in ok]
        if runs:
            rate = sum(r["steps_per_s"] for r in runs) / len(runs)
            # a run cut short: its last ten logged steps, named, rather than a window it never reached
            last = [last10(r["rewards"]) for r in runs]
            first = [per10(r["rewards"], a.steps)[0] for r in runs]
            print(f"SUMMARY grpo-learning {who}: {rate:.2f} steps/s; reward steps 1-10 "
                  f"{', '.join(fmt3(x) for x in first)} -> last 10 logged "
                  f"{', '.join(f'{fmt3(x)} (steps {lo}-{hi})' for x, lo, hi in last)} "
                  f"(seeds {', '.join(str(s) for s in a.seeds)}; correctness 2.0 = right)"
                  + (f"; FAILED {', '.join(failed)}" if failed else ""), flush=True)
        elif failed:
            print(f"SUMMARY grpo-learning {who}: FAILED {', '.join(failed)}", flush=True)
    if "ours-s0" in ok and "trl-s0" in ok:
        o = [r["steps_per_s"] for k, r in ok.items() if k.startswith("ours-s")]
        t = [r["steps_per_s"] for k, r in ok.items() if k.startswith("trl-s")]
        print(f"SUMMARY grpo-learning speed: ours {sum(o) / len(o):.2f} vs trl {sum(t) / len(t):.2f} steps/s = "
              f"{sum(o) / len(o) / (sum(t) / len(t)):.2f}x", flush=True)
    json.dump({"sft": figures, "runs": results}, open(work / "grpo-learning-results.json", "w"), indent=1, default=str)


if __name__ == "__main__":
    main()
