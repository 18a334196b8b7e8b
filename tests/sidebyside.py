"""Independent `python -m trainbox ...` runs started side by side, one per core: each spends its seconds importing
torch and TRL on one core, so in a row they leave the other cores idle and cost the sum."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

WORKERS = max(2, os.cpu_count() or 2)


def pool() -> ThreadPoolExecutor:
    """A pool of one worker per core (two at least), for runs a module starts early and its tests wait for."""
    return ThreadPoolExecutor(max_workers=WORKERS)


def in_parallel(calls) -> list:
    """Each call's result (in order), the calls run on a pool()."""
    with pool() as p:
        return list(p.map(lambda call: call(), calls))
