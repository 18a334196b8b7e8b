"""torch's own FlashAttention kernel behind `torch.nn.attention.varlen.varlen_attn` (torch >= 2.10, sm80+) as the
transformers attention `trainbox_varlen`: like the flash-attn packages it takes the cumulative sequence lengths of a
packed batch, so padding-free training needs no flash-attn wheel. A layer's sliding window goes to the kernel (torch >=
2.12); learned sinks (gpt-oss) go through varlen_sinks.py, which calls the same kernel's forward and backward so that
they are applied exactly. Which models get it, and the trials it passes first, are attention.py's.
"""

from __future__ import annotations

import functools
import inspect

from trainbox.training.kernels import flexattn, varlen_sinks

VARLEN = "trainbox_varlen"
_per_forward: list = []  # [(a tensor, its version, what was worked out from it)], the last three (once_a_forward)


def kernel():
    """torch's varlen_attn, or None when this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def once_a_forward(tensor, work):
    """work(tensor), worked out once for the tensor every layer of a forward is handed (position_ids, a 2-D mask;
    sliding and full layers may have one mask each) rather than once a layer: each working-out reads the GPU on the
    host, and a host read a layer leaves the GPU idle until the host has caught up again, every layer. A tensor
    changed in place is worked out again; one made under torch.inference_mode has no version counter (reading it
    raises) and is known by identity alone."""
    version = None if tensor.is_inference() else tensor._version
    for seen, seen_version, got in _per_forward:
        if seen is tensor and seen_version == version:
            return got
    got = work(tensor)
    _per_forward[:] = [(tensor, version, got)] + _per_forward[:2]
    return got


def boundaries(pos):
    """(cu_seqlens, the longest row as an int) of one row of packed examples whose position_ids restart, or None
    when they don't: transformers' packed check, its nonzero and the int the kernel takes are three host syncs,
    96 a step on an 8B Llama when worked out at every layer (10 ms of a 226 ms step ended at the layers' attention:
    benchmarks/profile_step.py --gaps, results/sft8b_one_gpu)."""
    from transformers.modeling_flash_attention_utils import _is_packed_sequence, prepare_fa_kwargs_from_position_ids

    def work(p):
        if not _is_packed_sequence(p, 1):
            return None
        (cu, _), (longest, _) = prepare_fa_kwargs_from_position_ids(p)
        return cu, int(longest)

    return once_a_forward(pos, work)


@functools.lru_cache(maxsize=8)
def _params(fn) -> frozenset:
    return frozenset(inspect.signature(fn).parameters)


def call(fn, q, k, v, cu_q, cu_k, max_q, max_k, scale, window: int | None = None):
    """q/k/v (tokens, heads, dim). torch 2.10/2.11 say causal with `is_causal`, 2.12+ with a window; GQA likewise.
    `window`: transformers' sliding_window, the tokens each query sees counting itself (flash's left bound + 1)."""
    params = _params(fn)
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


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """transformers attention interface: query/key/value (batch, heads, seq, dim) -> ((batch, seq, heads, dim), None).

    Packed rows (TRL's padding-free collator passes cu_seq_lens_*/max_length_*, or position_ids restart at 0) go
    through the varlen kernel, so no example attends to another; unpacked rows without padding use SDPA's causal
    kernel; a padded batch (2-D mask, e.g. evaluation) uses SDPA with that mask. A layer's `sliding_window` applies on
    every path. Learned sinks (gpt-oss's s_aux) go through varlen_sinks: a single row as one example, a padded batch
    unpadded into one packed row; rows the varlen kernel does not take (a KV cache, several rows without a mask) get
    the same softmax with the sinks as dense math (flexattn.dense, FlexAttention's CPU path). Softcaps are not
    applied: attention.decide never picks this kernel for a model that has them.
    """
    import torch
    import torch.nn.functional as F

    b, h, s, d = query.shape
    window = kwargs.get("sliding_window")
    sinks = kwargs.get("s_aux")
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    pos = kwargs.get("position_ids")
    if cu_q is None and attention_mask is None and pos is not None and b == 1 and s > 1 and query.is_cuda:
        # No boundaries given: packed only if the positions restart (host syncs, once per forward).
        found = boundaries(pos)
        if found:
            (cu_q, max_q), cu_k, max_k = found, None, None
    dtype = query.dtype
    if dtype not in (torch.float16, torch.bfloat16):  # fp32 activations outside autocast: the kernel wants 16 bits
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else torch.bfloat16
    if sinks is not None and cu_q is None and attention_mask is None and b == 1 and s == key.shape[2] and query.is_cuda:
        cu_q, max_q, max_k = torch.tensor([0, s], device=query.device, dtype=torch.int32), s, s  # one example
    if cu_q is not None and b == 1 and attention_mask is None:
        q, k, v = (t.transpose(1, 2)[0].to(dtype) for t in (query, key, value))
        cu_q, cu_k = cu_q.to(torch.int32), (cu_k if cu_k is not None else cu_q).to(torch.int32)
        max_k = max_k if max_k is not None else max_q
        if sinks is not None:
            out = varlen_sinks.attention(q, k, v, sinks, cu_q, cu_k, max_q, max_k, scaling, window)
        else:
            out = call(kernel(), q, k, v, cu_q, cu_k, max_q, max_k, scaling, window=window)
        return out.unsqueeze(0).to(query.dtype), None
    if sinks is not None and attention_mask is not None and attention_mask.dim() == 2 and s == key.shape[2] \
            and query.is_cuda:  # a padded batch (GRPO's loss forward): its rows unpadded into one packed row
        indices, cu, longest = unpadded(attention_mask)
        q, k, v = (t.transpose(1, 2).reshape(b * s, t.shape[1], d).index_select(0, indices).to(dtype)
                   for t in (query, key, value))
        out = varlen_sinks.attention(q, k, v, sinks, cu, cu, longest, longest, scaling, window)
        full = out.new_zeros(b * s, h, d).index_copy(0, indices, out)
        return full.view(b, s, h, d).to(query.dtype), None
    if sinks is not None:  # a KV cache, several unpadded rows: the same softmax with the sinks as dense math
        training = bool(getattr(module, "training", False))
        scale = scaling if scaling is not None else d**-0.5
        return flexattn.dense_forward(query, key, value, pos, attention_mask, scale, window, None, sinks,
                                      dropout if training else 0.0, training), None
    causal = module.is_causal if is_causal is None else is_causal
    kv = key.shape[2]
    mask = None
    if attention_mask is not None or (window and kv > window):  # 2-D padding mask and/or a window that cuts
        mask = dense_mask(attention_mask, s, kv, causal, window, query.device)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                         is_causal=bool(causal and mask is None and s > 1),
                                         enable_gqa=key.shape[1] != h)
    return out.transpose(1, 2).contiguous(), None


def unpadded(attention_mask):
    """(indices of the real tokens in the flattened batch, int32 cumulative lengths, the longest row) for a 2-D mask
    of padding at the rows' ends (transformers' own unpadding, as its flash path does; one host read of the longest
    row a mask, not a layer)."""
    from transformers.modeling_flash_attention_utils import _get_unpad_data

    return once_a_forward(attention_mask, _get_unpad_data)


def dense_mask(attention_mask, s: int, kv: int, causal: bool, window: int | None, device):
    """(batch or 1, 1, s, kv) bool: True where a query (the last s of kv positions) may attend."""
    import torch

    q_pos = torch.arange(kv - s, kv, device=device)[:, None]
    k_pos = torch.arange(kv, device=device)[None, :]
    mask = (k_pos <= q_pos) if causal else torch.ones(s, kv, dtype=torch.bool, device=device)
    if window:
        mask = mask & (k_pos > q_pos - window)
    mask = mask[None, None]
    return mask & attention_mask.bool()[:, None, None, :] if attention_mask is not None else mask


def register() -> None:
    """Make `attn_implementation="trainbox_varlen"` known to transformers (attention + its flash-style mask)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    varlen_sinks.prepare()  # now, not inside a trace of the model
    AttentionInterface.register(VARLEN, attention_forward)
    AttentionMaskInterface.register(VARLEN, flash_attention_mask)
