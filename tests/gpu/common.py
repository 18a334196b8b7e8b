"""Shared by the GPU checks: a ~100M-parameter Llama built locally (no hub), synthetic chat data, and running an
entrypoint as a user would (`python -m trainbox.cli.NAME ...`) while reading its summary line back."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))  # trainbox/, as the checks run it


def build_model(dirpath: Path, hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2048) -> Path:
    """A random Llama of about 100M parameters with the tests' local BPE tokenizer (chat template included)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tiny import make_tokenizer

    if (dirpath / "config.json").is_file():
        return dirpath
    tok = make_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    print(f"built Llama: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters", flush=True)
    model.save_pretrained(dirpath)
    tok.save_pretrained(dirpath)
    return dirpath


def write_chat_data(path: Path, rows: int, words: int) -> Path:
    """Chat `messages` rows whose answers are long enough to fill the sequence length."""
    from tiny import CORPUS

    vocab = " ".join(CORPUS).split()
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(rows):
            q = " ".join(rng.choice(vocab) for _ in range(words // 4))
            a = " ".join(rng.choice(vocab) for _ in range(words))
            f.write(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n")
    return path


SUMMARY = re.compile(r"^\[trainbox\] \w+ (done|preempted).*$", re.M)


def run_entrypoint(name: str, args: list[str], log: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}".rstrip(":"), PYTHONUNBUFFERED="1")
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", f"trainbox.cli.{name}", *args], cwd=ROOT, env=env, stdout=f,
                            stderr=subprocess.STDOUT).returncode  # fmt: skip
    text = log.read_text()
    m = SUMMARY.search(text)
    result = {"entrypoint": name, "rc": rc, "wall_s": round(time.time() - t0, 1), "summary": m.group(0) if m else None}
    if m:
        line = m.group(0)
        for key, pat in {
            # The steady-state figures (first to last optimizer step); the whole-run ones when there are none.
            "steps_per_s": r"([\d.]+) steps/s",
            "tokens_per_s": r"([\d,.]+) (?:real )?tokens/s",
            "mfu_pct": r"MFU ([\d.]+) %",
            "peak_gpu_gib": r"peak GPU memory ([\d.]+) GiB",
            "train_s": r"(?:steps in|train) ([\d.]+)s",
        }.items():
            if mm := re.search(pat, line):
                result[key] = float(mm.group(1).replace(",", ""))
    if rc != 0 or not m:
        print(text[-6000:], file=sys.stderr)
    return result


def report(result: dict, json_path: str | None) -> int:
    print("RESULT " + json.dumps(result), flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
    return 0 if result["rc"] == 0 and result["summary"] else 1
