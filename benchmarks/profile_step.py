"""Where a `trainbox sft` (or `qlora`) step's time goes: torch.profiler around a few steady-state steps, kernels by
category.

On the device (one H100, no network; about 1 to 1.5 minutes per run, 2 runs here):

    python benchmarks/profile_step.py --kinds uniform mix --json /tmp/profile.json

Before/after in the same call: one run per kind and variant, each variant extra `trainbox sft` options (the last
occurrence of an option wins), e.g. the cost of logging every step (the runs log at trainbox's default, every 10
steps; 4 runs, about 5 to 6 minutes):

    python benchmarks/profile_step.py --kinds uniform mix --variant base= \\
        --variant every-step="--logging_steps 1" --json /tmp/profile.json

Where the GPU waits for the host (idle gaps, by the kernel that ended them) and where one step syncs host and GPU
(torch's sync debug mode over step --skip, before the timed ones):

    python benchmarks/profile_step.py --shape gpt-oss-2b --kinds mix --gaps 10 --syncs

QLoRA's step at 8B, as train_throughput's qlora runs it (batch 4 x max length 1024, its defaults otherwise), and
without the checkpoint offload (`--command qlora`; a variant's options are `trainbox qlora`'s):

    python benchmarks/profile_step.py --command qlora --shape llama-8b --variant base= \
        --variant no-offload="TRAINBOX_CKPT_OFFLOAD=0" --gaps 8

Here (CPU, a tiny Llama, ~10 s): `python benchmarks/profile_step.py --device cpu`.

What runs: the Llama-3.2-1B shape (`--shape`: another of train_throughput's, e.g. gemma2-1b or gpt-oss-2b), its
word-level tokenizer and synthetic chat data (train_throughput's make_model, lengths, write_chat, flops_per_token,
peak_tflops, sft_common), and `trainbox sft` with train_throughput's
`ours` options (batch 8 x max length 2048, `--resume never`), called in this process (trainbox.cli.sft.main). The
measurement is attached from outside: trainbox.cli.sft's `build_trainer` is wrapped here to add a callback to the
trainer it builds (and to count real tokens per micro-batch on the GPU, no host sync). Nothing in trainbox changes.

Steps 1..--warm run unprofiled (a fresh GPU's first steps are slow; steps --skip+1..--warm-1 give the unprofiled
rate; step --warm is the profiler's warm-up), steps --warm+1 .. --warm+--active run under the profiler (CPU + CUDA
activities), then one more step; on a GPU the host waits for it before and after them (trainbox's steps have no
sync inside, so the host runs ahead and an undrained window held parts of the neighbouring steps). Reported:
wall per step (CUDA events, GPU timeline) profiled and unprofiled, GPU busy time (the union of kernel, memcpy and
memset intervals) vs wall (idle = launch/CPU/sync gaps), kernel time by category (share of kernel time and of the
step), the top kernels (--top, 15 by default), and MFU over the profiled steps (train_throughput's flops_per_token x
real tokens / time / peak). A kernel's category: "loss" or "optimizer" when it was launched under TRL's fused LM head + log-prob
(forward or backward) or the optimizer's step/zero_grad, else by its name (CATEGORIES, first match). So "loss" holds
the LM head's GEMMs (useful work, in 6N) as well as the log-softmax; "matmul" is the decoder layers' GEMMs.
Several kinds or variants: each runs in its own process (one after another), then a table compares them.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import train_throughput as tt

# one home for the categories and their summary: train_throughput (its --kernels tables use them too)
CATEGORIES, OTHER, ORDER, categorize, summarize = tt.CATEGORIES, tt.OTHER, tt.ORDER, tt.categorize, tt.summarize
# Launched under these (a kernel's CPU op or one of its parents): the region decides, not the kernel's name. The
# profiler records an autograd Function's forward under its class name and its backward as <name>Backward: TRL's
# fused LM head (ChunkedLogProbFunction: the LM-head GEMMs in tiles + log-softmax) and trainbox's one-pass head
# (losshead.py's OnePassLogProbs) are the loss, GEMMs included;
# torch.optim records every optimizer's step and zero_grad.
REGIONS = [("loss", re.compile(r"ChunkedLogProb|OnePassLogProbs|LigerFusedLinearCrossEntropy")),
           ("optimizer", re.compile(r"Optimizer\.(step|zero_grad)"))]

def union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals: time the GPU ran anything (streams may overlap)."""
    busy, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        busy += e - max(s, end)
        end = e
    return busy


