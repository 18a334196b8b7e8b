"""vLLM's importance-sampling correction computed from the loss's own forward instead of an extra one.

TRL (1.16) runs one more no-grad forward of the policy over every generation batch when rollouts come from vLLM: the
"old" log-probs, from which the importance-sampling ratio between the trainer and vLLM (exp(old - vLLM's logprobs),
clipped or masked per vllm_importance_sampling_mode) corrects the loss. When the generation batch is used up within
one optimizer step (gradient_accumulation_steps a multiple of steps_per_generation x num_iterations, TRL's own test
for "old == current"), the weights that score the loss are the ones that generated, so the loss forward's log-probs,
detached, ARE the old log-probs: TRL itself then uses per_token_logps.detach() for the PPO ratio. This mixin skips
the extra forward in that case and computes the same ratio (and the same sampling/* metrics) from the loss forward.
On one H100 (1.24 B policy, 16 x 256-token rollouts) that forward was 0.08-0.095 s of a 0.85 s step.

Anything else (weights that may have changed since generation, the VESPO loss, which reads the ratio its own way)
keeps TRL's path.
"""

from __future__ import annotations

import math

import torch
from trl import GRPOTrainer
from trl.trainer.utils import nanmax, nanmin


def importance_ratio(current: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, mode: str,
                     clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """TRL's vLLM importance-sampling ratio (GRPOTrainer._generate_and_score_completions), from log-probs [B, T]."""
    diff = torch.nan_to_num((current - sampling) * mask, nan=0.0)  # no vLLM logprob: ratio 1
    if mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode in ("sequence_truncate", "token_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    if mode in ("sequence_mask", "token_mask"):
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    raise ValueError(f"Unknown vLLM importance sampling level: {mode}")


class LossTimeRatio(GRPOTrainer):
    """Mixin (before TRL's GRPOTrainer or a subclass of it): see the module docstring."""

    _ratio_inputs: dict | None = None  # the micro-batch whose loss forward is running (set by _compute_loss)

    def _ratio_from_loss(self) -> bool:
        generate_every = self.args.steps_per_generation * self.num_iterations
        return (self.use_vllm and self.vllm_importance_sampling_correction and self.loss_type != "vespo"
                and self.args.gradient_accumulation_steps % generate_every == 0)

    def _generate_and_score_completions(self, inputs):
        if not self._ratio_from_loss():
            return super()._generate_and_score_completions(inputs)
        # TRL reads the switch only to decide the old-policy forward, the ratio and its metrics; the loss reads it
        # again (to apply the ratio) after it is restored.
        self.vllm_importance_sampling_correction = False
        try:
            return super()._generate_and_score_completions(inputs)
        finally:
            self.vllm_importance_sampling_correction = True

    def _compute_loss(self, model, inputs):
        if not self._ratio_from_loss() or "importance_sampling_ratio" in inputs:
            return super()._compute_loss(model, inputs)
        self._ratio_inputs = inputs
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._ratio_inputs = None

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        inputs = self._ratio_inputs
        if inputs is not None:  # the loss's forward: the first call inside _compute_loss
            self._ratio_inputs = None
            self._add_ratio(inputs, out[0].detach())
        return out

    def _add_ratio(self, inputs: dict, current: torch.Tensor) -> None:
        """inputs["importance_sampling_ratio"] and TRL's sampling/* metrics, as TRL computes them at generation."""
        sampling = inputs["sampling_per_token_logps"]
        mask = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
        ratio = importance_ratio(current, sampling, mask, self.vllm_importance_sampling_mode,
                                 self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max)
        inputs["importance_sampling_ratio"] = ratio
        mode = "train" if self.model.training else "eval"
        zero = torch.tensor(0.0, device=current.device)
        on = mask.bool()
        delta = torch.abs(current - sampling)
        delta = delta[on & ~torch.isnan(delta)]
        sequence_level = self.vllm_importance_sampling_mode in ("sequence_mask", "sequence_truncate")
        flat = ratio.flatten() if sequence_level else ratio[on]
        gather = self.accelerator.gather
        metrics = self._metrics[mode]
        metrics["sampling/sampling_logp_difference/mean"].append(
            gather(delta.mean() if delta.numel() else zero).mean().item())
        metrics["sampling/sampling_logp_difference/max"].append(
            gather(delta.max() if delta.numel() else zero).max().item())
        metrics["sampling/importance_sampling_ratio/min"].append(
            nanmin(gather(flat.min() if flat.numel() else zero)).item())
        metrics["sampling/importance_sampling_ratio/mean"].append(
            gather(flat.mean() if flat.numel() else zero).nanmean().item())
        metrics["sampling/importance_sampling_ratio/max"].append(
            nanmax(gather(flat.max() if flat.numel() else zero)).item())
