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
import time

from common import launch
from trainbox.run import outputs, ranks, resume, runsummary
from trainbox.training import moe, precision, runner, speed
from trainbox.training import config as cfg
# The SFT-style trainers' library (qlora uses it too); its names stay reachable here (sft.DataArguments).
from trainbox.training.sftlib import (FSDP2_GPU, DataArguments, build_trainer, check_before_launch, finish_tuning,
                                      load_tokenizer, prepare_dataset, shards, tune, validate)


def distributed_strategy(training_args) -> str:
    """Pick FSDP2 on GPUs with >1 process; on CPU the Trainer runs DDP (gloo). Returns a label for the log."""
    import torch

    world = ranks.world_size()
    on_gpu = torch.cuda.is_available() and not training_args.use_cpu
    if world <= 1:
        return "single process" + (" (GPU)" if on_gpu else " (CPU)")
    if not on_gpu:
        if training_args.fsdp:
            print("warning: --fsdp is ignored by the Trainer on CPU; running DDP over gloo", file=sys.stderr)
        return f"DDP over gloo, {world} processes (CPU)"
    return f"FSDP2, {world} processes (GPU)"


def sft_defaults() -> dict:
    import torch

    d = {"include_num_input_tokens_seen": True, "logging_steps": 10, "save_steps": 200}
    if torch.cuda.is_available() and ranks.distributed():
        d.update(FSDP2_GPU)
    return d


def parse(argv: list[str], prog: str = "trainbox sft"):
    from trl import ModelConfig, SFTConfig

    return cfg.parse_args(
        (DataArguments, launch.LaunchArguments, ModelConfig, SFTConfig),
        argv,
        prog=prog,
        legacy={**cfg.LEGACY_TRAINING, **cfg.LEGACY_SFT},
        defaults=sft_defaults(),
    )



def train(data_args, model_args, training_args, name: str = "sft") -> int:
    import torch
    from transformers import AutoModelForCausalLM
    from trl import SFTTrainer

    started = time.time()
    training_args.output_dir = outputs.output_dir(cfg.configured_output_dir(training_args))
    validate(data_args, model_args, training_args)
    tokenizer = load_tokenizer(model_args.model_name_or_path, training_args)
    with training_args.main_process_first(local=False, desc="dataset"):
        train_ds = prepare_dataset(data_args, training_args)
    ckpt = resume.resolve_resume(data_args.resume, training_args.output_dir, training_args, name)
    strategy = distributed_strategy(training_args)
    if outputs.is_main_process():
        print(
            f"[trainbox] {name}: model {model_args.model_name_or_path}, {len(train_ds)} examples, {strategy}, "
            f"outputs {training_args.output_dir}" + (f", resuming from {ckpt}" if ckpt else ""),
            flush=True,
        )

    choice, facts = tune(model_args, training_args, shards=shards(training_args))
    experts, line = moe.choose(facts)
    if line and outputs.is_main_process():
        print(f"[trainbox] {line}", flush=True)
    dtype = model_args.dtype if model_args.dtype in ("auto", None) else getattr(torch, model_args.dtype)
    model = AutoModelForCausalLM.from_pretrained(
        model_args.model_name_or_path,
        dtype=dtype,
        attn_implementation=choice.impl,
        revision=model_args.model_revision,
        **experts,
    )
    trainer = build_trainer(model, training_args, train_ds, tokenizer,
                            optimizer_cls_and_kwargs=(precision.optimizer_for(SFTTrainer, training_args, model)
                                                      if getattr(training_args, "trainbox_master_weights", False)
                                                      else None))
    if getattr(training_args, "trainbox_master_weights", False):
        precision.attach(trainer)  # clipping and the logged grad_norm read the float32 gradient sums
    finish_tuning(trainer, facts)
    trainer.train(resume_from_checkpoint=ckpt)
    if not preemption.was_preempted():
        if trainer.is_fsdp_enabled:
            # The final model is one loadable safetensors set, not shards.
            trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
        trainer.save_model(training_args.output_dir)
    runsummary.finish(trainer, training_args.output_dir, started, name)
    return preemption.exit_code()


def main(argv: list[str]) -> int:
    return runner.run_trainer("sft", argv, parse_checked, _check_before_launch, _train)


def parse_checked(argv: list[str], prog: str = "trainbox sft"):
    """parse() and the checks of sft's options on their own (`trainbox plan` runs the same)."""
    options = parse(argv, prog=prog)
    cfg.check_full_training(options[2])  # LoRA/4-bit options: refused, not ignored (qlora has its own main)
    speed.fsdp_reshard(options[3])  # reshard_after_forward: a boolean, as accelerate reads it
    return options


def _check_before_launch(options, plan) -> None:
    data_args, _, model_args, training_args = options
    check_before_launch(data_args, model_args, training_args)


def _train(options) -> int:
    data_args, _, model_args, training_args = options
    return train(data_args, model_args, training_args)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
