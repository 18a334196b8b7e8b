"""PyTorch FlexAttention as a transformers attention function (`trainbox_flex`): packed rows for the models whose
attention is special (Gemma 2's tanh softcap, gpt-oss's learned sinks, sliding windows on both). gpt-oss gets torch's
varlen FlashAttention with the sinks (varlen_sinks.py, twice as fast on its head size) where that runs; this kernel
is its fallback.

One packed row (padding-free, position_ids restarting at 0 per example) or a padded batch goes through one fused
kernel: the block mask keeps each query to its own example (document ids from the position_ids resets), before it
(causal), inside the layer's window and off padding (the 2-D attention mask); the score modifier applies the softcap
(`tanh(s / c) * c`, after scaling, before masking: Gemma 2's eager order); sinks are applied from the kernel's
log-sum-exp: eager's softmax over [scores, sink] gives each real key exp(s) / (Z + exp(sink)) with Z = exp(lse), so
out_with_sinks = out * Z / (Z + exp(sink)) = out * sigmoid(lse - sink), exactly, per head.

The fused kernel runs on CUDA, compiled once per shape family: torch.compile's automatic dynamic shapes turn the
sequence length symbolic after the first change, so a new packed length does not recompile. The block mask (a cheap
index structure) is built per batch, outside the compiled function, and shared by the layers of one forward; its
document ids are padded up to a multiple of 128 (the block size; that padding is a document of its own), while query,
key and value keep their length (the kernel bounds-checks a last, partial block: padding them was ~150 launches and 3
ms of copies a gpt-oss step). Every number the kernel reads besides the shapes (scale, softcap, window, document ids)
is a tensor captured by the mask/score modifiers, never a Python float: Dynamo guards a captured float's value, and a
second value (the choice trial's softcap, then the model's) turns it symbolic, breaks the graph and sends the call to
the unfused eager operator, whose backward then failed inside the models (reproduced on CPU:
tests/test_flex_attention.py). fullgraph=True makes any such break, or the recompile limit, an error at the first
call instead of that silent fall-back. Elsewhere the same masks and modifiers run as dense math (`dense`): on CPU
(torch has no FlexAttention backward there), when a KV cache makes queries and keys differ in length (generation),
and for dropout.
"""

from __future__ import annotations

import math
import os

from common import errors
from trainbox.training.kernels import compilefail, switches

FLEX = "trainbox_flex"
BLOCK = 128  # FlexAttention's default block size: the block mask's document ids are padded up to a multiple of it
# (2 blocks at least: Dynamo specializes a size of 1, so one-block rows would compile graphs of their own)
RECOMPILE_LIMIT = 32
NO_WINDOW = 1 << 30
PAD_DOC = -1  # document id of padding (attention mask 0); internal bucket padding gets PAD_DOC - 1

GPU_ENV = "TRAINBOX_FLEX_GPU"  # "0": never offer the fused kernel on GPUs (it is offered by default: see usable)
_compiled: dict = {}  # torch.compile backend -> compiled flex_attention (one per process)
_score_mods: dict = {}  # (scale, softcap, device) -> score_mod: one function and its tensors, reused by every call
_sinks: dict = {}  # "fn" -> the compiled sinks (compilefail.Fallback)
_masks: list = []  # (key tensors, window, length) -> BlockMask, for the layers of the current forward
_outside: dict = {}  # "fn" -> fused_forward behind a graph break (made in register(), outside any trace)
# Block sizes where inductor's default is slow, by (GPU capability, head sizes lo < d <= hi); measured with
# benchmarks/flex_configs.py on an H200 (fwd+bwd of one packed 16k-token row, full / windowed layer):
# - head size 256 (Gemma 2, 1,024-token window), 2026-11-26: 2.76 / 2.64 ms against the default's 3.59 / 3.30 ms;
#   inductor's own max-autotune found 2.93 / 2.77 ms after 134 s of compiling.
# - head size 64 (gpt-oss: 32/8 heads, 128-token window, the log-sum-exp's gradient), 2026-11-28: 1.73 / 1.08 ms
#   against 2.28 / 1.35 ms, mostly the forward's 64x128 tiles; max-autotune picked the same tiles.
KERNEL_OPTIONS = {
    ((9, 0), (128, math.inf)): dict(BLOCK_M1=32, BLOCK_N1=32, BLOCK_M2=32, BLOCK_N2=32, num_warps=4, num_stages=2),
    ((9, 0), (0, 64)): dict(BLOCK_M=64, BLOCK_N=128, BLOCK_M1=64, BLOCK_N1=64, BLOCK_M2=64, BLOCK_N2=64, num_warps=4,
                            num_stages=3),
}


