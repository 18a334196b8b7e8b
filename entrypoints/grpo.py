"""GRPO training (TRL GRPOTrainer): YAML + CLI options named as in TRL, gsm8k preset, full/LoRA/QLoRA, vLLM if present.

Usage: `trainbox grpo --model_name_or_path MODEL --dataset DATA [--preset gsm8k] [--mode full|lora|qlora]
[--reward_funcs rewards:correctness,my_mod:fn] [--config grpo.yaml] [any GRPOConfig / ModelConfig option]`.
Options are TRL's GRPOConfig (transformers' TrainingArguments included) and ModelConfig, the launcher flags shared
with sft (torchrun from Slurm or --nnodes/--nproc_per_node/...), and the script options below.

Everything that can be wrong with the options (including the batch / num_generations arithmetic for the real number
of processes), the model reference, the dataset or the reward functions is checked before a model loads (and before
torchrun starts), and reported as one `error: ...` line with exit code 2.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import time
from dataclasses import dataclass, field

from entrypoints import (attention, config, data, launch, memplan, outputs, preemption, resume, rewards, runner,
                         runsummary, speed, throughput, vllm_server)
from entrypoints.errors import UsageError

PROG = "trainbox grpo"
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
            "(grpo_padding_free.py). Default: on where the attention kernel keeps packed sequences apart "
            "(FlashAttention, PyTorch varlen; on CPU a block-diagonal mask), off with SDPA on a GPU."
        },
    )
    vllm_server_nodes: int = field(
        default=0,
        metadata={
            "help": "Run `trl vllm-serve` on the last node of the srun step (one task per node) and train on the "
            "others with vllm_mode server (entrypoints/vllm_server.py; ports: vllm_server_port 8000, vllm_group_port "
            "51216, lease = server port + 1). 0: off."
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


def _raw_config_class():
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


def world_size() -> int:
    # torchrun/accelerate export WORLD_SIZE; a plain `python -m entrypoints grpo` is one process.
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


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


def grpo_legacy() -> dict:
    """Removed options from Unsloth / TRL 0.x GRPO recipes, each translated (config.parse_args prints a warning)."""
    legacy = dict(config.LEGACY_TRAINING)
    # TRL 1.16 removed max_prompt_length and no longer truncates prompts at all; cutting prompts from the left
    # (the old behaviour) loses the system prompt, so overlong prompts are dropped from the data instead.
    legacy["max_prompt_length"] = lambda v: {"max_prompt_tokens": int(v)}
    legacy["vllm_max_model_len"] = lambda v: {"vllm_max_model_length": int(v)}
    legacy["vllm_guided_decoding_regex"] = lambda v: {"vllm_structured_outputs_regex": str(v)}
    legacy["wandb_log_unique_prompts"] = lambda v: {"log_unique_prompts": config.truthy(v)}
    legacy["use_liger_loss"] = lambda v: {"use_liger_kernel": config.truthy(v)}
    legacy["torch_dtype"] = lambda v: {"dtype": str(v)}  # transformers 5 renamed it
    # TRL places colocated vLLM on each process's own device now; a separate generation GPU is `vllm_mode server`.
    legacy["vllm_device"] = lambda v: {}
    # TRL 1.16 builds vLLM with the model's own dtype and vLLM's defaults (prefix caching on): nothing to set.
    legacy["vllm_dtype"] = lambda v: {}
    legacy["vllm_enable_prefix_caching"] = lambda v: {}
    return legacy


def parse(argv: list[str]):
    """(script, launch, raw GRPO options, model) from YAML + CLI; the GRPO options still need `finalize`."""
    from trl import ModelConfig

    return config.parse_args(
        (GRPOScriptArgs, launch.LaunchArguments, _raw_config_class(), ModelConfig), argv, prog=PROG, legacy=grpo_legacy()
    )


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


# ---------------------------------------------------------------- checks that run before any model loads


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
    return mode


def resolve_rollouts(args, ours: str | None = None) -> str:
    """Pick vLLM when it's installed and a GPU is there (unless use_vllm was set); return the line to report."""
    has_vllm = importlib.util.find_spec("vllm") is not None
    if "use_vllm" in config.explicit(args):
        if args.use_vllm and not has_vllm:
            raise UsageError(
                "use_vllm=true but vllm is not installed here; drop use_vllm to generate with transformers"
            )
        why = "use_vllm set"
    else:
        import torch

        args.use_vllm = has_vllm and torch.cuda.is_available()
        why = "auto: " + ("vllm installed, GPU present" if args.use_vllm
                          else "vllm not installed" if not has_vllm else "no GPU")
    if not args.use_vllm:
        return f"rollouts: transformers generate ({why})"
    explicit = config.explicit(args)
    if "vllm_mode" not in explicit:
        args.vllm_mode = "colocate"  # said, not inherited: TRL's default could change under us
    if args.vllm_mode == "server":
        where = args.vllm_server_base_url or f"{args.vllm_server_host}:{args.vllm_server_port}"
        return f"rollouts: vLLM server at {where} ({why}; {ours or 'start it with `trl vllm-serve --model MODEL`'})"
    if "vllm_enable_sleep_mode" not in explicit:
        # Colocated vLLM frees its weights and KV cache while the policy trains: the optimizer step gets the memory.
        args.vllm_enable_sleep_mode = True
    sized = ""
    if "vllm_gpu_memory_utilization" not in explicit:
        import torch

        try:
            total = torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else None
        except (RuntimeError, AssertionError):  # no usable CUDA after all: keep TRL's share
            total = None
        if total:
            args.vllm_gpu_memory_utilization, sized = rollout_memory_share(total)
    return (f"rollouts: vLLM colocate, sleep mode {'on' if args.vllm_enable_sleep_mode else 'off'}, "
            f"gpu_memory_utilization {args.vllm_gpu_memory_utilization:.2f}{sized} ({why})")


