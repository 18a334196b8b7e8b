"""Where a run's outputs go: the output folder (checked before anything loads), the artifact folder and the copy
into it, and which process writes them (the main one).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from common import atomic
from common.errors import UsageError
from trainbox.run import ranks

DEFAULT_OUTPUT_DIR = "/workspace/outputs"


def output_dir(configured: str | None) -> str:
    """Explicit option if the user set it, else $OUTPUT_DIR, else /workspace/outputs; checked (see check_writable_dir)
    before anything loads, created later by whoever writes first."""
    if configured:
        return check_writable_dir(str(configured), "--output_dir")
    if os.environ.get("OUTPUT_DIR"):
        return check_writable_dir(os.environ["OUTPUT_DIR"], "OUTPUT_DIR")
    return check_writable_dir(DEFAULT_OUTPUT_DIR, "the default output folder (--output_dir / OUTPUT_DIR)")


def check_writable_dir(path: str, option: str) -> str:
    """`path` if it is a writable folder or can be made one; else one UsageError (a file there, read-only, /proc)."""
    why = atomic.why_not_a_folder(path)
    if why:
        raise UsageError(f"{option} {path}: {why}; pass a writable folder (and check the container's mounts)")
    return path


def is_main_process() -> bool:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
    except ImportError:  # pragma: no cover
        pass
    return ranks.rank() == 0


def artifact_dir() -> str | None:
    return os.environ.get("ARTIFACT_DIR") or os.environ.get("SAKURA_ARTIFACT_DIR") or None


# Checkpoints (weights + optimizer state: ~100 GB for an 8B full fine-tune) stay in OUTPUT_DIR unless asked for.
CHECKPOINTS_ENV = "TRAINBOX_ARTIFACT_CHECKPOINTS"


def copy_artifacts(src: str, dest_root: str, name: str) -> str:
    """Copy src to DEST_ROOT/<basename of src> through the one atomic writer (never half-written, swapped whole):
    the final model or adapter, a merged model, the logs; `checkpoint-*` (and `abandoned-*`, an earlier run's
    checkpoints that `--resume never` moved aside) only with TRAINBOX_ARTIFACT_CHECKPOINTS=1."""
    final = Path(dest_root) / (Path(src).name or name)
    if final.resolve() == Path(src).resolve():
        return str(final)
    atomic.clean_stale(final)  # what an earlier copy on this host left when it was killed
    keep = os.environ.get(CHECKPOINTS_ENV, "").lower() in ("1", "true", "yes")
    return str(atomic.copy_tree(src, final, ignore=None if keep else shutil.ignore_patterns("checkpoint-*", "abandoned-*")))


def follow_umask_in_safetensors() -> None:
    """safetensors >= 0.8 writes every file through a Rust temporary (the tempfile crate: mode 0600) renamed into
    place (safetensors issue 782), so each model, adapter, merged model and checkpoint it wrote was readable by its
    writer only, while config.json beside it followed the umask: a colleague, a serving job under another uid got
    "No such file or directory". safetensors.torch.save_file (what transformers, PEFT and accelerate call) looks up
    serialize_file at each call: wrapped here so the file gets the mode `open()` would give it (atomic.existing_mode).
    Idempotent; a safetensors without that function (older, mode right already) is left alone."""
    try:
        import safetensors.torch as st
    except ImportError:  # pragma: no cover - the light stack
        return
    inner = getattr(st, "serialize_file", None)
    if inner is None or getattr(inner, "trainbox_umask", False):
        return

    def serialize_file(tensors, filename, *args, **kwargs):
        mode = atomic.existing_mode(filename)
        result = inner(tensors, filename, *args, **kwargs)
        os.chmod(filename, mode)
        return result

    serialize_file.trainbox_umask = True
    st.serialize_file = serialize_file
