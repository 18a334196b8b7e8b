"""The master-weight AdamW step (precision.py) in one pass over memory: one Triton kernel per parameter dtype.

torch's fused AdamW, the Trainer's default optimizer, updates float32 tensors from float32 gradients. Around it the
master-weight step made three more passes over every parameter: the bf16 gradient cast into a float32 .grad, the
clipping multiply, and the copy of the updated float32 master into the bf16 weight (20 of the 48 bytes a parameter
the step moved). Here one kernel reads the gradient as autograd made it (bf16; float32 where micro-batches were
summed), scales it by the clipping factor, applies AdamW as torch's fused kernel does (float32 math; bias corrections
in float64 from each parameter's own step count) and writes the master, both moments and the bf16 weight: 28 bytes.
Its state is the inner torch.optim.AdamW's own (the same tensors, initialised as its fused path does), so a
checkpoint, a resume and the op-by-op path read it alike.

bf16 moments (`moments=torch.bfloat16`, the memory plan's rung between AdamW's own float32 states and torchao's 8-bit
ones: 12 bytes a parameter instead of 16-18, and still one pass): both moments are kept in bf16 and written with
stochastic rounding (16 random bits added below the bf16 mantissa, then truncated: unbiased, so the second moment's
0.1 % updates are not rounded away as they would be by round-to-nearest). DeepSeek-V3 keeps its AdamW moments in
bf16 too. Why not torchao's 8-bit AdamW here: one compiled call per weight, measured on an H200 at 140 ms of
Python/dispatch per step for a 0.45 B model (4.6 vs 12.7 steps/s, benchmarks/precision_rungs.py) and 1.08x TRL at
8B, where this kernel moves 24 bytes a parameter in one launch. reference_step is the same update in torch ops
(the CPU, and the fallback when the kernel can't run).

Taken only where it is the same update: torch's AdamW with fused=True (the Trainer's `adamw_torch_fused`), no
amsgrad/maximize/differentiable, Python-number hyper-parameters, every tensor contiguous on one CUDA device and
Triton importable. Anything else (other optimizers, CPU) is precision.py's op-by-op path. A kernel that fails to
compile says so once and the op-by-op path takes over.
"""

from __future__ import annotations

import functools

import torch

from trainbox.training.kernels import compilefail

BLOCK = 1024  # elements a program updates
WARPS = 4  # 8 elements a thread: one 16-byte load of bf16, two of float32
_OFF: list[str] = []  # the compile failure that turned this path off, once


def usable(inner: torch.optim.Optimizer) -> bool:
    """The optimizer and options this kernel reproduces; the tensors are checked at each step (tensors_ok)."""
    if _OFF or type(inner) is not torch.optim.AdamW:
        return False
    for g in inner.param_groups:
        if not g.get("fused") or g.get("amsgrad") or g.get("maximize") or g.get("differentiable"):
            return False
        if any(isinstance(g[k], torch.Tensor) for k in ("lr", "weight_decay", "eps")):
            return False
        if any(isinstance(b, torch.Tensor) for b in g["betas"]):
            return False
    return True


def tensors_ok(weights, grads, masters) -> bool:
    """One CUDA device, contiguous, shapes alike, dtypes the kernel has: what its flat indexing needs."""
    if not weights:
        return True
    device = weights[0].device
    if device.type != "cuda":
        return False
    return all(t.device == device and t.is_contiguous() and t.dtype in _TL and t.data_ptr() % 16 == 0
               for ts in (weights, grads, masters) for t in ts) and all(
        g.shape == m.shape == w.shape for w, g, m in zip(weights, grads, masters))


