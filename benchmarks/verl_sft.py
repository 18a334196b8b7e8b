"""verl's FSDP SFT trainer (verl.trainer.sft_trainer, messages format) on a tiny local model (issue 21 item 3).

    python benchmarks/verl_sft.py [--steps 30] [--nproc 1] [--out DIR] [--work DIR] [--dataset-only]

Builds everything locally (nothing from a hub): a small Llama from a config plus tests/tiny.py's BPE tokenizer and
chat template, and a synthetic messages-format parquet (user asks a sum, assistant answers it). Then launches verl's
own entry point exactly as its docs do, `torchrun --standalone --nproc_per_node N -m verl.trainer.sft_trainer
key=value ...` (config sft_trainer_engine.yaml: FSDP engine, no_padding/remove-padding path, console logger), parses
the `step:N - train/loss:X - ...` lines verl prints, and writes a JSON summary: loss per step, s/step (wall time
between step lines, first step excluded), peak GPU memory (verl's perf/max_memory_allocated_gb), versions.

`--dataset-only` stops after building verl's MultiTurnSFTDataset over the parquet (a CPU check of the data and chat
template against verl's tokenisation rules, no GPU).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Small enough to build in a second, big enough that FSDP shards real tensors; head_dim 64 for sdpa.
SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)
STEP_RE = re.compile(r"step:(\d+) - (.*)$")  # searched: tqdm's bar often precedes it on the same line
VERSIONS = ["verl", "torch", "transformers", "tokenizers", "hydra-core", "omegaconf", "tensordict", "torchdata",
            "datasets", "ray", "accelerate", "peft", "pandas", "pyarrow"]


def emit(out: Path, line: str) -> None:
    print(line, flush=True)
    with open(out / "verl_sft.log", "a") as f:
        f.write(line + "\n")


def make_model(dirpath: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    # By file path: verl's wheel ships a top-level regular `tests` package that shadows our namespace one.
    spec = importlib.util.spec_from_file_location("trainbox_tiny", ROOT / "tests" / "tiny.py")
    tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny)
    tok = tiny.make_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, tie_word_embeddings=False, **SHAPE)
    LlamaForCausalLM(cfg).save_pretrained(dirpath)
    tok.save_pretrained(dirpath)
    return dirpath


def make_data(path: Path, n: int, seed: int) -> Path:
    import pandas as pd

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append({"messages": [
            {"role": "system", "content": "Answer with the number."},
            {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": f"{a} + {b} = {a + b}"},
        ]})
    pd.DataFrame(rows).to_parquet(path)
    return path


def dataset_check(model: Path, data: Path) -> dict:
    """Build verl's own dataset over the parquet: fails the same way the trainer would on a bad chat template."""
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.utils.dataset.multiturn_sft_dataset import MultiTurnSFTDataset

    tok = AutoTokenizer.from_pretrained(model)
    cfg = OmegaConf.create({"messages_key": "messages", "max_length": 128, "truncation": "error",
                            "pad_mode": "no_padding"})
    ds = MultiTurnSFTDataset(parquet_files=str(data), tokenizer=tok, config=cfg)
    item = ds[0]
    return {"rows": len(ds), "tokens_row0": int(item["input_ids"].numel()),
            "loss_tokens_row0": int(item["loss_mask"].sum())}


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in VERSIONS:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--nproc", type=int, default=1, help="torchrun --nproc_per_node (one rank per GPU)")
    ap.add_argument("--batch", type=int, default=64, help="data.train_batch_size (global)")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out/verl_sft")))
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--dataset-only", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="verl_sft_"))
    work.mkdir(parents=True, exist_ok=True)

    model = make_model(work / "model")
    data = make_data(work / "train.parquet", args.rows, seed=0)
    val = make_data(work / "val.parquet", 256, seed=1)
    check = dataset_check(model, data)
    import torch

    header = {"versions": versions(), "python": sys.version.split()[0],
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "gpus": torch.cuda.device_count(), "nproc": args.nproc, "shape": SHAPE, "dataset": check}
    emit(args.out, json.dumps(header))
    if args.dataset_only:
        return 0

    # Overrides of verl 0.9.1's sft_trainer_engine.yaml; everything else is its default (FSDP engine, bf16, the
    # no_padding data path with remove-padding, dynamic batch size). attn sdpa: flash-attn is not installed, and
    # transformers builds the block-causal mask for the packed sequence from position_ids.
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", "-m", "verl.trainer.sft_trainer",
        f"data.train_files={data}", f"data.val_files={val}", "data.messages_key=messages",
        f"data.train_batch_size={args.batch}", "data.micro_batch_size_per_gpu=16", "data.max_length=128",
        "data.num_workers=2",
        f"model.path={model}", "+model.override_config.attn_implementation=sdpa",
        "model.enable_gradient_checkpointing=False",
        "optim.lr=1e-3", "optim.lr_warmup_steps_ratio=0.05",
        "engine.use_torch_compile=False",
        f"trainer.default_local_dir={work / 'ckpt'}", "trainer.project_name=trainbox-verl-sft",
        "trainer.experiment_name=tiny", "trainer.logger=[console]", f"trainer.total_training_steps={args.steps}",
        "trainer.total_epochs=100", "trainer.resume_mode=disable", "trainer.save_freq=-1", "trainer.test_freq=-1",
        f"trainer.n_gpus_per_node={args.nproc}", "checkpoint.save_contents=[model]",
    ]
    emit(args.out, "$ torchrun " + " ".join(cmd[3:]))  # torch.distributed.run is what `torchrun` runs
    steps, stamps = {}, []
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    for line in proc.stdout:
        line = line.rstrip("\n")
        emit(args.out, line)
        m = STEP_RE.search(line)
        if m:  # verl logs val/loss as a second line with the same step number: merge by step
            rec = steps.setdefault(int(m.group(1)), {"step": int(m.group(1))})
            for kv in m.group(2).split(" - "):
                k, _, v = kv.partition(":")
                try:
                    rec[k] = float(v)
                except ValueError:
                    pass
            if "train/loss:" in m.group(2):
                stamps.append(time.time())
    rc = proc.wait()
    wall = time.time() - t0

    steps = [steps[k] for k in sorted(steps)]
    losses = [s.get("train/loss") for s in steps]
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    summary = {
        "rc": rc, "steps_logged": len(steps), "wall_s": round(wall, 1),
        "loss_per_step": [round(x, 4) if x is not None else None for x in losses],
        "s_per_step_after_first": round(statistics.median(gaps), 4) if gaps else None,
        "peak_mem_allocated_gb": max((s.get("perf/max_memory_allocated_gb", 0) for s in steps), default=None),
        "peak_mem_reserved_gb": max((s.get("perf/max_memory_reserved_gb", 0) for s in steps), default=None),
        "val_loss": [s["val/loss"] for s in steps if "val/loss" in s],
        "nproc": args.nproc,
    }
    emit(args.out, "SUMMARY " + json.dumps(summary))
    (args.out / "verl_sft_summary.json").write_text(json.dumps({**header, **summary, "steps": steps}, indent=1))
    ok = rc == 0 and len(steps) == args.steps and losses and losses[-1] is not None and losses[-1] < losses[0]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
