"""This process's place among the training ranks, as its launcher exported it: torchrun, accelerate, or one Slurm
task per rank (common.launch.plan sets the same names). One reader, so every room agrees on the defaults: unset (a
plain `python -m trainbox ...`) or unreadable means a single process, rank 0. A launcher that gives WORLD_SIZE
without LOCAL_WORLD_SIZE is read as one rank per node: the reading that keeps the memory plan on the safe side
(FSDP2 then re-shards after forward, as across nodes).
"""

from __future__ import annotations

import os


def _read(name: str, default: int, env) -> int:
    env = os.environ if env is None else env
    try:
        value = int(str(env.get(name) or "").strip() or default)
    except ValueError:
        return default
    return value if value >= 0 else default


def world_size(env=None) -> int:
    """Ranks in the whole run (WORLD_SIZE), at least 1."""
    return max(1, _read("WORLD_SIZE", 1, env))


def local_world_size(env=None) -> int:
    """Ranks on this node (LOCAL_WORLD_SIZE), at least 1 and at most world_size()."""
    return min(world_size(env), max(1, _read("LOCAL_WORLD_SIZE", 1, env)))


def rank(env=None) -> int:
    """This process's rank in the run (RANK)."""
    return _read("RANK", 0, env)


def local_rank(env=None) -> int:
    """This process's rank on its node (LOCAL_RANK): its GPU's index among the visible ones."""
    return _read("LOCAL_RANK", 0, env)


def distributed(env=None) -> bool:
    """This process is one rank of several."""
    return world_size(env) > 1


def nodes(env=None) -> int:
    """Nodes the ranks span (a node with fewer ranks than the others counts: 3 ranks, 2 per node, are 2 nodes)."""
    return -(-world_size(env) // local_world_size(env))
