"""SFT's training loss without host syncs: TRL's SFTTrainer.compute_loss for the plain NLL loss, with its metrics
(entropy, mean token accuracy, tokens seen, the MoE balancing loss) kept on the GPU until the Trainer logs them.

TRL's compute_loss turns each metric into a Python number at every micro-batch (`.item()`, `num_valid > 0`): host
syncs right after the forward, so the host waits for the loss head's GEMMs to finish before it may launch the
backward, and a step whose kernels are small (MoE: thousands a step) then runs at the host's pace. Here the same
sums are appended as 0-d tensors and turned into numbers once per log line (`log`), where TRL averages them.

Taken where TRL's code does exactly this: training (evaluation and `return_outputs` go to TRL's), the `nll` loss, no
compute_loss_func, no label smoothing, no sequence parallelism. The loss is TRL's expression, and a CPU test runs
both on the same batches: the same loss, gradients and logged metrics.
"""

from __future__ import annotations

from trainbox.training.kernels import losshead


def usable(trainer) -> bool:
    """TRL's SFTTrainer configured for its plain fused-head NLL path in training."""
    args = trainer.args
    if not all(hasattr(trainer, a) for a in ("_metrics", "aux_loss_enabled", "_total_train_tokens", "_tp_size")):
        return False  # a TRL whose compute_loss keeps other state: its own stays
    if getattr(trainer, "compute_loss_func", None) is not None or getattr(trainer, "label_smoother", None) is not None:
        return False
    if getattr(args, "loss_type", "nll") != "nll":
        return False
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    return not (pc is not None and getattr(pc, "sp_enabled", False))


def install(trainer) -> bool:
    """Our compute_loss and log on `trainer` where usable(); False (TRL's stay) otherwise."""
    if not usable(trainer):
        return False
    trl_compute_loss, trl_log = trainer.compute_loss, trainer.log

    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs or not trainer.model.training:
            return trl_compute_loss(model, inputs, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)
        return train_loss(trainer, model, inputs, num_items_in_batch)

    def log(logs, start_time=None):
        settle(trainer)
        return trl_log(logs, start_time)

    trainer.compute_loss, trainer.log = compute_loss, log
    return True


def train_loss(trainer, model, inputs, num_items_in_batch):
    """TRL's loss for one micro-batch (sft_trainer.compute_loss, the fused-head NLL branch); the metrics as tensors."""
    import torch

    inputs["use_cache"] = False
    if trainer.aux_loss_enabled:
        inputs["output_router_logits"] = True
    labels = inputs.get("shift_labels")
    if labels is None and inputs.get("labels") is not None:
        labels = inputs["labels"][:, 1:]  # what TRL's fused forward scores (shift_labels as they come)
    # the loss below weighs every token alike; the head picks the labelled rows itself (no host sync in the backward)
    with losshead.uniform(known=True, rows=None if labels is None else labels != -100):
        outputs = model(**inputs, fused_lm_head=True)
    num_tokens = outputs.label_mask.sum() if num_items_in_batch is None else num_items_in_batch
    loss = -outputs.log_probs.sum() / torch.as_tensor(num_tokens).clamp(min=1)
    acc = trainer.accelerator
    if trainer.args.average_tokens_across_devices and num_items_in_batch is not None:
        loss = loss * (acc.num_processes // trainer.get_tp_size())
    if trainer.aux_loss_enabled:
        steps = trainer.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
        loss = loss + trainer.router_aux_loss_coef * outputs.aux_loss / steps

    metrics = trainer._metrics["train"]
    with torch.no_grad():
        num_valid = acc.gather_for_metrics(outputs.label_mask.sum()).sum()
        entropy = acc.gather_for_metrics(outputs.entropy.detach().sum()).sum()
        correct = acc.gather_for_metrics(outputs.is_top1.sum()).sum()
        some = num_valid > 0
        metrics["entropy"].append(torch.where(some, entropy / num_valid.clamp(min=1), 0.0))
        metrics["mean_token_accuracy"].append(torch.where(some, correct / num_valid.clamp(min=1), 0.0))
        if "attention_mask" in inputs:
            tokens = acc.gather_for_metrics(inputs["attention_mask"].sum()).sum()
        elif "position_ids" in inputs:
            local = inputs["position_ids"].size(1)
            tokens = local if acc.num_processes == 1 else acc.gather_for_metrics(
                torch.tensor(local, device=inputs["position_ids"].device)).sum()
        else:
            raise ValueError("Expected 'attention_mask' or 'position_ids' in inputs.")  # TRL's own error
        trainer._total_train_tokens += tokens // trainer._tp_size
        metrics["num_tokens"] = [trainer._total_train_tokens]
        if trainer.aux_loss_enabled:
            metrics["aux_loss"].append(acc.gather_for_metrics(outputs.aux_loss.detach()).mean())
    return loss


def settle(trainer) -> None:
    """The metrics kept as tensors, as the numbers TRL would have appended: one read per metric."""
    import torch

    if isinstance(trainer._total_train_tokens, torch.Tensor):
        trainer._total_train_tokens = int(trainer._total_train_tokens.item())
    for mode, metrics in trainer._metrics.items():
        for key, values in metrics.items():
            if key == "num_tokens" and mode == "train":
                metrics[key] = [trainer._total_train_tokens]
            elif any(isinstance(v, torch.Tensor) for v in values):
                device = next(v.device for v in values if isinstance(v, torch.Tensor))
                metrics[key] = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device)
                                            for v in values]).tolist()