def region_of(evt) -> str | None:
    """'loss'/'optimizer' when this CPU op or a parent is the LM-head log-prob function or the optimizer step."""
    while evt is not None:
        for cat, rx in REGIONS:
            if rx.search(evt.name):
                return cat
        evt = evt.cpu_parent
    return None


ANNOTATION = re.compile(r"^ProfilerStep|#")  # 'ProfilerStep*', 'Optimizer.step#AdamW.step'


def device_activities(events) -> list:
    """The GPU's own work: kernels, memcpy, memset; not the user annotations the profiler also puts on the GPU's
    timeline (the step's and the optimizer's ranges, ANNOTATION: they span whole regions, and counted as work they
    hid every idle gap; torch 2.11's events don't say their activity type)."""
    from torch.autograd import DeviceType

    return [e for e in events if e.device_type == DeviceType.CUDA and not ANNOTATION.search(e.name)
            and getattr(e, "activity_type", None) != "gpu_user_annotation"]


def frontend_ops(events) -> list:
    """The CPU ops that launch device work (linked_correlation_id 0): not their runtime calls, which share the ids."""
    from torch.autograd import DeviceType

    return [e for e in events if e.device_type == DeviceType.CPU and not e.is_async
            and getattr(e, "linked_correlation_id", 0) == 0]


def launched(events) -> tuple[list[tuple[str, float, object]], float]:
    """The CUDA activities (kernels, memcpy, memset) of a profile: (name, us, the CPU op that launched it or None),
    and busy time. A device event names its launching CPU op by linked_correlation_id; a torch whose events lack it
    gets the same list from the CPU ops' own kernel lists, plus, with no launching op, the activities no op lists (a
    Triton kernel launched from Python outside any aten op: masterstep's): by name, those beyond the ops' count."""
    gpu = device_activities(events)
    busy = union_us([(e.time_range.start, e.time_range.end) for e in gpu])
    frontend = frontend_ops(events)
    if gpu and hasattr(gpu[0], "linked_correlation_id"):
        ops = {e.id: e for e in frontend}
        return [(e.name, e.time_range.end - e.time_range.start, ops.get(e.linked_correlation_id)) for e in gpu], busy
    attached = [(k.name, k.duration, e) for e in frontend for k in e.kernels]
    listed = collections.Counter(name for name, _, _ in attached)
    for e in gpu:
        if listed[e.name] > 0:
            listed[e.name] -= 1
        else:
            attached.append((e.name, e.time_range.end - e.time_range.start, None))
    return attached, busy


def device_kernels(events) -> tuple[list[tuple[str, float, str | None]], float]:
    """launched(events) with each launching op replaced by its region category (region_of)."""
    kernels, busy = launched(events)
    return [(name, us, region_of(op)) for name, us, op in kernels], busy


def origin(evt) -> str:
    """Where a kernel came from: its launching op < the outermost aten op around it < the first op that is not aten
    (an autograd backward node, an autograd Function, the optimizer, a compiled graph), e.g.
    'aten::copy_ < aten::to < ToCopyBackward0'."""
    names = []
    while evt is not None:
        name = evt.name.replace("autograd::engine::evaluate_function: ", "")
        names.append(name)
        if not name.startswith("aten::"):
            break
        evt = evt.cpu_parent
    aten = [n for n in names if n.startswith("aten::")]
    parts = aten[:1] + aten[-1:] if len(aten) > 1 else aten
    return " < ".join(parts + [n for n in names if not n.startswith("aten::")])


def sources(events, category: str, top: int, steps: int) -> list[dict]:
    """The `top` launching places (origin) of `category`'s kernels by time, ms per step: where elementwise/copies/casts
    time comes from, which kernel names alone don't say."""
    by: dict[str, list] = {}
    for name, us, op in launched(events)[0]:
        if (region_of(op) or categorize(name)) != category:
            continue
        entry = by.setdefault(origin(op) if op is not None else "(no launching op)", [0.0, 0])
        entry[0] += us
        entry[1] += 1
    ranked = sorted(by.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"origin": o, "ms_per_step": us / steps / 1e3, "calls_per_step": n / steps} for o, (us, n) in ranked]


