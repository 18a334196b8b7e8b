"""Full-parameter SFT from 1 process to many nodes (torchrun c10d, FSDP2 on GPUs; chat messages, dolly, verl gsm8k).

Usage: `python -m trainbox.cli.sft --model_name_or_path M --dataset D [--config X.yaml] [--option value ...]`.
Options: TRL's SFTConfig (transformers' TrainingArguments included), TRL's ModelConfig (model loading), and the
script options below (dataset, format, keys, resume, launcher flags). Outside torchrun, under Slurm or with
`--nnodes/--nproc-per-node/--master-addr/--master-port/--node-rank`, this starts torchrun itself (launch.py).
On GPUs with more than one process it shards with FSDP2; on CPU the Trainer runs DDP over gloo (it ignores FSDP there).
"""

from __future__ import annotations

from trainbox.run import preemption

if __name__ == "__main__":  # first, before torch's seconds of imports: a stop signal then is remembered, not a kill
    preemption.claim_preempt_signals()

import sys

from trainbox.image import imageinfo
from trainbox.training import config as cfg, sftlib, skeleton, speed


def _config():
    from trl import SFTConfig

    return SFTConfig


def _check(run) -> None:
    cfg.check_full_training(run.model)  # LoRA/4-bit options: refused, not ignored (qlora has its own recipe)
    speed.fsdp_reshard(run.args)  # reshard_after_forward: a boolean, as accelerate reads it


RECIPE = skeleton.Recipe(
    name="sft",
    config=_config,
    defaults=skeleton.run_defaults,
    check=_check,
    rows=lambda run, tokenizer, rows: sftlib.prepare_dataset(run.data, run.args, rows),
    trainer=lambda run, model, ds, tokenizer, callbacks: sftlib.build_trainer(model, run.args, ds, tokenizer,
                                                                              callbacks=callbacks),
)
parse = RECIPE.parse


def main(argv: list[str]) -> int:
    return skeleton.main(RECIPE, argv, imageinfo.load)


def parse_checked(argv: list[str], prog: str = "trainbox sft"):
    """RECIPE.parse and sft's own option checks (`trainbox plan` parses and checks the same)."""
    options = RECIPE.parse(argv, prog=prog)
    _check(skeleton.Run.of(RECIPE, options))
    return options


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
