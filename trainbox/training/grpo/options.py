"""GRPO's options: the script's own (GRPOScriptArgs), TRL's GRPOConfig parsed raw (no __post_init__: nothing derived
before the number of processes is known) and then finalized for it (the batch / num_generations arithmetic
explained), the legacy names of Unsloth and TRL 0.x recipes translated, and the training mode (full, lora, qlora).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field

from common.errors import UsageError
from trainbox.training import config
from trainbox.training.grpo import vllm_server

MODES = ("full", "lora", "qlora")
PRESETS = ("gsm8k",)
GSM8K_HUB = "openai/gsm8k:main"  # data.load_table's `name:config`; used when --preset gsm8k names no dataset


@dataclass
class GRPOScriptArgs:
    """Options of this entrypoint that are not TRL's (TRL's own are GRPOConfig's and ModelConfig's)."""

    dataset: str | None = field(
        default=None,
        metadata={
            "help": "Training data: a local .parquet/.jsonl file or directory, or a hub dataset id (name:config). "
            f"Default with --preset gsm8k: {GSM8K_HUB}."
        },
    )
    dataset_split: str = field(default="train", metadata={"help": "Split to train on."})
    preset: str | None = field(
        default=None,
        metadata={
            "help": "gsm8k: system prompt asking for <reasoning>/<answer>, answers parsed after ####, and the "
            "notebook's reward set (correctness 2.0, integer 0.5, strict/soft format 0.5, xml tag count).",
            "choices": PRESETS,
        },
    )
    mode: str | None = field(
        default=None,
        metadata={
            "help": "full: train all weights; lora: LoRA adapters; qlora: LoRA on a 4-bit nf4 (bitsandbytes) base. "
            "Default: from use_peft/load_in_4bit, else full.",
            "choices": MODES,
        },
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions, comma- or space-separated: rewards:NAME (built-ins: correctness, int_format, "
            "strict_format, soft_format, xmlcount), a.module:fn or path/to/file.py:fn. Weights: --reward_weights."
        },
    )
    resume: str = field(
        default="auto",
        metadata={"help": "auto: last complete checkpoint in output_dir if any; never; or a checkpoint path"},
    )
    max_prompt_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Drop training prompts longer than this many tokens (TRL 1.16 no longer truncates prompts; the "
            "old max_prompt_length is translated to this)."
        },
    )
    padding_free: bool | None = field(
        default=None,
        metadata={
            "help": "Policy (and reference) log-prob forward on packed rows of only the real tokens "
            "(grpo/padding_free.py). Default: on where the attention kernel keeps packed sequences apart "
            "(FlashAttention, PyTorch varlen; on CPU a block-diagonal mask), off with SDPA on a GPU."
        },
    )
    static_decode: bool | None = field(
        default=None,
        metadata={
            "help": "Sample completions through a static KV cache and one CUDA-graphed decode step on a bfloat16 "
            "copy of the policy (static_decode.py) instead of vLLM or transformers' generate. Default: on with a "
            "GPU for full fine-tuning with plain sampling (top_p 1, top_k 0, min_p and repetition_penalty unset/1, "
            "no generation_kwargs or cache_implementation), not under FSDP or DeepSpeed; with vLLM installed, also "
            "only for dense text models whose training state and decoder copy fit 80%% of the GPU, with no use_vllm "
            "or vllm_* option given; else off."
        },
    )
    vllm_server_nodes: int = field(
        default=0,
        metadata={
            "help": "Run `trl vllm-serve` on the last node of the srun step (one task per node) and train on the "
            "others with vllm_mode server (trainbox/training/grpo/vllm_server.py; ports: vllm_server_port 8000, "
            "vllm_group_port 51216, lease = server port + 1). 0: off."
        },
    )
    vllm_server_gpus: int = field(
        default=0,
        metadata={"help": "One node: run `trl vllm-serve` on the last N visible GPUs, train on the rest. 0: off."},
    )
    vllm_serve_args: str | None = field(
        default=None,
        metadata={"help": "More `trl vllm-serve` options, TRL's names, one string (e.g. '--gpu_memory_utilization "
                  "0.8'); default tensor_parallel_size: the server's GPUs."},
    )
    vllm_server_wait: float = field(
        default=vllm_server.DEFAULT_WAIT,
        metadata={"help": "Seconds the trainers wait for the server's /health (and the server for the trainers)."},
    )


def raw_config_class():
    """GRPOConfig's fields without its __post_init__: parsed values only, nothing derived, no device set up.

    The launcher process needs the options before it knows how many processes torchrun will start, and TRL's own
    checks would judge the batch arithmetic against this one process; `finalize` builds the real GRPOConfig.
    """
    from trl import GRPOConfig

    @dataclass
    class GRPOOptions(GRPOConfig):
        __doc__ = GRPOConfig.__doc__

        def __post_init__(self):
            pass

    return GRPOOptions


def check_generation_batch(args, processes: int) -> None:
    """GRPO scores groups of num_generations completions per prompt: each generation batch must hold whole groups."""
    bs, ng = args.per_device_train_batch_size, args.num_generations
    if ng is None or ng < 2:
        raise UsageError(
            f"num_generations={ng}: GRPO compares completions of the same prompt, so it needs at least 2; "
            f"set --num_generations 2 or more"
        )
    if args.generation_batch_size is not None and args.steps_per_generation is not None:
        raise UsageError(
            "generation_batch_size and steps_per_generation are two ways to say the same thing; set only one"
        )
    if args.generation_batch_size is not None:
        gen = args.generation_batch_size
        if gen % (bs * processes):
            raise UsageError(
                f"generation_batch_size={gen} must be a multiple of per_device_train_batch_size {bs} x {processes} "
                f"process(es) = {bs * processes}"
            )
        how = f"generation_batch_size {gen}"
        spg = gen // (bs * processes)
    else:
        spg = args.steps_per_generation or args.gradient_accumulation_steps
        gen = bs * processes * spg
        src = "steps_per_generation" if args.steps_per_generation else "gradient_accumulation_steps"
        how = (
            f"per_device_train_batch_size {bs} x {processes} process(es) x steps_per_generation {spg} "
            f"(= {src}) = {gen}"
        )
    if gen % ng == 0:
        return
    per_step = processes * spg
    good_bs = next(b for b in range(bs, bs * ng + 1) if (b * per_step) % ng == 0)
    divisors = [d for d in range(2, gen + 1) if gen % d == 0]
    fixes = [f"per_device_train_batch_size {good_bs}"]
    if divisors:
        fixes.append(f"num_generations {' or '.join(map(str, divisors[-3:]))}")
    raise UsageError(
        f"GRPO samples num_generations={ng} completions per prompt and needs whole groups in each generation "
        f"batch, but {how} completions is not a multiple of {ng}. Fix: set {' or '.join(fixes)}"
    )


def legacy() -> dict:
    """Removed options from Unsloth / TRL 0.x GRPO recipes, each translated (config.parse_args prints a warning)."""
    renamed = dict(config.LEGACY_TRAINING)
    # TRL 1.16 removed max_prompt_length and no longer truncates prompts at all; cutting prompts from the left
    # (the old behaviour) loses the system prompt, so overlong prompts are dropped from the data instead.
    renamed["max_prompt_length"] = lambda v: {"max_prompt_tokens": int(v)}
    renamed["vllm_max_model_len"] = lambda v: {"vllm_max_model_length": int(v)}
    renamed["vllm_guided_decoding_regex"] = lambda v: {"vllm_structured_outputs_regex": str(v)}
    renamed["wandb_log_unique_prompts"] = lambda v: {"log_unique_prompts": config.truthy(v)}
    renamed["use_liger_loss"] = lambda v: {"use_liger_kernel": config.truthy(v)}
    renamed["torch_dtype"] = lambda v: {"dtype": str(v)}  # transformers 5 renamed it
    # TRL places colocated vLLM on each process's own device now; a separate generation GPU is `vllm_mode server`.
    renamed["vllm_device"] = lambda v: {}
    # TRL 1.16 builds vLLM with the model's own dtype and vLLM's defaults (prefix caching on): nothing to set.
    renamed["vllm_dtype"] = lambda v: {}
    renamed["vllm_enable_prefix_caching"] = lambda v: {}
    return renamed


def finalize(raw, processes: int, *, launcher: bool = False):
    """Check the batch arithmetic for `processes` (explained), then build TRL's GRPOConfig (its own checks run).

    launcher=True: this process only starts torchrun; TRL's checks are made to count the processes it will start.
    """
    from trl import GRPOConfig

    check_generation_batch(raw, processes)
    values = {f.name: getattr(raw, f.name) for f in dataclasses.fields(GRPOConfig) if f.init}
    cls = GRPOConfig
    if launcher:
        cls = type("GRPOConfigPlanned", (GRPOConfig,), {"world_size": property(lambda self: processes)})
    try:
        args = cls(**values)
    except (ValueError, TypeError) as e:
        raise UsageError(f"invalid options: {e}".replace("\n", " ")) from None
    config.set_explicit(args, config.explicit(raw))  # keep "what the user set"
    return args


def resolve_mode(script, model_args) -> str:
    given = script.mode
    flags = config.explicit(model_args)
    if given is None:
        if model_args.load_in_4bit and not model_args.use_peft:
            raise UsageError("load_in_4bit=true needs LoRA on top (a 4-bit base can't be trained): use --mode qlora")
        mode = "qlora" if model_args.load_in_4bit else "lora" if model_args.use_peft else "full"
    else:
        mode = given
        wants_peft = mode in ("lora", "qlora")
        if "use_peft" in flags and model_args.use_peft != wants_peft:
            raise UsageError(f"--mode {mode} contradicts use_peft={model_args.use_peft}; drop one of them")
        if "load_in_4bit" in flags and model_args.load_in_4bit != (mode == "qlora"):
            raise UsageError(f"--mode {mode} contradicts load_in_4bit={model_args.load_in_4bit}; drop one of them")
        if model_args.load_in_8bit:
            raise UsageError("load_in_8bit isn't one of the supported modes; use --mode qlora (4-bit nf4)")
        model_args.use_peft = wants_peft
        model_args.load_in_4bit = mode == "qlora"
    if mode == "full":
        config.refuse_unused(model_args, config.PEFT_OPTIONS + config.QUANT_OPTIONS, "--mode full trains every weight "
                             "and", "use --mode lora or qlora for adapters, or drop them")
    elif mode == "lora":
        config.refuse_unused(model_args, config.QUANT_OPTIONS, "--mode lora keeps the base unquantized and",
                             "use --mode qlora for a 4-bit base, or drop them")
    if mode == "qlora":
        if importlib.util.find_spec("bitsandbytes") is None:
            raise UsageError("--mode qlora needs bitsandbytes, which this image lacks; use --mode lora")
        if "lora_dropout" not in flags:  # as `trainbox qlora`: dropout 0 takes the fused 4-bit LoRA (lora4bit.py)
            model_args.lora_dropout = 0.0
    return mode
