"""The one callback list every trainer carries (sft, qlora, dpo through skeleton.py; grpo through grpo/trainer.py).

Preemption (SIGTERM/SIGUSR1 -> the ranks agree -> checkpoint and stop), the steady-state throughput the summary
line reports, and Python's collector kept off the step's path (FrozenHeap, below). A new callback for every trainer
goes here, once.

FrozenHeap: Python's garbage collector kept off the training loop's path. Its full collections scan every object
the process tracks (the model's modules, torch.compile's graphs, guards and kernels: millions), and one such pass
inside a step stalls the host that launches the GPU's work: a 618 ms step among 180-200 ms ones, gpt-oss-2b on an H200
(benchmarks/profile_step.py, `gc_ms`). After the first steps, whose compiles make most of those objects, they are
moved out of the collector's view (gc.freeze): later collections look only at what the steps themselves make.
Before the first step a full collection runs first (outside the timed steps); after steps 1 and 3 only the young
generations are collected (a full pass there would cost a step's time again), so a reference cycle that became
garbage in those steps' compiles and had aged stays until the process ends: host memory, the compiler's.
TRAINBOX_GC_FREEZE=0 leaves the collector as Python has it.
"""

from __future__ import annotations

import gc
import os

from transformers import TrainerCallback

from trainbox.run import preemption, throughput
from trainbox.training.kernels import switches

ENV = "TRAINBOX_GC_FREEZE"
FREEZE_AFTER = (1, 3)  # steps of this run: the first (its compiles), then once shapes turned dynamic (a recompile)


def standard(preempt=None) -> list:
    """The callbacks, built now (each imports transformers); `preempt`: a PreemptionCallback made earlier (grpo makes
    its own before the trainer, to pass to its rollout engine), else a new one."""
    return [preempt or preemption.PreemptionCallback(), throughput.Throughput(), FrozenHeap()]


def _on() -> bool:
    return switches.switch(os.environ.get(ENV), default=True) is not False


class FrozenHeap(TrainerCallback):
    def __init__(self):
        self.steps = 0

    def on_train_begin(self, args, state, control, **kwargs):
        if _on():
            gc.collect()  # what is garbage now goes; what lives (the model, the libraries) is frozen
            gc.freeze()

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1
        if self.steps in FREEZE_AFTER and _on():
            gc.collect(1)
            gc.freeze()
