"""Speed defaults of the SFT-style trainers (sft, qlora), chosen for this model, GPU and data and printed.

What is decided here, each only when the user did not set it (`--option` or YAML always wins):
- packing: best-fit-decreasing packing with padding-free batches (TRL's `packing_strategy="bfd"`), so no compute is
  spent on padding; each example keeps its own positions, and the attention kernel keeps examples apart (varlen
  kernels take the sequence boundaries; on CPU transformers builds a block-diagonal mask). With plain GPU SDPA, which
  could only do that through a dense mask over the whole packed batch, batches stay padded.
- Liger kernels (RMSNorm, RoPE, SwiGLU; TRL keeps its own fused LM head + loss) where liger-kernel supports the model.
- gradient checkpointing: off when the estimate below fits in 85 % of the GPU's free memory, else on.
- precision: bf16 weights with float32 master weights in the optimizer (precision.py says why) for one process per
  model copy; FSDP2 keeps float32 shards and computes in bf16.

The estimate (bytes): weights + grads + AdamW states = 16 per parameter (fp32; 8-bit optimizers 10), sharded over the
FSDP ranks, plus bf16 weight copies under autocast (2 per parameter), plus activations without checkpointing:
per token and layer about 16*hidden + 10*intermediate bytes (bf16 inputs of every matmul, norm outputs, the
SwiGLU gate/up/product, attention output and its log-sum-exp), times the tokens of one micro-batch.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from . import attention
from . import config as cfg

GiB = 2**30


@dataclass(frozen=True)
class ModelFacts:
    model_type: str
    params: int
    embedding_params: int  # input embedding (a lookup, not a matmul) when the LM head is a separate matrix
    layers: int
    hidden: int
    intermediate: int
    attn_width: int  # heads x head dim: the width of QK^T and AV
    attention: "attention.Needs" = None  # windows, softcaps, sinks: what the attention kernel must honour
    experts: int = 0  # routed experts per MoE layer (0: dense)

    @property
    def matmul_params(self) -> int:
        return self.params - self.embedding_params


def model_facts(model_path: str, revision: str | None = None) -> ModelFacts:
    """Parameter count and shape, from the config alone (the model is built on the meta device: no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = AutoConfig.from_pretrained(model_path, revision=revision)
    text = conf.get_text_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(conf)
    params = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings()
    out = model.get_output_embeddings()
    tied = out is not None and out.weight is emb.weight
    heads = getattr(text, "num_attention_heads", 0)
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else 0)
    return ModelFacts(
        model_type=conf.model_type,
        params=params,
        embedding_params=0 if tied else emb.weight.numel(),
        layers=getattr(text, "num_hidden_layers", 0),
        hidden=text.hidden_size,
        intermediate=getattr(text, "intermediate_size", 4 * text.hidden_size) or 4 * text.hidden_size,
        attn_width=heads * head_dim,
        attention=attention.needs(conf, model),
        experts=int(getattr(text, "num_local_experts", 0) or getattr(text, "num_experts", 0) or 0),
    )


def state_bytes_per_param(optim: str) -> int:
    return 10 if "8bit" in optim else 16


def estimate_bytes(f: ModelFacts, tokens: int, optim: str, shards: int = 1) -> dict[str, int]:
    states = f.params * state_bytes_per_param(optim) // max(1, shards)
    casts = 2 * f.params // max(1, shards)
    acts = tokens * f.layers * (16 * f.hidden + 10 * f.intermediate)
    return {"states": states, "casts": casts, "activations": acts, "total": states + casts + acts}


def free_gpu_bytes() -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info()
    return free


def _optim_name(args) -> str:
    return str(getattr(args.optim, "value", args.optim))


