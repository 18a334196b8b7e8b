"""The run skeleton: one run of a trainer from parsed options to exit code, the same steps for every trainer that
declares a Recipe (sft, qlora, dpo; grpo keeps its own steps around its rollout engine).

output folder -> checks -> tokenizer -> data -> resume -> tuning (attention kernel, speed defaults, memory plan)
-> model -> trainer (the one callback list, callbacks.py) -> train -> save -> summary. `main(recipe, argv)` hands
these steps to runner.run_trainer (signals, launch plan, run log, torchrun; bad input: one `error:` line, exit 2),
whose launcher runs the checks, the tokenizer and a few rows of data before torchrun starts the ranks.

A Recipe says only what differs: its options, its defaults, its own checks, its rows, how its model loads, which
TRL trainer it builds and what it saves. Everything else, and the order, is here once.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common import launch
from trainbox.run import outputs, preemption, ranks, resume, runsummary
from trainbox.training import callbacks, config as cfg, memplan, runner, sftlib
from trainbox.training.kernels import moe, precision


@dataclass(frozen=True)
class Run:
    """A run's parsed options: the dataset's, the recipe's own (`extras`), TRL's ModelConfig and its trainer config
    (`args`: TrainingArguments included). `parse` gives them in this order, the launcher's between."""

    data: Any
    extras: tuple
    model: Any
    args: Any
    recipe: Recipe

    @classmethod
    def of(cls, recipe: Recipe, options: tuple) -> Run:
        return cls(options[0], tuple(options[1:-3]), options[-2], options[-1], recipe)

    def extra(self, kind: type):
        return next(o for o in self.extras if isinstance(o, kind))


@dataclass(frozen=True)
class Tuning:
    """What the speed defaults may decide for this trainer (speed.apply)."""

    checkpointing: bool = True  # the memory plan decides gradient checkpointing (False: the recipe's default stays)
    # None: packing decided (speed.choose_packing); else the line saying what this trainer does, or f(choice) -> it
    packing: str | Callable | None = None
    loss_head: bool = True  # our SFT loss (sftloss.py, losshead.py) in TRL's place; False: the trainer's own
    memory_first: bool = False  # FSDP2 reshards after forward on one node too (a 4-bit base: qlora)
    # (run, facts) -> {"tokens": of one micro-batch, "extra": bytes beside the trained model}: the memory plan's view
    memory: Callable[[Run, Any], dict] | None = None


