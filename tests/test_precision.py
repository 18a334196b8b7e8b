"""bf16 weights + float32 master weights (entrypoints/precision.py): updates too small for bf16 are kept, the
trajectory is fp32 AdamW's, the LR schedule reaches the inner optimizer, and a resumed run continues exactly."""

import pytest
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


# ---------------------------------------------------------------- the memory plan (speed.choose_memory)
GIB = 2**30
LLAMA_8B = dict(model_type="llama", params=8_030_261_248, embedding_params=525_336_576, layers=32, hidden=4096,
                intermediate=14336, attn_width=4096)  # Llama-3.1-8B's shape


def plan(free_gib, shards=1, extra=0, masters_ok=True, **set_by_user):
    from types import SimpleNamespace

    from entrypoints import config, speed

    args = SimpleNamespace(per_device_train_batch_size=2, max_length=1024, optim="adamw_torch_fused",
                           gradient_checkpointing=set_by_user.get("gradient_checkpointing", True))
    setattr(args, config._EXPLICIT_ATTR, frozenset(set_by_user))
    line, masters_off = speed.choose_memory(args, speed.ModelFacts(**LLAMA_8B), shards, int(free_gib * GIB),
                                            masters_ok=masters_ok, extra=extra)
    return args.gradient_checkpointing, masters_off, line


def test_8b_on_one_h200_drops_master_weights_and_checkpoints_where_trl_trains():
    """The case measured on an H200: 139.2 GiB free. Master weights need 20 bytes/param (149.6 GiB) at the step:
    the float32 path (16, what `trl sft` peaked at) with checkpointing is what fits."""
    ckpt, masters_off, line = plan(139.2)
    assert ckpt is True and masters_off and "149.6 GiB" in masters_off
    assert "estimate 120.6 GiB = 16 B/param (float32 weights" in line and "over 85 % of 139.2 GiB" in line


def test_1b_keeps_master_weights_and_skips_checkpointing():
    from entrypoints import speed

    small = {**LLAMA_8B, "params": 1_235_814_400, "layers": 16, "hidden": 2048, "intermediate": 8192}
    e = speed.estimate_bytes(speed.ModelFacts(**small), 2048, "adamw_torch_fused", masters=True)
    assert e["per_param"] == 20 and e["total"] < 0.85 * 139 * GIB
    e8 = speed.estimate_bytes(speed.ModelFacts(**small), 2048, "adamw_bnb_8bit")
    assert e8["per_param"] == 10  # 8-bit moments: 2 bytes instead of 8


def test_nothing_fits_is_one_error_naming_the_options():
    from entrypoints.errors import UsageError

    with pytest.raises(UsageError, match=r"8.0 B parameters need about 120.6 GiB .* 80.0 GiB are free: use more GPUs"
                                         r".*adamw_bnb_8bit.*trainbox qlora.*gradient_accumulation_steps"):
        plan(80)


def test_user_checkpointing_is_kept_and_only_precision_varies():
    ckpt, masters_off, line = plan(139.2, gradient_checkpointing=False)
    assert ckpt is False and masters_off and line.startswith("gradient checkpointing off (set by you; estimate 132.4")


def test_fsdp_without_reshard_counts_unsharded_bf16_layers_and_grpo_its_reference_model(monkeypatch):
    from entrypoints import speed

    f = speed.ModelFacts(**LLAMA_8B)
    sharded = speed.estimate_bytes(f, 2048, "adamw_torch_fused", shards=2, checkpointing=True)
    kept = speed.estimate_bytes(f, 2048, "adamw_torch_fused", shards=2, checkpointing=True, unsharded=True)
    assert kept["total"] - sharded["total"] == 2 * f.params - 4 * f.params // f.layers
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    # one node: no reshard, so 4 + 4 sharded + 2 whole bytes/param (and no checkpointing: it fits)
    assert "estimate 87.5 GiB = 10 B/param" in plan(139.2, shards=2, masters_ok=False)[2]
    ref = plan(192, masters_ok=False, extra=4 * f.params)[2]  # (a B200: on an H200 policy + reference exceed it)
    assert "+ 29.9 GiB reference model" in ref