def gaps(events, top: int, steps: int) -> dict:
    """The GPU's idle time between activities (all streams as one timeline), each gap put on the activity that ends
    it: by that activity's origin (its launching op; its own name where the profile links none: torch 2.11's
    kernels on the device), the `top` largest sums, ms per step. A gap is time the GPU
    waited for the host: a launch that came late (Python, a sync before it, the data loader)."""
    ops = {e.id: e for e in frontend_ops(events)}
    gpu = sorted(device_activities(events), key=lambda e: e.time_range.start)
    by: dict[str, list] = {}
    end = None
    for e in gpu:
        if end is not None and e.time_range.start > end:
            op = ops.get(getattr(e, "linked_correlation_id", 0))
            entry = by.setdefault(origin(op) if op is not None else f"(kernel) {e.name[:100]}", [0.0, 0])
            entry[0] += e.time_range.start - end
            entry[1] += 1
        end = e.time_range.end if end is None else max(end, e.time_range.end)
    ranked = sorted(by.items(), key=lambda kv: -kv[1][0])
    return {"ms_per_step": sum(v[0] for v in by.values()) / steps / 1e3,
            "where": [{"origin": o, "ms_per_step": us / steps / 1e3, "gaps_per_step": n / steps}
                      for o, (us, n) in ranked[:top]]}


def cpu_ops(prof) -> list[tuple[str, float, None, int]]:
    """CPU mode: each op's self time (no double counting of nested ops); the plumbing, not a GPU profile."""
    return [(k.key, k.self_cpu_time_total, None, k.count) for k in prof.key_averages()
            if k.self_cpu_time_total > 0 and not k.key.startswith("ProfilerStep")]


class Profile:
    """A TrainerCallback (built in attach(): transformers is imported late) that marks every step end and runs the
    profiler over steps warm+1 .. warm+active. The profiler starts one step earlier, in its warm-up phase (CUPTI's
    set-up stalls the host): that step, `warm`, is in neither timed window."""

    def __init__(self, trainer, warm: int, active: int, skip: int, cuda: bool, syncs: bool = False):
        self.trainer, self.warm, self.active, self.skip, self.cuda = trainer, warm, active, skip, cuda
        self.syncs: dict | None = {} if syncs and cuda else None  # where step `skip` synchronizes: count
        self._sync_watch = None
        self.marks: dict[int, tuple] = {}  # global step -> (time mark, real tokens so far)
        self.prof = None
        # Real tokens so far: counted on the host where the shape says it (padding-free), summed on the device where
        # a mask does (read at the end). Never a host<->device copy: a blocking one would sync every step.
        self.tokens_host, self.tokens_dev = 0, None
        # Python's garbage collections by the step they ran in (ms, host time): a full one stalls the launches
        self.gc_ms: dict[int, float] = {}
        self._gc_start = 0.0
        gc.callbacks.append(self.on_gc)

    def on_gc(self, phase, info) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
            return
        step = self.trainer.state.global_step + 1
        self.gc_ms[step] = self.gc_ms.get(step, 0.0) + 1e3 * (time.perf_counter() - self._gc_start)

    def mark(self):
        import torch

        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        else:
            ev = time.perf_counter()
        return ev, self.tokens_host, (self.tokens_dev.clone() if self.tokens_dev is not None else None)

    def on_step_end(self, args, state, control, **kw):
        import torch

        step = state.global_step
        self.marks[step] = self.mark()
        if self.cuda and self.prof is not None and step in (self.warm, self.warm + self.active):
            # The host runs ahead of the GPU (no sync inside a step): drained at both ends, the recorded window
            # holds the profiled steps' kernels only, not the next step's launches or the last one's tail.
            torch.cuda.synchronize()
        if self.syncs is not None and step in (self.skip - 1, self.skip):
            self.watch_syncs(step == self.skip - 1)
        if step == self.warm - 1:
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if self.cuda else [])
            self.prof = torch.profiler.profile(activities=acts, schedule=torch.profiler.schedule(
                wait=0, warmup=1, active=self.active, repeat=1))
            self.prof.start()
        elif self.warm <= step < self.warm + self.active and self.prof is not None:
            self.prof.step()  # at `warm`: warm-up -> recording
        elif step == self.warm + self.active and self.prof is not None:
            self.prof.stop()

    def watch_syncs(self, on: bool) -> None:
        """torch's sync debug mode over step `skip` (before the timed ones): each host<->device synchronization
        warns; the warnings are counted by where Python called the op (a backward's show at the backward() call)."""
        import traceback
        import warnings

        import torch

        if on:
            self._sync_watch = warnings.catch_warnings()
            self._sync_watch.__enter__()
            warnings.simplefilter("always")

            def record(message, category, filename, lineno, file=None, line=None):
                if "synchroniz" not in str(message):
                    return
                frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")]
                where = " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-4:]))
                self.syncs[where] = self.syncs.get(where, 0) + 1

            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
        elif self._sync_watch is not None:
            torch.cuda.set_sync_debug_mode(0)
            self._sync_watch.__exit__(None, None, None)
            self._sync_watch = None

    def count(self, inputs) -> None:
        """Real tokens of a micro-batch, kept on its device: the mask's sum where there is padding, every position
        of a padding-free (flattened) batch."""
        if "attention_mask" not in inputs:
            self.tokens_host += inputs["input_ids"].numel()
            return
        n = inputs["attention_mask"].sum()
        self.tokens_dev = n if self.tokens_dev is None else self.tokens_dev + n

    def seconds(self, a: int, b: int) -> float:
        x, y = self.marks[a][0], self.marks[b][0]
        if self.cuda:
            return x.elapsed_time(y) / 1e3
        return y - x

    def tokens_between(self, a: int, b: int) -> int:
        (_, hx, dx), (_, hy, dy) = self.marks[a], self.marks[b]
        return hy - hx + (int((dy - (dx if dx is not None else 0)).item()) if dy is not None else 0)


