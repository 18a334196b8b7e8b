"""gpt-oss's learned sinks on torch's varlen FlashAttention (varlen_sinks.py): the backward identity the kernel's own
backward is called with, the choice that sends gpt-oss there, and the rows the varlen attention function routes to
dense math. The kernel itself is CUDA-only: tests/gpu/flex_check.py --impl trainbox_varlen and
benchmarks/sink_kernels.py run it against float32 eager / dense math on the device."""

import pytest
import torch

from trainbox.training import attention
from trainbox.training.kernels import flexattn, varlen_sinks, varlenattn

LENS = (5, 9, 3)  # one packed row of three examples


def packed(heads=4, kv_heads=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(LENS)
    q = torch.randn(n, heads, dim, dtype=torch.float64, generator=g)
    k, v = (torch.randn(n, kv_heads, dim, dtype=torch.float64, generator=g) for _ in "kv")
    sinks = torch.randn(heads, dtype=torch.float64, generator=g)
    pos = torch.cat([torch.arange(n) for n in LENS])[None]
    return q, k, v, sinks, flexattn.documents(pos, None, 1, n, "cpu")


def layout(t):
    return t.transpose(0, 1)[None]  # (tokens, heads, dim) -> the models' (1, heads, tokens, dim)


def flash_forward(q, k, v, docs, scale, window):
    """What FlashAttention returns: (out (tokens, heads, dim), lse (heads, tokens)), without sinks."""
    out, lse = flexattn.dense(layout(q), layout(k), layout(v), docs, scale, window, None)
    return out[0].transpose(0, 1), lse[0]


def flash_backward(dout, q, k, v, out, lse, docs, scale, window):
    """FlashAttention's backward as its papers write it, from (dout, out, lse) alone: P = exp(S - lse), dV = P^T dout,
    dS = P * (dout V^T - rowsum(dout * out)); grouped key/value heads summed."""
    rep = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(rep, dim=1) for t in (k, v))
    n = q.shape[0]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    ok = (j <= i) & (i - j < (window or n + 1)) & (docs[0][:, None] == docs[0][None, :])
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    p = torch.exp(s.masked_fill(~ok, float("-inf")) - lse[..., None])
    dv = torch.einsum("hqk,qhd->khd", p, dout)
    dp = torch.einsum("qhd,khd->hqk", dout, vv)
    ds = p * (dp - (dout * out).sum(-1).t()[..., None])
    dq = torch.einsum("hqk,khd->qhd", ds, kk) * scale
    dk = torch.einsum("hqk,qhd->khd", ds, q) * scale
    group = lambda t: t.view(n, k.shape[1], rep, -1).sum(2)  # noqa: E731
    return dq, group(dk), group(dv)


def eager(q, k, v, sinks, docs, scale, window):
    """gpt-oss's softmax over [scores, sink] (flexattn's dense math with the sinks, the reference its tests hold to
    transformers' eager gpt-oss)."""
    out, lse = flexattn.dense(layout(q), layout(k), layout(v), docs, scale, window, None)
    return flexattn.with_sinks(out, lse, sinks)[0].transpose(0, 1)