# vLLM's colocated share of the GPU: enough KV cache for a generation batch of long completions, the rest for
# training. 24 GiB holds a 7-8B model's bf16 weights plus a few GB of KV cache; past that more cache buys little.
ROLLOUT_BYTES = 24 * 2**30


def rollout_memory_share(total_bytes: int) -> tuple[float, str]:
    """gpu_memory_utilization for colocated vLLM on a GPU of `total_bytes`, and how it was sized."""
    share = min(0.5, max(0.15, ROLLOUT_BYTES / total_bytes))
    return round(share, 2), f" (sized: {share * total_bytes / 2**30:.0f} GiB of {total_bytes / 2**30:.0f} GiB)"


def reward_refs(script) -> list[str]:
    refs = [r.strip() for item in (script.reward_funcs or []) for r in str(item).split(",") if r.strip()]
    if not refs:
        if script.preset == "gsm8k":
            return list(rewards.GSM8K)
        raise UsageError(
            "no reward functions: give --reward_funcs (e.g. rewards:correctness,rewards:xmlcount or my_mod:fn), "
            "or --preset gsm8k for the notebook's set"
        )
    return refs


def prepare_dataset(script, refs, funcs):
    if not script.dataset:
        if script.preset != "gsm8k":
            raise UsageError("no training data: give --dataset (a .parquet/.jsonl file or directory, or a hub id)")
        script.dataset = GSM8K_HUB
    where = f"dataset {script.dataset}"
    ds = data.load_table(script.dataset, split=script.dataset_split)
    if script.preset == "gsm8k":
        # gsm8k question/answer (answer after ####) or verl's gsm8k parquet -> prompt with the notebook's system
        # prompt + answer column for rewards:correctness.
        ds = data.to_prompt_answer(ds, where=f"{where} (--preset gsm8k)", system_prompt=rewards.SYSTEM_PROMPT)
    data.require_columns(ds, ["prompt"], f"{where} (GRPO needs a prompt per row)")
    for ref, func in zip(refs, funcs):
        need = rewards.required_columns(func)
        if need:
            data.require_columns(ds, need, f"{where} (reward function {ref})")
    if len(ds) == 0:
        raise UsageError(f"{where} split {script.dataset_split} has no rows")
    return ds


