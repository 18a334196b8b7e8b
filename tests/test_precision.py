"""bf16 weights + float32 master weights (entrypoints/precision.py): updates too small for bf16 are kept, the
trajectory is fp32 AdamW's, the LR schedule reaches the inner optimizer, and a resumed run continues exactly."""

import torch

from entrypoints.precision import MasterWeights


def bf16_param(value=1.0, n=4):
    return torch.nn.Parameter(torch.full((n,), value, dtype=torch.bfloat16))


def run(opt, params, steps, grad=1.0):
    for _ in range(steps):
        for p in params:
            p.grad = torch.full_like(p, grad)
        opt.step()
        opt.zero_grad()


def test_small_updates_survive_where_plain_bf16_adamw_loses_them():
    plain, ours = bf16_param(), bf16_param()
    run(torch.optim.AdamW([plain], lr=1e-4, weight_decay=0.0), [plain], 100)
    opt = MasterWeights([ours], inner=torch.optim.AdamW, lr=1e-4, weight_decay=0.0)
    run(opt, [ours], 100)
    assert (plain == 1.0).all()  # every update rounded away: this model would never learn
    assert torch.allclose(opt.masters[0][0], torch.full((4,), 0.99), atol=1e-4)  # 100 x 1e-4 kept in float32
    assert (ours < 1.0).all() and ours.dtype == torch.bfloat16  # and the bf16 weights follow


def test_trajectory_is_float32_adamw():
    torch.manual_seed(0)
    ref = torch.nn.Parameter(torch.randn(64))
    ours = torch.nn.Parameter(ref.detach().to(torch.bfloat16))
    opt_ref = torch.optim.AdamW([ref], lr=1e-3)
    opt = MasterWeights([ours], inner=torch.optim.AdamW, lr=1e-3)
    opt.masters[0][0].copy_(ref.detach())  # same float32 start
    for i in range(20):
        g = torch.randn(64, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        ref.grad, ours.grad = g.float(), g
        opt_ref.step()
        opt.step()
    torch.testing.assert_close(opt.masters[0][0], ref.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.float(), ref.detach().to(torch.bfloat16).float())


def test_lr_schedule_reaches_the_inner_optimizer():
    p = bf16_param()
    opt = MasterWeights([p], inner=torch.optim.AdamW, lr=1e-2, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0 if step >= 1 else 1.0)
    run(opt, [p], 1)
    sched.step()  # lr -> 0
    before = opt.masters[0][0].clone()
    run(opt, [p], 3)
    assert opt.inner.param_groups[0]["lr"] == 0.0
    torch.testing.assert_close(opt.masters[0][0], before)


def test_resume_continues_from_the_float32_masters():
    a = bf16_param()
    opt_a = MasterWeights([a], inner=torch.optim.AdamW, lr=1e-4)
    run(opt_a, [a], 30)
    saved = opt_a.state_dict()
    run(opt_a, [a], 30)

    b = bf16_param(0.5)  # a fresh process: whatever the weights file held, the masters come back
    opt_b = MasterWeights([b], inner=torch.optim.AdamW, lr=1e-4)
    opt_b.load_state_dict(saved)
    run(opt_b, [b], 30)
    torch.testing.assert_close(opt_b.masters[0][0], opt_a.masters[0][0], rtol=0, atol=0)
    assert torch.equal(a, b)


def test_gradient_accumulation_keeps_float32_weights():
    """bf16 weights would sum micro-batch gradients in bf16: with accumulation the float32 path is chosen."""
    from types import SimpleNamespace

    from entrypoints import speed

    for steps, master in ((1, True), (4, False)):
        args = SimpleNamespace(bf16=True, optim="adamw_torch_fused", gradient_accumulation_steps=steps)
        model_args = SimpleNamespace(dtype="auto")
        line = speed.choose_precision(args, model_args, on_gpu=True, shards=1)
        assert args.trainbox_master_weights is master, line
        assert (model_args.dtype == "bfloat16") is master
        if not master:
            assert "gradient_accumulation_steps 4" in line
