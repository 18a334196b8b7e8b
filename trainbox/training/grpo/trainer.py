"""GRPO's trainer set up: gradient checkpointing (off where full training fits beside colocated vLLM or the static
decoder), the policy's attention kernel and padding-free forward, TRL's GRPOTrainer (padding-free, static decoder
rollouts, or neither) with our callbacks, and a line on what was loaded.
"""

from __future__ import annotations

from trainbox.run import ranks
from trainbox.training import attention, callbacks, config, memplan, speed
from trainbox.training.grpo import rollouts as grpo_rollouts


def choose_checkpointing(args, model_args, mode: str, max_prompt_tokens: int | None, facts,
                         static_decode: bool = False) -> str:
    """TRL turns gradient checkpointing on for GRPO; full fine-tuning turns it off when the policy's training memory
    fits in what colocated vLLM (or the static decoder's weights and cache) leaves (speed.py's estimate; the
    micro-batch is prompt + completion tokens of each completion). LoRA/QLoRA keep TRL's choice: their point is
    fitting a big base in little memory."""
    if mode != "full" or "gradient_checkpointing" in config.explicit(args):
        why = "set by you" if "gradient_checkpointing" in config.explicit(args) else f"{mode}: TRL's default"
        return (f"gradient checkpointing {'on' if args.gradient_checkpointing else 'off'} ({why})"
                + choose_sleep_mode(args, planned=False))
    import torch

    free = memplan.free_memory()  # this rank's GPU (TRAINBOX_GPU_FREE_GIB caps it); the ranks agree in choose_memory
    if free is not None and args.use_vllm and args.vllm_mode == "colocate":
        total = torch.cuda.mem_get_info(torch.device("cuda", ranks.local_rank()))[1]
        free -= int(args.vllm_gpu_memory_utilization * total)  # vLLM takes its share of the whole GPU at start
    if free is not None and static_decode:
        free -= grpo_rollouts.decoder_bytes(args, facts, max_prompt_tokens)
    tokens = args.per_device_train_batch_size * ((max_prompt_tokens or 512) + args.max_completion_length)
    line = speed.choose_memory(args, facts, shards=1, free=free, tokens=tokens,
                               extra=grpo_rollouts.reference_bytes(args, facts))[0]
    return line + choose_sleep_mode(args, planned=free is not None)


def choose_sleep_mode(args, planned: bool) -> str:
    """Colocated vLLM's sleep mode, unless set: off where the plan kept its fastest settings (checkpointing off)
    beside vLLM's share of the GPU, since the plan counted that share as taken anyway; on where it had to save memory
    (sleeping hands vLLM's memory back while the policy trains). Sleeping costs every step a weight reload and cache
    remap: on one H100, a 1B policy, 16 x 256-token rollouts, 1.07 steps/s with it, 1.19 without, TRL 1.13
    (benchmarks/results/grpo_vllm-2026-11-26.txt). Returns the note for the plan's line."""
    if not (args.use_vllm and args.vllm_mode == "colocate") or "vllm_enable_sleep_mode" in config.explicit(args):
        return ""
    if planned and not args.gradient_checkpointing:
        args.vllm_enable_sleep_mode = False
        return "; vLLM sleep mode off (training fits beside its share)"
    args.vllm_enable_sleep_mode = True
    return "; vLLM sleep mode on" + (" (the plan saves memory)" if planned else " (no memory plan here)")


def choose_policy_forward(script, args, model_args, needs=None, image: dict | None = None) -> list[str]:
    """The policy's attention kernel (attention.choose, as sft) and whether its log-prob forward is padding-free;
    sets model_args.attn_implementation and script.padding_free, returns the lines to print.

    Padding-free needs a kernel that keeps packed sequences apart: FlashAttention or torch's varlen kernel take the
    boundaries from the position ids (attention.UNPACKED_WHY says why SDPA and eager don't).
    """
    init = args.model_init_kwargs or {}
    requested = (model_args.attn_implementation if "attn_implementation" in config.explicit(model_args)
                 else init.get("attn_implementation"))
    choice = attention.choose(requested, image, model=needs or attention.Needs())
    model_args.attn_implementation = choice.impl  # our aliases (varlen, fa2, ...) resolved to transformers' names
    if "attn_implementation" in init:
        args.model_init_kwargs = {**init, "attn_implementation": choice.impl}
    if script.padding_free is not None:
        why = "set by --padding_free"
    elif choice.packed:
        script.padding_free = True
        why = "the kernel keeps packed sequences apart"
    else:
        script.padding_free = False
        why = f"{choice.impl}: {attention.UNPACKED_WHY}"
    how = ("padding-free (one packed row of real tokens per chunk; no compute on padding)" if script.padding_free
           else "padded rows (TRL's)")
    return [choice.line(), f"policy forward: {how}: {why}"]


