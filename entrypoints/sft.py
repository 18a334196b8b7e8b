"""Full-parameter SFT from 1 process to many nodes (torchrun c10d, FSDP2 on GPUs; chat messages, dolly, verl gsm8k).

Usage: `python -m entrypoints.sft --model_name_or_path M --dataset D [--config X.yaml] [--option value ...]`.
Options: TRL's SFTConfig (transformers' TrainingArguments included), TRL's ModelConfig (model loading), and the
script options below (dataset, format, keys, resume, launcher flags). Outside torchrun, under Slurm or with
`--nnodes/--nproc-per-node/--master-addr/--master-port/--node-rank`, this starts torchrun itself (launch.py).
On GPUs with more than one process it shards with FSDP2; on CPU the Trainer runs DDP over gloo (it ignores FSDP there).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

from . import attention, data, launch, lifecycle, precision, runlog, speed, throughput
from . import config as cfg
from . import errors
from .errors import UsageError


@dataclass
class DataArguments:
    dataset: str | None = field(
        default=None, metadata={"help": "local .parquet/.jsonl/.json/.csv file or directory, or a hub id name[:config]"}
    )
    dataset_split: str = field(default="train", metadata={"help": "split to train on"})
    dataset_format: str = field(default="auto", metadata={"help": f"one of {', '.join(data.FORMATS)}"})
    prompt_key: str | None = field(default=None, metadata={"help": "prompt column; dotted for dicts (extra_info.question)"})
    response_key: str | None = field(default=None, metadata={"help": "response column; dotted (extra_info.answer)"})
    messages_key: str = field(default="messages", metadata={"help": "column with chat messages"})
    system_prompt: str | None = field(default=None, metadata={"help": "system message prepended to every example"})
    max_samples: int | None = field(default=None, metadata={"help": "use only the first N rows"})
    resume: str = field(
        default="auto", metadata={"help": "auto: last complete checkpoint in output_dir if any; never; or a checkpoint path"}
    )


def load_tokenizer(model_path: str, training_args):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    if tok.chat_template is None and getattr(training_args, "chat_template_path", None) is None:
        raise UsageError(
            f"the tokenizer in {model_path} has no chat template; conversational data needs one "
            "(use an instruct model or --chat_template_path FILE)"
        )
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def prepare_dataset(data_args: DataArguments, training_args, rows: int | None = None):
    """The dataset as SFT rows; `rows` (or --max_samples) keeps only the first ones."""
    ds = data.load_table(data_args.dataset, split=data_args.dataset_split)
    rows = rows or data_args.max_samples
    if rows:
        ds = ds.select(range(min(rows, len(ds))))
    return data.to_sft(
        ds,
        fmt=data_args.dataset_format,
        prompt_key=data_args.prompt_key,
        response_key=data_args.response_key,
        messages_key=data_args.messages_key,
        system_prompt=data_args.system_prompt,
        where=f"dataset {data_args.dataset}",
    )


def distributed_strategy(training_args) -> str:
    """Pick FSDP2 on GPUs with >1 process; on CPU the Trainer runs DDP (gloo). Returns a label for the log."""
    import torch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    on_gpu = torch.cuda.is_available() and not training_args.use_cpu
    if world <= 1:
        return "single process" + (" (GPU)" if on_gpu else " (CPU)")
    if not on_gpu:
        if training_args.fsdp:
            print("warning: --fsdp is ignored by the Trainer on CPU; running DDP over gloo", file=sys.stderr)
        return f"DDP over gloo, {world} processes (CPU)"
    return f"FSDP2, {world} processes (GPU)"


FSDP2_GPU = {
    "fsdp": "full_shard auto_wrap",
    "fsdp_config": {
        "version": 2,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "reshard_after_forward": True,
        # Sharded checkpoints: every rank writes its shard to the shared output dir; fast and resumable.
        "state_dict_type": "SHARDED_STATE_DICT",
    },
}


def sft_defaults() -> dict:
    import torch

    d = {"include_num_input_tokens_seen": True, "logging_steps": 10, "save_steps": 200}
    if torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
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


def validate(data_args, model_args, training_args):
    """Checks that need neither the model nor the data: model path, report_to, dataset given, resume target."""
    if training_args.resume_from_checkpoint:
        # TrainingArguments' own option means the same as our --resume PATH.
        data_args.resume = training_args.resume_from_checkpoint
    cfg.check_model_path(model_args.model_name_or_path)
    cfg.check_report_to(training_args.report_to)
    if not data_args.dataset:
        raise UsageError("no dataset given: pass --dataset PATH (.parquet/.jsonl/.json/.csv file or directory) or a hub id")
    if data_args.resume not in ("auto", "never"):
        lifecycle.resolve_resume(data_args.resume, training_args.output_dir)


def shards(training_args) -> int:
    """Ranks the weights and optimizer states are sharded over (FSDP on GPUs), 1 otherwise."""
    import torch

    if training_args.fsdp and torch.cuda.is_available() and not training_args.use_cpu:
        return int(os.environ.get("WORLD_SIZE", "1"))
    return 1


def tune(model_args, training_args, shards: int, checkpointing: bool = True):
    """Attention kernel and speed defaults (speed.py) for this model and GPU, printed once; returns (choice, facts)."""
    requested = model_args.attn_implementation if "attn_implementation" in cfg.explicit(model_args) else None
    facts = speed.model_facts(model_args.model_name_or_path, model_args.model_revision)
    choice = attention.choose(requested, model=facts.attention)
    lines = speed.apply(training_args, model_args, choice, facts, shards=shards, checkpointing=checkpointing)
    if lifecycle.is_main_process():
        for line in lines:
            print(f"[trainbox] {line}", flush=True)
    return choice, facts


def build_trainer(model, training_args, train_ds, tokenizer, **extra):
    """TRL's SFTTrainer with our callbacks (preemption, steady-state throughput); `extra`: peft_config, optimizer."""
    from trl import SFTTrainer

    # TRL tokenizes and packs inside the constructor, on every rank at once, into one datasets cache (shared by
    # the nodes of a job on shared storage): the first process fills it, the others then read it.
    with training_args.main_process_first(local=False, desc="tokenize and pack"):
        return SFTTrainer(model=model, args=training_args, train_dataset=train_ds, processing_class=tokenizer,
                          callbacks=[lifecycle.PreemptionCallback(), throughput.Throughput()], **extra)


