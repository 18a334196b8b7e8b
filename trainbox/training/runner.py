"""The one run of a trainer (sft, qlora, grpo: the command table's `trainer` kind), from argv to exit code.

`run_trainer(name, argv, parse, check_before_launch, train)`: preemption handlers first, the options parsed, the
launch planned (launch.py); the run's log kept (runlog.py) around either the torchrun hand-off (outside torchrun:
the checks that need no GPU run here first, so a bad config is one line here, not a failure in every rank) or the
training in this process (a Slurm task per rank: its RANK/WORLD_SIZE set first, the options parsed again). Bad input
(UsageError) is one `error:` line and exit 2; a crash in training ends the run at once (crash.ends_on_crash).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from common import commands, errors, launch, pipes
from common.errors import UsageError
from trainbox.run import crash, exitdeadline, outputs, preemption, ranks, runlog
from trainbox.training import config

# One trainer's steps: `parse(argv)` gives the tuple of its option objects (one launch.LaunchArguments, one with
# output_dir: TrainingArguments), which the others take.
Options = tuple


def run_trainer(name: str, argv: list[str], parse: Callable[[list[str]], Options],
                check_before_launch: Callable[[Options, launch.Plan], None], train: Callable[[Options], int], *,
                arrange: Callable | None = None, reparse: bool = True,
                failures: dict[type[BaseException], int] | None = None, expandable_segments: bool = True) -> int:
    """`trainbox NAME ARGV` for a trainer, returning its exit code.

    check_before_launch(options, plan): in the launcher, before torchrun starts the ranks.
    train(options): in this process (a rank, or the only process); its exit code.
    arrange(options, argv): before the launch plan; an int ends the run there (this process had another role, e.g.
        grpo's vLLM server), else (argv, env, torchrun): the ranks' argv, variables the plan reads, and the call that
        replaces launch.run_torchrun(plan, module, argv) (or None).
    reparse: parse again once a Slurm task's rank variables are set (defaults that read WORLD_SIZE, e.g. FSDP2).
    failures: more exceptions that end the run with one `error:` line, and their exit codes.
    expandable_segments: PyTorch's allocator setting below, unless PYTORCH_CUDA_ALLOC_CONF says otherwise.
    """
    # Before CUDA starts (torchrun's workers inherit it): freed blocks are remapped, not left as holes, so what the
    # memory plan counts is close to what the allocator reserves (measured on 2 x H100, 8B shape, without it:
    # 63.7 GiB allocated, 74.9 GiB reserved).
    if expandable_segments:
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    handled = tuple(failures or ())
    try:
        # Handlers first: a SIGTERM during start-up or model loading is remembered, not fatal.
        preemption.install_signal_handlers()
        options = parse(argv)
        env, torchrun = {}, None
        if arrange is not None:
            arranged = arrange(options, argv)
            if isinstance(arranged, int):
                return arranged
            argv, env, torchrun = arranged
        launch_args = next(o for o in options if isinstance(o, launch.LaunchArguments))
        plan = launch.plan(launch_args, {**os.environ, **env})
        with runlog.for_command(name, output_dir(options), plan, argv):
            if plan.mode == "torchrun":
                check_before_launch(options, plan)
                if preemption.preempt_requested():  # the ranks would start afresh, knowing nothing of it
                    return preemption.stop_before_training(name)
                if torchrun is not None:
                    return torchrun(plan, argv)
                return launch.run_torchrun(plan, commands.qualified(name), argv)
            if plan.env:
                # One Slurm task per rank: set RANK/WORLD_SIZE/... first, then parse again so the
                # distributed defaults (FSDP2 on GPUs) and the Trainer's device setup see them.
                launch.apply_env(plan, os.environ)
                if reparse:
                    options = parse(argv)
            if preemption.preempt_requested() and not ranks.distributed():
                # One process, stopped while it imported and parsed: nothing to save. (A rank of several trains on
                # to its first step end, where the ranks agree and save: one that left now would hang the others.)
                return preemption.stop_before_training(name)
            outputs.follow_umask_in_safetensors()
            with crash.ends_on_crash():
                code = train(options)
            if ranks.distributed():
                exitdeadline.arm(code)  # one rank held at exit fails a multi-node job (exitdeadline.py)
            return code
    except UsageError as e:
        print(f"error: {errors.line(e)}", file=sys.stderr)
        return 2
    except handled as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return next(code for cls, code in failures.items() if isinstance(e, cls))
    except crash.Crashed as e:  # after the run log was closed and copied: leave now, whatever still runs
        return crash.exit_now(e.code)
    except BrokenPipeError:  # `trainbox sft --help | head`: the reader left
        if not pipes.stdout_closed():
            raise
        return pipes.reader_gone()


def output_dir(options: Options) -> str | None:
    """The --output_dir the user set (in the options that have one), else None (outputs.output_dir decides)."""
    return next((config.configured_output_dir(o) for o in options if hasattr(o, "output_dir")), None)
