"""QLoRA SFT: 4-bit nf4 base (double quant, bf16 compute), LoRA on all linear layers; saves the adapter (+ merged).

Usage: `python -m trainbox.cli.qlora --model_name_or_path M --dataset D [--merge] [--config X.yaml] [--option value]`.
Options: TRL's SFTConfig (TrainingArguments included), TRL's ModelConfig (4-bit and LoRA settings) and the dataset
options of `sft`. Defaults: load_in_4bit, nf4, nested (double) quant, bf16 compute, LoRA r=16 alpha=32 dropout 0
on all-linear (fused into the 4-bit GEMM: kernels/lora4bit.py), gradient checkpointing, learning rate 2e-4, paged
8-bit AdamW on GPU (plain AdamW on CPU, where paged optimizers do not exist). Across GPUs (more than one process):
FSDP2 shards the 4-bit base (bf16 quant storage) and the adapters, fused AdamW. Data: chat `messages`, dolly-style instruction/context|input/response|output, verl gsm8k.
The adapter goes to OUTPUT_DIR; with --merge, the base in bf16 + adapter merged goes to OUTPUT_DIR/merged.
"""

from __future__ import annotations

from trainbox.run import preemption

if __name__ == "__main__":  # first, before torch's seconds of imports: a stop signal then is remembered, not a kill
    preemption.claim_preempt_signals()

import sys
from dataclasses import dataclass, field

from common.errors import UsageError
from trainbox import helpcache
from trainbox.image import imageinfo
from trainbox.run import outputs, ranks
from trainbox.training import adapters, modelfiles, sftlib, skeleton


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
        # 0, as Unsloth's notebooks have it: the fused 4-bit LoRA path (kernels/lora4bit.py) takes no dropout
        "lora_dropout": 0.0,
        "lora_target_modules": ["all-linear"],
        "gradient_checkpointing": True,
        "learning_rate": 2e-4,
        # bitsandbytes' paged optimizers need CUDA unified memory.
        "optim": "adamw_torch_fused" if sharded else "paged_adamw_8bit" if gpu else "adamw_torch",
        "include_num_input_tokens_seen": True,
        "logging_steps": 10,
        "save_steps": 200,
    }


def check(run) -> None:
    m = run.model
    if m.load_in_4bit and m.load_in_8bit:
        raise UsageError("--load_in_4bit and --load_in_8bit exclude each other; pick one")
    if not m.use_peft:
        raise UsageError("qlora trains LoRA adapters: --use_peft must stay true (use `sft` for full fine-tuning)")
    if m.dtype not in ("bfloat16", "float16", "float32"):
        raise UsageError(f"--dtype {m.dtype}: qlora needs bfloat16, float16 or float32 (the compute dtype)")
    modelfiles.check_lora_targets(m.model_name_or_path, m.model_revision, m.lora_target_modules)


def describe(run) -> str:
    m, args = run.model, run.args
    bits = "4-bit " + m.bnb_4bit_quant_type if m.load_in_4bit else ("8-bit" if m.load_in_8bit else "unquantized")
    return (f"{bits}, LoRA r={m.lora_r} on {m.lora_target_modules}, "
            f"optim {getattr(args.optim, 'value', args.optim)}")


def save(run, trainer, tokenizer) -> None:
    adapters.save_adapter(trainer, run.args.output_dir)
    if run.extra(QLoRAArguments).merge:
        trainer.accelerator.wait_for_everyone()
        if outputs.is_main_process():
            merged = adapters.save_merged(run.model, run.args.output_dir, tokenizer)
            print(f"[trainbox] qlora: merged model in {merged}", flush=True)


def _config():
    from trl import SFTConfig

    return SFTConfig


RECIPE = skeleton.Recipe(
    name="qlora",
    config=_config,
    defaults=lambda argv: qlora_defaults(gpu=True if helpcache.asked(argv) else None),
    extras=(QLoRAArguments,),
    check=check,
    rows=lambda run, tokenizer, rows: sftlib.prepare_dataset(run.data, run.args, rows),
    # gradient checkpointing stays on (qlora's point: a big base in little memory); FSDP2 reshards (memory first)
    tuning=skeleton.Tuning(checkpointing=False, memory_first=True),
    notes=lambda run, facts: [adapters.choose_lora_dropout(run.model, facts)],
    model=lambda run, choice, facts: adapters.load_quantized(run.model, choice.impl),
    trainer=lambda run, model, ds, tokenizer, callbacks: sftlib.build_trainer(
        model, run.args, ds, tokenizer, peft_config=adapters.peft_config(run.model), callbacks=callbacks),
    describe=describe,
    save=save,
)
parse = RECIPE.parse


def main(argv: list[str]) -> int:
    return skeleton.main(RECIPE, argv, imageinfo.load)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
