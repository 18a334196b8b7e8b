"""The memory plan of a full fine-tuning job (`sft`) for any model config and cluster, without a GPU or weights.

Usage: `trainbox plan --model_name_or_path M --nnodes N --nproc-per-node G --gpu-memory GIB [sft options ...]`.
M is a folder with the model's config.json (no weights are read: the model is built on the meta device) or a hub id
(only its config is fetched). GIB is the free memory of one GPU as the job will find it (torch reports about
77.7 GiB free on an H100 80GB, 139 GiB on an H200, 22.5 GiB on a 24 GB card). Every `trainbox sft` option that
weighs on memory counts: --per_device_train_batch_size, --max_length, --gradient_accumulation_steps, --optim,
--gradient_checkpointing, --fsdp_config. The plan is computed by the same code `trainbox sft` runs before it
loads the model (trainbox/training/memplan.py), so what this prints is what the job will do on those GPUs: the same
checks (the options sft refuses, the model's config.json, FSDP settings), TRAINBOX_GPU_FREE_GIB capping GIB and
TRAINBOX_MEMORY_PLAN=report (the fastest settings your options allow, fitting or not) as the job reads them. It makes
no process group, so it runs inside an allocation too (RANK/WORLD_SIZE/MASTER_ADDR are not this process's). Exit 0:
it fits (the settings and the per-GPU estimate by term); 1: it does not (the smallest changes that do; under report:
the estimate is OVER); 2: bad input.
"""

from __future__ import annotations

import os
import sys

from common import errors
from common.errors import UsageError
from trainbox.training import memplan

# What a launcher sets for a rank (torchrun, accelerate, MPI): read by transformers' TrainingArguments, which then
# joins a process group (and waits for MASTER_ADDR). `trainbox plan` is no rank of the allocation it may run in.
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "NODE_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE",
                 "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK",
                 "MV2_COMM_WORLD_LOCAL_RANK")


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
    from trainbox.cli import sft
    from trainbox.training import attention, config as cfg, modelfacts, speed

    memplan.mode()  # a bad TRAINBOX_MEMORY_PLAN is bad input (exit 2), not a plan that does not fit
    free = memplan.cap(int(gib * memplan.GiB))  # TRAINBOX_GPU_FREE_GIB caps it, as it caps the job's
    for name in LAUNCHER_VARS:  # this process is no rank: transformers would join the allocation's process group
        os.environ.pop(name, None)
    _data, launch_args, model_args, args = sft.parse_checked(rest, prog="trainbox plan")
    cfg.check_model_path(model_args.model_name_or_path)
    nodes, per_node = layout(launch_args)
    world = nodes * per_node
    # The job's view of its layout (speed.job_for and reshards_after_forward read it from the launcher's env).
    os.environ.update(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(per_node))
    shards = world if world > 1 else 1
    facts = modelfacts.model_facts(model_args.model_name_or_path, model_args.model_revision)
    masters_ok = shards == 1 and speed.float32_reason(args, model_args, True, shards) is None
    # the kernel the job loads matters only where it is eager or SDPA (score matrices, masks): the user's choice;
    # unset, the job takes a flash kernel on the GPU
    requested = model_args.attn_implementation if "attn_implementation" in cfg.explicit(model_args) else None
    attn = attention.ALIASES.get(requested, requested) if requested else ""
    job = speed.job_for(args, facts, shards, masters_ok=masters_ok, attn=attn)
    capped = f" (capped by {memplan.FREE_ENV})" if free < int(gib * memplan.GiB) else ""
    where = (f"{facts.params / 1e9:.1f} B parameters ({facts.model_type}) on {nodes} node(s) x {per_node} GPU(s) with "
             f"{free / memplan.GiB:g} GiB free each{capped}, micro-batch {job.batch} x {job.max_length} tokens, "
             f"{job.grad_accum} accumulation step(s), {job.optim}" + (f", attention {job.attn}" if job.attn else ""))
    try:
        return memplan.decide(job, free), None, where
    except memplan.DoesNotFit as e:
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
    if not plan.fits:  # TRAINBOX_MEMORY_PLAN=report: the job would run these settings and run out of memory
        print(f"[trainbox] does not fit: the estimate is over what is usable ({memplan.MODE_ENV}=report takes the "
              "fastest settings your options allow as they are; unset it to let the plan choose)")
    for k, v in plan.terms.items():
        if k not in ("total", "phase"):
            print(f"    {k:<18} {v / memplan.GiB:8.2f} GiB")
    print(f"    {'total':<18} {plan.terms['total'] / memplan.GiB:8.2f} GiB of {memplan.usable(plan.free) / memplan.GiB:.2f} "
          "usable")
    return 0 if plan.fits else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
