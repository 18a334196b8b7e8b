"""SFT's training loss without host syncs (trainbox/training/kernels/sftloss.py) against TRL's own compute_loss on the same
batches: the same loss, gradients and logged metrics, dense and MoE (the balancing loss), padded and padding-free,
and a real training run logs numbers, not tensors."""

from __future__ import annotations

import pytest
import torch

from trainbox.training.kernels import sftloss


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    from zoo import make_zoo_model

    return make_zoo_model(tmp_path_factory.mktemp("mixtral"), "mixtral")


def _trainer(model_dir, tmp_path, **kw):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = Dataset.from_list([{"messages": [{"role": "user", "content": f"count to {i}"},
                                            {"role": "assistant", "content": " ".join(["one two"] * (i + 1))}]}
                              for i in range(8)])
    args = SFTConfig(str(tmp_path), per_device_train_batch_size=4, max_steps=2, report_to="none", use_cpu=True,
                     save_strategy="no", logging_steps=1, disable_tqdm=True, **kw)
    torch.manual_seed(0)
    return SFTTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir), args=args, train_dataset=rows,
                      processing_class=tok)


def _loss_grads_metrics(trainer, batch, num_items):
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    trainer._total_train_tokens = 0
    loss = trainer.compute_loss(trainer.model, dict(batch), num_items_in_batch=num_items)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    sftloss.settle(trainer)  # a no-op on TRL's numbers
    return loss.detach(), grads, {k: list(v) for k, v in trainer._metrics["train"].items()}


@pytest.mark.parametrize("model", ["tiny", "mixtral"])
@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize("given", [False, True], ids=["count-here", "num_items_in_batch"])
def test_same_loss_gradients_and_metrics_as_trl(model, padding_free, given, tiny_model, mixtral, tmp_path):
    trainer = _trainer(tiny_model if model == "tiny" else mixtral, tmp_path, padding_free=padding_free,
                       packing=padding_free)
    assert trainer.aux_loss_enabled == (model == "mixtral")
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    assert ("attention_mask" in batch) != padding_free and ("position_ids" in batch) >= padding_free
    num_items = (batch["labels"][:, 1:] != -100).sum() if given else None
    trainer.current_gradient_accumulation_steps = 2  # what the Trainer's loop sets: divides the balancing loss
    theirs = _loss_grads_metrics(trainer, batch, num_items)
    assert sftloss.install(trainer)
    ours = _loss_grads_metrics(trainer, batch, num_items)
    torch.testing.assert_close(ours[0], theirs[0], rtol=0, atol=0)
    assert ours[1].keys() == theirs[1].keys()
    for name in theirs[1]:
        torch.testing.assert_close(ours[1][name], theirs[1][name], rtol=0, atol=0)
    assert ours[2].keys() == theirs[2].keys() and {"entropy", "mean_token_accuracy", "num_tokens"} <= ours[2].keys()
    assert ("aux_loss" in ours[2]) == (model == "mixtral")
    for key, values in theirs[2].items():
        assert all(type(v) is type(w) for v, w in zip(ours[2][key], values)), key  # numbers, as TRL's
        assert ours[2][key] == pytest.approx(values, rel=1e-6), key


def test_a_training_run_logs_numbers(tiny_model, tmp_path):
    trainer = _trainer(tiny_model, tmp_path)
    assert sftloss.install(trainer)
    trainer.train()
    logged = [e for e in trainer.state.log_history if "entropy" in e]
    assert len(logged) == 2  # logging_steps=1, max_steps=2
    for entry in logged:
        for key in ("loss", "entropy", "mean_token_accuracy", "num_tokens"):
            assert isinstance(entry[key], (int, float)) and entry[key] == entry[key], (key, entry)
    assert logged[1]["num_tokens"] > logged[0]["num_tokens"] > 0


@pytest.mark.parametrize("kw", [dict(loss_type="dft"), dict(compute_loss_func=lambda *a, **k: 0)])
def test_other_losses_keep_trls(kw, tiny_model, tmp_path):
    if "loss_type" in kw:
        trainer = _trainer(tiny_model, tmp_path, **kw)
    else:
        trainer = _trainer(tiny_model, tmp_path)
        trainer.compute_loss_func = kw["compute_loss_func"]
    before = trainer.compute_loss
    assert not sftloss.install(trainer)
    assert trainer.compute_loss == before


@pytest.mark.parametrize("set_by_you", [False, True])
def test_nan_filter_off_on_gpus_unless_set(set_by_you, tmp_path):
    """HF's nan/inf loss filter syncs at every backward's end: off by default on a GPU, yours when you set it."""
    from trl import SFTConfig

    from trainbox.training import config as cfg, speed

    for on_gpu in (False, True):
        args = SFTConfig(str(tmp_path), report_to="none", use_cpu=True)  # HF's default: on
        cfg.set_explicit(args, ["logging_nan_inf_filter"] if set_by_you else [])
        speed.host_defaults(args, on_gpu)
        assert args.logging_nan_inf_filter is (set_by_you or not on_gpu)


def _graph(tensor) -> set[str]:
    """The names of the autograd nodes behind `tensor`."""
    seen, todo = set(), [tensor.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None and fn not in seen:
            seen.add(fn)
            todo += [nxt for nxt, _ in fn.next_functions]
    return {type(fn).__name__ for fn in seen}


@pytest.mark.parametrize("padding_free", [False, True])
def test_the_loss_heads_backward_reads_no_count_on_the_host(padding_free, tiny_model, tmp_path, monkeypatch):
    """On a GPU TRL's fused forward keeps the labelled rows (`hidden[mask]`) and scatters the results back: backward
    ops that read the mask's count on the host (IndexBackward0, MaskedScatterBackward0), where the backward waited
    for the head's GEMMs. With trainbox's head and loss the rows are picked in the forward: neither node is in the
    graph, and the loss and gradients are TRL's compacting path's (the one-pass head runs on the CPU here)."""
    import trl.trainer.utils as trl_utils

    from trainbox.training.kernels import losshead

    for name in ("_use_triton", "_ChunkedLogProbFunction"):
        monkeypatch.setattr(trl_utils, name, getattr(trl_utils, name))
    monkeypatch.setattr(trl_utils, "_use_triton", lambda device: True)  # TRL's GPU path: compact rows
    trainer = _trainer(tiny_model, tmp_path, padding_free=padding_free, packing=padding_free)
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    batch["labels"][:, :5] = -100  # some rows without a label, as a prompt's

    def run():
        trainer.model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(trainer.model, dict(batch))
        nodes = _graph(loss)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters()}, nodes

    trainer.model.train()
    theirs = run()
    assert {"IndexBackward0", "MaskedScatterBackward0"} <= theirs[2]
    monkeypatch.setattr(losshead, "applies", lambda hidden, weight, bias, outputs: bool(losshead._uniform))
    assert losshead.install(trainer, on_gpu=True) and sftloss.install(trainer)
    ours = run()
    assert not {"IndexBackward0", "MaskedScatterBackward0"} & ours[2] and "IndexSelectBackward0" in ours[2]
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-6)
    for name, grad in theirs[1].items():
        torch.testing.assert_close(ours[1][name], grad, rtol=1e-4, atol=1e-6 * float(grad.abs().max()) + 1e-7)
    assert trl_utils._use_triton(batch["labels"].device) is True  # outside the loss: TRL's own answer
