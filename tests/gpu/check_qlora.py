"""GPU check for `qlora`: 4-bit nf4 base + LoRA all-linear, paged 8-bit AdamW, gradient checkpointing, on a local
model (or a ~100M Llama built here); prints steps/s, tokens/s and peak GPU memory; --merge also times the merge.

    python tests/gpu/check_qlora.py [--model PATH] [--steps 30] [--seq 1024] [--batch 8] [--merge] [--nproc N]
                                    [--json out.json]

With --nproc N > 1 the entrypoint's launcher starts torchrun and the base is sharded with FSDP2 (bf16 quant storage).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import build_model, report, run_entrypoint, write_chat_data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="saved model directory; default: build a ~100M Llama locally")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=8, help="per-device batch size")
    ap.add_argument("--merge", action="store_true", help="also save the merged model")
    ap.add_argument("--nproc", type=int, help="processes (default: 1; >1 shards the 4-bit base with FSDP2)")
    ap.add_argument("--work", help="work directory (default: a temporary one)")
    ap.add_argument("--json", help="also write the result here")
    a = ap.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="check-qlora-"))
    work.mkdir(parents=True, exist_ok=True)
    model = a.model or str(build_model(work / "llama-100m"))
    data = write_chat_data(work / "chat.jsonl", rows=a.steps * a.batch * 8, words=a.seq)
    args = ["--model_name_or_path", model, "--dataset", str(data), "--output_dir", str(work / "out"),
            "--max_steps", str(a.steps), "--per_device_train_batch_size", str(a.batch), "--max_length", str(a.seq),
            "--logging_steps", "10", "--save_steps", str(a.steps), "--report_to", "none", "--resume", "never",
            "--disable_tqdm", "true"]  # fmt: skip
    if a.merge:
        args.append("--merge")
    if a.nproc:
        args += ["--nproc-per-node", str(a.nproc)]
    result = run_entrypoint("qlora", args, work / "qlora.log")
    if a.merge:
        result["merged"] = (work / "out" / "merged" / "config.json").is_file()
    return report(result, a.json)


if __name__ == "__main__":
    raise SystemExit(main())
