"""LoRA and QLoRA's model side (qlora, and dpo with --use_peft): the 4-bit base loaded, the adapter's PEFT config,
the adapter saved (gathered under FSDP2), and base + adapter merged. The commands only declare; this does.
"""

from __future__ import annotations

import os

from common import atomic
from trainbox.training import config as cfg, modelfiles


def choose_lora_dropout(model_args, facts) -> str | None:
    """PEFT puts LoRA on an MoE model's fused expert weights (Mixtral, Qwen3-MoE in transformers 5) through a
    parameter wrapper that refuses dropout: the default 0.05 would crash there, so MoE models get 0."""
    if not facts.experts or model_args.lora_dropout == 0 or "lora_dropout" in cfg.explicit(model_args):
        return None
    model_args.lora_dropout = 0.0
    return f"LoRA dropout 0 (MoE, {facts.experts} experts: PEFT's LoRA on fused expert weights takes no dropout)"


def peft_config(model_args):
    """TRL's LoraConfig from ModelConfig (None without --use_peft)."""
    from trl import get_peft_config

    model_args.lora_target_modules = modelfiles.peft_targets(model_args.lora_target_modules)
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

