"""Speed defaults of the SFT-style trainers (sft, qlora), chosen for this model, GPU and data and printed.

What is decided here, each only when the user did not set it (`--option` or YAML always wins):
- packing: best-fit-decreasing packing with padding-free batches (TRL's `packing_strategy="bfd"`), so no compute is
  spent on padding; each example keeps its own positions, and the attention kernel keeps examples apart (varlen
  kernels take the sequence boundaries). With SDPA or eager batches stay padded (attention.UNPACKED_WHY).
- Liger kernels (RMSNorm, RoPE, SwiGLU; TRL keeps its own fused LM head + loss) where liger-kernel supports the model.
- memory (choose_memory): the job's memory plan (memplan.py: its ladder, its estimate and how it was checked),
  decided once for every rank from the smallest free memory among them; an error naming what fits when nothing does.
- precision: bf16 weights with float32 master weights in the optimizer (precision.py says why) for one process per
  model copy; FSDP2 keeps float32 shards and computes in bf16.

Measured on one H200, 8B Llama shape, batch 2 x 1024, checkpointing: `trl sft` and `trainbox sft` (float32
path) both peaked at 119.75 GiB allocated, estimate 120.6 GiB.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import replace

from common.errors import UsageError
from trainbox.run import ranks
from trainbox.training import attention, config as cfg, memplan
from trainbox.training.modelfacts import ModelFacts

GiB = 2**30
TRUTH = {"y": True, "yes": True, "t": True, "true": True, "on": True, "1": True,
         "n": False, "no": False, "f": False, "false": False, "off": False, "0": False}  # accelerate's str_to_bool


def fsdp_reshard(args) -> bool | None:
    """--fsdp_config's reshard_after_forward as FSDP2 reads it (transformers passes str(value) through accelerate's
    str_to_bool: true/false, yes/no, on/off, 1/0), None where it is not set; one UsageError for anything else
    ("maybe" used to be read as true by the plan and fail inside the Trainer on every rank)."""
    conf = getattr(args, "fsdp_config", None)
    if isinstance(conf, str) and conf:  # a path: TrainingArguments reads it only when FSDP is on (GPUs, >1 rank)
        import json

        try:
            with open(conf, encoding="utf-8") as f:
                conf = json.load(f)
        except (OSError, ValueError, RecursionError) as e:
            raise UsageError(f"--fsdp_config {conf}: not a readable JSON file ({' '.join(str(e).split())[:200]})") \
                from None
    if not isinstance(conf, dict) or "reshard_after_forward" not in conf:
        return None
    value = conf["reshard_after_forward"]
    read = TRUTH.get(str(value).strip().lower())
    if read is None:
        raise UsageError(f"--fsdp_config reshard_after_forward {str(value)[:60]!r}: expected true or false (FSDP2 "
                         "keeps the gathered layers for backward when false)")
    return read


def _optim_name(args) -> str:
    return str(getattr(args.optim, "value", args.optim))


def job_for(args, f: ModelFacts, shards: int, *, tokens: int | None = None, masters_ok: bool = False,
            extra: int = 0, split: bool = False, attn: str = "") -> memplan.Job:
    """The memory plan's view of this run (memplan.Job): shape, batch, accumulation, optimizer, layout, and the
    settings the user fixed (kept by every rung). `split`: a micro-batch of `tokens` may still be halved (DPO's
    pairs: 2 x batch rows), where GRPO's may not. `attn`: the attention kernel the run loads (transformers'
    attn_implementation; "" for a flash kernel)."""
    explicit = cfg.explicit(args)
    fixed: dict = {}
    if "gradient_checkpointing" in explicit:
        fixed["checkpointing"] = bool(args.gradient_checkpointing)
    reshard = fsdp_reshard(args)  # checked: "maybe" is an error here as in the Trainer
    if shards > 1 and "fsdp_config" in explicit and reshard is not None:
        fixed["reshard"] = reshard  # the user's own FSDP setting
    elif shards > 1 and reshards_after_forward(memory_first=False):
        fixed["reshard"] = True  # across nodes memory wins (reshards_after_forward)
    if tokens is not None and not split:
        fixed["batch"] = True  # GRPO's micro-batch is its generation batch: not ours to split
    # smaller AdamW moments only where master weights could be kept and you left --optim (torchao's 8-bit ones where
    # torchao is installed)
    states_ok = (("bf16",) + (("8bit",) if memplan.lowbit_reason() is None else ())
                 if masters_ok and "optim" not in explicit else ())
    return memplan.Job(f, batch=int(args.per_device_train_batch_size),
                       max_length=int(getattr(args, "max_length", None) or 1024),
                       grad_accum=int(getattr(args, "gradient_accumulation_steps", 1) or 1), optim=_optim_name(args),
                       shards=shards, nodes=ranks.nodes(), masters_ok=masters_ok, states_ok=states_ok,
                       extra=extra, tokens=tokens,
                       fixed=fixed, fsdp=shards > 1, liger=bool(getattr(args, "trainbox_liger", False)
                                                   or getattr(args, "use_liger_kernel", False)),
                       attn=attn, optim_args=getattr(args, "optim_args", None))


def choose_memory(args, f: ModelFacts, shards: int, free: int | None, *, tokens: int | None = None,
                  masters_ok: bool = False, extra: int = 0, split: bool = False,
                  attn: str = "") -> tuple[str, str | None]:
    """The memory plan (memplan.py) for this run, agreed by every rank of the job: `free` is this rank's free GPU
    memory (None: CPU); the group plans with the smallest. Sets args.gradient_checkpointing, the FSDP2 settings
    (args.trainbox_reshard, sync_each_batch) and the micro-batch split; returns (the plan's line,
    why master weights are off or None). `tokens`: of one micro-batch (default batch x max_length, SFT's worst case)."""
    explicit = "gradient_checkpointing" in cfg.explicit(args)
    job = job_for(args, f, shards, tokens=tokens, masters_ok=masters_ok, extra=extra, split=split, attn=attn)

    def decide(smallest, seen):
        if smallest is None:
            return None
        plan = memplan.decide(job, smallest)
        lo, hi, ranks = seen
        note = (f"the smallest of {ranks} ranks' free memory, largest {hi / GiB:.1f} GiB" if ranks > 1 else "")
        if os.environ.get(memplan.FREE_ENV):
            note = (note + "; " if note else "") + f"capped by {memplan.FREE_ENV}"
        return plan, plan.line(note)

    agreed = memplan.agree(free, decide)
    if agreed is None:
        if not explicit:
            args.gradient_checkpointing = False
        return (f"gradient checkpointing {'on' if args.gradient_checkpointing else 'off'} "
                + ("(set by you)" if explicit else "(CPU: memory is not the limit)"), None)
    plan, line = agreed
    s = plan.settings
    args.gradient_checkpointing = s.checkpointing
    args.trainbox_states = s.states  # AdamW's moments: choose_precision and precision.optimizer_for read it
    args.trainbox_reshard = s.reshard
    if s.batch != args.per_device_train_batch_size:
        args.per_device_train_batch_size, args.gradient_accumulation_steps = s.batch, s.grad_accum
    if s.sync_each_batch:  # (TrainingArguments has made accelerator_config an AcceleratorConfig by now)
        acc = args.accelerator_config
        acc.gradient_accumulation_kwargs = dict(acc.gradient_accumulation_kwargs or {}, sync_each_batch=True)
    masters_off = None
    if masters_ok and not s.masters:
        with_masters = memplan.estimate(job, replace(s, masters=True, states="float32"))["total"]
        masters_off = (f"master weights would need {with_masters / GiB:.1f} GiB, over the "
                       f"{memplan.usable(plan.free) / GiB:.1f} GiB usable")
    return line, masters_off


def liger_reason(model_type: str) -> str | None:
    """None when Liger's kernels can be applied to `model_type` here, else why not."""
    import torch

    if not torch.cuda.is_available():
        return "no GPU (Triton kernels)"
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel not installed"
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return f"no Liger kernels for model type {model_type}"
    return None


def choose_liger(args, f: ModelFacts) -> str:
    """Sets args.trainbox_liger (apply_liger runs on the loaded model) unless the user set TRL's own flag."""
    args.trainbox_liger = False
    if "use_liger_kernel" in cfg.explicit(args):
        return f"Liger kernels {'on' if args.use_liger_kernel else 'off'} (set by you)"
    why = liger_reason(f.model_type)
    if why is None and getattr(args, "torch_compile", False):
        # measured on an H200 (torch 2.11, Liger 0.8.5): inductor's backward compile of a Llama with Liger's kernels
        # inside failed (an AssertionError decomposing their Triton calls); the compile fuses those ops itself
        why = "--torch_compile traces the model, and inductor fails on Liger's Triton kernels inside it"
    args.trainbox_liger = why is None
    return "Liger kernels on (RMSNorm, RoPE, SwiGLU)" if why is None else f"Liger kernels off: {why}"


def apply_liger(model, model_type: str) -> None:
    """Liger's own patch for this model type on the loaded model (a PEFT wrapper's base), instead of TRL's
    `use_liger_kernel`, deprecated in TRL 1.16. Layer kernels only: TRL's fused LM head computes the loss."""
    import inspect

    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    fn = MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]
    wanted = dict(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False)
    params = inspect.signature(fn).parameters
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:  # Liger also swaps the experts class in the modeling module (models built later, e.g. qlora's merge, get it)
        modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except ImportError:
        modeling = None
    classes = {n: c for n, c in vars(modeling).items() if n.endswith("Experts")} if modeling else {}
    fn(model=base, **{k: v for k, v in wanted.items() if k in params})
    for name, cls in classes.items():
        setattr(modeling, name, cls)
    unpatch_experts(base)


