"""Which attention kernel the trainers use: the image record's backend first, then the next one that runs here.

One decision for `doctor` and the trainers (`decide` is pure; `choose` feeds it what this process can import and
run). Order by image record:

    fa3 (Hopper images)    FA3 -> FA4 -> FA2 -> PyTorch varlen flash -> FlexAttention -> SDPA -> eager
    fa2 (Ampere images)    FA2 -> PyTorch varlen flash -> FlexAttention -> SDPA -> eager
    sdpa (Blackwell, CPU)  FA4 -> PyTorch varlen flash -> FlexAttention -> SDPA -> eager
    no GPU                 SDPA -> FlexAttention's dense math -> eager

"PyTorch varlen flash" is torch's own FlashAttention kernel behind `torch.nn.attention.varlen.varlen_attn` (torch >=
2.10, sm80+), registered here as the transformers attention `trainbox_varlen`: like the flash-attn packages it takes
the cumulative sequence lengths of a packed batch, so padding-free training needs no flash-attn wheel.
"FlexAttention" is torch's compiled FlexAttention kernel (flexattn.py, registered as `trainbox_flex`): packed rows
with windows, softcaps and sinks, so the models the other kernels would change (Gemma 2 without FA3, gpt-oss
everywhere) train packed instead of padded on eager. Without a GPU it runs the same masks as dense math, packed too.
Every kernel but SDPA is tried on a tiny forward+backward before it is chosen: a wheel built for another torch or GPU
falls through to the next one with the reason printed. `--attn_implementation` always wins.

The choice sees the model (`Needs`): a kernel that would drop a sliding window, an attention-logit softcap or
attention sinks is skipped with the reason printed, never used. Each kernel honours what its table entry says: the
flash-attn packages take windows and softcaps (transformers passes them), torch's varlen kernel a window (torch >=
2.12, checked against SDPA on a tiny batch before it is trusted), SDPA a window through transformers' mask, and
eager (the model's own code) everything. transformers' SDPA silently ignores softcaps and sinks.
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass, field
from importlib import metadata
from typing import Callable

from common import errors

VARLEN = "trainbox_varlen"
FLEX = "trainbox_flex"  # flexattn.FLEX


@dataclass(frozen=True)
class Kernel:
    impl: str  # transformers' attn_implementation
    label: str
    min_cc: tuple[int, int] | None = None
    max_cc: tuple[int, int] | None = None
    packed: bool = True  # takes packed rows (cu_seqlens / position_ids) without attending across examples
    honours: frozenset[str] = frozenset()  # of Needs.FEATURES this kernel applies (the rest it would drop)


WINDOW, SOFTCAP, SINKS = "window", "softcap", "sinks"
KERNELS = {
    "fa3": Kernel("flash_attention_3", "FlashAttention 3", (9, 0), (9, 9), honours=frozenset({WINDOW, SOFTCAP})),
    # FA4 takes windows, but its CuTe backward for them is new: trusted for plain causal attention only.
    "fa4": Kernel("flash_attention_4", "FlashAttention 4 (CuTe)", (9, 0), (12, 9)),
    "fa2": Kernel("flash_attention_2", "FlashAttention 2", (8, 0), (9, 9), honours=frozenset({WINDOW, SOFTCAP})),
    "varlen": Kernel(VARLEN, "PyTorch varlen flash attention", (8, 0), None, honours=frozenset({WINDOW})),
    "flex": Kernel(FLEX, "PyTorch FlexAttention", (8, 0), None,
                   honours=frozenset({WINDOW, SOFTCAP, SINKS})),
    "sdpa": Kernel("sdpa", "PyTorch SDPA", None, None, packed=False, honours=frozenset({WINDOW})),
    "eager": Kernel("eager", "eager (the model's own attention)", None, None, packed=False,
                    honours=frozenset({WINDOW, SOFTCAP, SINKS})),
}
# Why the trainers never pack for SDPA or eager (TRL's rule too): they see packed examples only through the mask the
# model builds, and not every model builds it from position_ids (gpt-oss's doesn't: packed examples then attend to
# each other, measured on the test zoo); where one does, the mask is quadratic in the packed row.
UNPACKED_WHY = "SDPA and eager keep packed examples apart only if the model's mask follows the positions, not a given"
ORDER = {
    "fa3": ("fa3", "fa4", "fa2", "varlen", "flex", "sdpa", "eager"),
    "fa2": ("fa2", "varlen", "flex", "sdpa", "eager"),
    "sdpa": ("fa4", "varlen", "flex", "sdpa", "eager"),
}
# Without a GPU FlexAttention is its dense math (torch has no FlexAttention backward on CPU): after SDPA, so only the
# models SDPA would change get it, and they train packed like on a GPU.
CPU_ORDER = ("sdpa", "flex", "eager")
CPU_FLEX = "no GPU: FlexAttention's masks and softcap/sinks as dense math (torch has no FlexAttention backward on CPU)"


@dataclass(frozen=True)
class Needs:
    """What a model's attention does beyond causal softmax(QK^T/sqrt(d))V: a sliding window (on some or all layers),
    tanh softcapping of the attention logits, learned attention sinks (gpt-oss)."""

    window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    head_dim: int | None = None  # not a feature: the size a compiled kernel is tried at before it is trusted

    def features(self) -> frozenset[str]:
        return frozenset(f for f, on in ((WINDOW, self.window), (SOFTCAP, self.softcap), (SINKS, self.sinks)) if on)

    def describe(self, features) -> str:
        says = {WINDOW: f"a {self.window}-token sliding window", SOFTCAP: f"attention logits softcapped at {self.softcap}",
                SINKS: "attention sinks"}
        return ", ".join(says[f] for f in (WINDOW, SOFTCAP, SINKS) if f in features)


def needs(conf, model=None) -> Needs:
    """The Needs of a transformers config (its text config for multimodal ones); `model` (e.g. built on the meta
    device) adds sinks found as parameters."""
    text = conf.get_text_config() if hasattr(conf, "get_text_config") else conf
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        window = None  # e.g. Qwen2/3 with use_sliding_window off: every layer is full attention
    softcap = getattr(text, "attn_logit_softcapping", None)
    sinks = getattr(text, "model_type", "") == "gpt_oss" or (
        model is not None and any(n.rsplit(".", 1)[-1] in ("sinks", "s_aux") for n, _ in model.named_parameters()))
    heads = getattr(text, "num_attention_heads", 0)
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else None)
    return Needs(window=int(window) if window else None, softcap=float(softcap) if softcap else None, sinks=sinks,
                 head_dim=int(head_dim) if head_dim else None)
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
           requested: str | None = None, model: Needs = Needs()) -> Choice:
    """The kernel for a GPU of `capability` (None: no GPU) and a model that needs `model`. `usable(name)` returns
    None when the kernel imports and runs here, else why not. `requested` (the user's --attn_implementation) wins
    without checks, but a kernel that drops what the model needs is named in the reason."""
    if requested:
        impl = ALIASES.get(requested, requested)
        name = next((n for n, k in KERNELS.items() if k.impl == impl), "user")
        lost = model.features() - KERNELS[name].honours if name in KERNELS else frozenset()
        return Choice(name, impl, "set by --attn_implementation"
                      + (f"; WARNING: it drops this model's {model.describe(lost)}" if lost else ""))
    wanted = (info or {}).get("attention_backend") or "sdpa"
    skipped = []
    for name in (CPU_ORDER if capability is None else order(info)):
        k = KERNELS[name]
        lost = model.features() - k.honours
        if lost:
            if name == wanted or name in ("fa2", "varlen", "sdpa"):
                skipped.append((name, f"would drop this model's {model.describe(lost)}"))
            continue
        if capability is None:
            return Choice(name, k.impl, CPU_FLEX if name == "flex" else "no GPU", tuple(skipped))
        sm = f"sm{capability[0]}{capability[1]}"
        if k.min_cc and capability < k.min_cc or k.max_cc and capability > k.max_cc:
            if name == wanted:
                skipped.append((name, f"needs {_span(k)}; this GPU is {sm}"))
            continue
        why = None if name in ("sdpa", "eager") else usable(name)  # torch and transformers themselves: always there
        if why is None:
            if info is None:
                reason = "no image record: the best that runs here"
            elif name == wanted:
                reason = "the image's default"
            elif skipped and "would drop" in skipped[-1][1]:
                reason = "the first that runs here and honours this model's attention"
            else:
                reason = f"first that runs here after the image's {wanted}"
            return Choice(name, k.impl, reason, tuple(skipped))
        if name == wanted or name in ("fa2", "varlen", "flex"):  # worth telling; optional extras (fa4) are not
            skipped.append((name, why))
    raise AssertionError("eager honours everything and always runs")  # pragma: no cover


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
        return f"test op failed ({errors.brief(e)})"
    return None


def _cu(n: int = 256):
    import torch

    return torch.tensor([0, 100, n], device="cuda", dtype=torch.int32)


def runtime_usable(name: str, model: Needs = Needs()) -> str | None:
    """None when kernel `name` imports and runs on this GPU (and applies `model`'s window where it must), else why."""
    if name in ("sdpa", "eager"):
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
        if model.window and "window_size" not in inspect.signature(fn).parameters:
            return "this torch's varlen_attn takes no window (torch < 2.12)"
        why = _try_kernel(lambda q, k, v: _varlen_call(fn, q, k, v, _cu(), _cu(), 156, 156, None))
        return why or (_window_check(fn) if model.window else None)
    if name == "flex":
        from trainbox.training import flexattn

        return flexattn.usable(model.head_dim or 64)
    return f"unknown kernel {name}"


def _window_check(fn, window: int = 8) -> str | None:
    """The varlen kernel's window against SDPA with the window as a dense mask (float32), on two packed rows: the
    window's bounds are easy to get wrong by one token, and a wrong one would change every windowed layer."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(256, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    try:
        out = _varlen_call(fn, q, k, v, _cu(), _cu(), 156, 156, None, window=window).float()
    except Exception as e:  # noqa: BLE001 - any failure means "use the next kernel"
        return f"its windowed test op failed ({type(e).__name__})"
    worst = 0.0
    for a, b in ((0, 100), (100, 256)):
        qs, ks, vs = (t[a:b].float().transpose(0, 1) for t in (q, k, v))
        mask = _dense_mask(None, b - a, b - a, True, window, q.device)[0]
        ref = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask).transpose(0, 1)
        worst = max(worst, float((out[a:b] - ref).abs().max()))
    return None if worst < 3e-2 else f"its sliding window disagrees with SDPA's (max diff {worst:.3f})"


def _first(r):
    return r[0] if isinstance(r, tuple) else r


def choose(requested: str | None = None, info: dict | None = None, model: Needs = Needs()) -> Choice:
    """The kernel for this process's GPU (device 0 of what it sees) and a model that needs `model`, registering ours
    when chosen."""
    import torch

    from trainbox.image import imageinfo

    info = imageinfo.load() if info is None else info
    cc = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    if requested:  # the same option on every rank: no trials, nothing to agree on
        choice = decide(info, cc, lambda name: None, requested, model)
    else:
        choice = agree(lambda usable: decide(info, cc, usable, requested, model),
                       lambda name: runtime_usable(name, model))
    register(choice.impl)
    return choice


def agree(decide_fn: Callable[[Callable[[str], str | None]], Choice], usable: Callable[[str], str | None]) -> Choice:
    """One kernel for the whole process group, as memplan.agree gives one memory plan: rank 0 runs
    `decide_fn(usable)` and broadcasts its choice, every other rank tries that kernel itself, and a kernel that fails
    on any rank is ruled out (with that rank's reason) and rank 0 decides again, so the ranks never train with
    different kernels and different packing. Eager runs everywhere, so this ends. Every rank of the group must call
    it (as every rank calls memplan.agree); without a group of more than one rank it decides locally."""
    import torch
    import torch.distributed as dist

    seen: dict[str, str | None] = {}

    def tried(name: str) -> str | None:  # each kernel's trial once per process (they compile and allocate)
        if name not in seen:
            seen[name] = usable(name)
        return seen[name]

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return decide_fn(tried)
    rank, ranks = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    ruled_out: dict[str, str] = {}  # the same on every rank: built from all_gather's answers
    while True:
        box: list = [None]
        if rank == 0:
            try:
                choice = decide_fn(lambda n: ruled_out.get(n) or tried(n))
                box[0] = (choice, choice.name in seen)  # tried on rank 0 (not SDPA/eager, not the no-GPU choice)
            except Exception as e:  # noqa: BLE001 - the others must not wait in the broadcast for ever
                box[0] = (None, f"{type(e).__name__}: {e}")
        dist.broadcast_object_list(box, src=0, device=dev)
        choice, tested = box[0]
        if choice is None:
            raise RuntimeError(f"choosing the attention kernel failed on rank 0: {tested}")
        why = tried(choice.name) if tested and rank != 0 else None
        answers: list = [None] * ranks
        dist.all_gather_object(answers, why)
        failed = [(r, w) for r, w in enumerate(answers) if w]
        if not failed:
            return choice
        r, w = failed[0]
        ruled_out[choice.name] = f"fails on rank {r} of {ranks}: {w}"


def register(impl: str) -> None:
    """Make our attention `impl` (trainbox_varlen, trainbox_flex) known to transformers; others are its own."""
    if impl == VARLEN:
        register_varlen()
    elif impl == FLEX:
        from trainbox.training import flexattn

        flexattn.register()


# ---------------------------------------------------------------------------------------------------------------
# torch's varlen FlashAttention as a transformers attention function
# ---------------------------------------------------------------------------------------------------------------
def _varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _varlen_call(fn, q, k, v, cu_q, cu_k, max_q, max_k, scale, window: int | None = None):
    """q/k/v (tokens, heads, dim). torch 2.10/2.11 say causal with `is_causal`, 2.12+ with a window; GQA likewise.
    `window`: transformers' sliding_window, the tokens each query sees counting itself (flash's left bound + 1)."""
    params = inspect.signature(fn).parameters
    kw = {}
    if "scale" in params:
        kw["scale"] = scale
    elif scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-6:
        raise ValueError(f"this torch's varlen_attn has no `scale` and the model scales by {scale}")
    if "window_size" in params:
        kw["window_size"] = (window - 1 if window else -1, 0)
    elif window:
        raise ValueError("this torch's varlen_attn takes no window (torch < 2.12)")
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
    kernel; a padded batch (2-D mask, e.g. evaluation) uses SDPA with that mask. A layer's `sliding_window` applies on
    every path. Softcaps and sinks are not applied: `decide` never picks this kernel for a model that has them.
    """
    import torch
    import torch.nn.functional as F

    b, h, s, d = query.shape
    window = kwargs.get("sliding_window")
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
                           max_q, max_k if max_k is not None else max_q, scaling, window=window)
        return out.unsqueeze(0).to(query.dtype), None
    causal = module.is_causal if is_causal is None else is_causal
    kv = key.shape[2]
    mask = None
    if attention_mask is not None or (window and kv > window):  # 2-D padding mask and/or a window that cuts
        mask = _dense_mask(attention_mask, s, kv, causal, window, query.device)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                         is_causal=bool(causal and mask is None and s > 1),
                                         enable_gqa=key.shape[1] != h)
    return out.transpose(1, 2).contiguous(), None


def _dense_mask(attention_mask, s: int, kv: int, causal: bool, window: int | None, device):
    """(batch or 1, 1, s, kv) bool: True where a query (the last s of kv positions) may attend."""
    import torch

    q_pos = torch.arange(kv - s, kv, device=device)[:, None]
    k_pos = torch.arange(kv, device=device)[None, :]
    mask = (k_pos <= q_pos) if causal else torch.ones(s, kv, dtype=torch.bool, device=device)
    if window:
        mask = mask & (k_pos > q_pos - window)
    mask = mask[None, None]
    return mask & attention_mask.bool()[:, None, None, :] if attention_mask is not None else mask


def register_varlen() -> None:
    """Make `attn_implementation="trainbox_varlen"` known to transformers (attention + its flash-style mask)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(VARLEN, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN, flash_attention_mask)
