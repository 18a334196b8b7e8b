"""QLoRA SFT: 4-bit nf4 base (double quant, bf16 compute), LoRA on all linear layers; saves the adapter (+ merged).

Usage: `python -m trainbox.cli.qlora --model_name_or_path M --dataset D [--merge] [--config X.yaml] [--option value]`.
Options: TRL's SFTConfig (TrainingArguments included), TRL's ModelConfig (4-bit and LoRA settings) and the dataset
options of `sft`. Defaults: load_in_4bit, nf4, nested (double) quant, bf16 compute, LoRA r=16 alpha=32 on
all-linear, gradient checkpointing, learning rate 2e-4, paged 8-bit AdamW on GPU (plain AdamW on CPU, where paged
optimizers do not exist). Across GPUs (more than one process): FSDP2 shards the 4-bit base (bf16 quant storage) and
the adapters, fused AdamW. Data: chat `messages`, dolly-style instruction/context|input/response|output, verl gsm8k.
The adapter goes to OUTPUT_DIR; with --merge, the base in bf16 + adapter merged goes to OUTPUT_DIR/merged.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

from common import atomic, launch
from common.errors import UsageError
from trainbox import helpcache
from trainbox.run import outputs, preemption, ranks, resume, runsummary
from trainbox.training import config as cfg
from trainbox.training import runner, sftlib


@dataclass
class QLoRAArguments:
    merge: bool = field(default=False, metadata={"help": "also save base+adapter merged (bf16) to OUTPUT_DIR/merged"})


def qlora_defaults(gpu: bool | None = None) -> dict:
    """`gpu` None: ask torch. --help shows the GPU defaults on every host (helpcache.py: one text for all)."""
    if gpu is None:
        import torch

        gpu = torch.cuda.is_available()
    sharded = gpu and ranks.distributed()
    return {
        # Across GPUs: FSDP2 shards the base too. It can shard 4-bit weights only when they are stored in a float
        # dtype (bf16 storage: same bytes, two nf4 values per byte pair), and bitsandbytes' 8-bit optimizers don't
        # step sharded (DTensor) parameters; the LoRA states are small, so fused AdamW costs little memory.
        **(dict(sftlib.FSDP2_GPU, bnb_4bit_quant_storage="bfloat16", optim="adamw_torch_fused",
                gradient_checkpointing_kwargs={"use_reentrant": False}) if sharded else {}),
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "use_bnb_nested_quant": True,
        "dtype": "bfloat16",
        "use_peft": True,
        "lora_r": 16,
        "lora_alpha": 32,
        "lora_dropout": 0.05,
        "lora_target_modules": ["all-linear"],
        "gradient_checkpointing": True,
        "learning_rate": 2e-4,
        # bitsandbytes' paged optimizers need CUDA unified memory.
        "optim": "adamw_torch_fused" if sharded else "paged_adamw_8bit" if gpu else "adamw_torch",
        "include_num_input_tokens_seen": True,
        "logging_steps": 10,
        "save_steps": 200,
    }


def parse(argv: list[str], prog: str = "trainbox qlora"):
    from trl import ModelConfig, SFTConfig

    return cfg.parse_args(
        (sftlib.DataArguments, QLoRAArguments, launch.LaunchArguments, ModelConfig, SFTConfig),
        argv,
        prog=prog,
        legacy={**cfg.LEGACY_TRAINING, **cfg.LEGACY_SFT},
        defaults=qlora_defaults(gpu=True if helpcache.asked(argv) else None),
    )


def validate(data_args, model_args, training_args):
    sftlib.validate(data_args, model_args, training_args)
    if model_args.load_in_4bit and model_args.load_in_8bit:
        raise UsageError("--load_in_4bit and --load_in_8bit exclude each other; pick one")
    if not model_args.use_peft:
        raise UsageError("qlora trains LoRA adapters: --use_peft must stay true (use `sft` for full fine-tuning)")
    if model_args.dtype not in ("bfloat16", "float16", "float32"):
        raise UsageError(f"--dtype {model_args.dtype}: qlora needs bfloat16, float16 or float32 (the compute dtype)")


def choose_lora_dropout(model_args, facts) -> str | None:
    """PEFT puts LoRA on an MoE model's fused expert weights (Mixtral, Qwen3-MoE in transformers 5) through a
    parameter wrapper that refuses dropout: the default 0.05 would crash there, so MoE models get 0."""
    if not facts.experts or model_args.lora_dropout == 0 or "lora_dropout" in cfg.explicit(model_args):
        return None
    model_args.lora_dropout = 0.0
    return f"LoRA dropout 0 (MoE, {facts.experts} experts: PEFT's LoRA on fused expert weights takes no dropout)"


def _peft_config(model_args):
    from trl import get_peft_config

    targets = model_args.lora_target_modules
    if isinstance(targets, list) and len(targets) == 1:
        # peft recognises the `all-linear` shortcut only as a plain string.
        model_args.lora_target_modules = targets[0]
    return get_peft_config(model_args)


def load_quantized(model_args, attn_implementation: str | None = None):
    import torch
    from transformers import AutoModelForCausalLM
    from trl import get_quantization_config

    # TRL's own helper builds the BitsAndBytesConfig from ModelConfig (as `grpo` does): nf4, double quant, compute
    # dtype = --dtype, storage = --bnb_4bit_quant_storage.
    quant = get_quantization_config(model_args)
    # Each rank loads a whole (quantized) copy onto its own device; under FSDP2 the Trainer then shards it.
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if torch.cuda.is_available() else "cpu"
    return AutoModelForCausalLM.from_pretrained(
        model_args.model_name_or_path,
        dtype=getattr(torch, model_args.dtype),
        quantization_config=quant,
        device_map={"": device},
        attn_implementation=attn_implementation or model_args.attn_implementation,
        revision=model_args.model_revision,
    )


def save_merged(model_args, adapter_dir: str, tokenizer) -> str:
    """Base in the compute dtype (not quantized) + adapter, merged, written through the one atomic writer (a temp
    folder, fsynced, swapped in whole)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    final = os.path.join(adapter_dir, "merged")
    base = AutoModelForCausalLM.from_pretrained(
        model_args.model_name_or_path, dtype=getattr(torch, model_args.dtype), revision=model_args.model_revision
    )
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    with atomic.replacing_dir(final) as tmp:
        merged.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return final