@pytest.mark.parametrize("window", [None, 4])
def test_the_kernels_own_backward_with_the_sink_folded_in_is_the_softmax_backward_with_the_sink(window):
    """y = o * sigmoid(lse - sink); FlashAttention's backward called with dout = w * dy and out = y gives eager's
    gradients of q, k and v, and sink_grads the sink's own (float64 in, the gate in float32 as on the GPU: equal to
    float32's rounding)."""
    q, k, v, sinks, docs = packed()
    scale = 8 ** -0.5
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
    want = eager(*leaves, docs, scale, window)
    dy = torch.randn(want.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want.backward(dy)

    o, lse = flash_forward(q, k, v, docs, scale, window)
    y, w = varlen_sinks.apply_sinks(o, lse, sinks)
    assert torch.allclose(y, want.detach(), atol=1e-6)
    dout, dsinks = varlen_sinks.sink_grads(dy, y, w)
    got = flash_backward(dout, q, k, v, y, lse, docs, scale, window) + (dsinks.double(),)
    for name, a, leaf in zip(("dq", "dk", "dv", "dsinks"), got, leaves):
        assert torch.allclose(a, leaf.grad, atol=1e-6), name

    # The check can fail: the kernel's usual `out` (o, not y) in its rowsum gives other gradients.
    dq_wrong = flash_backward(dout, q, k, v, o, lse, docs, scale, window)[0]
    assert (dq_wrong - leaves[0].grad).abs().max() > 1e-3


def test_sinks_are_tried_on_the_varlen_kernel_before_flex_attention():
    """gpt-oss (window + sinks) gets the varlen kernel where it runs (FA3/FA2 drop sinks); Gemma 2's softcap still
    goes to FlexAttention; without the varlen kernel gpt-oss falls to FlexAttention."""
    oss = attention.Needs(window=128, sinks=True, head_dim=64)
    gemma = attention.Needs(window=1024, softcap=50.0, head_dim=256)
    hopper = {"attention_backend": "fa3"}
    every = lambda name: None  # noqa: E731
    c = attention.decide(hopper, (9, 0), every, model=oss)
    assert c.impl == attention.VARLEN and c.packed
    assert dict(c.skipped) == {"fa3": "would drop this model's attention sinks",
                               "fa2": "would drop this model's attention sinks"}
    assert "honours this model's attention" in c.line()
    torch_only = lambda name: "not installed" if name in ("fa3", "fa2") else None  # noqa: E731 - as on the device
    assert attention.decide(hopper, (9, 0), torch_only, model=gemma).impl == attention.FLEX
    no_varlen = attention.decide(hopper, (9, 0), lambda n: "not here" if n == "varlen" else None, model=oss)
    assert no_varlen.impl == attention.FLEX and ("varlen", "not here") in no_varlen.skipped


def test_rows_the_varlen_kernel_does_not_take_get_the_same_softmax_as_dense_math():
    """A padded batch and a KV cache (on the CPU every row) with sinks: varlenattn.attention_forward's dense path equals
    FlexAttention's (which the flex tests hold to transformers' eager gpt-oss), padding rows included."""
    q, k, v, sinks, _ = packed(seed=3)

    class Layer:
        is_causal, training = True, False

    qb, kb, vb = (t[:12].reshape(2, 6, t.shape[1], -1).transpose(1, 2).float() for t in (q, k, v))
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    for s, m in ((6, mask), (1, mask)):  # the whole rows; one decoding step over a cache of 6
        got, _ = varlenattn.attention_forward(Layer(), qb[:, :, -s:], kb, vb, m, scaling=0.3,
                                                    sliding_window=4, s_aux=sinks.float())
        want, _ = flexattn.flex_attention_forward(Layer(), qb[:, :, -s:], kb, vb, m, scaling=0.3,
                                                  sliding_window=4, s_aux=sinks.float())
        assert got.shape == (2, s, 4, 8)
        assert torch.allclose(got, want, atol=1e-6)


def test_a_compiled_helper_that_fails_to_compile_runs_op_by_op_with_one_line(capsys):
    """compilefail.Fallback (the sinks' compiled forward and backward here, FlexAttention's sinks): a compiler
    failure prints one line and the function runs op by op from then on, never compiled again."""
    from trainbox.training.kernels import compilefail

    def fn(x):
        torch._dynamo.graph_break()  # under fullgraph: an error of the compiler, not of the step
        return x * 2

    f = compilefail.Fallback(fn, "the test's helper", "running it op by op", ((0, 0),))
    x = torch.ones(3)
    assert torch.equal(f(x), x * 2) and f.compiled is False
    assert torch.equal(f(torch.ones(5)), torch.full((5,), 2.0))
    err = capsys.readouterr().err
    assert err.count("did not compile") == 1 and "the test's helper did not compile" in err and "op by op" in err
    torch._dynamo.reset()


def test_a_padded_batch_is_unpadded_once_a_mask_not_once_a_layer(monkeypatch):
    """GPU path of a padded batch with sinks (GRPO's loss forward): the rows are unpadded into one packed row by
    transformers' own unpadding, which reads the longest row on the host; the layers of a forward share the mask
    tensor (sliding and full layers may have one each), so that read happens once a mask."""
    from transformers import modeling_flash_attention_utils as fa_utils

    calls = []
    real = fa_utils._get_unpad_data
    monkeypatch.setattr(fa_utils, "_get_unpad_data", lambda m: calls.append(m) or real(m))
    monkeypatch.setattr(varlenattn, "_per_forward", [])
    full, sliding = torch.tensor([[0, 1, 1], [1, 1, 0]]), torch.tensor([[0, 1, 1], [1, 1, 0]])
    for _ in range(3):  # three layer pairs of one forward
        indices, cu, longest = varlenattn.unpadded(full)
        varlenattn.unpadded(sliding)
    assert len(calls) == 2
    assert indices.tolist() == [1, 2, 3, 4] and cu.tolist() == [0, 2, 4] and longest == 2
    varlenattn.unpadded(full.clone())  # the next forward's mask
    assert len(calls) == 3


def test_packed_position_ids_are_worked_out_once_a_forward_not_once_a_layer(monkeypatch):
    """Packing passes only position_ids that restart: their boundaries (three host syncs) are worked out once for the
    tensor every layer of a forward gets; a new tensor, or the same one changed in place, is worked out again."""
    from transformers import modeling_flash_attention_utils as fa_utils

    calls = []
    real = fa_utils.prepare_fa_kwargs_from_position_ids
    monkeypatch.setattr(fa_utils, "prepare_fa_kwargs_from_position_ids", lambda p: calls.append(p) or real(p))
    monkeypatch.setattr(varlenattn, "_per_forward", [])
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1]])
    for _ in range(4):  # four layers of one forward
        cu, longest = varlenattn.boundaries(pos)
    assert len(calls) == 1 and cu.tolist() == [0, 5, 8, 10] and longest == 5
    assert varlenattn.boundaries(torch.arange(6)[None]) is None  # one example: not packed
    pos[0, 8:] = torch.tensor([3, 4])  # changed in place: rows of 5 and 5
    assert varlenattn.boundaries(pos)[1] == 5 and varlenattn.boundaries(pos)[0].tolist() == [0, 5, 10]
    assert len(calls) == 2
    with torch.inference_mode():  # e.g. a generation pipeline: such tensors have no version counter
        frozen = torch.tensor([[0, 1, 0, 1, 2]])
    assert varlenattn.boundaries(frozen)[0].tolist() == [0, 2, 5] and varlenattn.boundaries(frozen)[1] == 3
    assert len(calls) == 3
