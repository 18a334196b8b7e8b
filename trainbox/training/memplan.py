"""The memory plan of a training job: which settings fit on every GPU, decided once for the whole job.

One home for the figures: `trainbox sft/qlora/grpo` use it before the model loads (every rank reads its own GPU's
free memory, the group takes the smallest, rank 0 decides and broadcasts, so no rank can take a path the others
don't), and `trainbox plan` prints the same plan for any model config and cluster shape on a machine without a GPU.

The estimate is a hand formula over the model's shape (ModelFacts: read from the config on the meta device), per GPU
and in bytes, term by term:
- weights, gradients, optimizer states. One process: float32 weights + float32 gradients (8/param; TRL's path) or
  bf16 weights + float32 masters + their gradients (precision.py); a step's first gradients exist only from backward
  on, so the peak is the larger of backward's start (activations, no gradients) and its end (every gradient; 16/param
  of TRL's path: measured 119.75 GiB for an 8B shape on an H200, estimate 120.6). FSDP2 over k ranks: float32 shards
  of weights and gradients (8/k). The optimizer's states: memterms.optimizer_state_bytes (AdamW 8/param, 8-bit 2,
  SGD none, Adafactor factored, ...), divided by k under FSDP2.
- FSDP2's all-gathered bf16 layers: every layer kept from forward to backward when it does not reshard after
  forward (2/param), else the layer at work and the one prefetched; the LM head and final norm (accelerate's tail
  group, never resharded) always; and in backward a layer's unsharded bf16 gradient plus its float32 copy for the
  reduce-scatter (6/param of two layers).
- float32 gradient accumulation buffers: under gradient accumulation FSDP2 skips the reduce-scatter of the micro-
  batches before the last and accumulates *unsharded* float32 gradients (4/param, the whole model), unless
  gradients are synchronised on every micro-batch (accelerate's `sync_each_batch`: no buffer, one reduce-scatter per
  micro-batch).
- activations of one micro-batch (memterms.py, by layer kind): per token and layer about 8*hidden + 8*attention
  width (16*hidden where they agree) + 10*intermediate bytes (the bf16 inputs of every matmul, norm outputs, the
  SwiGLU gate/up/product, attention output and log-sum-exp; 5*intermediate with Liger's SwiGLU, which recomputes the
  product in backward); a MoE layer's experts by experts per token and their width instead of the MLP; eager's
  score matrices and SDPA's mask biases where those kernels run; with gradient checkpointing each layer's input
  (2*hidden) plus one layer recomputed.
- the loss head: TRL's fused LM head computes the loss in tiles and never holds the full logits; its float32
  working set is taken as 2,048 tokens x vocabulary (small beside the rest; calibrated on the device). One process
  per model copy (no FSDP2) may run losshead.py's one-pass head instead, whose tile spans the vocabulary: plus that
  tile (<= losshead.TILE_BYTES: 0.98 GiB at 128k vocabulary; measured +0.17 GiB at the head, +0.23 GiB at the
  step's peak, Llama 1B shape, 16k tokens: the estimate stays on the safe side).
- slack: what the caching allocator and NCCL hold beyond the tensors (fragmentation, communication buffers):
  the plan only takes settings whose estimate stays under FIT x free - RESERVE.

torch ships estimators for this under `torch.distributed._tools` (FSDPMemTracker, MemTracker: per-module peaks of a
real FSDP2 step, also under FakeTensorMode). They are not used: they are private API that changed in each recent
release, running them means building and stepping the model (fake tensors still trace every op: minutes for an 8B
shape on a laptop CPU, and the FSDP2 tracker needs an initialised process group of the target size), while the
plan must answer in well under a second before anything loads, for a 70B config on 16 GPUs from a laptop. The
formula's terms are checked against measured peaks on the device instead (benchmarks/memory_plan.py).

The ladder (fastest first; a setting the user chose is kept): no checkpointing before checkpointing; keeping the
gathered layers before resharding them; accumulating unsharded gradients before synchronising each micro-batch;
then the micro-batch split in halves with gradient accumulation doubled (the same tokens per optimizer step). When
nothing fits, one error names the smallest change that does: more GPUs, or an 8-bit optimizer on one GPU, each
checked with this same plan. FSDP2's CPU offload is not a rung: tried on 2 x H100 (torch 2.11, accelerate 1.15), the
Trainer's gradient clipping failed on the CPU shards ("No backend type associated with device type cpu": the NCCL
process group has no CPU backend).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from common.errors import UsageError
from trainbox.run import ranks
from trainbox.training import memterms
from trainbox.training.kernels import losshead

GiB = 2**30
FIT = 0.92  # of the free memory: the allocator's fragmentation (expandable segments keep it small)
RESERVE = int(1.5 * GiB)  # NCCL's buffers, cuBLAS workspaces, the loss head's transient spikes
LOSS_CHUNK_TOKENS = 2048
FREE_ENV = "TRAINBOX_GPU_FREE_GIB"  # plan as if only this much memory per GPU were free (room for something else)
# "report": print the plan, but run the fastest rung the user's own options allow, fitting or not (for measuring
# the estimate against a real peak, or for a user who knows better); "auto" (default): the plan decides.
MODE_ENV = "TRAINBOX_MEMORY_PLAN"


@dataclass(frozen=True)
class Job:
    """What the plan is for: the model's shape and the run's settings that weigh on memory."""

    facts: object  # modelfacts.ModelFacts
    batch: int  # per-device micro-batch (rows)
    max_length: int  # tokens per row (packed rows are this long)
    grad_accum: int = 1
    optim: str = "adamw_torch_fused"
    shards: int = 1  # ranks FSDP2 shards over (1: one process per model copy)
    nodes: int = 1
    masters_ok: bool = False  # bf16 weights + float32 masters are possible (one process, a wrapped optimizer)
    # AdamW's moments may be kept smaller than float32 (masters_ok, --optim not fixed): "bf16" (masterstep.py's
    # stochastic rounding), "8bit" (torchao's AdamW8bit, where torchao is installed)
    states_ok: tuple[str, ...] = ()
    extra: int = 0  # bytes beside the trained model (GRPO's reference model)
    tokens: int | None = None  # tokens of one micro-batch when not batch x max_length (GRPO)
    fixed: dict = field(default_factory=dict)  # settings the user chose: checkpointing, reshard, batch
    fsdp: bool = False  # FSDP2 (GPUs, more than one process)
    liger: bool = False  # Liger's fused RMSNorm/RoPE/SwiGLU: the MLP keeps half its activations
    attn: str = ""  # transformers' attn_implementation the job runs ("": a flash kernel; eager, sdpa: memterms.scores)
    optim_args: str | None = None  # the Trainer's --optim_args (SGD's momentum: memterms.optimizer_state_bytes)


@dataclass(frozen=True)
class Settings:
    checkpointing: bool
    masters: bool = False
    # AdamW's moments: "float32", "bf16" (with masters) or "8bit" (torchao; without masters: bf16 weights updated
    # with stochastic rounding)
    states: str = "float32"
    reshard: bool = True  # FSDP2: reshard after forward
    sync_each_batch: bool = False
    batch: int = 1
    grad_accum: int = 1

    def describe(self, job: Job) -> str:
        parts = [f"gradient checkpointing {'on' if self.checkpointing else 'off'}"]
        if job.fsdp:
            parts.append(f"reshard after forward {'on' if self.reshard else 'off'}")
            if self.grad_accum > 1:
                parts.append("gradients synchronised every micro-batch" if self.sync_each_batch
                             else "unsharded float32 gradient accumulation")
        elif job.masters_ok or self.masters:
            parts.append(self.precision())
        if self.batch != job.batch:
            parts.append(f"micro-batch {self.batch} x {self.grad_accum} accumulation steps "
                         f"(was {job.batch} x {job.grad_accum}: the same tokens per step)")
        return ", ".join(parts)

    def precision(self) -> str:
        """The weights and optimizer states of one process per model copy, as the plan line names them."""
        if self.states == "8bit":
            return ("bf16 weights + float32 masters, 8-bit AdamW states (torchao)" if self.masters
                    else "bf16 weights with stochastic rounding, 8-bit AdamW states (torchao)")
        if self.states == "bf16":
            return "bf16 weights + float32 masters, bf16 AdamW states (stochastic rounding)"
        return "bf16 weights + float32 masters" if self.masters else "float32 weights"


# AdamW's two moments, bytes a parameter: float32, bf16, torchao's 8-bit (a byte an element plus a float32 scale per
# block of 256)
STATE_BYTES = {"float32": 8, "bf16": 4, "8bit": 2 + 2 * 4 / 256}


def lowbit_reason() -> str | None:
    """None when torchao's low-bit AdamW can be built here (the rungs that use it are offered), else why not."""
    import importlib.util

    return None if importlib.util.find_spec("torchao") else "torchao is not installed"


