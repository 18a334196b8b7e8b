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
- Gradients are summed in float32: a hook on each weight takes its bf16 gradient as soon as autograd has it (the
  weight's own .grad stays empty). A step of one micro-batch uses it as it is (exact); from the second micro-batch
  on they are added into the master's float32 .grad, so gradient accumulation over N micro-batches rounds once per
  micro-batch, never the running sum (summing in the bf16 .grad had a 2-7e-3 relative error after 4-64 of them).
  The Trainer's clipping and logged grad_norm read those gradients (attach()); the clipping factor is applied in
  the step. Memory: bf16 weights (2 bytes per parameter) + float32 masters (4) + gradients (2, or 4 when summed)
  + AdamW (8) = 16-18.
- The step: with torch's fused AdamW (the Trainer's default) on a GPU, one kernel reads each gradient, clips it,
  updates the master and both moments and writes the bf16 weight (masterstep.py). Any other optimizer runs as
  itself on the float32 masters, and the rounded result is copied back. Where the memory plan takes torchao's 8-bit AdamW
  states (memplan.py: 12 bytes a parameter instead of 18, an 8B model without checkpointing on one H200), that
  optimizer steps the masters one weight at a time, each bf16 gradient made float32 just before its own update.
FSDP2 does the same on its own (float32 shards, bf16 all-gathered compute: speed.tune_fsdp), so this is for one
process per model copy.
"""

from __future__ import annotations

import functools

import torch

from trainbox.training.kernels import masterstep


class MasterWeights(torch.optim.Optimizer):
    """Wraps `inner` (an optimizer class and its kwargs) around float32 copies of low-precision parameters."""

    def __init__(self, params, inner: type[torch.optim.Optimizer] = torch.optim.AdamW,
                 moments: torch.dtype | None = None, **kwargs):
        super().__init__(params, dict(kwargs))
        # bf16: AdamW's moments in bf16 with stochastic rounding (masterstep.py), torch's AdamW options otherwise
        self.moments = moments
        self.steps = 0  # seeds the stochastic rounding: a different stream each step
        self.masters: list[list[torch.Tensor]] = [
            [p.detach().float().clone() for p in g["params"]] for g in self.param_groups
        ]
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": m}
                  for g, m in zip(self.param_groups, self.masters)]
        self.inner = inner(groups, **kwargs)
        self.pending: dict[int, torch.Tensor] = {}  # id(master): a micro-batch's gradient, as autograd made it
        self.scale: torch.Tensor | None = None  # the clipping factor the next step applies
        for p, m in self._pairs():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(functools.partial(self._take, m))

    def _pairs(self):
        for group, masters in zip(self.param_groups, self.masters):
            yield from zip(group["params"], masters)

    @torch.no_grad()
    def _take(self, master: torch.Tensor, p: torch.Tensor) -> None:
        """p's gradient of this backward: kept as it is if it is the step's first, else summed in master.grad
        (float32); p's own .grad is emptied."""
        if p.grad is None:
            return
        first = self.pending.pop(id(master), None)
        if master.grad is None and first is None:
            self.pending[id(master)] = p.grad
        else:
            if master.grad is None:
                master.grad = first.to(torch.float32, copy=True)
            master.grad.add_(p.grad)
        p.grad = None

    def _grads(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(weight, gradient, master) for each parameter that has one: gradients set by hand (not through
        autograd, so no hook ran) are taken first."""
        out = []
        for p, m in self._pairs():
            if p.grad is not None:
                self._take(m, p)
            g = m.grad if m.grad is not None else self.pending.get(id(m))
            if g is not None:
                out.append((p, g, m))
        return out

    @torch.no_grad()
    def clip_master_grads(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch's clip_grad_norm_ over the step's gradients (norms in float32); returns the norm before clipping.
        The factor is applied by the step (no pass over the gradients here)."""
        grads = [g for _, g, _ in self._grads()]
        if not grads:
            return torch.zeros(())
        norms = torch._foreach_norm(grads, norm_type, dtype=torch.float32)
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        if max_norm != float("inf"):
            factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            self.scale = factor if self.scale is None else self.scale * factor
        return total

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group, igroup in zip(self.param_groups, self.inner.param_groups):
            # The LR scheduler (and anything else) changes this wrapper's groups: pass the values on. torchao keeps
            # its learning rate as a tensor (its compiled step reads it): filled, not replaced.
            for k, v in group.items():
                if k == "params":
                    continue
                if isinstance(igroup.get(k), torch.Tensor) and not isinstance(v, torch.Tensor):
                    igroup[k].fill_(v)
                else:
                    igroup[k] = v
        triples = self._grads()
        left = self._one_pass(triples) if masterstep.usable(self.inner) else triples
        if left and self.moments is not None:  # torch's own AdamW has no bf16 moments: the kernel's update in ops
            for igroup, mine in self._by_group(left):
                masterstep.reference_step(self.inner, igroup, *map(list, zip(*mine)), self.scale, self.moments)
            left = []
        self.steps += 1
        if left:
            redo = {id(m) for _, _, m in left}
            self._op_by_op(left, skip=[t for t in triples if id(t[2]) not in redo])
        self.pending.clear()
        self.scale = None
        for _, _, m in triples:
            m.grad = None
        return loss

    def _one_pass(self, triples):
        """masterstep's kernel, group by group; returns the triples it did not update."""
        if not triples or not masterstep.tensors_ok(*map(list, zip(*triples))):
            return triples
        left = []
        for i, (igroup, mine) in enumerate(self._by_group(triples)):
            if left or (mine and not masterstep.step(self.inner, igroup, *map(list, zip(*mine)), scale=self.scale,
                                                     moments=self.moments, seed=self.steps * 1_000_003 + 7 * i)):
                left += mine
        return left

    def _by_group(self, triples):
        """(inner param group, its triples) for each group, in the groups' order."""
        by_master = {id(m): (p, g, m) for p, g, m in triples}
        for igroup in self.inner.param_groups:
            yield igroup, [by_master[id(m)] for m in igroup["params"] if id(m) in by_master]

    def _op_by_op(self, triples, skip) -> None:
        """The inner optimizer on the float32 masters of `triples`, the rounded result copied into the weights;
        `skip`: already updated (their float32 sums, if any, are dropped so that the inner step passes them by)."""
        for _, _, m in skip:
            m.grad = None
        if type(self.inner).__module__.startswith("torchao."):
            self._one_at_a_time(triples)
            return
        for _, g, m in triples:
            if m.grad is None:
                m.grad = g.to(torch.float32, copy=True)
        if self.scale is not None:
            torch._foreach_mul_([m.grad for _, _, m in triples], self.scale)
        self.inner.step()
        torch._foreach_copy_([p for p, _, _ in triples], [m for _, _, m in triples])

    def _one_at_a_time(self, triples) -> None:
        """A per-parameter optimizer (torchao's 8-bit AdamW: its step is one compiled call a weight anyway) given one
        float32 gradient at a time, so that the float32 copies of bf16 gradients never all exist at once (the
        memory plan counts one, the largest: memplan's "step" term)."""
        grads = [(p, m, m.grad if m.grad is not None else g) for p, g, m in triples]
        for _, _, m in triples:
            m.grad = None
        for p, m, g in grads:
            m.grad = g.to(torch.float32)
            if self.scale is not None:
                m.grad.mul_(self.scale)
            self.inner.step()  # (it passes by the masters whose .grad is None)
            m.grad = None
            p.copy_(m)

    def zero_grad(self, set_to_none: bool = True):
        super().zero_grad(set_to_none)
        self.pending.clear()
        self.scale = None
        for _, m in self._pairs():
            m.grad = None

    def state_dict(self):
        # The masters as they are (torch's optimizers don't copy their state either): saved before the next step.
        return {"inner": self.inner.state_dict(), "masters": self.masters,
                "groups": super().state_dict()["param_groups"], "steps": self.steps}

    def load_state_dict(self, state):
        if self.moments is None:
            self.inner.load_state_dict(state["inner"])
        else:  # torch's loader would make the bf16 moments float32 (its params' dtype): all at once, twice the memory
            saved = state["inner"]
            self.inner.load_state_dict({**saved, "state": {}})
            ids = [i for g in saved["param_groups"] for i in g["params"]]
            for i, p in zip(ids, [p for g in self.inner.param_groups for p in g["params"]]):
                if i in saved["state"]:
                    self.inner.state[p] = {k: v.to(p.device) for k, v in saved["state"][i].items()}
        self.steps = state.get("steps", 0)
        for ms, saved, group in zip(self.masters, state["masters"], self.param_groups):
            for m, s, p in zip(ms, saved, group["params"]):
                m.copy_(s.to(m.device))
                p.data.copy_(m)
        for group, saved in zip(self.param_groups, state["groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})


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
    """(MasterWeights, kwargs) wrapping the optimizer the Trainer would build from `args` (e.g. fused AdamW), or
    torchao's 8-bit AdamW with the same hyper-parameters where the memory plan chose its states
    (args.trainbox_states "8bit"), or AdamW with bf16 moments ("bf16": masterstep.py's kernel)."""
    states = getattr(args, "trainbox_states", "float32")
    if states == "8bit":
        from torchao.optim import AdamW8bit

        return MasterWeights, {"inner": AdamW8bit, "lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2),
                               "eps": args.adam_epsilon, "weight_decay": args.weight_decay}
    inner, kwargs = trainer_cls.get_optimizer_cls_and_kwargs(args, model)
    return MasterWeights, {"inner": inner, **kwargs, **({"moments": torch.bfloat16} if states == "bf16" else {})}