def save_adapter(trainer, output_dir: str) -> None:
    """The adapter (adapter_config.json + weights) as one loadable set. Under FSDP2 only the LoRA weights are gathered
    (every rank joins each all-gather, the first process writes): a full state dict of the sharded 4-bit base is
    never built (it hung in accelerate's FULL_STATE_DICT path on 2 GPUs, and it is not what an adapter needs)."""
    if not trainer.is_fsdp_enabled:
        trainer.save_model(output_dir)
        return
    from torch.distributed.tensor import DTensor

    state = {}
    for name, p in trainer.model.named_parameters():
        if p.requires_grad:
            full = p.full_tensor() if isinstance(p, DTensor) else p.data
            state[name] = full.detach().to("cpu")
    if trainer.accelerator.is_main_process:
        # PeftModel.save_pretrained keeps the adapter's keys (lora_*) and drops the adapter name, as usual.
        trainer.model.save_pretrained(output_dir, state_dict=state)
        trainer.processing_class.save_pretrained(output_dir)
    trainer.accelerator.wait_for_everyone()


def train(data_args, q_args, model_args, training_args, name: str = "qlora") -> int:
    started = time.time()
    training_args.output_dir = outputs.output_dir(cfg.configured_output_dir(training_args))
    validate(data_args, model_args, training_args)
    tokenizer = sftlib.load_tokenizer(model_args.model_name_or_path, training_args)
    with training_args.main_process_first(local=False, desc="dataset"):
        train_ds = sftlib.prepare_dataset(data_args, training_args)
    ckpt = resume.resolve_resume(data_args.resume, training_args.output_dir, training_args, name)
    choice, facts = sftlib.tune(model_args, training_args, shards=sftlib.shards(training_args), checkpointing=False)
    dropout = choose_lora_dropout(model_args, facts)
    peft_config = _peft_config(model_args)
    if outputs.is_main_process():
        bits = "4-bit " + model_args.bnb_4bit_quant_type if model_args.load_in_4bit else ("8-bit" if model_args.load_in_8bit else "unquantized")
        print(
            f"[trainbox] {name}: model {model_args.model_name_or_path} ({bits}, LoRA r={model_args.lora_r} on "
            f"{model_args.lora_target_modules}, optim {getattr(training_args.optim, 'value', training_args.optim)}), {len(train_ds)} examples, "
            f"outputs {training_args.output_dir}" + (f", resuming from {ckpt}" if ckpt else ""),
            flush=True,
        )
        if dropout:
            print(f"[trainbox] {name}: {dropout}", flush=True)
    model = load_quantized(model_args, choice.impl)
    trainer = sftlib.build_trainer(model, training_args, train_ds, tokenizer, peft_config=peft_config)
    sftlib.finish_tuning(trainer, facts, qlora=True)
    trainer.train(resume_from_checkpoint=ckpt)
    if not preemption.was_preempted():
        save_adapter(trainer, training_args.output_dir)
        if q_args.merge:
            trainer.accelerator.wait_for_everyone()
            if outputs.is_main_process():
                merged = save_merged(model_args, training_args.output_dir, tokenizer)
                print(f"[trainbox] {name}: merged model in {merged}", flush=True)
    runsummary.finish(trainer, training_args.output_dir, started, name)
    return preemption.exit_code()


def main(argv: list[str]) -> int:
    return runner.run_trainer("qlora", argv, parse, _check_before_launch, _train)


def _check_before_launch(options, plan) -> None:
    data_args, _, _, model_args, training_args = options
    validate(data_args, model_args, training_args)
    sftlib.check_before_launch(data_args, model_args, training_args)


def _train(options) -> int:
    data_args, q_args, _, model_args, training_args = options
    return train(data_args, q_args, model_args, training_args)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