def _largest_param(f) -> int:
    """The largest single weight (the embedding or the LM head, else a layer's biggest matrix, bounded by the
    layer): what the per-parameter 8-bit step converts to float32 at a time."""
    head = getattr(f, "vocab", 0) * f.hidden
    return max(head, f.hidden * max(f.intermediate, f.hidden), 1)


def _layer_params(f) -> int:
    head = getattr(f, "vocab", 0) * f.hidden
    untied = f.embedding_params > 0
    body = f.params - head * (2 if untied else 1)
    return max(1, body // max(1, f.layers))


def estimate(job: Job, s: Settings) -> dict:
    """Peak bytes per GPU, term by term (module docstring), their total, and the phase of the step where the peak
    falls ("phase": "backward start", when the activations are all kept, or "backward end", when every gradient
    exists)."""
    f, n, k = job.facts, job.facts.params, max(1, job.shards)
    head = getattr(f, "vocab", 0) * f.hidden
    layer = _layer_params(f)
    tokens = s.batch * job.max_length if job.tokens is None else job.tokens * s.batch // max(1, job.batch)
    acts = activations(job, s, tokens)
    loss = 4 * min(tokens, LOSS_CHUNK_TOKENS) * getattr(f, "vocab", 0) if head else 0
    if head and not job.fsdp:  # losshead's tile (bf16 tiles: 2 bytes a logit)
        loss += 2 * min(tokens, losshead.tile_tokens(f.vocab, 2)) * f.vocab
    extra = {"reference model": job.extra} if job.extra else {}
    optim = _state_bytes(job) // k
    if not job.fsdp:
        if s.states != "float32":  # the memory plan's smaller AdamW moments, whatever --optim says
            optim = int(STATE_BYTES[s.states] * n)
        start, end = _one_process(job, s, n, optim, extra)
        start.update({"activations": acts, "loss head": loss})
    else:
        shard = 4 * n // k
        accum = 4 * n if s.grad_accum > 1 and not s.sync_each_batch else 0
        # Gradients are freed after each optimizer step (set to None): they exist at the start of backward only when
        # an earlier micro-batch of the same step made them.
        grads_early = shard if s.grad_accum > 1 else 0
        gathered = 2 * n if not s.reshard else 2 * 2 * layer + 2 * head
        unit = max(layer, f.embedding_params, head)  # the largest FSDP unit (an untied embedding is its own)
        start = {"weights": shard, "grads": grads_early, "optimizer": optim, "accumulation": accum,
                 "gathered": gathered, "reduce": 2 * 6 * layer, "activations": acts, "loss head": loss, **extra}
        # At the end of backward every sharded gradient exists, and the last unit (the embedding) is gathered with its
        # bf16 gradient and the float32 copy the reduce-scatter sends: 8 bytes per parameter of it.
        end = {"weights": shard, "grads": shard, "optimizer": optim, "accumulation": accum,
               "gathered": 2 * head, "reduce": 8 * unit, **extra}
    at_start = sum(start.values()) >= sum(end.values())
    t: dict = dict(start if at_start else end)
    t["total"] = sum(t.values())
    t["phase"] = "backward start" if at_start else "backward end"
    return t


def _one_process(job: Job, s: Settings, n: int, optim: int, extra: dict) -> tuple[dict, dict]:
    """One process per model copy, the terms of both phases without the activations: float32 weights and gradients
    (TRL's), or bf16 weights + float32 masters (precision.py) whose bf16 gradients are summed in float32 from the
    second micro-batch on. The gradients of a step's first micro-batch exist only once backward made them (the
    optimizer step frees them): at backward start they count from the second micro-batch on."""
    if s.masters:
        weights, grads_end = 6 * n, 2 * n if s.grad_accum == 1 else 4 * n
        # bf16 gradients kept between micro-batches beside the float32 sums (precision.py): measured +4N
        accum = 4 * n if s.grad_accum > 1 else 0
    elif s.states != "float32":  # bf16 weights updated with stochastic rounding: bf16 gradients, summed in bf16
        weights, grads_end, accum = 2 * n, 2 * n, 0
    else:
        weights, grads_end, accum = 4 * n, 4 * n, 0
    grads_start = grads_end if s.grad_accum > 1 else 0
    start = {"weights": weights, "grads": grads_start, "optimizer": optim, "accumulation": accum, **extra}
    end = {"weights": weights, "grads": grads_end, "optimizer": optim, "accumulation": accum, **extra}
    if s.states == "8bit":
        # torchao's step, one weight at a time, holds float32 working copies of the weight it updates (and, under
        # masters, precision.py's float32 copy of its gradient): 8 (12) bytes an element of the largest weight,
        # calibrated on one H200 (8B shape: 81.0 and 49.1 GiB peaks, benchmarks/results/sft8b_one_gpu-2026-12-02.txt)
        end["step"] = (12 if s.masters else 8) * _largest_param(job.facts)
    elif s.masters and s.grad_accum == 1 and s.states == "float32" and job.optim != "adamw_torch_fused":
        end["step"] = 4 * n  # the op-by-op path (no one-pass kernel): float32 copies of every gradient at once
    return start, end


def activations(job: Job, s: Settings, tokens: int) -> int:
    """One micro-batch's activations kept for backward (memterms.py: by layer kind and attention kernel); with
    gradient checkpointing each layer's input (2 x hidden a token) plus one layer recomputed."""
    f = job.facts
    layers = max(1, f.layers)
    kinds = memterms.per_token_layer(f, job.liger)
    per_layer = sum(kinds.values()) // layers  # one layer's share (the recomputed one under checkpointing)
    kept = tokens * (layers * 2 * f.hidden + per_layer if s.checkpointing else sum(kinds.values()))
    rows = max(1, tokens // max(1, job.max_length))
    return kept + memterms.scores(f, job.attn, rows, min(tokens, job.max_length), s.checkpointing)


def resident(job: Job) -> int:
    """Bytes a job holds on each GPU whatever its batch: weights, gradients, optimizer states and what sits beside
    them (job.extra); the estimate less activations and the loss head."""
    t = estimate(job, Settings(checkpointing=True))
    return t["total"] - t.get("activations", 0) - t.get("loss head", 0)


def usable(free: int) -> int:
    """What the plan may fill of `free` bytes: FIT of it less RESERVE, never below 0 (too_little says so)."""
    return max(0, int(FIT * free) - RESERVE)


def too_little(free: int) -> str | None:
    """Why nothing can be planned in `free` bytes a GPU (less than RESERVE's share), or None."""
    if usable(free) > 0:
        return None
    return (f"the GPU has too little free memory: {free / GiB:.1f} GiB, and the plan keeps {RESERVE / GiB:.1f} GiB + "
            f"{100 * (1 - FIT):.0f} % of it for NCCL, cuBLAS and the allocator")


class DoesNotFit(UsageError):
    """decide's refusal: nothing on the ladder fits (bad input is a plain UsageError)."""


def ladder(job: Job) -> list[Settings]:
    """Candidate settings, fastest first, honouring what the user fixed. The loops give the order: the micro-batch
    as asked before its splits (smaller ones do less work per kernel and more collectives), then no checkpointing
    before checkpointing (it recomputes every layer: a third of a step), keeping the gathered layers before
    resharding them (one more all-gather per layer in backward), unsharded accumulation before one reduce-scatter
    per micro-batch, and (one process per model copy) bf16 weights with float32 masters and bf16 AdamW moments
    written with stochastic rounding (14 bytes a parameter; masterstep.py's one pass moves 20 bytes a parameter
    instead of 28: 11.4 vs 14.5 ms on 1.9 B parameters, benchmarks/master_step.py), then with AdamW's own float32
    moments (18), then with torchao's 8-bit moments (12, a slower step), before float32 weights (TRL's path, 16);
    the loss measured alike on each (benchmarks/precision_rungs.py). An --optim you set keeps AdamW's float32
    moments (states_ok is empty). Only when every exact rung fails, with checkpointing too, bf16 weights with
    stochastic rounding and 8-bit states (6 bytes a parameter: an 8B model on an 80 GB card): a lossier update is
    taken after a slower step, not before."""
    fx = job.fixed
    ckpts = [fx["checkpointing"]] if "checkpointing" in fx else [False, True]
    out: list[Settings] = []
    splits = [(job.batch, job.grad_accum)]
    if "batch" not in fx:
        b, g = job.batch, job.grad_accum
        while b > 1 and b % 2 == 0:
            b, g = b // 2, g * 2
            splits.append((b, g))
    # (masters, states): float32 masters with bf16 moments, with AdamW's own, with 8-bit ones; float32 weights
    precisions = ([(True, "bf16")] * ("bf16" in job.states_ok) + [(True, "float32")] * job.masters_ok
                  + [(True, "8bit")] * ("8bit" in job.states_ok) + [(False, "float32")])
    for b, g in splits:
        for c in ckpts:
            if job.fsdp:
                for reshard in ([fx["reshard"]] if "reshard" in fx else [False, True]):
                    for sync in ([False, True] if g > 1 else [False]):
                        out.append(Settings(c, reshard=reshard, sync_each_batch=sync, batch=b, grad_accum=g))
            else:
                out += [Settings(c, masters=m, states=st, batch=b, grad_accum=g) for m, st in precisions]
        if "8bit" in job.states_ok and not job.fsdp:  # every master rung failed: bf16 weights, stochastic rounding
            out += [Settings(c, states="8bit", batch=b, grad_accum=g) for c in ckpts]
    return out


@dataclass(frozen=True)
class Plan:
    settings: Settings
    terms: dict
    free: int
    job: Job
    rung: int  # index in the ladder (0: the fastest)

    @property
    def fits(self) -> bool:
        return self.terms["total"] <= usable(self.free)

    def line(self, free_note: str = "") -> str:
        t = self.terms
        shown = ", ".join(f"{k} {v / GiB:.1f}" for k, v in t.items() if k not in ("total", "phase") and v)
        shown += f"; peak at {t['phase']}" if "phase" in t else ""
        fits = self.fits
        return (f"memory plan: {self.settings.describe(self.job)}; estimate {t['total'] / GiB:.1f} GiB per GPU "
                f"({shown}) {'within' if fits else 'OVER'} {usable(self.free) / GiB:.1f} GiB usable of "
                f"{self.free / GiB:.1f} GiB free" + (f" ({free_note})" if free_note else "")
                + ("" if self.rung >= 0 else f"; {MODE_ENV}=report: taken as is")
                + (f"; {too_little(self.free)}" if too_little(self.free) else ""))


def mode() -> str:
    m = os.environ.get(MODE_ENV, "auto") or "auto"
    if m not in ("auto", "report"):
        raise UsageError(f"{MODE_ENV}={m!r}: expected auto (the plan decides) or report (print it, run the fastest "
                         "settings your options allow)")
    return m


def decide(job: Job, free: int) -> Plan:
    """The first rung of the ladder that fits in `free` bytes per GPU; UsageError naming what fits when none does."""
    rungs = ladder(job)
    if mode() == "report":
        return Plan(rungs[0], estimate(job, rungs[0]), free, job, -1)
    for i, s in enumerate(rungs):
        t = estimate(job, s)
        if t["total"] <= usable(free):
            return Plan(s, t, free, job, i)
    raise DoesNotFit(refusal(job, free, t["total"]))  # t: the last rung's, the least memory the ladder offers


def fits(job: Job, free: int) -> bool:
    return any(estimate(job, s)["total"] <= usable(free) for s in ladder(job))


def refusal(job: Job, free: int, least: int) -> str:
    f = job.facts
    if too_little(free):
        return f"{f.params / 1e9:.1f} B parameters need at least {least / GiB:.1f} GiB per GPU: " + too_little(free)
    head = (f"{f.params / 1e9:.1f} B parameters need at least {least / GiB:.1f} GiB per GPU "
            f"({describe_layout(job)}, {job.optim}) with every memory saving on, and {usable(free) / GiB:.1f} "
            f"GiB of {free / GiB:.1f} GiB free are usable")
    return head + ": " + advice(job, free)


def describe_layout(job: Job) -> str:
    if job.shards <= 1:
        return "one GPU"
    return f"FSDP2 over {job.shards} GPUs" + (f" on {job.nodes} nodes" if job.nodes > 1 else "")


def gpu_counts(job: Job, limit: int = 4096):
    """The GPU counts more_gpus tries, smallest first: on one node, more of its GPUs (up to 8, or the job's own count
    per node where larger), then whole nodes of that many; a job that spans nodes, whole nodes of its GPUs per node
    (16 = 2 x 8, never 9 or 17)."""
    node = _node_size(job)
    if job.nodes <= 1:
        yield from range(max(2, job.shards + 1), min(node, limit) + 1)
    for nodes in range(2 if job.nodes <= 1 else job.nodes + 1, limit // node + 1):
        yield nodes * node


def _node_size(job: Job) -> int:
    """GPUs a node: the job's own where it spans nodes, else at least 8 (a node has more than the job may use)."""
    per_node = max(1, job.shards // max(1, job.nodes))
    return per_node if job.nodes > 1 else max(per_node, 8)


def more_gpus(job: Job, free: int, limit: int = 4096) -> int | None:
    """The smallest GPU count (gpu_counts: whole nodes once it spans nodes) on which it fits."""
    node = _node_size(job)
    for g in gpu_counts(job, limit):
        if fits(replace(job, shards=g, fsdp=True, masters_ok=False, nodes=-(-g // node)), free):
            return g
    return None


def _state_bytes(job: Job, optim: str | None = None) -> int:
    f = job.facts
    return memterms.optimizer_state_bytes(optim or job.optim, f.params, getattr(f, "factored_state", 0),
                                          job.optim_args if optim is None else None)


def qlora_estimate(job: Job) -> int:
    """Peak bytes per GPU of `trainbox qlora` on this job's model and layout at its smallest micro-batch (one row,
    checkpointing on: qlora's defaults): the 4-bit base (nf4 with nested quantisation: about 0.53 bytes a matmul
    parameter; the embeddings and LM head stay bf16), LoRA r=16 on every linear layer (under 1 % of the parameters,
    16 bytes each with AdamW and their gradients), one row's activations and the loss head. Only to decide whether
    the refusal may offer qlora: qlora itself does not plan."""
    f, k = job.facts, max(1, job.shards)
    head = getattr(f, "vocab", 0) * f.hidden
    embed = head + f.embedding_params
    base = int(0.53 * max(0, f.params - embed)) + 2 * embed
    adapters = 16 * f.params // 100
    one_row = replace(job, batch=1, grad_accum=1, tokens=None, fixed={}, optim="adamw_torch_fused", extra=0)
    t = estimate(one_row, Settings(checkpointing=True))
    return (base + adapters) // k + t.get("activations", 0) + t.get("loss head", 0) + job.extra


def advice(job: Job, free: int) -> str:
    """The smallest changes that fit, each checked with this plan: an 8-bit optimizer, more GPUs, or QLoRA (its own
    estimate, qlora_estimate)."""
    options = []
    # bitsandbytes' 8-bit optimizers don't step FSDP2's DTensors; torchao's do (the same 2 bytes a parameter)
    eight = "adamw_torch_8bit" if job.fsdp else "adamw_bnb_8bit"
    if (not job.fsdp or lowbit_reason() is None) and _state_bytes(job) > _state_bytes(job, eight):
        if fits(replace(job, optim=eight, optim_args=None, masters_ok=False, states_ok=()), free):
            options.append(f"--optim {eight} (8-bit optimizer states" + (", torchao's" if job.fsdp else "") + ")")
    g = more_gpus(job, free)
    if g:
        options.append(f"{g} GPUs like these (FSDP2 shards the weights, gradients and optimizer states: "
                       + ("--nnodes/--nproc-per-node" if job.shards <= 1 else "more nodes or GPUs per node") + ")")
    if qlora_estimate(job) <= usable(free):
        options.append("`trainbox qlora` (a 4-bit base with LoRA adapters)")
    if not options:
        return ("nothing this plan knows fits: not more GPUs (up to 4096), an 8-bit optimizer or `trainbox qlora`; "
                "use a smaller model or GPUs with more memory")
    return "it fits with " + ", or ".join(options)


def free_memory() -> int | None:
    """This process's GPU's free bytes (the device of its LOCAL_RANK, read explicitly: the current device may not be
    set yet), or None without a GPU. TRAINBOX_GPU_FREE_GIB caps it."""
    import torch

    if not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info(torch.device("cuda", ranks.local_rank()))
    return cap(free)


def hold_to_cap() -> str | None:
    """With TRAINBOX_GPU_FREE_GIB set, this process's caching allocator held to that much (torch's per-process memory
    fraction of its GPU), so a run planned for a smaller card also allocates no more than that card has: it fails
    where the card would, instead of borrowing the big GPU's memory (the 12 GB QLoRA run, which has no memory plan to
    cap, reserved 11.1 GiB under a cap of 11). The line to print, or None (not set, or no GPU)."""
    if not os.environ.get(FREE_ENV):
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    dev = torch.device("cuda", ranks.local_rank())
    total = torch.cuda.get_device_properties(dev).total_memory
    held = cap(total)
    torch.cuda.set_per_process_memory_fraction(min(1.0, held / total), dev)
    return f"GPU memory held to {held / GiB:.1f} GiB of {total / GiB:.1f} ({FREE_ENV}: torch's per-process fraction)"


def cap(free: int) -> int:
    raw = os.environ.get(FREE_ENV)
    if not raw:
        return free
    try:
        gib = float(raw)
    except ValueError:
        raise UsageError(f"{FREE_ENV}={raw!r}: not a number (GiB of free memory per GPU to plan for)") from None
    if not 0 < gib < float("inf"):  # (NaN compares false)
        raise UsageError(f"{FREE_ENV}={raw!r}: must be a positive number of GiB")
    return min(free, int(gib * GiB))


def agree(local_free: int | None, decide_fn):
    """One decision for the whole process group: every rank's free memory is reduced to the smallest, rank 0 runs
    `decide_fn(smallest, (smallest, largest, ranks))` and broadcasts its result (or its refusal) to every rank.
    Without a process group of more than one rank, decides locally. Returns decide_fn's result; raises the same
    UsageError on every rank when rank 0's decision was a refusal."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return decide_fn(local_free, (local_free, local_free, 1))
    backend = dist.get_backend()
    dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    known = -1 if local_free is None else int(local_free)
    lo = torch.tensor([known], dtype=torch.int64, device=dev)
    hi = lo.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    smallest = None if int(lo.item()) < 0 else int(lo.item())
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", decide_fn(smallest, (smallest, int(hi.item()), dist.get_world_size())))
        except UsageError as e:
            box[0] = ("refused", str(e))
    dist.broadcast_object_list(box, src=0, device=dev)
    kind, value = box[0]
    if kind == "refused":
        raise UsageError(value)
    return value
