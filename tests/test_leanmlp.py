"""leanmlp's autograd plumbing on the CPU: Liger's Triton kernels need a GPU, so they are stood in for by the same
math in torch (forward: act(a) * b; backward: da, db written into a's and b's storage, as Liger's do). The product
recomputed in backward gives the same output and gradients as an MLP that keeps it, bias included; and when it
applies. The real kernels run in tests/gpu/leanmlp_check.py (device figures in benchmarks/results)."""

from __future__ import annotations

import pytest

from trainbox.training.kernels import leanmlp


def _torch_kernels(kind):
    import torch
    import torch.nn.functional as F

    def act(a):
        return F.gelu(a, approximate="tanh") if kind == "geglu" else F.silu(a)

    def fwd(a, b):
        return a, b, act(a) * b

    def bwd(a, b, dc):
        with torch.enable_grad():
            x, y = a.detach().requires_grad_(True), b.detach().requires_grad_(True)
            da, db = torch.autograd.grad(act(x) * y, (x, y), dc)
        a.copy_(da)
        b.copy_(db)
        return a, b

    return fwd, bwd


@pytest.mark.parametrize("kind", ["swiglu", "geglu"])
@pytest.mark.parametrize("bias", [False, True])
def test_recomputed_product_gives_the_same_gradients(monkeypatch, kind, bias):
    import torch
    import torch.nn.functional as F

    monkeypatch.setattr(leanmlp, "_kernels", _torch_kernels)
    torch.manual_seed(0)
    gate, up = torch.nn.Linear(16, 48, bias=False), torch.nn.Linear(16, 48, bias=False)
    down = torch.nn.Linear(48, 16, bias=bias)
    x = torch.randn(2, 5, 16)
    act = (lambda a: F.gelu(a, approximate="tanh")) if kind == "geglu" else F.silu
    got = {}
    for how in ("kept", "lean"):
        for m in (gate, up, down):
            m.zero_grad()
        xx = x.clone().requires_grad_(True)
        if how == "kept":
            y = down(act(gate(xx)) * up(xx))
        else:
            y = leanmlp._function().apply(gate(xx), up(xx), down.weight, down.bias, kind)
        (y * torch.arange(y.numel()).reshape(y.shape).sin()).sum().backward()
        got[how] = [y.detach(), xx.grad] + [p.grad.clone() for m in (gate, up, down) for p in m.parameters()]
    for ref, lean in zip(got["kept"], got["lean"]):
        assert torch.allclose(ref, lean, atol=1e-6), (ref - lean).abs().max()


def test_it_applies_only_without_checkpointing_and_can_be_turned_off(monkeypatch):
    import torch

    model = torch.nn.Linear(4, 4)
    assert leanmlp.choose(model, checkpointing=True) is None  # whole layers are recomputed anyway
    monkeypatch.setenv(leanmlp.ENV, "0")
    assert leanmlp.choose(model, checkpointing=False) == f"MLP product kept for backward ({leanmlp.ENV}=0)"
    monkeypatch.setenv(leanmlp.ENV, "off")
    assert leanmlp.setting() == (False, None)
    monkeypatch.delenv(leanmlp.ENV)
    assert leanmlp.setting() == (True, None)
    assert leanmlp.choose(model, checkpointing=False) is None  # nothing Liger-patched here: no line, no change
    assert "forward" not in model.__dict__


def test_any_value_of_the_switch_gives_a_line_never_a_traceback(monkeypatch):
    """Fuzzed: whatever TRAINBOX_MLP_RECOMPUTE holds, choose() returns a line or None (a typo is named, never
    raised)."""
    import torch
    from hypothesis import given, settings, strategies as st

    model = torch.nn.Linear(4, 4)

    @settings(max_examples=200, deadline=None)
    @given(st.text().filter(lambda t: "\x00" not in t))
    def check(value):
        monkeypatch.setenv(leanmlp.ENV, value)
        line = leanmlp.choose(model, checkpointing=False)
        v = value.strip().lower()
        if v in ("0", "false", "no", "off"):
            assert line == f"MLP product kept for backward ({leanmlp.ENV}={value})"
        elif v in ("", "1", "true", "yes", "on"):
            assert line is None  # on, and nothing here to apply it to
        else:
            assert line == f"{leanmlp.ENV}={value!r} is neither 0 nor 1: left on"

    check()