def drop_long_prompts(ds, model_ref: str, limit: int, revision=None):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_ref, revision=revision)

    def n_tokens(row):
        p = row["prompt"]
        if isinstance(p, list):
            return len(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False))
        return len(tok(p)["input_ids"])

    before = len(ds)
    ds = ds.filter(lambda row: n_tokens(row) <= limit)
    print(f"[trainbox] grpo: max_prompt_tokens {limit}: dropped {before - len(ds)} of {before} prompts", flush=True)
    if len(ds) == 0:
        raise UsageError(f"every prompt is longer than max_prompt_tokens={limit}; raise it or shorten the prompts")
    return ds


# ---------------------------------------------------------------- run


def main(argv: list[str]) -> int:
    # No expandable segments: colocated vLLM's sleep mode (on by default, resolve_rollouts) allocates through
    # vLLM's CuMemAllocator, which asserts that PYTORCH_CUDA_ALLOC_CONF does not turn them on (pytorch#147851);
    # `trl vllm-serve` beside the trainers would inherit the variable too.
    return runner.run_trainer("grpo", argv, parse, _check_before_launch, _train, arrange=_arrange,
                              reparse=False, failures={vllm_server.ServerDown: 1}, expandable_segments=False)


def _arrange(options, argv):
    """A vLLM server beside the trainers: this process serves (its exit code), or the trainers' argv, plan
    variables and launch (run_beside_server)."""
    script, launch_args, raw, model_args = options
    roles = arrange_server(script, raw, launch_args, os.environ)
    if roles is None:
        return argv, {}, None
    if roles.role == "server":
        cmd = vllm_server.serve_command(model_args.model_name_or_path, roles, script.vllm_serve_args)
        return vllm_server.serve(cmd, roles, script.vllm_server_wait)
    return ([*argv, *roles.trainer_args()], roles.trainer_env,
            lambda plan, argv: run_beside_server(script, roles, model_args, plan, argv))


def _check_before_launch(options, plan) -> None:
    # Judge the options against the processes torchrun will start, before starting any.
    script, _, raw, model_args = options
    validate(script, finalize(raw, plan.nnodes * plan.nproc_per_node, launcher=True), model_args)


def _train(options) -> int:
    # No second parse after a Slurm task's rank variables are set: TRL's checks run here, for the real world size.
    script, _, raw, model_args = options
    args = finalize(raw, world_size())
    return train(script, args, model_args, validate(script, args, model_args))


def arrange_server(script, raw, launch_args, env):
    """vllm_server.Roles when a server beside the trainers was asked for (not in torchrun's ranks), else None.

    Trainers: TRL's server options are set here (validation sees them) and appended to the ranks' argv."""
    if not (script.vllm_server_nodes or script.vllm_server_gpus) or env.get("TORCHELASTIC_RUN_ID"):
        return None
    if script.vllm_server_nodes and script.vllm_server_gpus:
        raise UsageError("--vllm_server_nodes and --vllm_server_gpus exclude each other: a node of its own, or "
                         "GPUs of this node")
    explicit = config.explicit(raw)
    if "vllm_mode" in explicit and raw.vllm_mode != "server" or "use_vllm" in explicit and not raw.use_vllm:
        raise UsageError("--vllm_server_nodes/--vllm_server_gpus run the trainers with vllm_mode server; drop "
                         "use_vllm/vllm_mode")
    if raw.vllm_server_base_url:
        raise UsageError("--vllm_server_base_url points at a server you run; drop it, or drop "
                         "--vllm_server_nodes/--vllm_server_gpus")
    ports = dict(http_port=raw.vllm_server_port, group_port=raw.vllm_group_port)
    if script.vllm_server_nodes:
        roles = vllm_server.slurm_roles(env, script.vllm_server_nodes, launch.local_procs(env), **ports)
    else:
        if any(getattr(launch_args, f, None) not in (None, 0) for f in ("nnodes", "node_rank", "master_addr")):
            raise UsageError("--vllm_server_gpus splits one node; drop --nnodes/--node-rank/--master-addr")
        roles = vllm_server.local_roles(vllm_server.visible_gpus(env), script.vllm_server_gpus, **ports)
        if launch_args.nproc_per_node is None:
            launch_args.nproc_per_node = len(roles.trainer_gpus)
    if roles.role == "trainer":
        raw.use_vllm, raw.vllm_mode, raw.vllm_server_host = True, "server", roles.server_host
        config.set_explicit(raw, explicit | {"use_vllm", "vllm_mode", "vllm_server_host"})
    return roles


