"""Learned attention sinks (gpt-oss) on torch's varlen FlashAttention kernel: exact, forward and backward.

gpt-oss's eager attention takes each head's softmax over [scores, sink] and drops the sink's column, so every real
key's probability is p * Z / (Z + e^sink) with Z = e^lse: out = o * w, w = sigmoid(lse - sink) per query and head
(flexattn applies the same to FlexAttention's output). FlashAttention returns o and lse, but its backward takes no
gradient for lse. The sink is a key whose value is zero, so the backward of the whole softmax, sink included, is
FlashAttention's own backward called with dout = w * dy and out = y (= w * o): from lse it rebuilds P (without the
sink), and then
    dV = P^T dout              = P'^T dy                    (P' = w P: the probabilities with the sink)
    D  = rowsum(dout * out)    = w * rowsum(dy * y)
    dS = P (dout V^T - D)      = P' (dy V^T - rowsum(dy * y))
which is the softmax backward with the sink in it. The sink's own gradient is its column of the same dS, summed over
the head's queries: -(1 - w) * rowsum(dy * y). tests/test_varlen_sinks.py checks these identities against autograd
through eager's softmax; tests/gpu/flex_check.py --impl trainbox_varlen checks the kernel against float32 eager.

The kernel is called through its aten ops (torch.ops.aten._flash_attention_forward/_backward, what
torch.nn.attention.varlen wraps), which take a window on every torch with varlen FlashAttention.
"""

from __future__ import annotations

_FN: dict = {}


def apply_sinks(out, lse, sinks):
    """(y = out * w, w (tokens, heads) float32) for out (tokens, heads, dim), lse (heads, tokens), sinks (heads,)."""
    import torch

    w = torch.sigmoid(lse.float() - sinks.float()[:, None]).t()
    return (out.float() * w[..., None]).to(out.dtype), w


def sink_grads(dy, y, w):
    """(dout for FlashAttention's backward, the sinks' gradient (heads,) float32) from the gradient dy of y = w * o.
    dy, y (tokens, heads, dim); w (tokens, heads) float32."""
    rows = (dy.float() * y.float()).sum(-1)  # rowsum(dy * y): (tokens, heads)
    dsinks = -((1.0 - w) * rows).sum(0)
    return (dy.float() * w[..., None]).to(dy.dtype), dsinks


def _compiled() -> None:
    """apply_sinks and sink_grads compiled, one kernel or two each (op by op they are about ten over the attention
    output: float32 casts, the gate, products and sums), the token count symbolic from the first call."""
    from trainbox.training.kernels import compilefail

    if "apply" not in _FN:
        _FN["apply"] = compilefail.Fallback(apply_sinks, "attention: the sinks", "applying them op by op",
                                            ((0, 0), (1, 1)))
        _FN["grads"] = compilefail.Fallback(sink_grads, "attention: the sinks' backward", "running it op by op",
                                            ((0, 0), (1, 0), (2, 0)))


def _bounds(window: int | None) -> tuple[int | None, int | None]:
    """FlashAttention's (left, right) for transformers' sliding_window (the tokens a query sees, itself included)."""
    return (window - 1, 0) if window else (None, None)


def _function():
    import torch

    class VarlenSinks(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, sinks, cu_q, cu_k, max_q: int, max_k: int, scale, window):
            left, right = _bounds(window)
            out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
                q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale, window_size_left=left,
                window_size_right=right)
            y, w = _FN["apply"](out, lse, sinks)
            ctx.save_for_backward(q, k, v, y, lse, w, cu_q, cu_k, rng, unused)
            ctx.args = (max_q, max_k, scale, left, right, sinks.dtype)
            return y

        @staticmethod
        def backward(ctx, dy):
            q, k, v, y, lse, w, cu_q, cu_k, rng, unused = ctx.saved_tensors
            max_q, max_k, scale, left, right, sinks_dtype = ctx.args
            dout, dsinks = _FN["grads"](dy.contiguous(), y, w)
            dq, dk, dv = torch.ops.aten._flash_attention_backward(
                dout, q, k, v, y, lse, cu_q, cu_k, max_q, max_k, 0.0, True, rng, unused, scale=scale,
                window_size_left=left, window_size_right=right)
            return dq, dk, dv, dsinks.to(sinks_dtype), None, None, None, None, None, None

    return VarlenSinks


def prepare() -> None:
    """Make the autograd Function now, outside any trace of the model (Dynamo cannot trace a class statement)."""
    if "fn" not in _FN:
        _FN["fn"] = _function()
    _compiled()


def attention(q, k, v, sinks, cu_q, cu_k, max_q: int, max_k: int, scale: float | None, window: int | None):
    """Causal varlen attention with a learned sink per head: q (tokens, heads, dim), k/v (tokens, kv heads, dim) in
    16 bits, sinks (heads,), cu_q/cu_k int32 cumulative lengths. Returns (tokens, heads, dim)."""
    prepare()
    return _FN["fn"].apply(q, k, v, sinks, cu_q, cu_k, int(max_q), int(max_k), scale, window)
