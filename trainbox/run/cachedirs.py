"""Writable cache and runtime folders when $HOME is not writable (enroot/pyxis defaults: read-only root, no home).

Hugging Face, datasets, Triton, inductor, Jupyter, IPython and matplotlib all default to folders under $HOME; under
`enroot start` or `srun --container-image` without `--container-mount-home` that is the caller's host home (absent
from the image) or the image's /root, on a read-only squashfs: the first write fails with EROFS. `apply()` runs in the
dispatcher before any entrypoint imports those libraries. It does nothing when $HOME/.cache can be written. Otherwise
each variable below that is unset gets a folder under one writable base: $XDG_CACHE_HOME if the user set it, else
a per-user temp dir (enroot and pyxis mount a tmpfs on /tmp), else the outputs volume ($OUTPUT_DIR or
/workspace/outputs). A variable the user set always wins, even one we would consider unwritable. One line says where.

Temporary files come first (`apply_temp`): `docker run --read-only` (or a uid with no writable /tmp) leaves no
directory `tempfile` accepts ($TMPDIR, /tmp, /var/tmp, the cwd), and the first `tempfile.gettempdir()` (ours, or a
library's) raised "No usable temporary directory". Then TMPDIR points at a per-user folder on the outputs volume
(the one place the image promises is writable); when that can't be written either, one line and exit 2.
"""

from __future__ import annotations

import os
import sys
import tempfile

DEFAULT_OUTPUT_DIR = "/workspace/outputs"  # the image's VOLUME (CONTRIBUTING.md: image contract)
# Variable -> folder under the base ("" = the base itself). XDG_CACHE_HOME also moves what follows it (torch hub,
# pip, vLLM); HF_HOME moves the hub, datasets (HF_DATASETS_CACHE) and the token file.
CACHE_VARS = {
    "XDG_CACHE_HOME": "",
    "HF_HOME": "huggingface",
    "TRITON_CACHE_DIR": "triton",
    "TORCHINDUCTOR_CACHE_DIR": "torchinductor",  # its default needs getpass.getuser(): fails for a uid not in passwd
    "CUDA_CACHE_PATH": "nv",
    "MPLCONFIGDIR": "matplotlib",
    "IPYTHONDIR": "ipython",
    "JUPYTER_CONFIG_DIR": "jupyter/config",
    "JUPYTER_DATA_DIR": "jupyter/data",
}
# Per-run files (Jupyter's server and kernel connection files, mode 0600): a local temp dir, never a shared volume.
RUNTIME_VARS = {"JUPYTER_RUNTIME_DIR": "jupyter-runtime"}


def writable_dir(path: str) -> bool:
    """True when `path` exists or can be created, and files can be written in it."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK | os.X_OK)


def _home_cache(env) -> str | None:
    home = env.get("HOME") or ""
    return os.path.join(home, ".cache") if home.startswith("/") else None


def _temp_base() -> str:
    # Per uid: /tmp is shared by every user of a node in bare runs, and another user's folder is not ours to write.
    return os.path.join(tempfile.gettempdir(), f"trainbox-{os.getuid()}")


def temp_plan(env) -> tuple[dict[str, str], str | None]:
    """({}, None) when tempfile finds a usable folder; else ({"TMPDIR": a folder on the outputs volume}, the line).
    Raises UsageError when that folder can't be written either."""
    try:
        tempfile.gettempdir()
        return {}, None
    except FileNotFoundError:  # tempfile's "No usable temporary directory found in [...]"
        pass
    outputs = env.get("OUTPUT_DIR") or DEFAULT_OUTPUT_DIR
    base = os.path.join(outputs, f".tmp-{os.getuid()}")
    if not writable_dir(base):
        from common.errors import UsageError

        raise UsageError(f"no writable folder for temporary files: TMPDIR ({env.get('TMPDIR') or 'unset'}), /tmp, "
                         f"/var/tmp, the working directory and {outputs} are all read-only or not writable by uid "
                         f"{os.getuid()}; mount one (`docker run --tmpfs /tmp`, or a volume on {outputs} that this "
                         "user can write)")
    line = (f"[trainbox] no writable temporary folder (/tmp and the working directory are read-only): TMPDIR={base} "
            "on the outputs volume; `docker run --tmpfs /tmp` keeps them off it")
    return {"TMPDIR": base}, line


def apply_temp(environ=None, stream=None) -> dict[str, str]:
    """temp_plan applied to `environ` (os.environ) and this process's tempfile; says where on `stream` (stderr)."""
    environ = os.environ if environ is None else environ
    add, line = temp_plan(environ)
    if add:
        environ.update(add)
        tempfile.tempdir = add["TMPDIR"] if environ is os.environ else tempfile.tempdir
        print(line, file=stream or sys.stderr, flush=True)
    return add


def plan(env) -> tuple[dict[str, str], str | None]:
    """The variables to add (never one already set) and the line that says where; ({}, None) when nothing is needed."""
    home_cache = _home_cache(env)
    if home_cache and writable_dir(home_cache):
        return {}, None
    missing = [v for v in (*CACHE_VARS, *RUNTIME_VARS) if not env.get(v)]
    if not missing:
        return {}, None
    outputs = env.get("OUTPUT_DIR") or DEFAULT_OUTPUT_DIR
    temp = _temp_base()
    if env.get("XDG_CACHE_HOME"):
        base = env["XDG_CACHE_HOME"]
    else:
        base = next((b for b in (os.path.join(temp, "cache"), os.path.join(outputs, ".cache")) if writable_dir(b)),
                    None)
    runtime = next((b for b in (temp, base) if b and writable_dir(b)), None)
    if base is None:
        return {}, (f"[trainbox] warning: $HOME ({env.get('HOME') or 'unset'}) is not writable and neither is "
                    f"{temp} or {outputs}: caches will fail; mount a writable folder and set XDG_CACHE_HOME/HF_HOME")
    add = {v: os.path.join(base, sub) if sub else base for v, sub in CACHE_VARS.items() if not env.get(v)}
    if runtime:
        add.update({v: os.path.join(runtime, sub) for v, sub in RUNTIME_VARS.items() if not env.get(v)})
    where = f"caches under {base}" + (f", runtime files under {runtime}" if any(v in add for v in RUNTIME_VARS) else "")
    line = (f"[trainbox] $HOME ({env.get('HOME') or 'unset'}) is not writable: {where} "
            f"({', '.join(add)}); set them, or mount a cache and set HF_HOME, to choose")
    return add, line


def apply(environ=None, stream=None) -> dict[str, str]:
    """Set the folders in `environ` (os.environ) and say where on `stream` (stderr); returns what was added."""
    environ = os.environ if environ is None else environ
    add, line = plan(environ)
    environ.update(add)
    if line:
        print(line, file=stream or sys.stderr, flush=True)
    return add