def attach(trainer, opts) -> Profile:
    """Adds the profile callback and the token count to a trainer trainbox built."""
    from transformers import TrainerCallback

    prof = Profile(trainer, opts.warm, opts.active, opts.skip, cuda=opts.device == "cuda", syncs=opts.syncs)
    callback = type("ProfileCallback", (TrainerCallback,), {"on_step_end": lambda self, *a, **k:
                                                             prof.on_step_end(*a, **k)})()
    trainer.add_callback(callback)
    step = trainer.training_step

    def training_step(model, inputs, *a, **k):
        if isinstance(inputs, dict):
            prof.count(inputs)
        return step(model, inputs, *a, **k)

    trainer.training_step = training_step
    return prof


@contextlib.contextmanager
def patched(opts, found: list):
    """sftlib's build_trainer wrapped: the trainer it returns gets the profile (appended to `found` with it); restored
    after. sft's recipe (trainbox/cli/sft.py) looks the name up in sftlib when it builds its trainer."""
    from trainbox.training import sftlib

    build = sftlib.build_trainer

    def build_trainer(*a, **k):
        trainer = build(*a, **k)
        found.append((trainer, attach(trainer, opts)))
        return trainer

    sftlib.build_trainer = build_trainer
    try:
        yield
    finally:
        sftlib.build_trainer = build


# CPU smoke: a tiny Llama, short rows, small batches (the plumbing, not the numbers).
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=tt.WORDS + 7, max_position_embeddings=256)


def tiny(shape: str) -> dict:
    """TINY over `shape` (per-layer lists cut to its layers)."""
    types = tt.SHAPES[shape].get("layer_types")
    return {**TINY, **({"layer_types": types[: TINY["num_hidden_layers"]]} if types else {})}


# (max length, batch) on the GPU: train_throughput's for each command (sft's `ours`, qlora's every side)
GPU_BATCH = {"sft": (2048, 8), "qlora": (1024, 4)}


