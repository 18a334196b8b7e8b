"""LoRA on a 4-bit base as one autograd Function: the base GEMM and the adapter's product land in one output (qlora).

PEFT's lora.Linear4bit runs, for each projection and pass: bitsandbytes' layer (dequantize, GEMM), a defensive clone
of that output, the adapter's two GEMMs, a multiply by the scale and an add, and autograd mirrors each of them in
backward: three output-wide elementwise passes forward and two backward, per projection (seven per Llama layer, and
under gradient checkpointing the forward runs twice). At 8B x 4,096 tokens a step that is on the order of 200 GB of
memory traffic that computes nothing. Here the adapter goes into the base GEMM's output by cuBLAS's own
accumulate (addmm, alpha = the scale), and backward is written out: dX = g W + (s g B) A (the second term added by
the same GEMM call), dB = s g^T (x A^T), dA = (s g B)^T x, with W dequantized again as bitsandbytes' own backward
does. It keeps what PEFT keeps for backward (the input, which the other projections of the same input share, and
x A^T, rank-wide), nothing more.

Where: vanilla LoRA (no DoRA or other variant) with dropout 0 (TRL's default dropout 0.05 makes PEFT's path the only
one; `trainbox qlora` defaults to 0, as Unsloth's notebooks do), one active adapter, adapter weights in the compute
dtype (TRL casts them to bf16 for a quantized base), a plain bitsandbytes 4-bit weight (not sharded: one process per
model copy), and only when autograd records (generation and evaluation keep PEFT's path, whose one-token case uses
bitsandbytes' GEMV). Anything else falls through to PEFT's forward, per call. TRAINBOX_LORA_FUSED=0 keeps PEFT's.
"""

from __future__ import annotations

import os
import types

from trainbox.training.kernels import switches

ENV = "TRAINBOX_LORA_FUSED"


def _function():
    import bitsandbytes.functional as bnbf
    import torch

    class LoRA4bit(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, a, b, scale, bias):
            w = bnbf.dequantize_4bit(weight.data, weight.quant_state).to(x.dtype)  # (out, in)
            x2 = x.reshape(-1, x.shape[-1])
            xa = x2 @ a.t()  # (tokens, r)
            out = x2 @ w.t() if bias is None else torch.addmm(bias.to(x.dtype), x2, w.t())
            del w
            out.addmm_(xa, b.t(), alpha=scale)
            ctx.save_for_backward(x, xa, a, b)
            ctx.weight, ctx.scale, ctx.bias = weight, scale, bias is not None
            return out.view(*x.shape[:-1], out.shape[-1])

        @staticmethod
        def backward(ctx, grad):
            x, xa, a, b = ctx.saved_tensors
            g2 = grad.reshape(-1, grad.shape[-1]).to(x.dtype)
            x2 = x.reshape(-1, x.shape[-1])
            gb = (g2 @ b).mul_(ctx.scale)  # (tokens, r): s g B
            dx = None
            if ctx.needs_input_grad[0]:
                w = bnbf.dequantize_4bit(ctx.weight.data, ctx.weight.quant_state).to(x.dtype)
                dx = g2 @ w
                del w
                dx.addmm_(gb, a)
                dx = dx.view(x.shape)
            da = (gb.t() @ x2) if ctx.needs_input_grad[2] else None
            db = (g2.t() @ xa).mul_(ctx.scale) if ctx.needs_input_grad[3] else None
            dbias = g2.sum(0) if ctx.bias and ctx.needs_input_grad[5] else None
            return dx, None, da, db, None, dbias

    return LoRA4bit


def _eligible(layer, x, args, kwargs) -> tuple | None:
    """(weight, A, B, scale, bias) when this call can take the fused path, else None (PEFT's forward runs)."""
    import torch
    import torch.nn as nn

    if args or kwargs or layer.disable_adapters or layer.merged or not torch.is_grad_enabled():
        return None
    names = layer.active_adapters
    if len(names) != 1 or names[0] not in layer.lora_A or names[0] in getattr(layer, "lora_variant", {}):
        return None
    name = names[0]
    if not isinstance(layer.lora_dropout[name], nn.Identity):
        return None
    a, b = layer.lora_A[name].weight, layer.lora_B[name].weight
    base = layer.get_base_layer()
    weight = base.weight
    if (getattr(weight, "quant_state", None) is None or type(weight).__name__ != "Params4bit"
            or x.dim() < 2 or x.numel() == x.shape[-1]):
        return None
    dtype = base.compute_dtype or x.dtype
    if not (x.dtype == a.dtype == b.dtype == dtype) or not (x.requires_grad or a.requires_grad or b.requires_grad):
        return None
    if getattr(layer, "use_dora", {}).get(name) or getattr(layer.lora_A[name], "bias", None) is not None:
        return None
    return weight, a, b, layer.scaling[name], base.bias


def setting() -> tuple[bool, str | None]:
    """(on?, a note on the variable): switches.setting for ENV."""
    return switches.setting(ENV)


def apply(model) -> int:
    """Route every PEFT 4-bit LoRA layer of `model` through LoRA4bit where a call is eligible; returns how many
    layers were routed (their other calls still take PEFT's forward)."""
    try:
        from peft.tuners.lora.bnb import Linear4bit
    except ImportError:  # no bitsandbytes: no 4-bit layers either
        return 0
    fn = None
    n = 0
    for module in model.modules():
        if not isinstance(module, Linear4bit) or getattr(module, "_trainbox_lora4bit", False):
            continue
        fn = fn or _function()
        peft_forward = module.forward

        def forward(self, x, *args, _fn=fn, _peft=peft_forward, **kwargs):
            hit = _eligible(self, x, args, kwargs)
            if hit is None:
                return _peft(x, *args, **kwargs)
            return _fn.apply(x, *hit)

        module.forward = types.MethodType(forward, module)
        module._trainbox_lora4bit = True
        n += 1
    return n


def choose(model, distributed: bool) -> str | None:
    """Apply where it can run (one process per model copy); the line to print, or None where nothing is 4-bit LoRA."""
    on, note = setting()
    if not on:
        return f"4-bit LoRA: PEFT's forward ({ENV}={os.environ.get(ENV)})"
    if distributed:
        return None  # FSDP2 shards the 4-bit base: its DTensors are not bitsandbytes weights there
    n = apply(model)
    return (f"4-bit LoRA fused into the base GEMM ({n} layers: no clone, scale or add passes; {ENV}=0 keeps PEFT's)"
            + (f"; {note}" if note else "")) if n else note