def run_beside_server(script, roles, model_args, plan, argv) -> int:
    """Trainer launcher: (start the one-node server,) wait for its health, run torchrun, stop the server."""
    proc = None
    if roles.server_gpus is not None:  # one node: the server is our child, on its GPUs
        cmd = vllm_server.serve_command(model_args.model_name_or_path, roles, script.vllm_serve_args)
        print(f"[trainbox] vllm server on GPU(s) {','.join(roles.server_gpus)}: {' '.join(cmd)}", flush=True)
        proc = vllm_server.subprocess.Popen(
            cmd, env={**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(roles.server_gpus)}, start_new_session=True)
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(roles.trainer_gpus)
    watch = vllm_server.Watch(roles, script.vllm_server_wait, proc)
    try:
        took = vllm_server.wait_healthy(roles.server_host, roles.http_port, script.vllm_server_wait, watch.gone)
        print(f"[trainbox] vllm server at {roles.server_host}:{roles.http_port} healthy after {took:.0f} s; "
              f"weight-sync group port {roles.group_port}", flush=True)
        watch.start()
        rc = launch.run_torchrun(plan, "entrypoints.grpo", argv)
        return 1 if watch.failed else rc
    finally:
        watch.close()


@dataclass
class Checked:
    """What validate() resolved: passed on to train() so nothing is decided twice."""

    mode: str
    refs: list
    funcs: list
    rollouts: str
    dataset: object
    resume: str | None


def validate(script, args, model_args) -> Checked:
    """Every check that needs no model: model path, mode, rewards, rollouts, report_to, dataset and its columns."""
    config.check_model_path(model_args.model_name_or_path)
    mode = resolve_mode(script, model_args)
    refs = reward_refs(script)
    funcs = [rewards.load(r) for r in refs]
    if args.reward_weights is not None and len(args.reward_weights) != len(funcs):
        raise UsageError(
            f"reward_weights has {len(args.reward_weights)} values for {len(funcs)} reward functions "
            f"({', '.join(refs)})"
        )
    ours = ("started by this run (--vllm_server_nodes/--vllm_server_gpus)"
            if script.vllm_server_nodes or script.vllm_server_gpus else None)
    rollouts = resolve_rollouts(args, ours)
    config.check_report_to(args.report_to)
    args.output_dir = outputs.output_dir(config.configured_output_dir(args))
    if args.resume_from_checkpoint:  # TrainingArguments' own option wins over --resume
        script.resume = args.resume_from_checkpoint
    ckpt = resume.resolve_resume(script.resume, args.output_dir, args, "grpo")
    ds = prepare_dataset(script, refs, funcs)
    if script.max_prompt_tokens is not None:
        ds = drop_long_prompts(ds, model_args.model_name_or_path, script.max_prompt_tokens, model_args.model_revision)
        if args.use_vllm and args.vllm_max_model_length is None:
            args.vllm_max_model_length = script.max_prompt_tokens + args.max_completion_length
    return Checked(mode, refs, funcs, rollouts, ds, ckpt)