def full_model(run: Run, choice, facts):
    """The model in its planned dtype (precision.py may have set bf16), the chosen attention kernel and our MoE
    experts where they apply (moe.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    experts, line = moe.choose(facts)
    say(line)
    m = run.model
    dtype = m.dtype if m.dtype in ("auto", None) else getattr(torch, m.dtype)
    return AutoModelForCausalLM.from_pretrained(m.model_name_or_path, dtype=dtype, attn_implementation=choice.impl,
                                                revision=m.model_revision, **experts)


def run_defaults(argv: list[str] | None = None) -> dict:
    """The defaults a full-parameter trainer starts from (sft, dpo): the real-token count for the summary, a log line
    every 10 steps, a checkpoint every 200, and FSDP2 across GPUs."""
    import torch

    d = {"include_num_input_tokens_seen": True, "logging_steps": 10, "save_steps": 200}
    if torch.cuda.is_available() and ranks.distributed():
        d.update(sftlib.FSDP2_GPU)
    return d


def save_full(run: Run, trainer, tokenizer) -> None:
    """The whole trained model as one loadable safetensors set (under FSDP2: gathered, not shards)."""
    if trainer.is_fsdp_enabled:
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    trainer.save_model(run.args.output_dir)


@dataclass(frozen=True)
class Recipe:
    """A trainer declared over the skeleton. Callables take the Run; `config` returns TRL's config class (imported
    when called: `trainbox NAME --help` is kept without TRL, helpcache.py)."""

    name: str
    config: Callable[[], type]  # e.g. lambda: trl.SFTConfig
    defaults: Callable[[list[str]], dict]  # argv -> option defaults (YAML and --option win; --help: GPU ones)
    data_options: type = sftlib.DataArguments
    extras: tuple = ()  # the recipe's own option dataclasses, parsed after the dataset's
    legacy: dict = field(default_factory=lambda: {**cfg.LEGACY_TRAINING, **cfg.LEGACY_SFT})
    check: Callable[[Run], None] | None = None  # its own checks beyond sftlib.validate (need no model, no data)
    chat_template: bool = True  # the tokenizer must have one (False: the dataset step checks what its rows need)
    rows: Callable[[Run, Any, int | None], Any] = None  # (run, tokenizer, first N or None) -> the dataset
    tuning: Tuning = Tuning()
    notes: Callable[[Run, Any], list[str]] | None = None  # (run, facts) -> lines after tuning (and their settings)
    model: Callable[[Run, Any, Any], Any] = full_model  # (run, attention choice, facts) -> the model to train
    trainer: Callable[..., Any] = None  # (run, model, dataset, tokenizer, callbacks) -> the TRL trainer
    describe: Callable[[Run], str] | None = None  # the start line's words after the model path
    save: Callable[[Run, Any, Any], None] = save_full  # (run, trainer, tokenizer), unless preempted

    def parse(self, argv: list[str], prog: str | None = None):
        """The options, in Run's order; `prog` names the command in errors and --help (`trainbox plan` reads sft's)."""
        from trl import ModelConfig

        return cfg.parse_args((self.data_options, *self.extras, launch.LaunchArguments, ModelConfig, self.config()),
                              argv, prog=prog or f"trainbox {self.name}", legacy=self.legacy,
                              defaults=self.defaults(argv))


def validate(run: Run) -> None:
    sftlib.validate(run.data, run.model, run.args)
    if run.recipe.check:
        run.recipe.check(run)


def distributed_strategy(args) -> str:
    """FSDP2 on GPUs with >1 process; on CPU the Trainer runs DDP (gloo). Returns a label for the log."""
    import torch

    world = ranks.world_size()
    on_gpu = torch.cuda.is_available() and not args.use_cpu
    if world <= 1:
        return "single process" + (" (GPU)" if on_gpu else " (CPU)")
    if not on_gpu:
        if args.fsdp:
            print("warning: --fsdp is ignored by the Trainer on CPU; running DDP over gloo", file=sys.stderr)
        return f"DDP over gloo, {world} processes (CPU)"
    return f"FSDP2, {world} processes (GPU)"


def say(line: str | None, name: str | None = None) -> None:
    """One line of the run's log, from the first process only (`name`: the trainer's, before the line)."""
    if line and outputs.is_main_process():
        print(f"[trainbox] {name + ': ' if name else ''}{line}", flush=True)


def check_before_launch(recipe: Recipe, options, plan=None) -> None:
    """In the launcher, before torchrun: the checks, the tokenizer and the first rows, so a bad config is one
    `error:` line here, not a failure in every rank."""
    run = Run.of(recipe, options)
    validate(run)
    tokenizer = sftlib.load_tokenizer(run.model.model_name_or_path, run.args, chat=recipe.chat_template)
    recipe.rows(run, tokenizer, 8)


def train(recipe: Recipe, options, image: Callable[[], dict | None]) -> int:
    """The steps, in order (the module docstring); the exit code (preempted: preemption.exit_code()). `image`
    reads the image record (the command passes trainbox.image.imageinfo.load: its kernel default)."""
    run = Run.of(recipe, options)
    name, args, model_args = recipe.name, run.args, run.model
    started = time.time()
    args.output_dir = outputs.output_dir(cfg.configured_output_dir(args))
    validate(run)
    say(memplan.hold_to_cap(), name)
    tokenizer = sftlib.load_tokenizer(model_args.model_name_or_path, args, chat=recipe.chat_template)
    with args.main_process_first(local=False, desc="dataset"):
        dataset = recipe.rows(run, tokenizer, None)
    ckpt = resume.resolve_resume(run.data.resume, args.output_dir, args, name)
    if outputs.is_main_process():
        what = recipe.describe(run) if recipe.describe else ""
        print(f"[trainbox] {name}: model {model_args.model_name_or_path}{' (' + what + ')' if what else ''}, "
              f"{len(dataset)} examples, {distributed_strategy(args)}, outputs {args.output_dir}"
              + (f", resuming from {ckpt}" if ckpt else ""), flush=True)

    t = recipe.tuning
    choice, facts = sftlib.tune(model_args, args, shards=sftlib.shards(args), image=image(),
                                checkpointing=t.checkpointing, packing=t.packing,
                                memory=(lambda f: t.memory(run, f)) if t.memory else None)
    for line in recipe.notes(run, facts) if recipe.notes else ():
        say(line, name)
    model = recipe.model(run, choice, facts)
    masters = bool(getattr(args, "trainbox_master_weights", False))
    trainer = recipe.trainer(run, model, dataset, tokenizer, callbacks.standard())
    if masters:
        # bf16 weights, float32 masters in the optimizer the Trainer builds from these (precision.py); clipping and
        # the logged grad_norm read the float32 gradient sums.
        trainer.optimizer_cls_and_kwargs = precision.optimizer_for(type(trainer), args, trainer.model)
        precision.attach(trainer)
    sftlib.finish_tuning(trainer, facts, qlora=t.memory_first, loss_head=t.loss_head)
    trainer.train(resume_from_checkpoint=ckpt)
    if not preemption.was_preempted():
        recipe.save(run, trainer, tokenizer)
    runsummary.finish(trainer, args.output_dir, started, name)
    return preemption.exit_code()


def main(recipe: Recipe, argv: list[str], image: Callable[[], dict | None]) -> int:
    """`trainbox NAME ARGV` for a declared trainer; `image` reads the image record (imageinfo.load)."""
    return runner.run_trainer(recipe.name, argv, recipe.parse, lambda o, p: check_before_launch(recipe, o, p),
                              lambda o: train(recipe, o, image))