def run_one(opts, kind: str, label: str, extra: list[str]) -> dict:
    """One `trainbox sft` (or qlora) in this process, profiled; the summary as a dict (printed too)."""
    work = Path(opts.work)
    cuda = opts.device == "cuda"
    max_len, batch = GPU_BATCH[opts.command] if cuda else (64, 2)
    model = (tt.make_model(work / opts.shape, opts.shape) if cuda else
             tt.make_model(work / f"tiny-{opts.shape}", opts.shape, device="cpu", **tiny(opts.shape)))
    steps = opts.warm + opts.active + 1
    lens = tt.lengths(kind, steps * batch * 6, max_len)
    data = tt.write_chat(work / f"data-{kind}-{max_len}-{steps}", lens)
    fpt = tt.flops_per_token(model, lens)
    out = work / f"o-{kind}-{label}"
    env, options = tt.split_env(extra)  # a variant's NAME=VALUE items are settings, set before trainbox imports
    argv = ["--dataset", str(data / "train.jsonl"), "--output_dir", str(out), "--max_steps", str(steps),
            "--resume", "never", *tt.sft_common(model, max_len, batch), *options]  # fmt: skip
    if not cuda:
        argv += ["--use_cpu", "true"]
    os.environ.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", **env)
    print(f"# profile {kind}/{label}: {' '.join(f'{k}={v}' for k, v in env.items())}{' ' * bool(env)}"
          f"trainbox {opts.command} {shlex.join(argv)}", flush=True)
    from trainbox.cli import qlora, sft

    found: list = []
    with patched(opts, found):
        rc = {"sft": sft, "qlora": qlora}[opts.command].main(argv)
    shutil.rmtree(out, ignore_errors=True)  # the saved model or adapter: only the figures are kept
    if rc != 0 or not found or found[-1][1].prof is None:
        raise SystemExit(f"error: trainbox {opts.command} exited {rc} before the profiled steps ran (see its output "
                         "above)")
    trainer, p = found[-1]
    a, b = opts.warm, opts.warm + opts.active
    events = p.prof.events()
    if cuda:
        kernels, busy = device_kernels(events)
    else:
        kernels, busy = cpu_ops(p.prof), None
    wall = p.seconds(a, b)
    res = summarize(kernels, wall * 1e6, busy, opts.active, opts.top)
    tokens = p.tokens_between(a, b)
    start, end = min(opts.skip, a - 2), a - 1  # unprofiled: steps start+1 .. end, before the profiler's warm-up
    res.update(kind=kind, variant=label, extra=extra, device=opts.device, command=opts.command, profiled_steps=[a + 1, b],
               unprofiled_wall_ms_per_step=1e3 * p.seconds(start, end) / (end - start),
               unprofiled_steps=[start + 1, end], real_tokens_per_step=tokens / opts.active,
               step_ms={i: round(1e3 * p.seconds(i - 1, i), 1) for i in sorted(p.marks) if i - 1 in p.marks},
               gc_ms={i: round(ms, 1) for i, ms in sorted(p.gc_ms.items()) if ms >= 1},
               flops_per_token=fpt, attn=str(getattr(trainer.model.config, "_attn_implementation", "?")),
               gradient_checkpointing=bool(trainer.args.gradient_checkpointing),
               packing=bool(getattr(trainer.args, "packing", False)),
               liger=bool(getattr(trainer.args, "trainbox_liger", False)
                          or getattr(trainer.args, "use_liger_kernel", False)))
    if cuda:
        peak = tt.peak_tflops()
        res.update(gpu=__import__("torch").cuda.get_device_name(), peak_tflops=peak,
                   peak_gib=__import__("torch").cuda.max_memory_allocated() / 2**30,
                   # the allocator's cudaFree-and-retry passes (each syncs the GPU): memory held too near the limit
                   alloc_retries=__import__("torch").cuda.memory_stats().get("num_alloc_retries", 0),
                   mfu=fpt * tokens / wall / (peak * 1e12),
                   mfu_unprofiled=fpt * p.tokens_between(start, end) / p.seconds(start, end) / (peak * 1e12))
    if cuda and opts.sources:
        res["sources"] = sources(events, OTHER, opts.sources, opts.active)
    if cuda and opts.gaps:
        res["gaps"] = gaps(events, opts.gaps, opts.active)
    if p.syncs is not None:
        res["syncs"] = {"step": opts.skip, "where": sorted(p.syncs.items(), key=lambda kv: -kv[1])}
    if opts.trace:
        trace = Path(opts.trace)
        trace = trace.with_name(f"{trace.stem}-{kind}-{label}{trace.suffix or '.json'}")
        trace.parent.mkdir(parents=True, exist_ok=True)
        p.prof.export_chrome_trace(str(trace))
        res["trace"] = str(trace)
    show(res)
    return res


