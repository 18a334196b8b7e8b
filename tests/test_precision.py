"""bf16 weights + float32 master weights (trainbox/training/kernels/precision.py): updates too small for bf16 are kept, the
trajectory is fp32 AdamW's, the LR schedule reaches the inner optimizer, and a resumed run continues exactly."""

import io

import pytest
import torch

from trainbox.training.kernels.precision import MasterWeights


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
    # Written as the Trainer writes optimizer.pt: state_dict() hands out the live masters (no copy), torch.save
    # copies them to the file before the next step.
    buf = io.BytesIO()
    torch.save(opt_a.state_dict(), buf)
    run(opt_a, [a], 30)
    buf.seek(0)
    saved = torch.load(buf)

    b = bf16_param(0.5)  # a fresh process: whatever the weights file held, the masters come back
    opt_b = MasterWeights([b], inner=torch.optim.AdamW, lr=1e-4)
    opt_b.load_state_dict(saved)
    run(opt_b, [b], 30)
    torch.testing.assert_close(opt_b.masters[0][0], opt_a.masters[0][0], rtol=0, atol=0)
    assert torch.equal(a, b)


def accumulate_through_autograd(p, micro: list[torch.Tensor]):
    """One backward per micro-batch, as the Trainer does: loss_k = <p, x_k> / N, so dloss_k/dp = x_k / N in bf16."""
    for x in micro:
        ((p * x).sum() / len(micro)).backward()


@pytest.mark.parametrize("n_micro", [4, 16, 64])
def test_accumulated_gradient_is_the_float32_sum_of_the_micro_batches(n_micro):
    """Each micro-batch's bf16 gradient rounds once; the running sum is float32. Summing in the bf16 .grad (what
    the weights alone would do) is measurably worse."""
    g = torch.Generator().manual_seed(n_micro)
    micro = [torch.randn(4096, generator=g).to(torch.bfloat16) for _ in range(n_micro)]
    exact = sum((x / n_micro).double() for x in micro)  # the bf16 gradients autograd hands over, summed exactly
    ours = torch.nn.Parameter(torch.randn(4096, generator=g).to(torch.bfloat16))
    opt = MasterWeights([ours], inner=torch.optim.AdamW, lr=1e-3)
    plain = torch.nn.Parameter(ours.detach().clone())
    accumulate_through_autograd(ours, micro)
    accumulate_through_autograd(plain, micro)
    assert ours.grad is None  # the hooks freed every bf16 gradient
    rel = lambda got: ((got.double() - exact).abs() / exact.abs().clamp_min(1e-3)).mean().item()  # noqa: E731
    assert rel(opt.masters[0][0].grad) < 1e-6
    assert rel(plain.grad) > 5e-4  # bf16 running sum


def test_trajectory_with_accumulation_and_clipping_is_float32_adamw():
    """16 micro-batches per step, gradient clipping at 1.0: the masters follow float32 AdamW fed the exact sums,
    and the clipped norm is the one the Trainer logs."""
    torch.manual_seed(0)
    ref = torch.nn.Parameter(torch.randn(256))
    ours = torch.nn.Parameter(ref.detach().to(torch.bfloat16))
    opt_ref, opt = torch.optim.AdamW([ref], lr=1e-3), MasterWeights([ours], inner=torch.optim.AdamW, lr=1e-3)
    opt.masters[0][0].copy_(ref.detach())
    for step in range(10):
        g = torch.Generator().manual_seed(step)
        micro = [torch.randn(256, generator=g).to(torch.bfloat16) for _ in range(16)]
        accumulate_through_autograd(ours, micro)
        ref.grad = sum((x / 16).double() for x in micro).float()
        ours_norm = opt.clip_master_grads(1.0)
        ref_norm = torch.nn.utils.clip_grad_norm_([ref], 1.0)
        torch.testing.assert_close(ours_norm, ref_norm, rtol=1e-6, atol=0)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
    torch.testing.assert_close(opt.masters[0][0], ref.detach(), rtol=0, atol=1e-6)
    assert opt.masters[0][0].grad is None