def flex_fn():
    """torch's flex_attention, or None when this torch has none."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return None
    return flex_attention


def compiled(backend: str = "inductor"):
    """flex_attention under torch.compile, one per process (its cache holds the shape families). fullgraph: a graph
    break or the recompile limit raises instead of running the unfused eager operator. `backend`: inductor (the fused
    kernel); aot_eager is Dynamo's capture and the operator's autograd without the kernel (CPU tests: inductor has no
    FlexAttention backward on CPU)."""
    if backend not in _compiled:
        import inspect

        import torch

        # Its own recompile budget (torch >= 2.13): graphs are few but multiply (grad on/off, first shape then the
        # symbolic one, batch or block count 1 vs more, lse or not); the global 8 is shared with every other user
        # of flex_attention's code and, under fullgraph, exceeding it is an error.
        own = {"recompile_limit": RECOMPILE_LIMIT, "isolate_recompiles": True}
        params = inspect.signature(torch.compile).parameters
        if "recompile_limit" not in params:
            # Older torch (2.11 on the H100 here) has only the global limit: a training process reached 7 of its 8
            # graphs, and more head sizes in one process hit it. Raise it (never lower what a user set).
            dyn = torch._dynamo.config
            dyn.recompile_limit = max(dyn.recompile_limit, RECOMPILE_LIMIT)
        _compiled[backend] = torch.compile(flex_fn(), backend=backend, fullgraph=True,
                                           **{k: v for k, v in own.items() if k in params})
    return _compiled[backend]


# ---------------------------------------------------------------------------------------------------------------
# Masks and modifiers: one description, used by the fused kernel and by the dense path
# ---------------------------------------------------------------------------------------------------------------
def documents(position_ids, attention_mask, batch: int, length: int, device):
    """(batch, length) int64: the example each token belongs to (a new one where position_ids restart at 0),
    PAD_DOC where the 2-D attention mask says padding. Without position_ids every token is in example 0."""
    import torch

    docs = torch.zeros(batch, length, dtype=torch.long, device=device)
    if position_ids is not None and position_ids.dim() == 2 and position_ids.shape[-1] == length:
        docs = (position_ids.to(device) == 0).cumsum(-1).expand(batch, length)
    if attention_mask is not None:
        docs = torch.where(attention_mask.to(device).bool(), docs, torch.full_like(docs, PAD_DOC))
    return docs


def mask_mod(docs, window):
    """FlexAttention mask_mod: same example, causal, inside the window (transformers' convention: a query sees
    `window` tokens counting itself, kv > q - window). `window` is a 0-dim tensor so every layer shares one graph."""

    def allowed(b, h, q, kv):
        return (docs[b, q] == docs[b, kv]) & (kv <= q) & (q - kv < window)

    return allowed


def score_mod(scale: float, softcap: float | None, device):
    """FlexAttention score_mod: the scale, then Gemma 2's softcap (`tanh(s / c) * c`), both 0-dim float32 tensors the
    closure captures (buffers of the compiled graph, so another value is another input, not a recompile or a symbolic
    float); the kernel is called with scale 1. One function per (scale, softcap, device), made once."""
    key = (float(scale), float(softcap or 0), str(device))
    if key not in _score_mods:
        import torch

        s = torch.tensor(float(scale), dtype=torch.float32, device=device)
        if softcap:
            c = torch.tensor(float(softcap), dtype=torch.float32, device=device)

            def mod(score, b, h, q, kv):
                return torch.tanh(score * s / c) * c
        else:

            def mod(score, b, h, q, kv):
                return score * s

        _score_mods[key] = mod
    return _score_mods[key]


def with_sinks(out, lse, sinks):
    """out (b, h, s, d), lse (b, h, s) natural-log; sinks (h,): eager's softmax over [scores, sink] exactly."""
    import torch

    gate = torch.sigmoid(lse.float() - sinks.float()[None, :, None])
    return (out.float() * gate[..., None]).to(out.dtype)