def show(res: dict) -> None:
    busy = ("" if res["busy_share"] is None else
            f", GPU busy {res['busy_ms_per_step']:.1f} ms = {100 * res['busy_share']:.1f} % "
            f"(idle {100 * res['idle_share']:.1f} %: launch/CPU/sync gaps)")
    mfu = (f"; MFU {100 * res['mfu']:.1f} % profiled, {100 * res['mfu_unprofiled']:.1f} % unprofiled; peak "
           f"{res['peak_gib']:.1f} GiB allocated, {res['alloc_retries']} allocator retries" if "mfu" in res else "")
    print(f"\n== {res['command']} {res['kind']}/{res['variant']} ({res['device']}; attn={res['attn']} liger={res['liger']} "
          f"packing={res['packing']} ckpt={res['gradient_checkpointing']})\n"
          f"steps {res['profiled_steps'][0]}-{res['profiled_steps'][1]}: {res['wall_ms_per_step']:.1f} ms/step "
          f"(unprofiled steps {res['unprofiled_steps'][0]}-{res['unprofiled_steps'][1]}: "
          f"{res['unprofiled_wall_ms_per_step']:.1f} ms){busy}; {res['real_tokens_per_step']:,.0f} real tokens/step"
          f"{mfu}", flush=True)
    print(f"  {'category':<26}{'ms/step':>9}{'% kernels':>11}{'% step':>9}")
    for cat, c in res["categories"].items():
        if c["ms_per_step"] > 0:
            print(f"  {cat:<26}{c['ms_per_step']:>9.2f}{100 * c['share_of_kernels']:>10.1f}%"
                  f"{100 * c['share_of_step']:>8.1f}%")
    if res["idle_share"] is not None:
        print(f"  {'GPU idle':<26}{res['wall_ms_per_step'] - res['busy_ms_per_step']:>9.2f}{'':>11}"
              f"{100 * res['idle_share']:>8.1f}%")
    print(f"  top {len(res['top'])} kernels:")
    for t in res["top"]:
        print(f"  {t['ms_per_step']:>8.2f} ms {100 * t['share_of_kernels']:5.1f}% x{t['calls_per_step']:<6.0f} "
              f"[{t['category']}] {t['name'][:110]}")
    if res.get("sources"):
        print(f"  {OTHER} by where it is launched (launching op < outermost aten op < first other op):")
        for t in res["sources"]:
            print(f"  {t['ms_per_step']:>8.2f} ms x{t['calls_per_step']:<6.0f} {t['origin'][:150]}")
    if res.get("gaps"):
        print(f"  GPU idle between activities: {res['gaps']['ms_per_step']:.2f} ms/step; by the activity that ended "
              "the gap (launching op < outermost aten op < first other op):")
        for t in res["gaps"]["where"]:
            print(f"  {t['ms_per_step']:>8.2f} ms x{t['gaps_per_step']:<6.0f} {t['origin'][:150]}")
    if "syncs" in res:
        where = res["syncs"]["where"]
        print(f"  host<->device synchronizations in step {res['syncs']['step']}: {sum(n for _, n in where)}"
              + "".join(f"\n    x{n:<4} {w[:160]}" for w, n in where))
    brief = {k: v for k, v in res.items() if k not in ("top", "categories", "sources", "syncs", "gaps")}
    print(f"RESULT {json.dumps(brief)}",
          flush=True)