def describe_model(model) -> str:
    """What was actually loaded: weight format and trainable share (shows that qlora really is 4-bit + LoRA)."""
    import torch

    total = trainable = 0
    for p in model.parameters():
        n = p.numel() * (2 if p.dtype == torch.uint8 else 1)  # bitsandbytes packs two 4-bit weights per byte
        total += n
        trainable += n if p.requires_grad else 0
    four_bit = [m for m in model.modules() if type(m).__name__ == "Linear4bit"]
    if four_bit:
        weights = f"4-bit {getattr(four_bit[0].weight, 'quant_type', '?')} (bitsandbytes Linear4bit)"
    else:
        weights = str(next(model.parameters()).dtype).removeprefix("torch.")
    lora = ", LoRA adapters" if any("lora_" in n for n, _ in model.named_parameters()) else ""
    return f"loaded: base weights {weights}{lora}; trainable {trainable:,} of {total:,} parameters"


def describe_ratio(trainer) -> str | None:
    """Where vLLM's importance-sampling ratio comes from (grpo/is_ratio.py), when vLLM generates."""
    if not (trainer.use_vllm and trainer.vllm_importance_sampling_correction):
        return None
    if trainer._ratio_from_loss():
        return ("vLLM importance-sampling ratio: from the loss forward (the weights that generated score the loss; "
                "no extra old-policy forward)")
    return ("vLLM importance-sampling ratio: TRL's old-policy forward (the weights may change between generation and "
            "use)")


def trainer_class(padding_free: bool, static_decode: bool = False):
    """Our GRPOTrainer: the loss-time importance ratio (grpo/is_ratio.py) over TRL's trainer, padding-free or not,
    rollouts without vLLM from the static decoder (grpo/static_rollouts.py) or not."""
    from trainbox.training.grpo.is_ratio import LossTimeRatio

    bases = (LossTimeRatio,)
    if static_decode:
        from trainbox.training.grpo.static_rollouts import StaticDecodeRollouts

        bases += (StaticDecodeRollouts,)
    if padding_free:
        from trainbox.training.grpo.padding_free import PaddingFreeGRPOTrainer

        bases += (PaddingFreeGRPOTrainer,)
    return type("TrainboxGRPOTrainer", bases, {})


def build_trainer(args, model_args, mode, funcs, ds, preempt_cb, padding_free: bool = False,
                  static_decode: bool = False):
    from trl import get_peft_config, get_quantization_config

    init = dict(args.model_init_kwargs or {})
    init.setdefault("revision", model_args.model_revision)
    init.setdefault("dtype", model_args.dtype)
    if model_args.attn_implementation:
        init.setdefault("attn_implementation", model_args.attn_implementation)
    quant = get_quantization_config(model_args) if mode == "qlora" else None
    if quant is not None:
        import torch

        if torch.cuda.is_available():
            # 4-bit weights can't be moved after loading: put each process's copy on its own GPU (TRL's default,
            # device_map=None under DDP, would quantize onto no device).
            init.setdefault("device_map", {"": ranks.local_rank()})
    args.model_init_kwargs = init
    try:  # colocated vLLM starts its engine here
        return trainer_class(padding_free, static_decode)(
            model=model_args.model_name_or_path,
            reward_funcs=funcs,
            args=args,
            train_dataset=ds,
            peft_config=get_peft_config(model_args) if mode != "full" else None,
            quantization_config=quant,
            # The one callback list (callbacks.py); no MFU in the summary: rollouts are most of a GRPO step's work.
            callbacks=callbacks.standard(preempt_cb),
        )
    except Exception as error:
        grpo_rollouts.explain_engine_failure(args, error)
        raise
