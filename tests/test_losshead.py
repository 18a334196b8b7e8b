"""losshead.py's one-pass loss head against TRL's ChunkedLogProbFunction (the function it stands in for), on the CPU
in float32: the same log-probabilities, entropy, top-1 flags and gradients, with softcaps, logit scales and
temperatures, over several tiles; the LM head's gradient right when the tokens are weighted unevenly (its fallback);
and which calls take the path (install(), applies())."""

from __future__ import annotations

import types

import pytest

from trainbox.training.kernels import losshead


def _inputs(n=300, hidden=24, vocab=1000, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * 0.5
    targets = torch.randint(0, vocab, (n,), generator=g)
    return h, w, targets


def _run(fn, h, w, targets, weights, **kw):
    """fn's (log_probs, entropy, is_top1) and the gradients of sum(weights * log_probs) w.r.t. hidden and weight."""
    h = h.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    lp, ent, _, _, top1 = fn(h, w, targets, **kw)
    (lp * weights).sum().backward()
    return lp.detach(), ent.detach(), top1, h.grad, w.grad


def _trl(h, w, targets, temperature=1.0, softcap=None, scale=1.0):
    from trl.kernels import ChunkedLogProbFunction

    return ChunkedLogProbFunction.apply(h, w, None, targets, temperature, 256, softcap, scale, losshead.OUTPUTS)


def _ours(h, w, targets, temperature=1.0, softcap=None, scale=1.0):
    return losshead.one_pass().apply(h, w, targets, temperature, softcap, scale, losshead.OUTPUTS)


def _close(a, b, what):
    import torch

    # rtol 1e-3: torch's CPU logsumexp can differ by ~4e-5 on its first call in a process (torch 2.13), which moves
    # the entropy by ~4e-4; the mistakes this catches (a chain-rule term, an uneven weighting) are off by O(1)
    assert torch.allclose(a, b, atol=1e-5 * float(b.abs().max()) + 1e-6, rtol=1e-3), (what, float((a - b).abs().max()))


@pytest.mark.parametrize("kw", [{}, {"softcap": 3.0}, {"scale": 0.7, "temperature": 0.8},
                                {"softcap": 30.0, "scale": 2.0}])
@pytest.mark.parametrize("uneven", [False, True])
def test_same_outputs_and_gradients_as_trl(kw, uneven, monkeypatch):
    import torch

    monkeypatch.setattr(losshead, "TILE_TOKENS", 128)  # 300 tokens: three tiles, the last one short
    h, w, targets = _inputs()
    if uneven:  # GRPO-like per-token weights: the LM head's gradient is computed again from the tiles
        weights = torch.rand(len(targets), generator=torch.Generator().manual_seed(3)) - 0.5
    else:  # SFT's loss: -sum / tokens
        weights = torch.full((len(targets),), -1.0 / len(targets))
    lp, ent, top1, gh, gw = _run(_ours, h, w, targets, weights, **kw)
    ref = _run(_trl, h, w, targets, weights, **kw)
    _close(lp, ref[0], "log_probs")
    _close(ent, ref[1], "entropy")
    assert torch.equal(top1, ref[2])
    _close(gh, ref[3], "hidden's gradient")
    _close(gw, ref[4], "weight's gradient")
    assert gw.abs().max() > 0 and gh.abs().max() > 0


def test_a_loss_known_uniform_skips_the_weights_check(monkeypatch):
    """uniform(known=True) (sftloss.py's own NLL): the backward takes the first token's factor for all without
    reading the weights on the host; its result for SFT's weights is the checked path's. Nested marks stay known."""
    import torch

    monkeypatch.setattr(losshead, "TILE_TOKENS", 128)
    h, w, targets = _inputs()
    sft = torch.full((len(targets),), -1.0 / len(targets))
    checked = _run(_ours, h, w, targets, sft)
    with losshead.uniform(known=True), losshead.uniform():
        assert losshead._uniform == "known"
        known = _run(_ours, h, w, targets, sft)
        uneven = torch.linspace(-1, 1, len(targets))
        skipped = _run(_ours, h, w, targets, uneven)
    assert losshead._uniform is False
    for a, b in zip(known[3:], checked[3:]):
        assert torch.equal(a, b)
    first = _run(_ours, h, w, targets, torch.full_like(uneven, float(uneven[0])))
    assert torch.equal(skipped[4], first[4])  # the weights were taken as uniform: the check did not run


def test_top1_is_the_first_maximum():
    import torch

    w = torch.zeros(5, 2)
    w[1, 0] = w[3, 0] = 1.0  # vocabulary entries 1 and 3 tie for the top logit
    h = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]])
    targets = torch.tensor([1, 3, 0])
    top1 = _ours(h, w, targets)[4]
    assert top1.tolist() == [True, False, False]
    assert _trl(h, w, targets)[4].tolist() == [True, False, False]