def unpatch_experts(model, fused=None) -> int:
    """Undo the fused MoE that Liger's SwiGLU patch binds to each experts module (Mixtral, Qwen3-MoE: LigerExperts'
    forward, which reads the expert weights itself); the module's class forward (transformers' experts interface:
    moe.py's trainbox_grouped_mm) runs again. Under PEFT's LoRA on the experts (qlora) a ParamWrapper stands where the
    experts were, and Liger's forward bound to it failed ('ParamWrapper' object has no attribute 'hidden_dim':
    tests/gpu/zoo_train.py, an H200); in full SFT ours is faster (benchmarks/moe_liger.py, Mixtral-like layer, 16k
    tokens, an H200: 13.98 ms forward+backward against Liger's 19.83). `fused`: the function to undo (default
    LigerExperts.forward). Returns how many modules were undone."""
    if fused is None:
        try:
            from liger_kernel.transformers.swiglu import LigerExperts
        except ImportError:  # a Liger without the fused MoE binds none
            return 0
        fused = LigerExperts.forward
    undone = 0
    for module in model.modules():
        bound = module.__dict__.get("forward")
        if getattr(bound, "__func__", None) is fused:
            del module.__dict__["forward"]
            module.__dict__.pop("_get_name", None)
            undone += 1
    return undone


