"""The gated MLP's product recomputed in backward instead of kept (Liger's SwiGLU/GeGLU MLPs).

A gated MLP (Llama's SwiGLU, Gemma's GeGLU) keeps three intermediate-wide activations per token for backward: the gate
and up projections (Liger's activation kernel needs both) and their product act(gate) * up, which the down projection
keeps as its input. The product is one elementwise kernel away from the other two, so here the activation and the
down projection are one autograd Function that keeps gate, up and the down weight, and in backward recomputes the
product with Liger's own forward kernel before the down projection's weight gradient. That is 2 x intermediate bytes
per token and layer less (about a quarter of a decoder layer's activations: 4.0 GiB for a 16-layer, 8192-wide MLP on
16k tokens), for one more elementwise pass per layer in backward.

Only where Liger's kernels were applied (apply_liger) to a plain MLP: the projections are plain nn.Linear (not LoRA,
not 4-bit) and the module runs Liger's own LigerSwiGLUMLP / LigerGEGLUMLP forward; and only without gradient
checkpointing (which recomputes whole layers). On by default: measured on an H100 (Gemma-2 1.27B shape, batch 8 x
2048 packed, benchmarks/profile_step.py) the peak went from 39.7 to 35.7 GiB for 2.5 % of the step time.
TRAINBOX_MLP_RECOMPUTE=0 keeps the product. The memory plan (memplan.py) still counts the product as kept: its
estimate stays on the safe side for the MLPs this does not reach.
"""

from __future__ import annotations

import os

from trainbox.training.kernels import switches

ENV = "TRAINBOX_MLP_RECOMPUTE"


def _kernels(kind: str):
    if kind == "geglu":
        from liger_kernel.ops.geglu import geglu_backward as bwd, geglu_forward as fwd
    else:
        from liger_kernel.ops.swiglu import swiglu_backward as bwd, swiglu_forward as fwd
    return fwd, bwd


def _function():
    import torch
    import torch.nn.functional as F

    class ProductDown(torch.autograd.Function):
        """down_proj(act(a) * b), keeping a, b and the weight; the product is recomputed in backward."""

        @staticmethod
        @torch.amp.custom_fwd(device_type="cuda")
        def forward(ctx, a, b, weight, bias, kind: str):
            fwd, _ = _kernels(kind)
            a, b = a.contiguous(), b.contiguous()
            c = fwd(a, b)[2]
            out = F.linear(c, weight, bias)
            ctx.save_for_backward(a, b, weight)
            ctx.kind, ctx.bias = kind, bias is not None
            return out

        @staticmethod
        @torch.amp.custom_bwd(device_type="cuda")
        def backward(ctx, grad):
            a, b, weight = ctx.saved_tensors
            fwd, bwd = _kernels(ctx.kind)
            grad = grad.contiguous()
            g2 = grad.reshape(-1, grad.shape[-1])
            cast = weight.dtype != grad.dtype and not torch.is_autocast_enabled("cuda")
            dc = g2 @ (weight.to(grad.dtype) if cast else weight)  # (tokens, intermediate)
            c = fwd(a, b)[2].reshape(-1, a.shape[-1]).to(dc.dtype)
            dw = g2.t() @ c
            del c
            da, db = bwd(a, b, dc.reshape(a.shape))  # Liger writes them into a's and b's storage
            return da, db, dw, (g2.sum(0) if ctx.bias else None), None

    return ProductDown


def _kind(module) -> str | None:
    """'geglu'/'swiglu' for a module running Liger's plain MLP forward over plain nn.Linear projections."""
    import torch.nn as nn

    try:
        from liger_kernel.transformers.geglu import LigerGEGLUMLP
        from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
    except ImportError:
        return None
    if not all(type(getattr(module, n, None)) is nn.Linear for n in ("gate_proj", "up_proj", "down_proj")):
        return None
    fn = getattr(module.forward, "__func__", None)
    if type(module) is LigerGEGLUMLP or fn is LigerGEGLUMLP.forward:  # the class, or apply_liger's bound forward
        return "geglu"
    if type(module) is LigerSwiGLUMLP or fn is LigerSwiGLUMLP.forward:
        return "swiglu"
    return None


def setting() -> tuple[bool, str | None]:
    """(on?, a note on the variable): switches.setting for ENV."""
    return switches.setting(ENV)


def choose(model, checkpointing: bool) -> str | None:
    """Apply where it saves memory (checkpointing recomputes whole layers anyway); the line to print, or None."""
    if checkpointing:
        return None
    on, note = setting()
    if not on:
        return f"MLP product kept for backward ({ENV}={os.environ.get(ENV)})"
    n = apply(model)
    return (f"MLP product recomputed in backward ({n} layers: 2 x intermediate bytes per token and layer less; "
            f"{ENV}=0 keeps it)" + (f"; {note}" if note else "")) if n else note


def apply(model) -> int:
    """Route every eligible MLP of `model` through ProductDown; returns how many were."""
    import types

    fn = None
    n = 0
    for module in model.modules():
        kind = _kind(module)
        if kind is None:
            continue
        fn = fn or _function()

        def forward(self, x, _kind=kind, _fn=fn):
            return _fn.apply(self.gate_proj(x), self.up_proj(x), self.down_proj.weight, self.down_proj.bias, _kind)

        module.forward = types.MethodType(forward, module)
        n += 1
    return n
