"""What the compiled fast paths (moe.py's experts and gate, the sinks of flexattn.py and varlen_sinks.py) share: they
fall back to the same ops, once, when the compiler fails, and must tell that failure from an exception that belongs
to the step."""

from __future__ import annotations

import sys

from common import errors


def is_compiler_failure(error: BaseException) -> bool:
    """False for the step's own exceptions, which pass through: out of memory, and non-reentrant activation
    checkpointing stopping a recomputation early (it raises through the recomputed forward's frames, ours included,
    once it has every tensor it needs: caught, the recomputation went on and broke the checkpoint's state)."""
    import torch
    from torch.utils import checkpoint

    stop = getattr(checkpoint, "_StopRecomputationError", None)
    return not isinstance(error, torch.OutOfMemoryError) and not (stop is not None and isinstance(error, stop))


def report(error: BaseException, what: str, instead: str) -> bool:
    """For `except Exception as error` around a compiled call: False for the step's own exceptions (the caller
    re-raises them); for a compiler failure, prints the one line saying `what` did not compile and what runs
    `instead`, and returns True (the caller falls back)."""
    if not is_compiler_failure(error):
        return False
    print(f"[trainbox] {what} did not compile ({errors.brief(error)}); {instead}", file=sys.stderr, flush=True)
    return True


class Fallback:
    """`fn` compiled whole (fullgraph) at its first call, with `dynamic` [(argument index, dim)] symbolic from the
    start; after a compiler failure (one line, `what` and `instead` as `report` says them) `fn` runs op by op for good.
    Called inside a trace (the user's torch.compile), `fn` itself, for that trace to take."""

    def __init__(self, fn, what: str, instead: str, dynamic: tuple[tuple[int, int], ...] = ()):
        self.fn, self.what, self.instead, self.dynamic = fn, what, instead, dynamic
        self.compiled = None  # None: not yet; False: it failed

    def __call__(self, *args):
        import torch

        if self.compiled is False or torch.compiler.is_compiling():
            return self.fn(*args)
        if self.compiled is None:
            self.compiled = torch.compile(self.fn, fullgraph=True)
        for i, dim in self.dynamic:
            torch._dynamo.maybe_mark_dynamic(args[i], dim)
        try:
            return self.compiled(*args)
        except Exception as error:  # noqa: BLE001 - a compiler failure: the same ops run one by one
            if not report(error, self.what, self.instead):
                raise
            self.compiled = False
            return self.fn(*args)
