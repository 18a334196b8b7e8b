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
FSDP2 does the same on its own (float32 shards, bf16 all-gathered compute: speed.tune_fsdp), so this is for one
process per model copy.
"""

from __future__ import annotations

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

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group, igroup, masters in zip(self.param_groups, self.inner.param_groups, self.masters):
            # The LR scheduler (and anything else) changes this wrapper's groups: pass the values on.
            igroup.update({k: v for k, v in group.items() if k != "params"} | {"params": igroup["params"]})
            for p, m in zip(group["params"], masters):
                m.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        for group, masters in zip(self.param_groups, self.masters):
            pairs = [(p, m) for p, m in zip(group["params"], masters) if m.grad is not None]
            if pairs:
                torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])
            for m in masters:
                m.grad = None
        return loss

    def state_dict(self):
        return {"inner": self.inner.state_dict(), "masters": [[m.clone() for m in ms] for ms in self.masters],
                "groups": super().state_dict()["param_groups"]}

    def load_state_dict(self, state):
        self.inner.load_state_dict(state["inner"])
        for ms, saved, group in zip(self.masters, state["masters"], self.param_groups):
            for m, s, p in zip(ms, saved, group["params"]):
                m.copy_(s.to(m.device))
                p.data.copy_(m)
        for group, saved in zip(self.param_groups, state["groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})


def optimizer_for(trainer_cls, args, model) -> tuple[type, dict]:
    """(MasterWeights, kwargs) wrapping the optimizer the Trainer would build from `args` (e.g. fused AdamW)."""
    inner, kwargs = trainer_cls.get_optimizer_cls_and_kwargs(args, model)
    return MasterWeights, {"inner": inner, **kwargs}