def test_frozen_head_gives_the_hidden_gradient_for_any_weighting():
    import torch

    h, w, targets = _inputs(n=64, vocab=300)
    weights = torch.linspace(-1, 1, 64)
    hh = h.clone().requires_grad_(True)
    lp = _ours(hh, w, targets)[0]  # w needs no gradient (QLoRA's frozen head)
    (lp * weights).sum().backward()
    hr = h.clone().requires_grad_(True)
    (_trl(hr, w, targets)[0] * weights).sum().backward()
    _close(hh.grad, hr.grad, "hidden's gradient")


def test_no_tokens():
    import torch

    h, w, targets = _inputs(n=0)
    lp, ent, top1, gh, gw = _run(_ours, h, w, targets, torch.zeros(0))
    assert lp.shape == (0,) and gh.shape == h.shape and torch.count_nonzero(gw) == 0


@pytest.mark.parametrize("known", [False, True])
def test_an_entropy_gradient_is_refused(known):
    h, w, targets = _inputs(n=8, vocab=50)
    h.requires_grad_(True)
    with losshead.uniform(known=known):  # known or not: outside a compiled graph an entropy gradient is a mistake
        lp, ent, *_ = _ours(h, w, targets)
    with pytest.raises(RuntimeError, match="no entropy gradient"):
        (lp.sum() + ent.sum()).backward()


def _trainer(**args):
    defaults = dict(loss_type="nll")
    calls = []

    def compute_loss(*a, **kw):
        calls.append(losshead._uniform)
        return "loss"

    t = types.SimpleNamespace(args=types.SimpleNamespace(**{**defaults, **args}), compute_loss_func=None,
                              label_smoother=None, compute_loss=compute_loss)
    return t, calls


def test_install_marks_plain_nll_only(monkeypatch):
    import trl.trainer.utils as trl_utils

    original = trl_utils._ChunkedLogProbFunction
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", original)
    t, calls = _trainer()
    assert losshead.install(_trainer()[0], on_gpu=False) is None
    assert "3 GEMMs" in losshead.install(t, on_gpu=True)
    assert trl_utils._ChunkedLogProbFunction is losshead.LogProbs and losshead._FN["trl"] is original
    assert t.compute_loss(None, {}) == "loss" and calls == [True] and losshead._uniform is False
    # a second trainer: TRL's function is still the one kept
    assert losshead.install(_trainer()[0], on_gpu=True) and losshead._FN["trl"] is original
    monkeypatch.setenv(losshead.ENV, "0")
    off = _trainer()[0]
    before = off.compute_loss
    assert losshead.install(off, on_gpu=True) == f"loss head: TRL's ({losshead.ENV}=0)" and off.compute_loss is before
    monkeypatch.setenv(losshead.ENV, "maybe")
    assert "neither 0 nor 1: left on" in losshead.install(_trainer()[0], on_gpu=True)
    monkeypatch.delenv(losshead.ENV)
    for other in (_trainer(loss_type="dft")[0], types.SimpleNamespace(**{**_trainer()[0].__dict__,
                                                                          "compute_loss_func": len})):
        before = other.compute_loss
        assert losshead.install(other, on_gpu=True) is None and other.compute_loss is before


def test_applies_only_inside_uniform_with_gradients():
    import torch

    h, w, _ = _inputs(n=4, vocab=10)
    h.requires_grad_(True)
    gpu = types.SimpleNamespace(requires_grad=True, is_cuda=True, dim=lambda: 2, dtype=torch.bfloat16)
    wb = w.bfloat16()
    assert not losshead.applies(gpu, wb, None, losshead.OUTPUTS)  # outside uniform()
    with losshead.uniform():
        assert losshead.applies(gpu, wb, None, losshead.OUTPUTS)
        assert not losshead.applies(h, w, None, losshead.OUTPUTS)  # on the CPU: TRL's
        assert not losshead.applies(gpu, w, None, losshead.OUTPUTS)  # float32 weight (autocast's business): TRL's
        assert not losshead.applies(gpu, wb, torch.zeros(10), losshead.OUTPUTS)  # a bias
        assert not losshead.applies(gpu, wb, None, losshead.OUTPUTS + ("mean_logits",))
        with torch.no_grad():
            assert not losshead.applies(gpu, wb, None, losshead.OUTPUTS)