def choose_packing(args, packed_ok: bool) -> str:
    explicit = cfg.explicit(args)
    if {"packing", "padding_free"} & explicit:
        return (f"packing {'on (' + args.packing_strategy + ')' if args.packing else 'off'}, padding-free "
                f"{'on' if args.padding_free or args.packing else 'off'} (set by you)")
    if packed_ok:
        args.packing = True
        args.packing_strategy = args.packing_strategy if "packing_strategy" in explicit else "bfd"
        return (f"packing on ({args.packing_strategy}, padding-free: no compute on padding; examples kept apart by "
                "the attention kernel)")
    return f"packing off: {attention.UNPACKED_WHY}; batches are padded"


def apply(args, model_args, choice, f: ModelFacts, *, shards: int, checkpointing: bool = True,
          packing=None, **memory) -> list[str]:
    """Decide the defaults above on TRL's config `args` (SFTConfig, DPOConfig); returns the lines to print.
    `checkpointing=False` leaves gradient checkpointing as it is (qlora keeps it on: its point is fitting a big model
    in little memory); `packing`: None decides it, else the trainer's own line (or f(choice) -> it); `memory`: the
    memory plan's tokens, extra and split (choose_memory)."""
    import torch

    on_gpu = torch.cuda.is_available() and not args.use_cpu
    if callable(packing):
        packing = packing(choice)
    lines = [choice.line(), choose_packing(args, choice.packed) if packing is None else packing,
             choose_liger(args, f)]
    masters_off = None
    if checkpointing:
        line, masters_off = choose_memory(args, f, shards, memplan.free_memory() if on_gpu else None,
                                          masters_ok=float32_reason(args, model_args, on_gpu, shards) is None,
                                          attn=choice.impl, **memory)
        lines.append(line)
    else:
        lines.append(f"gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}"
                     + (" (set by you)" if "gradient_checkpointing" in cfg.explicit(args) else " (qlora default)"))
    if "include_num_input_tokens_seen" not in cfg.explicit(args):
        args.include_num_input_tokens_seen = "non_padding"  # the summary's tokens/s counts real tokens only
    host_defaults(args, on_gpu)
    lines.append(choose_precision(args, model_args, on_gpu, shards, masters_off))
    return lines


def host_defaults(args, on_gpu: bool) -> None:
    """On a GPU, defaults that keep the host ahead of the GPU (unless you set them): no sync inside a step, batches
    made by workers and copied without waiting."""
    if not on_gpu:
        return
    explicit = cfg.explicit(args)
    if "logging_nan_inf_filter" not in explicit:
        # HF's filter reads every micro-batch's loss on the host: a sync at each backward's end that drains the GPU's
        # queue before the optimizer step can be launched. Off, a nan/inf loss is logged as it is instead of as the
        # running mean (the weights take the step either way).
        args.logging_nan_inf_filter = False
    if "dataloader_num_workers" not in explicit:
        args.dataloader_num_workers = min(2, os.cpu_count() or 1)
    if args.dataloader_pin_memory and "accelerator_config" not in explicit:
        # Batches from pinned memory copied without waiting: a blocking copy syncs the host with the GPU at each
        # step's start, so the next forward could only be launched once the last optimizer step had finished
        # (with throughput.TokenCount: -28 ms of a 288 ms gpt-oss-2b step, benchmarks/profile_step.py --gaps)
        args.accelerator_config.non_blocking = True