def finish_tuning(trainer, facts, qlora: bool = False) -> None:
    """After the trainer is built: FSDP2 policies on accelerate's plugin, FLOPs per token for the summary's MFU.
    qlora: checkpointing stays the model's own (PEFT prepared the 4-bit model for it), and memory comes first."""
    line = speed.tune_fsdp(trainer, activation_checkpointing=not qlora and bool(trainer.args.gradient_checkpointing),
                           memory_first=qlora)
    if line and lifecycle.is_main_process():
        print(f"[trainbox] {line}", flush=True)
    if getattr(trainer.args, "trainbox_liger", False):
        speed.apply_liger(trainer.model, facts.model_type)
    cb = lifecycle.find_callback(trainer, throughput.Throughput)
    if cb:
        cb.flops_per_token = throughput.flops_per_token(facts, throughput.example_lengths(trainer.train_dataset))


def check_before_launch(data_args, model_args, training_args) -> None:
    """In the launcher, before torchrun: the tokenizer's chat template and the dataset's columns (on a few rows),
    so a bad config is one `error:` line and exit 2 here, not a failure in every rank."""
    validate(data_args, model_args, training_args)
    load_tokenizer(model_args.model_name_or_path, training_args)
    prepare_dataset(data_args, training_args, rows=8)


def train(data_args, model_args, training_args, name: str = "sft") -> int:
    import torch
    from transformers import AutoModelForCausalLM
    from trl import SFTTrainer

    started = time.time()
    training_args.output_dir = lifecycle.output_dir(cfg.configured_output_dir(training_args))
    validate(data_args, model_args, training_args)
    tokenizer = load_tokenizer(model_args.model_name_or_path, training_args)
    with training_args.main_process_first(local=False, desc="dataset"):
        train_ds = prepare_dataset(data_args, training_args)
    ckpt = lifecycle.resolve_resume(data_args.resume, training_args.output_dir, training_args, name)
    strategy = distributed_strategy(training_args)
    if lifecycle.is_main_process():
        print(
            f"[trainbox] {name}: model {model_args.model_name_or_path}, {len(train_ds)} examples, {strategy}, "
            f"outputs {training_args.output_dir}" + (f", resuming from {ckpt}" if ckpt else ""),
            flush=True,
        )

    choice, facts = tune(model_args, training_args, shards=shards(training_args))
    dtype = model_args.dtype if model_args.dtype in ("auto", None) else getattr(torch, model_args.dtype)
    model = AutoModelForCausalLM.from_pretrained(
        model_args.model_name_or_path,
        dtype=dtype,
        attn_implementation=choice.impl,
        revision=model_args.model_revision,
    )
    trainer = build_trainer(model, training_args, train_ds, tokenizer,
                            optimizer_cls_and_kwargs=(precision.optimizer_for(SFTTrainer, training_args, model)
                                                      if getattr(training_args, "trainbox_master_weights", False)
                                                      else None))
    if getattr(training_args, "trainbox_master_weights", False):
        precision.attach(trainer)  # clipping and the logged grad_norm read the float32 gradient sums
    finish_tuning(trainer, facts)
    trainer.train(resume_from_checkpoint=ckpt)
    if not lifecycle.was_preempted():
        if trainer.is_fsdp_enabled:
            # The final model is one loadable safetensors set, not shards.
            trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
        trainer.save_model(training_args.output_dir)
    lifecycle.finish(trainer, training_args.output_dir, started, name)
    return lifecycle.exit_code()


def main(argv: list[str]) -> int:
    # Before CUDA starts (torchrun's workers inherit it): freed blocks are remapped, not left as holes, so what the
    # memory plan counts is close to what the allocator reserves (measured on 2 x H100, 8B shape, without it:
    # 63.7 GiB allocated, 74.9 GiB reserved).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    try:
        lifecycle.install_signal_handlers()
        data_args, launch_args, model_args, training_args = parse(argv)
        cfg.check_full_training(model_args)  # LoRA/4-bit options: refused, not ignored (qlora has its own main)
        plan = launch.plan(launch_args, os.environ)
        with runlog.for_command("sft", cfg.configured_output_dir(training_args), plan, argv):
            if plan.mode == "torchrun":
                check_before_launch(data_args, model_args, training_args)
                return launch.run_torchrun(plan, "entrypoints.sft", argv)
            if plan.env:
                # One Slurm task per rank: set RANK/WORLD_SIZE/... first, then parse again so the
                # distributed defaults (FSDP2 on GPUs) and the Trainer's device setup see them.
                launch.apply_env(plan, os.environ)
                data_args, launch_args, model_args, training_args = parse(argv)
            with lifecycle.ends_on_crash():
                return train(data_args, model_args, training_args)
    except UsageError as e:
        print(f"error: {errors.line(e)}", file=sys.stderr)
        return 2
    except lifecycle.Crashed as e:  # after the run log was closed and copied: leave now, whatever still runs
        return lifecycle.exit_now(e.code)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
