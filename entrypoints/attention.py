"""Which attention kernel the trainers use: the image record's backend first, then the next one that runs here.

One decision for `doctor` and the trainers (`decide` is pure; `choose` feeds it what this process can import and
run). Order by image record:

    fa3 (Hopper images)    FA3 -> FA4 -> FA2 -> PyTorch varlen flash -> SDPA
    fa2 (Ampere images)    FA2 -> PyTorch varlen flash -> SDPA
    sdpa (Blackwell, CPU)  FA4 -> PyTorch varlen flash -> SDPA

"PyTorch varlen flash" is torch's own FlashAttention kernel behind `torch.nn.attention.varlen.varlen_attn` (torch >=
2.10, sm80+), registered here as the transformers attention `trainbox_varlen`: like the flash-attn packages it takes
the cumulative sequence lengths of a packed batch, so padding-free training needs no flash-attn wheel. Every kernel
but SDPA is tried on a tiny forward+backward before it is chosen: a wheel built for another torch or GPU falls
through to the next one with the reason printed. `--attn_implementation` always wins.
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass, field
from importlib import metadata
from typing import Callable

VARLEN = "trainbox_varlen"


@dataclass(frozen=True)
class Kernel:
    impl: str  # transformers' attn_implementation
    label: str
    min_cc: tuple[int, int] | None = None
    max_cc: tuple[int, int] | None = None
    packed: bool = True  # takes packed rows (cu_seqlens / position_ids) without attending across examples


KERNELS = {
    "fa3": Kernel("flash_attention_3", "FlashAttention 3", (9, 0), (9, 9)),
    "fa4": Kernel("flash_attention_4", "FlashAttention 4 (CuTe)", (9, 0), (12, 9)),
    "fa2": Kernel("flash_attention_2", "FlashAttention 2", (8, 0), (9, 9)),
    "varlen": Kernel(VARLEN, "PyTorch varlen flash attention", (8, 0), None),
    # SDPA keeps packed examples apart only through a dense block mask (transformers builds it from position_ids):
    # correct, but quadratic in the packed row, so the trainers pack for SDPA only on CPU.
    "sdpa": Kernel("sdpa", "PyTorch SDPA", None, None, packed=False),
}
ORDER = {
    "fa3": ("fa3", "fa4", "fa2", "varlen", "sdpa"),
    "fa2": ("fa2", "varlen", "sdpa"),
    "sdpa": ("fa4", "varlen", "sdpa"),
}
# Names a user may pass to --attn_implementation besides transformers' own.
ALIASES = {name: k.impl for name, k in KERNELS.items()}


@dataclass(frozen=True)
class Choice:
    name: str  # key of KERNELS, or "user" for an --attn_implementation we don't know
    impl: str
    reason: str
    skipped: tuple[tuple[str, str], ...] = field(default=())

    @property
    def packed(self) -> bool:
        return KERNELS[self.name].packed if self.name in KERNELS else self.impl.startswith("flash_attention")

    def line(self) -> str:
        label = KERNELS[self.name].label if self.name in KERNELS else self.impl
        why = "; ".join(f"{KERNELS[n].label}: {r}" for n, r in self.skipped)
        return f"attention: {label} ({self.impl}): {self.reason}" + (f"; skipped {why}" if why else "")


def order(info: dict | None) -> tuple[str, ...]:
    return ORDER.get((info or {}).get("attention_backend") or "sdpa", ORDER["sdpa"])


def decide(info: dict | None, capability: tuple[int, int] | None, usable: Callable[[str], str | None],
           requested: str | None = None) -> Choice:
    """The kernel for a GPU of `capability` (None: no GPU). `usable(name)` returns None when the kernel imports and
    runs here, else why not. `requested` (the user's --attn_implementation) wins without checks."""
    if requested:
        impl = ALIASES.get(requested, requested)
        name = next((n for n, k in KERNELS.items() if k.impl == impl), "user")
        return Choice(name, impl, "set by --attn_implementation")
    wanted = (info or {}).get("attention_backend") or "sdpa"
    if capability is None:
        return Choice("sdpa", "sdpa", "no GPU")
    skipped = []
    for name in order(info):
        k = KERNELS[name]
        sm = f"sm{capability[0]}{capability[1]}"
        if k.min_cc and capability < k.min_cc or k.max_cc and capability > k.max_cc:
            if name == wanted:
                skipped.append((name, f"needs {_span(k)}; this GPU is {sm}"))
            continue
        why = None if name == "sdpa" else usable(name)  # SDPA is torch itself: always there
        if why is None:
            if info is None:
                reason = "no image record: the best that runs here"
            elif name == wanted:
                reason = "the image's default"
            else:
                reason = f"first that runs here after the image's {wanted}"
            return Choice(name, k.impl, reason, tuple(skipped))
        if name == wanted or name in ("fa2", "varlen"):  # worth telling; optional extras (fa4) are not
            skipped.append((name, why))
    return Choice("sdpa", "sdpa", "nothing else runs here", tuple(skipped))


def _span(k: Kernel) -> str:
    if k.min_cc == (9, 0) and k.max_cc == (9, 9):
        return "a Hopper GPU (sm90)"
    lo = f"sm{k.min_cc[0]}{k.min_cc[1]}" if k.min_cc else ""
    hi = f"sm{k.max_cc[0]}x" if k.max_cc else ""
    return f"{lo} to {hi}" if lo and hi else f"{lo} or newer" if lo else f"up to {hi}"


# ---------------------------------------------------------------------------------------------------------------
# What runs in this process
# ---------------------------------------------------------------------------------------------------------------
def _dist_installed(*names: str) -> bool:
    for n in names:
        try:
            metadata.version(n)
            return True
        except metadata.PackageNotFoundError:
            continue
    return False


def _try_kernel(fn) -> str | None:
    """Run fn(q, k, v) -> out forward and backward on a tiny packed bf16 batch; None if it works."""
    import torch

    try:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(256, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
                   for _ in range(3))
        out = fn(q, k, v)
        out.float().sum().backward()
        if not bool(torch.isfinite(out).all()) or q.grad is None or not bool(torch.isfinite(q.grad).all()):
            return "its test op gave non-finite values"
    except Exception as e:  # noqa: BLE001 - any failure means "use the next kernel"
        return f"test op failed ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})"
    return None


def _cu(n: int = 256):
    import torch

    return torch.tensor([0, 100, n], device="cuda", dtype=torch.int32)


def runtime_usable(name: str) -> str | None:
    """None when kernel `name` imports and runs on this GPU, else the reason."""
    if name == "sdpa":
        return None
    if name == "fa3":
        if importlib.util.find_spec("flash_attn_interface") is None or not _dist_installed("flash-attn-3", "flash_attn_3"):
            return "not installed (flash-attn-3)"
        from flash_attn_interface import flash_attn_varlen_func as f

        return _try_kernel(lambda q, k, v: _first(f(q, k, v, _cu(), _cu(), 156, 156, causal=True)))
    if name == "fa4":
        if not _dist_installed("flash-attn-4"):
            return "not installed (flash-attn-4)"
        from flash_attn.cute import flash_attn_varlen_func as f

        return _try_kernel(lambda q, k, v: _first(f(q, k, v, cu_seqlens_q=_cu(), cu_seqlens_k=_cu(), causal=True)))
    if name == "fa2":
        if not _dist_installed("flash-attn", "flash_attn"):
            return "not installed (flash-attn)"
        from flash_attn import flash_attn_varlen_func as f

        return _try_kernel(lambda q, k, v: _first(f(q, k, v, _cu(), _cu(), 156, 156, causal=True)))
    if name == "varlen":
        fn = _varlen_fn()
        if fn is None:
            return "this torch has no torch.nn.attention.varlen"
        return _try_kernel(lambda q, k, v: _varlen_call(fn, q, k, v, _cu(), _cu(), 156, 156, None))
    return f"unknown kernel {name}"


def _first(r):
    return r[0] if isinstance(r, tuple) else r


def choose(requested: str | None = None, info: dict | None = None) -> Choice:
    """The kernel for this process's GPU (device 0 of what it sees), registering ours when chosen."""
    import torch

    from . import imageinfo

    info = imageinfo.load() if info is None else info
    cc = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    choice = decide(info, cc, runtime_usable, requested)
    if choice.impl == VARLEN:
        register_varlen()
    return choice


# ---------------------------------------------------------------------------------------------------------------
# torch's varlen FlashAttention as a transformers attention function
# ---------------------------------------------------------------------------------------------------------------
def _varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _varlen_call(fn, q, k, v, cu_q, cu_k, max_q, max_k, scale):
    """q/k/v (tokens, heads, dim). torch 2.10/2.11 say causal with `is_causal`, 2.12+ with a window; GQA likewise."""
    params = inspect.signature(fn).parameters
    kw = {}
    if "scale" in params:
        kw["scale"] = scale
    elif scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-6:
        raise ValueError(f"this torch's varlen_attn has no `scale` and the model scales by {scale}")
    if "window_size" in params:
        kw["window_size"] = (-1, 0)
    else:
        kw["is_causal"] = True
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return fn(q, k, v, cu_q, cu_k, int(max_q), int(max_k), **kw)


def varlen_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """transformers attention interface: query/key/value (batch, heads, seq, dim) -> ((batch, seq, heads, dim), None).

    Packed rows (TRL's padding-free collator passes cu_seq_lens_*/max_length_*, or position_ids restart at 0) go
    through the varlen kernel, so no example attends to another; unpacked rows without padding use SDPA's causal
    kernel; a padded batch (2-D mask, e.g. evaluation) uses SDPA with that mask.
    """
    import torch
    import torch.nn.functional as F

    b, h, s, d = query.shape
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    pos = kwargs.get("position_ids")
    if cu_q is None and attention_mask is None and pos is not None and b == 1 and s > 1 and query.is_cuda:
        # No boundaries given: packed only if the positions restart (a host sync, like transformers' flash path).
        from transformers.modeling_flash_attention_utils import (
            _is_packed_sequence,
            prepare_fa_kwargs_from_position_ids,
        )

        if _is_packed_sequence(pos, b):
            (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(pos)
    dtype = query.dtype
    if dtype not in (torch.float16, torch.bfloat16):  # fp32 activations outside autocast: the kernel wants 16 bits
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else torch.bfloat16
    if cu_q is not None and b == 1 and attention_mask is None:
        q, k, v = (t.transpose(1, 2)[0].to(dtype) for t in (query, key, value))
        out = _varlen_call(_varlen_fn(), q, k, v, cu_q.to(torch.int32), (cu_k if cu_k is not None else cu_q).to(torch.int32),
                           max_q, max_k if max_k is not None else max_q, scaling)
        return out.unsqueeze(0).to(query.dtype), None
    causal = module.is_causal if is_causal is None else is_causal
    mask = None
    if attention_mask is not None:  # 2-D padding mask (flash-style masks are passed through as given)
        keep = attention_mask.bool()[:, None, None, :]
        mask = keep & torch.ones(s, key.shape[2], dtype=torch.bool, device=query.device).tril(key.shape[2] - s) \
            if causal else keep
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                         is_causal=bool(causal and mask is None and s > 1),
                                         enable_gqa=key.shape[1] != h)
    return out.transpose(1, 2).contiguous(), None


def register_varlen() -> None:
    """Make `attn_implementation="trainbox_varlen"` known to transformers (attention + its flash-style mask)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(VARLEN, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN, flash_attention_mask)
