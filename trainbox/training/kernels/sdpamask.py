"""transformers' SDPA attention with fully masked query rows opened up, so their gradients are finite.

Why: transformers 5 builds SDPA's boolean mask from the causal rule, the sliding window and the padding, and no
longer opens fully masked rows ("allow_torch_fix" has no effect since 5.x: it counts on torch >= 2.5). A right-padded
row whose padding runs past the window has query rows that see no key at all. On CUDA in bf16 (torch 2.11, one H200,
`trainbox selftest`'s attention-sdpa row, mistral, rows of 64/48/32 tokens in one batch, window 16), the forward of
the real tokens is right but the gradients of every projection are NaN: the padded rows' softmax is 0/0, and 0 * NaN
in the backward still reaches the weights. Opening such a row (every key allowed) gives it a finite, unused output;
the loss never reads a padded position, so its upstream gradient is 0 and nothing else changes. One `any` over the
mask per layer, only when a mask is passed (padding or a window; plain causal batches pass none).
"""

from __future__ import annotations

_original: dict = {}


def open_empty_rows(mask):
    """The boolean (batch, heads, q, k) mask with each row that allows no key made to allow all; others as given."""
    import torch

    if mask is None or mask.dtype != torch.bool:
        return mask
    return mask | ~mask.any(dim=-1, keepdim=True)


def sdpa_forward(module, query, key, value, attention_mask, *args, **kwargs):
    return _original["fn"](module, query, key, value, open_empty_rows(attention_mask), *args, **kwargs)


def register() -> None:
    """Put the wrapper under transformers' own name "sdpa" (once: the original is kept, never wrapped twice)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    _original.setdefault("fn", sdpa_attention_forward)
    AttentionInterface.register("sdpa", sdpa_forward)
