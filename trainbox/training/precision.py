"""bf16 weights for compute, float32 master weights for the update: the precision of single-GPU full training.

Why not the alternatives:
- float32 parameters under bf16 autocast (TRL's default) are correct but cast every weight and every fp32 residual
  activation to bf16 and every gradient back, at each step: on an H200 with a 1.2 B model that was 11 % of the GPU
  time (profiled: aten::copy_ 8.7 %, plus the casts' backward).
- bf16 parameters with a plain AdamW are fast but wrong: an update smaller than half a bf16 step (8 bits of mantissa,
  ~0.4 % of the weight) rounds away, and with learning rates of 1e-5 most updates are that small.
- Here the model holds bf16 weights (no casts in forward or backward); the optimizer keeps a float32 copy of each
  weight, applies the update there with the optimizer the Trainer would have used (fused AdamW by default), and
  writes the rounded result back. The master copies are part of the optimizer's state, so a resumed run continues
  from the exact float32 weights.
- Gradients are summed in float32: a hook on each weight adds its bf16 gradient into the master's float32 .grad as
  soon as autograd has it and frees the bf16 one, so gradient accumulation over N micro-batches rounds once per
  micro-batch, never the running sum (summing in the bf16 .grad had a 2-7e-3 relative error after 4-64 of them).
  The Trainer's clipping and logged grad_norm read those float32 sums (attach()). Memory: bf16 weights (2 bytes
  per parameter) + float32 masters (4) + float32 gradients (4) + AdamW (8) = 18, with no copy at the step.
FSDP2 does the same on its own (float32 shards, bf16 all-gathered compute: speed.tune_fsdp), so this is for one
process per model copy.
"""

from __future__ import annotations

import functools

import torch


class MasterWeights(torch.optim.Optimizer):
    """Wraps `inner` (an optimizer class and its kwargs) around float32 copies of low-precision parameters."""

    def __init__(self, params, inner: type[torch.optim.Optimizer] = torch.optim.AdamW, **kwargs):
        super().__init__(params, dict(kwargs))
        self.masters: list[list[torch.Tensor]] = [
            [p.detach().float().clone() for p in g["params"]] for g in self.param_groups
        ]
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": m}
                  for g, m in zip(self.param_groups, self.masters)]
        self.inner = inner(groups, **kwargs)
        for p, m in self._pairs():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(functools.partial(_accumulate, m))

    def _pairs(self):
        for group, masters in zip(self.param_groups, self.masters):
            yield from zip(group["params"], masters)

    def _fold(self) -> None:
        """Gradients set by hand (not through autograd, so no hook ran) join the float32 sums too."""
        for p, m in self._pairs():
            if p.grad is not None:
                _accumulate(m, p)

    @torch.no_grad()
    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch's clip_grad_norm_ on the float32 gradient sums; returns the norm before clipping."""
        self._fold()
        grads = [m for _, m in self._pairs() if m.grad is not None]
        if not grads:
            return torch.zeros(())
        return torch.nn.utils.clip_grad_norm_(grads, max_norm, norm_type)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        self._fold()
        for group, igroup in zip(self.param_groups, self.inner.param_groups):
            # The LR scheduler (and anything else) changes this wrapper's groups: pass the values on.
            igroup.update({k: v for k, v in group.items() if k != "params"} | {"params": igroup["params"]})
        self.inner.step()
        pairs = [(p, m) for p, m in self._pairs() if m.grad is not None]
        if pairs:
            torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])
        for _, m in pairs:
            m.grad = None
        return loss

    def state_dict(self):
        # The masters as they are (torch's optimizers don't copy their state either): saved before the next step.
        return {"inner": self.inner.state_dict(), "masters": self.masters,
                "groups": super().state_dict()["param_groups"]}

    def load_state_dict(self, state):
        self.inner.load_state_dict(state["inner"])
        for ms, saved, group in zip(self.masters, state["masters"], self.param_groups):
            for m, s, p in zip(ms, saved, group["params"]):
                m.copy_(s.to(m.device))
                p.data.copy_(m)
        for group, saved in zip(self.param_groups, state["groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})


@torch.no_grad()
def _accumulate(master: torch.Tensor, p: torch.Tensor) -> None:
    """p's gradient of this backward into master.grad (float32), then p's own is freed."""
    if p.grad is None:
        return
    if master.grad is None:
        master.grad = p.grad.to(torch.float32, copy=True)
    else:
        master.grad.add_(p.grad)
    p.grad = None


def attach(trainer) -> None:
    """The Trainer clips and logs the norm of model.parameters()' .grad, which the hooks keep empty: point both at
    the float32 sums of the MasterWeights optimizer it creates."""

    def masters():
        opt = trainer.optimizer
        return getattr(opt, "optimizer", opt)  # accelerate wraps it

    trainer._clip_grad_norm = lambda model: masters().clip_master_grads(trainer.args.max_grad_norm)
    trainer._get_grad_norm = lambda model, grad_norm=None: (
        grad_norm if grad_norm is not None else masters().clip_master_grads(float("inf")))


def optimizer_for(trainer_cls, args, model) -> tuple[type, dict]:
    """(MasterWeights, kwargs) wrapping the optimizer the Trainer would build from `args` (e.g. fused AdamW)."""
    inner, kwargs = trainer_cls.get_optimizer_cls_and_kwargs(args, model)
    return MasterWeights, {"inner": inner, **kwargs}
