"""kernels/lora4bit.py: LoRA on a real 4-bit base (bitsandbytes' CPU backend) through the fused Function gives
PEFT's own outputs and gradients, and every call it cannot take falls through to PEFT's forward."""

import pytest

torch = pytest.importorskip("torch")
bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")


def _model(seed: int, dropout: float = 0.0, bias: bool = False):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    lin = bnb.nn.Linear4bit(96, 80, bias=bias, compute_dtype=torch.bfloat16, quant_type="nf4",
                            compress_statistics=True)
    lin.weight = bnb.nn.Params4bit(torch.randn(80, 96) / 10, requires_grad=False, quant_type="nf4",
                                   compress_statistics=True)
    if bias:
        lin.bias = torch.nn.Parameter(torch.randn(80, dtype=torch.bfloat16), requires_grad=False)
    holder = torch.nn.Sequential()
    holder.add_module("proj", lin.to("cpu"))
    holder.is_loaded_in_4bit = True  # what transformers sets on a quantized model: PEFT then takes its 4-bit layer
    model = get_peft_model(holder, LoraConfig(r=8, lora_alpha=16, lora_dropout=dropout, target_modules=["proj"]))
    for n, p in model.named_parameters():
        if "lora_" in n:  # what TRL does for a quantized base, and B off zero so its gradient path is exercised
            p.data = (torch.randn_like(p.data) / 10).to(torch.bfloat16)
    return model


def _grads(model, x):
    x = x.clone().requires_grad_(True)
    out = model(x)
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), x.grad, got


@pytest.mark.parametrize("bias", [False, True])
def test_fused_matches_peft_forward_and_backward(bias):
    from trainbox.training.kernels import lora4bit

    x = torch.randn(3, 5, 96, dtype=torch.bfloat16)
    ref_out, ref_dx, ref = _grads(_model(0, bias=bias), x)
    fused = _model(0, bias=bias)
    assert lora4bit.apply(fused) == 1
    out, dx, got = _grads(fused, x)
    assert set(got) == set(ref) and len(got) == 2  # lora_A, lora_B
    # bf16 arithmetic in a different order: PEFT rounds B(Ax) before scaling and adding, the fused path doesn't
    assert torch.allclose(out.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
    assert torch.allclose(dx.float(), ref_dx.float(), atol=2e-2, rtol=2e-2)
    for n in ref:
        assert torch.allclose(got[n].float(), ref[n].float(), atol=3e-2, rtol=3e-2), n


def test_the_fused_path_runs_and_ineligible_calls_fall_back(monkeypatch):
    from trainbox.training.kernels import lora4bit

    model = _model(1)
    lora4bit.apply(model)
    taken = []
    real = lora4bit._function

    def counting():
        cls = real()

        class Counted(cls):
            @staticmethod
            def forward(ctx, *a):
                taken.append(1)
                return cls.forward(ctx, *a)

        return Counted

    monkeypatch.setattr(lora4bit, "_function", counting)
    model = _model(1)
    assert lora4bit.apply(model) == 1 and lora4bit.apply(model) == 0  # once per layer
    x = torch.randn(4, 96, dtype=torch.bfloat16)
    model(x).sum().backward()
    assert taken == [1]
    with torch.no_grad():  # generation/evaluation: PEFT's path (bitsandbytes' GEMV for one token)
        model(x)
        model(x[:1])
    with model.disable_adapter():
        model(x).sum()
    assert taken == [1]
    dropped = _model(1, dropout=0.1)  # dropout: PEFT's path
    lora4bit.apply(dropped)
    dropped(x).sum().backward()
    assert taken == [1]


def test_choose_says_what_it_did(monkeypatch):
    from trainbox.training.kernels import lora4bit

    assert "fused into the base GEMM (1 layers" in lora4bit.choose(_model(2), distributed=False)
    assert lora4bit.choose(_model(2), distributed=True) is None
    assert lora4bit.choose(torch.nn.Linear(3, 3), distributed=False) is None
    monkeypatch.setenv(lora4bit.ENV, "0")
    m = _model(2)
    assert "PEFT's forward" in lora4bit.choose(m, distributed=False)
    assert not getattr(m.base_model.model.proj, "_trainbox_lora4bit", False)