def compare(results: list[dict]) -> None:
    print("\nSUMMARY (kind/variant: ms/step profiled | unprofiled, idle, MFU unprofiled, three largest categories)")
    for r in results:
        cats = sorted(r["categories"].items(), key=lambda kv: -kv[1]["share_of_step"])[:3]
        idle = "" if r["idle_share"] is None else f" idle {100 * r['idle_share']:.1f} %"
        mfu = (f" MFU {100 * r['mfu_unprofiled']:.1f} %, peak {r['peak_gib']:.1f} GiB" if "mfu_unprofiled" in r
               else "")
        print(f"  {r['kind']}/{r['variant']}: {r['wall_ms_per_step']:.1f} | {r['unprofiled_wall_ms_per_step']:.1f} "
              f"ms{idle}{mfu}; " + ", ".join(f"{c} {100 * v['share_of_step']:.1f} %" for c, v in cats), flush=True)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", nargs="+", default=["uniform"], choices=["uniform", "mix"],
                    help="data: uniform (every row 2,048 tokens) and/or mix (lognormal, median 350); default uniform")
    ap.add_argument("--command", choices=list(GPU_BATCH), default="sft",
                    help="the trainer profiled: sft (default) or qlora (its defaults; on the GPU batch 4 x 1,024 "
                         "as train_throughput's qlora)")
    ap.add_argument("--variant", action="append", type=tt.variant, default=None, metavar="LABEL=OPTIONS",
                    help="a run with these extra options of the command and VAR=value settings (repeatable; "
                         "default: one run, none)")
    ap.add_argument("--shape", choices=list(tt.SHAPES), default="llama-1b",
                    help="model shape (train_throughput's SHAPES; default llama-1b): e.g. gemma2-1b, gpt-oss-2b")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: a tiny model of the shape on the CPU, CPU ops instead of kernels (tests the plumbing)")
    ap.add_argument("--warm", type=int, default=8, help="unprofiled steps before the profiled ones (default 8)")
    ap.add_argument("--active", type=int, default=3, help="profiled steps (default 3)")
    ap.add_argument("--skip", type=int, default=3, help="steps before the unprofiled rate's start (default 3)")
    ap.add_argument("--top", type=int, default=15, metavar="N", help="list the N costliest kernels (default 15)")
    ap.add_argument("--sources", type=int, default=0, metavar="N",
                    help=f"also list the N places ({OTHER}) kernels are launched from, by time (GPU only)")
    ap.add_argument("--gaps", type=int, default=0, metavar="N",
                    help="also list the N places whose kernels the GPU waited for longest (idle gaps; GPU only)")
    ap.add_argument("--syncs", action="store_true",
                    help="list where step --skip (before the timed ones) synchronizes host and GPU (torch's sync "
                         "debug mode)")
    ap.add_argument("--json", help="write the results (a list, one per run) to this file")
    ap.add_argument("--trace", help="chrome trace per run: FILE becomes FILE-STEM-KIND-VARIANT.json")
    ap.add_argument("--work", help="folder for the model and data (default: a new temporary one)")
    return ap


def main(argv: list[str] | None = None) -> int:
    opts = parser().parse_args(argv)
    if opts.warm < 3 or opts.active < 1:
        print("error: --warm must be >= 3 and --active >= 1 (steps before the profiled ones, and profiled steps)",
              file=sys.stderr)
        return 2
    opts.work = opts.work or tempfile.mkdtemp(prefix="profile-")
    Path(opts.work).mkdir(parents=True, exist_ok=True)
    runs = [(k, lab, extra) for k in opts.kinds for lab, extra in (opts.variant or [("default", [])])]
    if len(runs) == 1:
        results = [run_one(opts, *runs[0])]
    else:  # one process per run: no compile caches, allocator state or patches carried from one to the next
        results = []
        for k, lab, extra in runs:
            child = Path(opts.work) / f"result-{k}-{lab}.json"
            child.unlink(missing_ok=True)
            argv = [sys.executable, __file__, "--command", opts.command, "--kinds", k, "--variant",
                    f"{lab}={shlex.join(extra)}", "--shape",
                    opts.shape, "--device",
                    opts.device, "--warm", str(opts.warm), "--active", str(opts.active), "--skip", str(opts.skip),
                    "--work", opts.work, "--json", str(child), "--top", str(opts.top), "--sources", str(opts.sources),
                    "--gaps", str(opts.gaps), *(["--syncs"] if opts.syncs else []),
                    *(["--trace", opts.trace] if opts.trace else [])]
            r = subprocess.run(argv)
            if r.returncode != 0 or not child.is_file():
                print(f"{k}/{lab}: FAILED (exit {r.returncode})", flush=True)
                continue
            results += json.loads(child.read_text())
        compare(results)
    if opts.json:
        Path(opts.json).write_text(json.dumps(results, indent=1))
    return 0 if len(results) == len(runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