def choose_checkpointing(args, f: ModelFacts, shards: int, free: int | None, tokens: int | None = None) -> str:
    """Set args.gradient_checkpointing unless the user did; return the line that says what and why. `tokens`: of one
    micro-batch (default: batch x max_length, SFT's worst case)."""
    tokens = tokens or args.per_device_train_batch_size * (getattr(args, "max_length", None) or 1024)
    est = estimate_bytes(f, tokens, _optim_name(args), shards)
    detail = (f"estimate {est['total'] / GiB:.1f} GiB = states {est['states'] / GiB:.1f} + bf16 copies "
              f"{est['casts'] / GiB:.1f} + activations {est['activations'] / GiB:.1f} for {tokens} tokens/micro-batch")
    if "gradient_checkpointing" in cfg.explicit(args):
        return f"gradient checkpointing {'on' if args.gradient_checkpointing else 'off'} (set by you; {detail})"
    if free is None:
        args.gradient_checkpointing = False
        return "gradient checkpointing off (CPU: memory is not the limit)"
    fits = est["total"] <= 0.85 * free
    args.gradient_checkpointing = not fits
    return (f"gradient checkpointing {'off' if fits else 'on'}: {detail}, "
            f"{'fits in' if fits else 'exceeds'} 85 % of {free / GiB:.1f} GiB free")


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
    if "use_liger_kernel" in cfg.explicit(args):
        return f"Liger kernels {'on' if args.use_liger_kernel else 'off'} (set by you)"
    why = liger_reason(f.model_type)
    args.use_liger_kernel = why is None
    return "Liger kernels on (RMSNorm, RoPE, SwiGLU)" if why is None else f"Liger kernels off: {why}"


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


def apply(args, model_args, choice, f: ModelFacts, *, shards: int, checkpointing: bool = True) -> list[str]:
    """Decide the defaults above on TRL's SFTConfig `args`; returns the lines to print. `checkpointing=False` leaves
    gradient checkpointing as it is (qlora keeps it on: its point is fitting a big model in little memory)."""
    import torch

    on_gpu = torch.cuda.is_available() and not args.use_cpu
    lines = [choice.line(), choose_packing(args, choice.packed), choose_liger(args, f)]
    if checkpointing:
        lines.append(choose_checkpointing(args, f, shards, free_gpu_bytes() if on_gpu else None))
    else:
        lines.append(f"gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}"
                     + (" (set by you)" if "gradient_checkpointing" in cfg.explicit(args) else " (qlora default)"))
    if "include_num_input_tokens_seen" not in cfg.explicit(args):
        args.include_num_input_tokens_seen = "non_padding"  # the summary's tokens/s counts real tokens only
    if on_gpu and "dataloader_num_workers" not in cfg.explicit(args):
        args.dataloader_num_workers = min(2, os.cpu_count() or 1)
    lines.append(choose_precision(args, model_args, on_gpu, shards))
    return lines


MASTER_WEIGHT_OPTIMS = ("adamw_torch", "adamw_torch_fused")


def choose_precision(args, model_args, on_gpu: bool, shards: int) -> str:
    """bf16 weights + float32 master weights in the optimizer (precision.py) for one process per model copy on a
    GPU; sets model_args.dtype and args.trainbox_master_weights. FSDP keeps its own float32 shards."""
    args.trainbox_master_weights = False
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
    if args.gradient_accumulation_steps > 1:
        # bf16 .grad would sum the micro-batches in bf16 before the float32 master sees them (relative error 2-7e-3
        # after 4-64 of them, vs 1.5e-3 for one rounding): correct before fast, TRL's float32 path until the
        # masters accumulate in float32 themselves.
        return (f"precision: float32 weights under bf16 autocast (gradient_accumulation_steps "
                f"{args.gradient_accumulation_steps}: bf16 weights would accumulate gradients in bf16)")
    model_args.dtype = "bfloat16"
    args.trainbox_master_weights = True
    return f"precision: bf16 weights, float32 master weights in the optimizer ({optim}); no autocast casts"


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
    single_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) == int(os.environ.get("WORLD_SIZE", "1"))
    plugin.reshard_after_forward = memory_first or not single_node
    plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                         output_dtype=torch.bfloat16)
    if activation_checkpointing:
        plugin.activation_checkpointing = True
        trainer.args.gradient_checkpointing = False
    reshard = ("on (memory first)" if memory_first else "on") if plugin.reshard_after_forward else "off (one node)"
    return (f"FSDP2: bf16 compute, fp32 reduce, reshard after forward {reshard}"
            + (", activation checkpointing by FSDP" if activation_checkpointing else ""))
