"""The memory plan of a full fine-tuning job (`sft`) for any model config and cluster, without a GPU or weights.

Usage: `trainbox plan --model_name_or_path M --nnodes N --nproc-per-node G --gpu-memory GIB [sft options ...]`.
M is a folder with the model's config.json (no weights are read: the model is built on the meta device) or a hub id
(only its config is fetched). GIB is the free memory of one GPU as the job will find it (torch reports about
77.7 GiB free on an H100 80GB, 139 GiB on an H200, 22.5 GiB on a 24 GB card). Every `trainbox sft` option that
weighs on memory counts: --per_device_train_batch_size, --max_length, --gradient_accumulation_steps, --optim,
--gradient_checkpointing, --fsdp_config. The plan is computed by the same code `trainbox sft` runs before it
loads the model (trainbox/training/memplan.py), so what this prints is what the job will do on those GPUs. Exit 0: it
fits (the settings and the per-GPU estimate by term); 1: it does not (the smallest changes that do); 2: bad input.
"""

from __future__ import annotations

import os
import sys

from common import errors
from common.errors import UsageError
from trainbox.training import memplan


def split_argv(argv: list[str]) -> tuple[float | None, list[str]]:
    """`--gpu-memory GIB` (ours) apart from the sft options."""
    rest, gib, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a in ("--gpu-memory", "--gpu_memory") or a.startswith(("--gpu-memory=", "--gpu_memory=")):
            value = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else None)
            i += 1 if "=" in a else 2
            try:
                gib = float(value)
            except (TypeError, ValueError):
                raise UsageError(f"--gpu-memory {value!r}: give the free GiB of one GPU (e.g. 77.7 for an H100 80GB)")
            if not (0 < gib < 1e6):
                raise UsageError(f"--gpu-memory {value}: must be a positive number of GiB")
            continue
        rest.append(a)
        i += 1
    return gib, rest


def layout(launch_args) -> tuple[int, int]:
    nodes = launch_args.nnodes or 1
    per_node = launch_args.nproc_per_node or 1
    for name, v in (("--nnodes", nodes), ("--nproc-per-node", per_node)):
        if v < 1 or v > 100_000:
            raise UsageError(f"{name} {v}: must be between 1 and 100000")
    return nodes, per_node


def compute(argv: list[str]):
    """(plan or None, refusal text or None, description) for the command line; the same path as `trainbox sft`."""
    gib, rest = split_argv(argv)
    if gib is None:
        raise UsageError("--gpu-memory GIB is required: the free memory of one GPU (e.g. 77.7 for an H100 80GB)")
    # Here, not at the top: importing sft takes about 4 s (transformers), which `trainbox plan --help` need not pay.
    from trainbox.training import config as cfg
    from trainbox.cli import sft
    from trainbox.training import speed

    _data, launch_args, model_args, args = sft.parse(rest, prog="trainbox plan")
    cfg.check_model_path(model_args.model_name_or_path)
    nodes, per_node = layout(launch_args)
    world = nodes * per_node
    # The job's view of its layout (speed.job_for and reshards_after_forward read it from the launcher's env).
    os.environ.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(per_node))
    shards = world if world > 1 else 1
    facts = speed.model_facts(model_args.model_name_or_path, model_args.model_revision)
    masters_ok = shards == 1 and speed._float32_reason(args, model_args, True, shards) is None
    job = speed.job_for(args, facts, shards, masters_ok=masters_ok)
    free = int(gib * memplan.GiB)
    where = (f"{facts.params / 1e9:.1f} B parameters ({facts.model_type}) on {nodes} node(s) x {per_node} GPU(s) with "
             f"{gib:g} GiB free each, micro-batch {job.batch} x {job.max_length} tokens, {job.grad_accum} accumulation "
             f"step(s), {job.optim}")
    try:
        return memplan.decide(job, free), None, where
    except UsageError as e:
        return None, str(e), where


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    try:
        plan, refused, where = compute(argv)
    except UsageError as e:
        print(f"error: {errors.line(e)}", file=sys.stderr)
        return 2
    print(f"[trainbox] plan for {where}")
    if refused:
        print(f"[trainbox] does not fit: {refused}")
        return 1
    print(f"[trainbox] {plan.line()}")
    for k, v in plan.terms.items():
        if k not in ("total", "phase"):
            print(f"    {k:<18} {v / memplan.GiB:8.2f} GiB")
    print(f"    {'total':<18} {plan.terms['total'] / memplan.GiB:8.2f} GiB of {memplan.usable(plan.free) / memplan.GiB:.2f} "
          "usable")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
