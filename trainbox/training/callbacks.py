"""The one callback list every trainer carries (sft, qlora, dpo through skeleton.py; grpo through grpo_trainer.py).

Preemption (SIGTERM/SIGUSR1 -> the ranks agree -> checkpoint and stop), the steady-state throughput the summary
line reports, and Python's collector kept off the step's path (hostgc.py). A new callback for every trainer goes
here, once.
"""

from __future__ import annotations

from trainbox.run import preemption
from trainbox.training import hostgc, throughput


def standard(preempt=None) -> list:
    """The callbacks, built now (each imports transformers); `preempt`: a PreemptionCallback made earlier (grpo makes
    its own before the trainer, to pass to its rollout engine), else a new one."""
    return [preempt or preemption.PreemptionCallback(), throughput.Throughput(), hostgc.FrozenHeap()]