def train(script, args, model_args, checked: Checked) -> int:
    started = time.time()
    out = args.output_dir
    preempt_cb = preemption.PreemptionCallback()
    if outputs.is_main_process():
        print(
            f"[trainbox] grpo: model {model_args.model_name_or_path} mode {checked.mode}; data {script.dataset} "
            f"({len(checked.dataset)} rows); rewards {', '.join(checked.refs)}; {checked.rollouts}; "
            f"{world_size()} process(es); outputs {out}"
            + (f"; resuming from {checked.resume}" if checked.resume else ""),
            flush=True,
        )
    facts = speed.model_facts(model_args.model_name_or_path, model_args.model_revision)
    line = choose_checkpointing(args, model_args, checked.mode, script.max_prompt_tokens, facts)
    lines = [line, *choose_policy_forward(script, args, model_args, facts.attention)]
    if outputs.is_main_process():
        for line in lines:
            print(f"[trainbox] grpo: {line}", flush=True)
    trainer = build_trainer(args, model_args, checked.mode, checked.funcs, checked.dataset, preempt_cb,
                            padding_free=script.padding_free)
    if outputs.is_main_process():
        print(f"[trainbox] grpo: {describe_model(trainer.model)}", flush=True)
    trainer.train(resume_from_checkpoint=checked.resume)
    if not preemption.was_preempted():
        trainer.save_model(out)
    runsummary.finish(trainer, out, started, "grpo")
    return preemption.exit_code()


def choose_checkpointing(args, model_args, mode: str, max_prompt_tokens: int | None, facts) -> str:
    """TRL turns gradient checkpointing on for GRPO; full fine-tuning turns it off when the policy's training memory
    fits in what colocated vLLM leaves (speed.py's estimate; the micro-batch is prompt + completion tokens of each
    completion). LoRA/QLoRA keep TRL's choice: their point is fitting a big base in little memory."""
    if mode != "full" or "gradient_checkpointing" in config.explicit(args):
        return (f"gradient checkpointing {'on' if args.gradient_checkpointing else 'off'} ("
                + ("set by you" if "gradient_checkpointing" in config.explicit(args) else f"{mode}: TRL's default") + ")")
    import torch

    free = memplan.free_memory()  # this rank's GPU (TRAINBOX_GPU_FREE_GIB caps it); the ranks agree in choose_memory
    if free is not None and args.use_vllm and args.vllm_mode == "colocate":
        total = torch.cuda.mem_get_info(torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))))[1]
        free -= int(args.vllm_gpu_memory_utilization * total)  # vLLM takes its share of the whole GPU at start
    tokens = args.per_device_train_batch_size * ((max_prompt_tokens or 512) + args.max_completion_length)
    # TRL loads a reference model like the policy (float32 here) only when the KL term is on.
    ref = 4 * facts.params if args.beta else 0
    return speed.choose_memory(args, facts, shards=1, free=free, tokens=tokens, extra=ref)[0]


def choose_policy_forward(script, args, model_args, needs=None) -> list[str]:
    """The policy's attention kernel (attention.choose, as sft) and whether its log-prob forward is padding-free;
    sets model_args.attn_implementation and script.padding_free, returns the lines to print.

    Padding-free needs a kernel that keeps packed sequences apart: FlashAttention or torch's varlen kernel take the
    boundaries from the position ids (attention.UNPACKED_WHY says why SDPA and eager don't).
    """
    init = args.model_init_kwargs or {}
    requested = (model_args.attn_implementation if "attn_implementation" in config.explicit(model_args)
                 else init.get("attn_implementation"))
    choice = attention.choose(requested, model=needs or attention.Needs())
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


def build_trainer(args, model_args, mode, funcs, ds, preempt_cb, padding_free: bool = False):
    from trl import GRPOTrainer, get_peft_config, get_quantization_config

    if padding_free:
        from entrypoints.grpo_padding_free import PaddingFreeGRPOTrainer as GRPOTrainer

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
            init.setdefault("device_map", {"": int(os.environ.get("LOCAL_RANK", "0"))})
    args.model_init_kwargs = init
    return GRPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=funcs,
        args=args,
        train_dataset=ds,
        peft_config=get_peft_config(model_args) if mode != "full" else None,
        quantization_config=quant,
        # Steady steps/s and tokens/s for the summary (no MFU: rollouts are most of a GRPO step's work).
        callbacks=[preempt_cb, throughput.Throughput()],
    )


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
