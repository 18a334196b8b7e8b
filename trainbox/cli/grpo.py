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

from trainbox.run import preemption

if __name__ == "__main__":  # first, before torch's seconds of imports: a stop signal then is remembered, not a kill
    preemption.claim_preempt_signals()

import os
import sys
import time
from dataclasses import dataclass

from common import launch
from common.errors import UsageError
from trainbox.image import imageinfo
from trainbox.run import outputs, ranks, resume, runsummary
from trainbox.training import config, modelfacts, modelfiles, runner
from trainbox.training.grpo import (
    data as grpo_data,
    options as grpo_options,
    rewards,
    rollouts as grpo_rollouts,
    trainer as grpo_trainer,
    vllm_server,
)
from trainbox.training.kernels import lora4bit, moe

PROG = "trainbox grpo"


def parse(argv: list[str]):
    """(script, launch, raw GRPO options, model) from YAML + CLI; the GRPO options still need `finalize`."""
    from trl import ModelConfig

    return config.parse_args(
        (grpo_options.GRPOScriptArgs, launch.LaunchArguments, grpo_options.raw_config_class(), ModelConfig), argv,
        prog=PROG, legacy=grpo_options.legacy()
    )


def main(argv: list[str]) -> int:
    # No expandable segments: colocated vLLM's sleep mode (on unless training fits beside it:
    # grpo_trainer.choose_sleep_mode) allocates through vLLM's CuMemAllocator, which asserts that
    # PYTORCH_CUDA_ALLOC_CONF does not turn them on (pytorch#147851); `trl vllm-serve` beside the trainers would
    # inherit the variable too.
    return runner.run_trainer("grpo", argv, parse, _check_before_launch, _train, arrange=_arrange,
                              reparse=False, failures={vllm_server.ServerDown: 1}, expandable_segments=False)


def _arrange(options, argv):
    """A vLLM server beside the trainers: this process serves (its exit code), or the trainers' argv, plan
    variables and launch (run_beside_server)."""
    script, launch_args, raw, model_args = options
    roles = grpo_rollouts.arrange_server(script, raw, launch_args, os.environ)
    if roles is None:
        return argv, {}, None
    if roles.role == "server":
        cmd = vllm_server.serve_command(model_args.model_name_or_path, roles, script.vllm_serve_args)
        return vllm_server.serve(cmd, roles, script.vllm_server_wait)
    return ([*argv, *roles.trainer_args()], roles.trainer_env,
            lambda plan, argv: grpo_rollouts.run_beside_server(script, roles, model_args, plan, argv))


def _check_before_launch(options, plan) -> None:
    # Judge the options against the processes torchrun will start, before starting any.
    script, _, raw, model_args = options
    validate(script, grpo_options.finalize(raw, plan.nnodes * plan.nproc_per_node, launcher=True), model_args)


def _train(options) -> int:
    # No second parse after a Slurm task's rank variables are set: TRL's checks run here, for the real world size.
    script, _, raw, model_args = options
    args = grpo_options.finalize(raw, ranks.world_size())
    return train(script, args, model_args, validate(script, args, model_args))


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
    modelfiles.check_weights(model_args.model_name_or_path)
    mode = grpo_options.resolve_mode(script, model_args)
    if mode != "full":
        modelfiles.check_lora_targets(model_args.model_name_or_path, model_args.model_revision,
                                      model_args.lora_target_modules)
        model_args.lora_target_modules = modelfiles.peft_targets(model_args.lora_target_modules)
    refs = grpo_data.reward_refs(script)
    funcs = [rewards.load(r) for r in refs]
    if args.reward_weights is not None and len(args.reward_weights) != len(funcs):
        raise UsageError(
            f"reward_weights has {len(args.reward_weights)} values for {len(funcs)} reward functions "
            f"({', '.join(refs)})"
        )
    ours = ("started by this run (--vllm_server_nodes/--vllm_server_gpus)"
            if script.vllm_server_nodes or script.vllm_server_gpus else None)
    rollouts = grpo_rollouts.resolve_rollouts(args, ours, script, mode, model_args)
    config.check_report_to(args.report_to)
    args.output_dir = outputs.output_dir(config.configured_output_dir(args))
    if args.resume_from_checkpoint:  # TrainingArguments' own option wins over --resume
        script.resume = args.resume_from_checkpoint
    ckpt = resume.resolve_resume(script.resume, args.output_dir, args, "grpo")
    ds = grpo_data.prepare_dataset(script, refs, funcs)
    if script.max_prompt_tokens is not None:
        ds = grpo_data.drop_long_prompts(ds, model_args.model_name_or_path, script.max_prompt_tokens,
                                         model_args.model_revision)
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
            f"{ranks.world_size()} process(es); outputs {out}"
            + (f"; resuming from {checked.resume}" if checked.resume else ""),
            flush=True,
        )
    facts = modelfacts.model_facts(model_args.model_name_or_path, model_args.model_revision)
    line = grpo_trainer.choose_checkpointing(args, model_args, checked.mode, script.max_prompt_tokens, facts,
                                             script.static_decode)
    lines = [line, *grpo_trainer.choose_policy_forward(script, args, model_args, facts.attention, imageinfo.load())]
    if checked.mode == "full":  # (LoRA/QLoRA on MoE experts: not measured with it)
        experts, line = moe.choose(facts)
        if experts:
            args.model_init_kwargs = {**experts, **(args.model_init_kwargs or {})}  # the user's own kwargs win
        lines += [line] if line else []
    if outputs.is_main_process():
        for line in lines:
            print(f"[trainbox] grpo: {line}", flush=True)
    trainer = grpo_trainer.build_trainer(args, model_args, checked.mode, checked.funcs, checked.dataset, preempt_cb,
                                         padding_free=script.padding_free, static_decode=script.static_decode)
    fused = lora4bit.choose(trainer.model, distributed=ranks.distributed())
    if outputs.is_main_process():
        print(f"[trainbox] grpo: {grpo_trainer.describe_model(trainer.model)}", flush=True)
        if fused:
            print(f"[trainbox] grpo: {fused}", flush=True)
        ratio = grpo_trainer.describe_ratio(trainer)
        if ratio:
            print(f"[trainbox] grpo: {ratio}", flush=True)
    trainer.train(resume_from_checkpoint=checked.resume)
    if not preemption.was_preempted():
        trainer.save_model(out)
    runsummary.finish(trainer, out, started, "grpo")
    return preemption.exit_code()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
