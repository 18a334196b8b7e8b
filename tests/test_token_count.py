"""throughput.TokenCount: the Trainer's non-padding token count kept on the device between reads must give the
same numbers as HF's own per-step count wherever they are read: each log line, the checkpoint's trainer_state.json
(resume reads it), the final state and the summary's tokens/s (Throughput). A real Trainer on a tiny Llama, CPU
(install's on_gpu=True forces it where it would otherwise stay HF's)."""

from __future__ import annotations

import json

import pytest

from trainbox.run import throughput


def _pad_to_longest(rows):
    import torch

    n = max(len(r["input_ids"]) for r in rows)
    pad = {"input_ids": 0, "attention_mask": 0, "labels": -100}
    return {k: torch.tensor([r[k] + [v] * (n - len(r[k])) for r in rows]) for k, v in pad.items()}


def _train(model_dir, out, lazy: bool, **options):
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    torch.manual_seed(0)
    rows = []
    width = None if options.get("torch_compile") else 16  # compiled: each batch padded to its longest row
    for i in range(10):  # rows of different real lengths, right-padded to 16: the mask's sum is the count
        n = 5 + i
        pad = (width or n) - n
        ids = [3 + (j * 7 + i) % 50 for j in range(n)] + [0] * pad
        rows.append({"input_ids": ids, "attention_mask": [1] * n + [0] * pad, "labels": ids[:n] + [-100] * pad})
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    args = TrainingArguments(output_dir=str(out), use_cpu=True, max_steps=5, per_device_train_batch_size=2,
                             logging_steps=2, save_steps=3, save_strategy="steps", report_to="none",
                             include_num_input_tokens_seen="non_padding", disable_tqdm=True, seed=0, **options)
    logs: list = []

    class Seen(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs))  # what each log line carried

    seen = logs
    cb = throughput.Throughput()
    trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[cb, Seen()],
                      data_collator=None if width else _pad_to_longest)
    cb.count = throughput.TokenCount.install(trainer, on_gpu=True) if lazy else None
    assert (cb.count is not None) == lazy
    trainer.train()
    saved = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())["num_input_tokens_seen"]
    seen = [e["num_input_tokens_seen"] for e in logs if "num_input_tokens_seen" in e]
    return trainer.state.num_input_tokens_seen, seen, saved, cb.figures()


def test_same_count_as_hf_where_it_is_read(tiny_model, tmp_path):
    hf = _train(tiny_model, tmp_path / "hf", lazy=False)
    ours = _train(tiny_model, tmp_path / "ours", lazy=True)
    assert hf[0] == ours[0] == sum(5 + i for i in range(10))  # one epoch, 5 steps x 2 rows: only real tokens
    assert hf[1] == ours[1] and len(ours[1]) == 3  # the log lines of steps 2 and 4, and the final one
    assert hf[2] == ours[2] and 3 * 2 * 5 <= ours[2] <= 3 * 2 * 14  # checkpoint-3: 3 steps x 2 rows
    assert ours[3]["steps"] == hf[3]["steps"] == 4
    # the steady window's tokens (after step 1 to step 5), rate x seconds: the same count on both sides
    steady = [f["tokens_per_s"] * f["seconds"] for f in (hf[3], ours[3])]
    assert steady[1] == pytest.approx(steady[0]) and 4 * 2 * 5 <= steady[1] < hf[0]


def test_other_counts_stay_hfs(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    for setting, on_gpu in (("all", True), ("no", True), ("non_padding", False)):
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                 include_num_input_tokens_seen=setting)
        trainer = Trainer(model=AutoModelForCausalLM.from_pretrained(tiny_model), args=args)
        track = trainer._track_num_input_tokens
        assert throughput.TokenCount.install(trainer, on_gpu=on_gpu) is None
        assert trainer._track_num_input_tokens == track


def test_steps_that_compiled_are_left_out_of_the_steady_figures(tiny_model, tmp_path, monkeypatch):
    """--torch_compile: the second batch shape recompiles (21-29 s on an H200, the summary read 2.1 % MFU for a run
    at 36 %). The steps during which Dynamo compiled leave the steady window; real compiles on CPU (aot_eager), the
    batches' padded lengths differ."""
    import torch

    torch._dynamo.reset()
    try:
        fig = _train(tiny_model, tmp_path / "c", lazy=False, torch_compile=True, torch_compile_backend="aot_eager")[3]
    finally:
        torch._dynamo.reset()
    assert fig["compile_steps"] >= 1 and fig["steps"] + fig["compile_steps"] == 4, fig

    # The arithmetic, on a clock: step 1 (outside the window), step 2 compiled for 30 s, steps 3-6 took 1 s each.
    class State:
        global_step, num_input_tokens_seen = 0, 0

    clock, graphs = [0.0], [1]
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(throughput, "graphs_compiled", lambda: graphs[0])
    cb, state = throughput.Throughput(), State()
    for step, took, compiled in ((1, 10, 1), (2, 30, 1), (3, 1, 0), (4, 1, 0), (5, 1, 0), (6, 1, 0)):
        state.global_step, state.num_input_tokens_seen = step, state.num_input_tokens_seen + 100
        clock[0] += took
        graphs[0] += compiled
        cb.on_step_end(None, state, None)
    fig = cb.figures()
    assert (fig["steps"], fig["seconds"], fig["tokens_per_s"], fig["compile_steps"]) == (4, 4.0, 100.0, 1)
    assert "steady 4 steps (1 that compiled left out) in 4.0s" in cb.summary()
