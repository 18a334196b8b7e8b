"""callbacks.FrozenHeap: the objects alive before training and after steps 1 and 3 are frozen out of the collector's
full passes; TRAINBOX_GC_FREEZE=0 leaves the collector alone. Real sft and grpo trainers carry the callback."""

from __future__ import annotations

import gc

import pytest

from trainbox.training import callbacks, sftlib


@pytest.fixture(autouse=True)
def _thawed():
    gc.unfreeze()
    yield
    gc.unfreeze()


def _steps(cb, n):
    """The frozen count after each of n steps, each making 1,000 objects that stay alive."""
    frozen, alive = [], []
    for _ in range(n):
        alive.append([[i] for i in range(1000)])
        cb.on_step_end(None, None, None)
        frozen.append(gc.get_freeze_count())
    return frozen


def test_frozen_before_training_and_after_steps_1_and_3():
    cb = callbacks.FrozenHeap()
    cb.on_train_begin(None, None, None)
    begun = gc.get_freeze_count()
    assert begun > 0
    frozen = _steps(cb, 5)
    # what each step froze: a step's 1,001 containers at steps 1 and 3 (step 3: steps 2's and 3's), nothing after
    # steps 2, 4 and 5. Not equality: a frozen object that dies (another test's leftovers let go) leaves the count.
    grew = [b - a for a, b in zip([begun, *frozen], frozen)]
    assert grew[0] >= 1000 and grew[2] >= 2000, grew
    assert all(g < 1000 for g in (grew[1], grew[3], grew[4])), grew
    assert gc.isenabled()  # collections still run, over what the steps make


def test_off_switch(monkeypatch):
    monkeypatch.setenv(callbacks.ENV, "0")
    cb = callbacks.FrozenHeap()
    cb.on_train_begin(None, None, None)
    assert _steps(cb, 4) == [0, 0, 0, 0] and gc.get_freeze_count() == 0


def test_sft_trainers_carry_it(tiny_model, tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig

    rows = Dataset.from_list([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
                              for _ in range(4)])
    args = SFTConfig(str(tmp_path), max_steps=1, report_to="none", use_cpu=True, save_strategy="no")
    trainer = sftlib.build_trainer(AutoModelForCausalLM.from_pretrained(tiny_model), args, rows,
                                   AutoTokenizer.from_pretrained(tiny_model))
    assert any(isinstance(cb, callbacks.FrozenHeap) for cb in trainer.callback_handler.callbacks)
    trainer.train()
    assert gc.get_freeze_count() > 0


def test_grpo_trainers_carry_it(tiny_model, tmp_path):
    import datasets

    from trainbox.cli import grpo
    from trainbox.run import preemption
    from trainbox.training.grpo import options as grpo_options, trainer as grpo_trainer

    _, _, raw, model_args = grpo.parse(["--model_name_or_path", str(tiny_model), "--output_dir", str(tmp_path),
                                        "--num_generations", "2", "--per_device_train_batch_size", "2",
                                        "--max_completion_length", "4", "--max_steps", "1", "--use_cpu", "true",
                                        "--report_to", "none", "--save_strategy", "no"])
    trainer = grpo_trainer.build_trainer(grpo_options.finalize(raw, 1), model_args, "full",
                                         [lambda completions, **kw: [0.0] * len(completions)],
                                         datasets.Dataset.from_list([{"prompt": "a b"}] * 2),
                                         preemption.PreemptionCallback())
    assert any(isinstance(cb, callbacks.FrozenHeap) for cb in trainer.callback_handler.callbacks)
    trainer.train()
    assert gc.get_freeze_count() > 0