def test_a_trl_whose_kernels_changed_keeps_its_own_head(monkeypatch):
    import trl.trainer.utils as trl_utils

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", trl_utils._ChunkedLogProbFunction)
    assert losshead.self_check() is None  # this TRL: the one-pass head gives its results
    monkeypatch.setitem(losshead._FN, "check", None)
    broken = losshead._kernels

    def renamed(device):  # a TRL whose backward step takes other arguments
        fold, _, block = broken(device)
        return fold, (lambda n, cols: (lambda *a, **kw: None)), block

    monkeypatch.setattr(losshead, "_kernels", renamed)
    assert losshead.self_check() == "the one-pass head differs from this TRL's on a test case"
    monkeypatch.setattr(losshead, "_kernels", lambda device: (_ for _ in ()).throw(AttributeError("_forward_tile")))
    why = losshead.self_check()
    assert why.startswith("this TRL's kernels did not take the one-pass call") and "_forward_tile" in why
    monkeypatch.delitem(losshead._FN, "check")
    t, _ = _trainer()
    assert losshead.install(t, on_gpu=True) == f"loss head: TRL's ({why})"


def test_given_rows_are_picked_and_put_back(monkeypatch):
    """uniform(rows=...): the head scores the labelled rows only and returns every row (zeros where unlabelled);
    rows that are not the ones TRL scored (another size) go to TRL's function, right for any weighting."""
    import torch
    from trl.kernels import ChunkedLogProbFunction

    monkeypatch.setitem(losshead._FN, "trl", ChunkedLogProbFunction)
    h, w, targets = _inputs(n=40, vocab=60)
    rows = torch.arange(40) % 3 != 0
    with losshead.uniform(known=True, rows=rows):
        lp, ent, _, _, top1 = losshead.LogProbs.apply(h, w, None, targets, 1.0, 16)
    ref = ChunkedLogProbFunction.apply(h[rows], w, None, targets[rows], 1.0, 16, None, 1.0, losshead.OUTPUTS)
    assert lp.shape == (40,) and torch.equal(lp[rows], ref[0]) and torch.equal(ent[rows], ref[1])
    assert torch.equal(top1[rows], ref[4]) and not lp[~rows].any() and not top1[~rows].any()
    seen = []
    monkeypatch.setitem(losshead._FN, "trl", types.SimpleNamespace(apply=lambda *a: seen.append(a[0].shape) or ()))
    with losshead.uniform(known=True, rows=rows[:39]):
        losshead.LogProbs.apply(h, w, None, targets, 1.0, 16)
    assert seen == [h.shape]  # all 40 rows, to TRL's own function


@pytest.mark.parametrize("known", [True, False])
def test_inside_the_users_torch_compile(monkeypatch, known):
    """--torch_compile: Dynamo traces the model around the head. The head runs eagerly behind a graph break (on a GPU
    Dynamo crashed tracing its float32-output GEMMs), and the zeros the compiled graph hands back for the entropy it
    passed on unused are no entropy gradient (sftloss's known-uniform loss, or TRL's under uniform()): the same values
    and gradients; a real entropy gradient from a compiled graph is still refused."""
    import torch
    import trl.trainer.utils as trl_utils

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", trl_utils._ChunkedLogProbFunction)
    monkeypatch.setattr(losshead, "applies", lambda *a: True)  # the GPU path's condition, here on the CPU
    assert losshead.install(_trainer()[0], on_gpu=True)  # makes the eager wrapper, outside any trace
    eager, calls = losshead._FN["eager"], []
    monkeypatch.setitem(losshead._FN, "eager", torch.compiler.disable(lambda *a: calls.append(1) or eager(*a)))

    def head(h, w, t):
        lp, ent, _, _, top1 = losshead.LogProbs.apply(h, w, None, t, 1.0, 16)
        return lp * 1.0, ent * 1.0  # the model's compiled code after the head takes both on

    h, w, t = _inputs(n=40, vocab=60)
    torch._dynamo.reset()
    got = []
    for fn in (head, torch.compile(head, backend="aot_eager")):
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        with losshead.uniform(known=known):
            lp, ent = fn(hh, ww, t)
            (-lp.sum() / len(t)).backward()
        got.append((lp.detach(), ent.detach(), hh.grad, ww.grad))
    for a, b in zip(*got):
        assert torch.equal(a, b)
    assert got[1][3].abs().max() > 0 and calls == [1]  # the compiled call ran the head eagerly, untraced
    if not known:
        lp, ent = torch.compile(head, backend="aot_eager")(h.clone().requires_grad_(True), w, t)
        with pytest.raises(RuntimeError, match="no entropy gradient"):
            (lp.sum() + ent.sum()).backward()
