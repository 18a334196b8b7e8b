"""A run's life: outputs, preemption, resume, crash, summary, log, cache folders, a run from a notebook."""