def dense(query, key, value, docs, scale: float, window: int | None, softcap: float | None, dropout: float = 0.0,
          training: bool = False):
    """The same masks and modifiers as dense math (scores materialized): (out (b, h, s, d), lse (b, h, s)).
    `docs` covers the keys; queries are the last s of them (a KV cache)."""
    import torch

    b, h, s, _ = query.shape
    kv = key.shape[2]
    if key.shape[1] != h:
        key, value = (t.repeat_interleave(h // key.shape[1], dim=1) for t in (key, value))
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    qi = torch.arange(kv - s, kv, device=query.device)[:, None]
    ki = torch.arange(kv, device=query.device)[None, :]
    ok = (ki <= qi) & (qi - ki < (window or NO_WINDOW))
    ok = ok[None] & (docs[:, kv - s:, None] == docs[:, None, :])  # (b, s, kv)
    scores = scores.float().masked_fill(~ok[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).to(value.dtype)
    if dropout and training:
        probs = torch.nn.functional.dropout(probs, p=dropout)
    return torch.matmul(probs, value), lse


def block_mask(docs, window: int | None, length: int | None = None):
    """The BlockMask for `docs` (already padded to a multiple of BLOCK) over rows of `length` tokens (default: docs'
    padded length), reused while the same tensors come back (every layer of one forward, and its recomputation under
    checkpointing)."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    n = docs.shape[1] if length is None else length
    for key_docs, key_window, key_n, bm in _masks:
        if key_docs is docs and key_window == window and key_n == n:
            return bm
    w = torch.full((), window or NO_WINDOW, device=docs.device)  # a fill kernel: torch.tensor() would sync
    partial, full = tiles(docs, window)
    # The backward's (per key block) lists straight from the tiles: from_kv_blocks would rebuild the tiles from the
    # forward's lists first (an index_put_ and ~10 more launches per list, on the host's path in a host-bound step)
    bm = BlockMask((n, n), *_ordered(partial), *_ordered(full), *_ordered(partial.transpose(-2, -1)),
                   *_ordered(full.transpose(-2, -1)), BLOCK_SIZE=(BLOCK, BLOCK), mask_mod=mask_mod(docs, w))
    _masks.insert(0, (docs, window, n, bm))
    del _masks[4:]
    return bm


def tiles(docs, window: int | None):
    """(partial, full): (batch, 1, blocks, blocks) bool, which BLOCK x BLOCK tiles of mask_mod(docs, window) the
    kernel visits with the mask applied, and which it visits without (every pair allowed), from each block's position
    span, lowest and highest real document id and which padding ids it holds. torch's create_block_mask finds the
    same by evaluating the mask at every (query, key) pair: (batch x length^2) elements, six passes over 268 M of them
    for one 16k-token packed row, ~5 ms a mask on an H100: two masks a step for models with windows, 10.3 ms of the
    Gemma-2 benchmark step's kernels (benchmarks/results/moe_fold_tiles-2026-11-27.txt). Real document ids never
    decrease along a row (documents() counts position resets), so two blocks' id ranges overlap exactly when they
    share a document; padding ids (PAD_DOC, PAD_DOC - 1) are matched by presence. Full tiles are exact; a tile whose
    shared document meets only outside the window would be visited (masked) rather than skipped, which only costs
    time (tests/test_flex_attention.py finds create_block_mask's tiles exactly on packed and padded rows)."""
    import torch

    b, n = docs.shape
    blocks = n // BLOCK
    d = docs.view(b, blocks, BLOCK)
    real = d >= 0
    lo = torch.where(real, d, torch.iinfo(d.dtype).max).amin(-1)  # a block without real tokens: an empty range
    hi = torch.where(real, d, -1).amax(-1)
    some_doc = (lo[:, :, None] <= hi[:, None, :]) & (lo[:, None, :] <= hi[:, :, None])
    for pad in (PAD_DOC, PAD_DOC - 1):
        has = (d == pad).any(-1)
        some_doc |= has[:, :, None] & has[:, None, :]
    first = d.amin(-1)
    single = first == d.amax(-1)  # the block holds one id (real or padding)
    all_doc = single[:, :, None] & single[:, None, :] & (first[:, :, None] == first[:, None, :])
    i = torch.arange(blocks, device=docs.device)[:, None]
    j = torch.arange(blocks, device=docs.device)[None, :]
    w = window or NO_WINDOW
    # query block i spans [i*BLOCK, i*BLOCK + BLOCK - 1], key block j likewise; allowed: kv <= q and q - kv < w
    some_pos = (j <= i) & ((i - j - 1) * BLOCK + 1 < w)  # the closest causal pair is inside the window
    all_pos = (j < i) & ((i - j + 1) * BLOCK - 1 < w)  # the farthest pair is too
    full = all_pos & all_doc
    partial = some_pos & some_doc & ~full
    return partial[:, None], full[:, None]


def _ordered(tiles):
    """(per query block, how many key blocks; their indices first, ascending): BlockMask's layout, int32, contiguous
    (the kernels index these lists as contiguous: a transposed view's strides gave wrong key/value gradients on an
    H200; torch's own conversion, _dense_to_ordered, is private)."""
    import torch

    tiles = tiles.contiguous()
    num = tiles.sum(-1, dtype=torch.int32)
    idx = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num, idx


_docs_cache: list = []  # (position_ids, attention_mask, batch, length) -> padded docs: one per forward


def padded_documents(position_ids, attention_mask, batch: int, length: int, device):
    """documents() padded to a multiple of BLOCK (bucket padding is a document of its own), cached per input
    tensors so the layers of a forward share one tensor (and so one block mask per window)."""
    import torch

    for (p, m, b, n), docs in _docs_cache:
        if p is position_ids and m is attention_mask and (b, n) == (batch, length):
            return docs
    docs = documents(position_ids, attention_mask, batch, length, device)
    full = max(2, math.ceil(length / BLOCK)) * BLOCK
    if full != length:
        docs = torch.cat([docs, torch.full((batch, full - length), PAD_DOC - 1, dtype=docs.dtype, device=device)], 1)
    _docs_cache.insert(0, ((position_ids, attention_mask, batch, length), docs))
    del _docs_cache[2:]
    return docs


def fused(query, key, value, docs, scale: float, window: int | None, softcap: float | None, fn=None,
          lse: bool = True):
    """FlexAttention over rows of s tokens, `docs` their document ids padded to a multiple of BLOCK: (out (b, h, s,
    d), lse (b, h, s) or None when not `lse`). `fn`: the flex_attention to call (default: the compiled one)."""
    import torch
    from torch.nn.attention import flex_attention as fa

    # One dtype, autocast's where it is on: float32 weights under bf16 autocast (TRL's GRPO default) leave q and k
    # in float32 after RoPE's float32 cos/sin while v is bf16; keeping q's dtype ran the kernel in float32 (a
    # Gemma-2 GRPO step 2.2x slower than with bf16 weights on an H100, and a recompile on the dtype). Eager's
    # matmuls run in bf16 there too.
    device = query.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    kw = dict(score_mod=score_mod(scale, softcap, query.device), block_mask=block_mask(docs, window, query.shape[2]),
              scale=1.0, enable_gqa=key.shape[1] != query.shape[1])
    opts = kernel_options(query.shape[-1], query.device)
    if opts:
        kw["kernel_options"] = opts
    fn = fn or compiled()
    # Outside autocast: the Trainer's bf16 autocast makes FlexAttention's autocast rule break the compiled graph, and
    # its backward then fails on real tensors (seen on an H100, torch 2.11).
    with torch.autocast(device_type=device, enabled=False):
        if not lse:  # (compiled FlexAttention on CPU returns no log-sum-exp)
            return fn(query, key, value, **kw), None
        if hasattr(fa, "AuxRequest"):
            out, aux = fn(query, key, value, return_aux=fa.AuxRequest(lse=True), **kw)
            return out, aux.lse
        return fn(query, key, value, return_lse=True, **kw)  # torch < 2.9


def kernel_options(head_dim: int, device) -> dict | None:
    """KERNEL_OPTIONS for this GPU and head size (None: inductor's default)."""
    if device.type != "cuda":
        return None
    import torch

    cc = torch.cuda.get_device_capability(device)
    return next((o for (c, (lo, hi)), o in KERNEL_OPTIONS.items() if c == cc and lo < head_dim <= hi), None)


def uses_fused(query, key, dropout: float) -> bool:
    return bool(query.is_cuda and query.shape[2] == key.shape[2] and not dropout and flex_fn() is not None)


def flex_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                           scaling: float | None = None, sliding_window: int | None = None,
                           softcap: float | None = None, s_aux=None, **kwargs):
    """transformers attention interface: query/key/value (batch, heads, seq, dim) -> ((batch, seq, heads, dim), None).

    attention_mask: the 2-D padding mask or None (flash_attention_mask is registered as this kernel's mask);
    position_ids (in kwargs) mark the examples of a packed row; sliding_window, softcap (Gemma 2) and s_aux
    (gpt-oss's sinks) as the models pass them."""
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"{FLEX} takes a 2-D padding mask, got one of shape {tuple(attention_mask.shape)}")
    if getattr(module, "is_causal", True) is False:
        raise ValueError(f"{FLEX} is for causal attention; this layer ({type(module).__name__}) is not causal")
    b, h, s, d = query.shape
    scale = scaling if scaling is not None else d**-0.5
    pos = kwargs.get("position_ids")
    training = bool(getattr(module, "training", False))
    p = dropout if training else 0.0
    if uses_fused(query, key, p):
        import torch

        # Inside the user's own torch.compile (--torch_compile) the fused path runs behind a graph break, as it runs
        # outside one (its kernels compiled here, the block mask built eagerly): traced into the user's graph, the
        # block mask's symbolic block count failed inductor's codegen (CantSplit on gpt-oss, an H200, torch 2.11).
        fn = _outside["fn"] if torch.compiler.is_compiling() and "fn" in _outside else fused_forward
        return fn(query, key, value, pos, attention_mask, scale, sliding_window, softcap, s_aux), None
    return dense_forward(query, key, value, pos, attention_mask, scale, sliding_window, softcap, s_aux, p,
                         training), None


def dense_forward(query, key, value, position_ids, attention_mask, scale: float, window: int | None,
                  softcap: float | None, sinks, dropout: float = 0.0, training: bool = False):
    """The dense path of flex_attention_forward (and of trainbox_varlen's rows with sinks that its kernel does not
    take): (batch, seq, heads, dim)."""
    b, _, s, _ = query.shape
    kv = key.shape[2]
    docs = documents(position_ids if s == kv else None, attention_mask, b, kv, query.device)
    out, lse = dense(query, key, value, docs, scale, window, softcap, dropout, training)
    if sinks is not None:
        out = with_sinks(out, lse, sinks)
    return out.transpose(1, 2).contiguous()


def fused_forward(query, key, value, position_ids, attention_mask, scale: float, window: int | None,
                  softcap: float | None, sinks):
    """The fused path of flex_attention_forward: (batch, seq, heads, dim)."""
    b, _, s, _ = query.shape
    docs = padded_documents(position_ids, attention_mask, b, s, query.device)
    out, lse = fused(query, key, value, docs, scale, window, softcap, lse=sinks is not None)
    if sinks is not None:  # (generation's shapes, on the dense path, stay op by op: no graphs for them)
        return sinks_to_layout(out, lse, sinks)
    return out.transpose(1, 2).contiguous()


def _sinks_to_layout(out, lse, sinks):
    return with_sinks(out, lse, sinks).transpose(1, 2).contiguous()


def sinks_to_layout(out, lse, sinks):
    """with_sinks and the models' (batch, seq, heads, dim) layout, compiled into one kernel each way: op by op they
    are about ten kernels forward and backward over the attention output (float32 casts, the gate, its product and
    sum): ~7 ms of the gpt-oss-2b benchmark step's 12 layers on an H200 (benchmarks/results/moe_compiled-*). The
    sequence length is symbolic from the first call. A compiler failure falls back to the same ops, once, with a
    line; called inside a trace, that trace takes the same ops."""
    if "fn" not in _sinks:
        _sinks["fn"] = compilefail.Fallback(_sinks_to_layout, "attention: the sinks", "applying them op by op",
                                            ((0, 2), (1, 2)))
    return _sinks["fn"](out, lse, sinks)


def register() -> None:
    """Make `attn_implementation="trainbox_flex"` known to transformers (attention + the flash-style 2-D mask)."""
    import torch
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    if "fn" not in _outside:
        _outside["fn"] = torch.compiler.disable(fused_forward)
    AttentionInterface.register(FLEX, flex_attention_forward)
    AttentionMaskInterface.register(FLEX, flash_attention_mask)


def usable(head_dim: int = 64) -> str | None:
    """None when the fused kernel compiles and runs here (CUDA) and passes trial(); else why not."""
    import torch

    if flex_fn() is None:
        return "this torch has no torch.nn.attention.flex_attention"
    if not torch.cuda.is_available():
        return "no GPU"
    on = switches.switch(os.environ.get(GPU_ENV), default=True)
    if on is False:
        # Off switch. The GPU default rests on tests/gpu/flex_check.py passing on an H100 (torch 2.11): logits and
        # gradients within bf16 eager's bound for Gemma 2, gpt-oss and Llama, 0 graph breaks, no late recompiles.
        return f"{GPU_ENV}={os.environ[GPU_ENV]} turns it off"
    if on is None:
        return f"{GPU_ENV}={os.environ[GPU_ENV]!r} is neither 0 nor 1: left off (unset it to use FlexAttention)"
    try:
        from torch.utils._triton import has_triton

        if not has_triton():
            return "Triton is not usable here (FlexAttention's kernels are Triton)"
    except Exception as e:  # noqa: BLE001 - any failure means "use the next kernel"
        return f"Triton check failed ({type(e).__name__})"
    return trial("cuda", head_dim, torch.bfloat16)


def warm_up(head_dim: int = 64) -> str | None:
    """trial() on the GPU when the kernel was named (--attn_implementation trainbox_flex: no choice trial ran), for
    its compile. The trial's row differs from any training batch in every size, so the first batch's compile makes
    them all symbolic at once. Without it the first batch compiled a static graph and two later batches compiled
    again inside training (a new length, then a new block count: 7.6 s at step 2 and 7.5 s at step 10 of a gpt-oss
    run on an H200). None, or why the check failed (the named kernel is used anyway)."""
    import torch

    return trial("cuda", head_dim, torch.bfloat16)


def trial(device: str, head_dim: int = 64, dtype=None) -> str | None:
    """The fused kernel (compiled(), in `dtype` under autocast as the Trainer runs it) against the dense float32 math
    on a tiny packed row with a window, a softcap and sinks, forward and backward, at the model's head size (large
    ones need small blocks: a size the GPU can't fit fails here, not in the first training step). Its scale, softcap
    and window differ from any model's on purpose: the model's calls must reuse this compile, not break it. None when
    they agree, else why not."""
    import torch

    dtype = dtype or torch.float32
    try:
        g = torch.Generator(device=device).manual_seed(0)
        # (batch, seq, heads, dim) seen as (batch, heads, seq, dim): the models' layout, so the same strides
        q = torch.randn(1, 200, 4, head_dim, device=device, dtype=dtype, generator=g).transpose(1, 2)
        k, v = (torch.randn(1, 200, 2, head_dim, device=device, dtype=dtype, generator=g).transpose(1, 2)
                for _ in range(2))
        sinks = torch.randn(4, device=device, generator=g)
        pos = torch.cat([torch.arange(120), torch.arange(80)]).to(device)[None]
        outs, grads = [], []
        for run in ("fused", "dense"):
            qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
            if run == "fused":
                with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
                    docs = padded_documents(pos, None, 1, 200, device)
                    o, lse = fused(qq, kk, vv, docs, head_dim**-0.5, 48, 20.0)
            else:
                o, lse = dense(*(t.float() for t in (qq, kk, vv)), documents(pos, None, 1, 200, device),
                               head_dim**-0.5, 48, 20.0)
            o = with_sinks(o, lse, sinks)
            o.float().square().sum().backward()
            outs.append(o.detach().float())
            grads.append(qq.grad.float())
        if not all(bool(torch.isfinite(t).all()) for t in (*outs, *grads)):
            return "its test op gave non-finite values"
        worst = max(float((outs[0] - outs[1]).abs().max()), float((grads[0] - grads[1]).abs().max()) / 10)
        if worst > 5e-2:
            return f"its test op disagrees with the dense math (max diff {worst:.3f})"
    except Exception as e:  # noqa: BLE001 - any failure means "use the next kernel"
        return f"test op failed ({errors.brief(e)})"
    return None