MASTER_WEIGHT_OPTIMS = ("adamw_torch", "adamw_torch_fused")


def float32_reason(args, model_args, on_gpu: bool, shards: int) -> str | None:
    """The precision line when float32 master weights are not for this run, None when they are."""
    if "dtype" in cfg.explicit(model_args):
        return f"precision: {model_args.dtype} weights (set by you)"
    if not on_gpu or not args.bf16:
        return "precision: float32" + (" (CPU)" if not on_gpu else "")
    if getattr(model_args, "load_in_4bit", False):
        return (f"precision: 4-bit {model_args.bnb_4bit_quant_type} base, {model_args.dtype} compute"
                + (", base and adapters sharded by FSDP2 (bf16 quant storage)" if shards > 1 else ""))
    if shards > 1:
        return "precision: float32 shards, bf16 compute, fp32 gradient reduction (FSDP2)"
    optim = _optim_name(args)
    if optim not in MASTER_WEIGHT_OPTIMS:
        return f"precision: float32 weights under bf16 autocast (optim {optim} is not wrapped with master weights)"
    return None


def choose_precision(args, model_args, on_gpu: bool, shards: int, masters_off: str | None = None) -> str:
    """bf16 weights + float32 master weights in the optimizer (precision.py) for one process per model copy on a
    GPU, unless `masters_off` (choose_memory: they don't fit) says why not; sets model_args.dtype and
    args.trainbox_master_weights. FSDP keeps its own float32 shards."""
    args.trainbox_master_weights = False
    line = float32_reason(args, model_args, on_gpu, shards)
    if line:
        return line
    states = getattr(args, "trainbox_states", "float32")
    if masters_off and states == "8bit":
        # transformers' own torchao optimizer: bf16 weights updated with stochastic rounding, 8-bit moments
        from transformers.training_args import OptimizerNames

        model_args.dtype = "bfloat16"
        args.optim = OptimizerNames.ADAMW_TORCH_8BIT
        args.optim_args = ",".join(filter(None, [args.optim_args, "bf16_stochastic_round=True"]))
        return (f"precision: bf16 weights updated with stochastic rounding, torchao's 8-bit AdamW states "
                f"(adamw_torch_8bit; {masters_off}); no autocast casts")
    if masters_off:
        return f"precision: float32 weights under bf16 autocast (TRL's; {masters_off})"
    model_args.dtype = "bfloat16"
    args.trainbox_master_weights = True
    if states == "8bit":
        step = ", with torchao's 8-bit AdamW states (the memory plan's choice), stepped one weight at a time"
    elif states == "bf16":
        step = (", its moments in bf16 with stochastic rounding (the memory plan's choice; --optim adamw_torch_fused "
                "keeps AdamW's float32 ones); the step in one kernel, masterstep.py")
    else:
        step = "; the step in one kernel, masterstep.py" if _optim_name(args) == "adamw_torch_fused" else ""
    return (f"precision: bf16 weights, float32 master weights in the optimizer ({_optim_name(args)}{step}); "
            "no autocast casts")


def reshards_after_forward(memory_first: bool) -> bool:
    """FSDP2 keeps all-gathered layers from forward to backward inside one node (less traffic), not across nodes."""
    return memory_first or ranks.nodes() > 1


def tune_fsdp(trainer, activation_checkpointing: bool, memory_first: bool = False) -> str | None:
    """FSDP2 on GPUs: bf16 compute with fp32 gradient reduction, no re-shard after forward inside one node (the
    all-gathered layer stays for backward; across nodes memory wins), checkpointing through FSDP's own wrapper.
    Set on accelerate's plugin before train() wraps the model. memory_first (qlora): re-shard after forward on one
    node too, since keeping every gathered layer would hold a whole copy of the base on each GPU."""
    if not getattr(trainer, "is_fsdp_enabled", False):
        return None
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    plugin = trainer.accelerator.state.fsdp_plugin
    planned = getattr(trainer.args, "trainbox_reshard", None)  # the memory plan's choice (memplan.py)
    plugin.reshard_after_forward = reshards_after_forward(memory_first) if planned is None or memory_first else planned
    plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                         output_dtype=torch.bfloat16)
    if activation_checkpointing:
        plugin.activation_checkpointing = True
        trainer.args.gradient_checkpointing = False
    reshard = ("on (memory first)" if memory_first else "on") if plugin.reshard_after_forward else "off"
    return (f"FSDP2: bf16 compute, fp32 reduce, reshard after forward {reshard}"
            + (", activation checkpointing by FSDP" if activation_checkpointing else ""))