def init_state(inner: torch.optim.AdamW, master: torch.Tensor, moments: torch.dtype | None = None) -> dict:
    """The inner optimizer's state of `master`, created as torch's fused AdamW creates it on its first step (the
    moments in `moments`' dtype when given)."""
    state = inner.state[master]
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
        state["exp_avg"] = torch.zeros_like(master, dtype=moments, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(master, dtype=moments, memory_format=torch.preserve_format)
    return state


def round_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """float32 -> bf16 with stochastic rounding: E[round_bf16(x)] = x (the kernel's rule, in torch ops)."""
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    return ((x.contiguous().view(torch.int32) + noise) & -65536).view(torch.float32).to(torch.bfloat16)


@torch.no_grad()
def reference_step(inner: torch.optim.AdamW, group: dict, weights, grads, masters, scale: torch.Tensor | None,
                   moments: torch.dtype, generator: torch.Generator | None = None) -> None:
    """The kernel's update with `moments`-typed states in torch ops, one weight at a time (float32 math)."""
    beta1, beta2 = group["betas"]
    lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
    for w, g, m in zip(weights, grads, masters):
        state = init_state(inner, m, moments)
        state["step"] += 1
        t = float(state["step"])
        g = g.float() * scale if scale is not None else g.float()
        a = state["exp_avg"].float().mul_(beta1).add_(g, alpha=1 - beta1)
        v = state["exp_avg_sq"].float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
        m.mul_(1 - lr * wd)
        m.addcdiv_(a, (v.sqrt() / (1 - beta2**t) ** 0.5).add_(eps), value=-lr / (1 - beta1**t))
        for name, value in (("exp_avg", a), ("exp_avg_sq", v)):
            state[name].copy_(round_bf16(value, generator) if moments == torch.bfloat16 else value)
        w.copy_(m)


def step(inner: torch.optim.AdamW, group: dict, weights, grads, masters, scale: torch.Tensor | None,
         moments: torch.dtype | None = None, seed: int = 0) -> bool:
    """One AdamW step of `group` (an inner param group's options) over the (weight, gradient, master) triples; the
    gradients times `scale` (clipping, a 0-d float32 tensor) when given; the moments in bf16 with stochastic rounding
    (seeded by `seed`, different at each step) when `moments` is torch.bfloat16. False, with nothing changed, when
    the kernel could not run (the caller takes the op-by-op path)."""
    states = [init_state(inner, m, moments) for m in masters]
    steps = [s["step"] for s in states]
    beta1, beta2 = group["betas"]
    lr = float(group["lr"])
    scale = scale if scale is not None else torch.ones((), dtype=torch.float32, device=weights[0].device)
    by_dtype: dict[tuple, list[int]] = {}
    for i, (w, g) in enumerate(zip(weights, grads)):
        by_dtype.setdefault((w.dtype, g.dtype), []).append(i)
    adt = states[0]["exp_avg"].dtype if states else torch.float32
    if adt not in _TL or any(s["exp_avg"].dtype != adt or s["exp_avg_sq"].dtype != adt for s in states):
        return False
    try:
        for (wdt, gdt), idx in by_dtype.items():
            lists = [[weights[i] for i in idx], [grads[i] for i in idx], [masters[i] for i in idx],
                     [states[i]["exp_avg"] for i in idx], [states[i]["exp_avg_sq"] for i in idx]]
            # Per parameter, from its step count after this step (as torch: bias corrections in float64).
            after = torch.stack([steps[i] for i in idx]).double() + 1
            coefs = torch.stack([lr / (1 - beta1 ** after), torch.sqrt(1 - beta2 ** after)]).float()
            _launch(lists, coefs, scale, lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"],
                    lr_wd=lr * group["weight_decay"], wdt=wdt, gdt=gdt, adt=adt, seed=seed)
    except Exception as error:  # noqa: BLE001 - a compiler failure falls back; the step's own errors pass
        if not compilefail.report(error, "the one-pass master-weight AdamW kernel",
                                  "the optimizer steps op by op (torch's fused AdamW)"):
            raise
        _OFF.append(type(error).__name__)
        return False
    torch._foreach_add_(steps, 1)
    return True


def _launch(lists, coefs, scale, *, lr, beta1, beta2, eps, lr_wd, wdt, gdt, adt=torch.float32, seed=0) -> None:
    import triton.language as tl

    n = len(lists[0])
    device = lists[0][0].device
    # The tensors' addresses, rows weight/grad/master/exp_avg/exp_avg_sq; pinned so the copy is asynchronous.
    table = torch.tensor([t.data_ptr() for ts in lists for t in ts], dtype=torch.int64).pin_memory()
    table = table.to(device, non_blocking=True)
    kernel = _kernel()
    # Whole blocks without a mask (a mask on a size the compiler cannot see stops it vectorising the loads), then
    # each tensor's last partial block with one.
    with torch.cuda.device(device):  # Triton launches on the current device
        for tensors, offsets, masked in _programs(tuple(t.numel() for t in lists[0]), BLOCK, device):
            if tensors.numel():
                kernel[(tensors.numel(),)](table, tensors, offsets, coefs, scale, n, lr, beta1, beta2, eps, lr_wd,
                                           seed & 0x7FFFFFFF, W=getattr(tl, _TL[wdt]), G=getattr(tl, _TL[gdt]),
                                           A=getattr(tl, _TL[adt]), SR=adt == torch.bfloat16, BLOCK=BLOCK,
                                           MASKED=masked, num_warps=WARPS)


@functools.lru_cache(maxsize=16)
def _programs(numels: tuple[int, ...], block: int, device: torch.device):
    """Per program, its tensor, first element and (for the masked launch) the tensor's size: whole blocks, then
    tails. The sizes never change in a run, so this is built once."""
    whole_t, whole_o, tail_t, tail_o, tail_n = [], [], [], [], []
    for i, k in enumerate(numels):
        full = k // block
        whole_t += [i] * full
        whole_o += range(0, full * block, block)
        if k % block:
            tail_t.append(i)
            tail_o.append(full * block)
            tail_n.append(k)
    return [(torch.tensor(whole_t, dtype=torch.int32, device=device),
             torch.tensor(whole_o, dtype=torch.int64, device=device), False),
            (torch.tensor(tail_t, dtype=torch.int32, device=device),
             torch.tensor(tail_o + tail_n, dtype=torch.int64, device=device), True)]


_TL = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}  # Triton's names


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def adamw_master(table, tensors, offsets, coefs, scale_ptr, n, lr, beta1, beta2, eps, lr_wd, seed,
                     W: tl.constexpr, G: tl.constexpr, A: tl.constexpr, SR: tl.constexpr, BLOCK: tl.constexpr,
                     MASKED: tl.constexpr):
        pid = tl.program_id(0)
        t = tl.load(tensors + pid)
        offs = tl.multiple_of(tl.load(offsets + pid), BLOCK) + tl.arange(0, BLOCK)
        # Every address is 16-byte aligned (tensors_ok): the loads and stores can be vectors.
        w_ptr = tl.multiple_of(tl.load(table + t), 16).to(tl.pointer_type(W))
        g_ptr = tl.multiple_of(tl.load(table + n + t), 16).to(tl.pointer_type(G))
        m_ptr = tl.multiple_of(tl.load(table + 2 * n + t), 16).to(tl.pointer_type(tl.float32))
        a_ptr = tl.multiple_of(tl.load(table + 3 * n + t), 16).to(tl.pointer_type(A))
        v_ptr = tl.multiple_of(tl.load(table + 4 * n + t), 16).to(tl.pointer_type(A))
        if MASKED:
            mask = offs < tl.load(offsets + tl.num_programs(0) + pid)
        else:
            mask = None
        step_size = tl.load(coefs + t)
        bc2_sqrt = tl.load(coefs + n + t)
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32) * tl.load(scale_ptr)
        m = tl.load(m_ptr + offs, mask=mask)
        a = tl.load(a_ptr + offs, mask=mask).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
        m = m - lr_wd * m
        a = beta1 * a + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        # IEEE square root and division, as torch's kernel (Triton's defaults are approximate).
        m = m - tl.div_rn(step_size * a, tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps)
        tl.store(m_ptr + offs, m, mask=mask)
        if SR:  # 16 random bits added below bf16's mantissa, then cut: rounds up with the probability of the rest
            # The bits: one 32-bit integer hash of (element, tensor, step) a element, its halves for the two moments
            # ("lowbias32", two multiplies and three shift-xors). Philox (tl.randint4x) made this 51.7 ms an 8B step
            # where the bytes take 39: compute-bound (benchmarks/master_step.py: results/sft8b_one_gpu-2026-12-03).
            x = offs.to(tl.uint32) ^ ((seed + t * 7919).to(tl.uint32) * 0x9E3779B9)
            x = (x ^ (x >> 16)) * 0x7FEB352D
            x = (x ^ (x >> 15)) * 0x846CA68B
            x = x ^ (x >> 16)
            a = ((a.to(tl.uint32, bitcast=True) + (x & 0xFFFF)) & 0xFFFF0000).to(tl.float32, bitcast=True)
            v = ((v.to(tl.uint32, bitcast=True) + (x >> 16)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        tl.store(a_ptr + offs, a.to(A), mask=mask)
        tl.store(v_ptr + offs, v.to(A), mask=mask)
        tl.store(w_ptr + offs, m.to(W), mask=mask)

    return adamw_master