def test_accumulation_keeps_master_weights():
    """Accumulation no longer sends a run to the float32 path: the masters sum in float32."""
    from types import SimpleNamespace

    from trainbox.training import speed

    for steps in (1, 4):
        args = SimpleNamespace(bf16=True, optim="adamw_torch_fused", gradient_accumulation_steps=steps)
        model_args = SimpleNamespace(dtype="auto")
        line = speed.choose_precision(args, model_args, on_gpu=True, shards=1)
        assert args.trainbox_master_weights is True and model_args.dtype == "bfloat16", line


def test_a_real_trainer_clips_and_logs_the_float32_norm(tiny_model, tmp_path):
    """transformers' Trainer with the MasterWeights optimizer on a bf16 model, 2 micro-batches per step: the logged
    grad_norm is the float32 sums' (the bf16 .grad it would read is empty), and the weights move."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from trainbox.training.kernels import precision

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.bfloat16)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rows = Dataset.from_dict({"input_ids": [[5, 6, 7, 8, 9, 10, 11, 12]] * 8,
                              "labels": [[5, 6, 7, 8, 9, 10, 11, 12]] * 8})
    args = TrainingArguments(str(tmp_path), max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                             learning_rate=1e-2, max_grad_norm=1.0, logging_steps=1, report_to="none", use_cpu=True,
                             save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=rows,
                      optimizer_cls_and_kwargs=precision.optimizer_for(Trainer, args, model))
    precision.attach(trainer)
    trainer.train()
    norms = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    assert len(norms) == 2 and all(float(x) > 0.0 for x in norms)
    assert all(p.grad is None for p in model.parameters())
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())

# The memory plan (speed.choose_memory, trainbox/training/memplan.py) is tested in tests/test_memplan.py.


def test_one_micro_batch_keeps_its_gradient_as_autograd_made_it():
    """A step of one micro-batch allocates no float32 gradient: the bf16 one is kept until the step reads it."""
    p = torch.nn.Parameter(torch.randn(64).to(torch.bfloat16))
    opt = MasterWeights([p], inner=torch.optim.AdamW, lr=1e-3)
    accumulate_through_autograd(p, [torch.randn(64).to(torch.bfloat16)])
    master = opt.masters[0][0]
    assert p.grad is None and master.grad is None
    kept = opt.pending[id(master)]
    assert kept.dtype == torch.bfloat16
    before = master.clone()
    opt.step()
    assert not opt.pending and not torch.equal(master, before)


def test_a_group_the_kernel_left_runs_op_by_op_and_the_others_are_not_stepped_twice(monkeypatch):
    """masterstep updates group by group; should one fail (a kernel that does not compile), that group and the
    following ones take the inner optimizer, and the groups it already updated are passed by."""
    from trainbox.training.kernels import masterstep

    a, b = bf16_param(1.0), bf16_param(2.0)
    opt = MasterWeights([{"params": [a]}, {"params": [b]}], inner=torch.optim.AdamW, lr=1e-2, weight_decay=0.0)
    calls = []

    def fake_step(inner, group, weights, grads, masters, scale, **kw):
        calls.append(masters[0])
        return len(calls) == 1  # the first group "updated" (left as it was), the second refused

    monkeypatch.setattr(masterstep, "usable", lambda inner: True)
    monkeypatch.setattr(masterstep, "tensors_ok", lambda *lists: True)
    monkeypatch.setattr(masterstep, "step", fake_step)
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    opt.step()
    assert len(calls) == 2
    assert torch.equal(opt.masters[0][0], torch.full((4,), 1.0))  # not stepped again by the inner optimizer
    assert opt.masters[0][0] not in opt.inner.state
    assert (opt.masters[1][0] < 2.0).all() and torch.equal(b, opt.masters[1][0].to(torch.bfloat16))


# ------------------------------------------------------------ torchao's 8-bit AdamW as the inner optimizer (issue 60)
def test_8bit_inner_steps_the_float32_masters_as_torchao_steps_float32_weights():
    """The memory plan's masters + 8-bit rung: MasterWeights over bf16 weights with torchao's AdamW8bit inside gives
    the masters torchao's own trajectory on float32 weights fed the same gradients (one weight at a time, each
    stepped once), and the LR schedule reaches torchao's tensor learning rate."""
    AdamW8bit = pytest.importorskip("torchao.optim").AdamW8bit
    torch.manual_seed(0)
    shapes = [(64, 64), (4096,)]  # >= 4096 elements: 8-bit states (smaller ones stay float32 in torchao)
    refs = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    ours = [torch.nn.Parameter(r.detach().to(torch.bfloat16)) for r in refs]
    opt_ref = AdamW8bit(refs, lr=1e-3, weight_decay=0.01)
    opt = MasterWeights(ours, inner=AdamW8bit, lr=1e-3, weight_decay=0.01)
    for m, r in zip(opt.masters[0], refs):
        m.copy_(r.detach())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    sched_ref = torch.optim.lr_scheduler.LambdaLR(opt_ref, lambda step: 1.0 / (1 + step))
    for i in range(6):
        gen = torch.Generator().manual_seed(i)
        for r, p in zip(refs, ours):
            g = torch.randn(r.shape, generator=gen).to(torch.bfloat16)
            r.grad, p.grad = g.float(), g
        opt_ref.step()
        opt.step()
        opt.zero_grad()
        sched.step()
        sched_ref.step()
    assert float(opt.inner.param_groups[0]["lr"]) == pytest.approx(1e-3 / 6)  # the last step's, filled in
    assert type(opt.inner.state[opt.masters[0][0]]["exp_avg"]).__name__ == "OptimState8bit"
    for m, r, p in zip(opt.masters[0], refs, ours):
        torch.testing.assert_close(m, r.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(p.float(), r.detach().to(torch.bfloat16).float())


# ------------------------------------------------------------ bf16 moments with stochastic rounding (issue 60)
def test_stochastic_rounding_to_bf16_is_unbiased_and_lands_on_neighbours():
    from trainbox.training.kernels import masterstep

    x = torch.full((100_000,), 1.0 + 2**-10)  # 1/8 of the way from bf16's 1.0 to its next value, 1 + 2**-7
    r = masterstep.round_bf16(x, torch.Generator().manual_seed(0)).float()
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(r.mean().item() - x[0].item()) < 2e-5  # round-to-nearest would give 1.0: a bias of 1e-3
    neg = masterstep.round_bf16(-x, torch.Generator().manual_seed(0)).float()
    torch.testing.assert_close(neg, -r)  # the magnitude rounds alike for either sign


def test_bf16_moments_follow_float32_adamw_and_are_bf16():
    torch.manual_seed(0)
    ref = torch.nn.Parameter(torch.randn(4096))
    ours = torch.nn.Parameter(ref.detach().to(torch.bfloat16))
    opt_ref = torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.01)
    opt = MasterWeights([ours], inner=torch.optim.AdamW, moments=torch.bfloat16, lr=1e-3, weight_decay=0.01)
    opt.masters[0][0].copy_(ref.detach())
    start = ref.detach().clone()
    for i in range(50):
        g = torch.randn(4096, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        ref.grad, ours.grad = g.float(), g
        opt_ref.step()
        opt.step()
    state = opt.inner.state[opt.masters[0][0]]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    moved = (ref.detach() - start).norm()
    assert (opt.masters[0][0] - ref.detach()).norm() < 0.01 * moved  # within 1 % of the distance travelled
    saved = opt.state_dict()
    again = MasterWeights([torch.nn.Parameter(ours.detach().clone())], inner=torch.optim.AdamW,
                          moments=torch.bfloat16, lr=1e-3, weight_decay=0.01)
    again.load_state_dict(saved)
    assert again.steps == opt.steps == 50
    assert again.inner.state[again.masters[0][0]]["exp_avg"].dtype == torch.bfloat16
