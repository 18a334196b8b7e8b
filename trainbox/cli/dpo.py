"""Preference tuning with DPO (TRL's DPOTrainer): full-parameter or LoRA (--use_peft), from 1 process to many nodes.

Usage: `python -m trainbox.cli.dpo --model_name_or_path M --dataset D [--config X.yaml] [--option value ...]`.
Data: `prompt` + `chosen` + `rejected`, or `chosen` + `rejected` alone, each plain text or chat messages (the
conversational pairs). Options: TRL's DPOConfig (beta, loss_type, precompute_ref_log_probs...; TrainingArguments
included), TRL's ModelConfig (LoRA, 4-bit) and the dataset options below. The reference: a frozen bf16 copy on
GPUs (counted by the memory plan), none with LoRA (adapters off) or --precompute_ref_log_probs. Speed as `sft`:
attention kernel, Liger kernels, bf16 weights with float32 masters, the memory plan, FSDP2 across GPUs.
"""

from __future__ import annotations

from trainbox.run import preemption

if __name__ == "__main__":  # first, before torch's seconds of imports: a stop signal then is remembered, not a kill
    preemption.claim_preempt_signals()

import sys

from trainbox.image import imageinfo
from trainbox.training import adapters, config as cfg, dpolib, skeleton


def _config():
    from trl import DPOConfig

    return DPOConfig


def describe(run) -> str:
    m, args = run.model, run.args
    what = f"LoRA r={m.lora_r}" if m.use_peft else "full"
    return f"{what}, loss {'+'.join(args.loss_type)}, beta {args.beta}"


def _model(run, choice, facts):
    if run.model.load_in_4bit or run.model.load_in_8bit:
        return adapters.load_quantized(run.model, choice.impl)
    return skeleton.full_model(run, choice, facts)


def _save(run, trainer, tokenizer) -> None:
    if run.model.use_peft:
        adapters.save_adapter(trainer, run.args.output_dir)
    else:
        skeleton.save_full(run, trainer, tokenizer)


RECIPE = skeleton.Recipe(
    name="dpo",
    config=_config,
    defaults=skeleton.run_defaults,
    data_options=dpolib.PairArguments,
    legacy=dict(cfg.LEGACY_TRAINING),
    check=dpolib.check,
    chat_template=False,  # plain-text pairs need none; prepare_pairs asks for it where the pairs are chat
    rows=dpolib.prepare_pairs,
    tuning=skeleton.Tuning(packing=dpolib.packing_line, loss_head=False, memory=dpolib.memory),
    notes=lambda run, facts: [dpolib.reference_line(run, facts)],
    model=_model,
    trainer=dpolib.build_trainer,
    describe=describe,
    save=_save,
)
parse = RECIPE.parse


def main(argv: list[str]) -> int:
    return skeleton.main(RECIPE, argv, imageinfo.load)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
