"""A local model's files and module names, checked before any weight loads: every safetensors file readable and
whole (an unreadable or cut-short file was a traceback from deep inside from_pretrained, after the dataset and the
tokenizer), and `--lora_target_modules` names modules the model has (read from its config on the meta device: no
weights, no memory), where a typo was a traceback from PEFT after the 4-bit model had loaded.
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

from common.errors import UsageError

HEADER_MAX = 100 * 1024 * 1024  # safetensors' own bound on the JSON header


def _why_not_whole(path: Path) -> str | None:
    """Why a .safetensors file can't load (unreadable, not safetensors, shorter than its header says), or None."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"it is {size} bytes, too short for a safetensors file"
            n = struct.unpack("<Q", head)[0]
            if n > min(HEADER_MAX, size - 8):
                return "its header is not a safetensors header (a different format, or a cut-short file)"
            header = json.loads(f.read(n))
    except PermissionError:
        return f"it is not readable by this user (uid {os.getuid()}; check its mode and owner)"
    except OSError as e:
        return f"it can't be read ({e.strerror or e})"
    except (ValueError, UnicodeDecodeError):
        return "its header is not valid JSON (not a safetensors file, or damaged)"
    if not isinstance(header, dict):
        return "its header is not a safetensors header"
    ends = [v["data_offsets"][1] for k, v in header.items()
            if k != "__metadata__" and isinstance(v, dict) and isinstance(v.get("data_offsets"), list)
            and len(v["data_offsets"]) == 2 and isinstance(v["data_offsets"][1], int)]
    if ends and 8 + n + max(ends) > size:
        return f"it is cut short ({size} bytes; its header describes {8 + n + max(ends)})"
    return None


def check_weights(spec: str, option: str = "--model_name_or_path") -> None:
    """For a local model folder: each *.safetensors file readable and whole; one UsageError naming the first that
    is not. A hub id (no local folder) is left to the hub."""
    folder = Path(os.path.expanduser(spec))
    if not folder.is_dir():
        return
    for path in sorted(folder.glob("*.safetensors")):
        why = _why_not_whole(path)
        if why:
            raise UsageError(f"{option} {spec}: the weights file {path.name} can't be loaded: {why}; copy the model "
                             "again (or fix the file's permissions)")


# The module types PEFT's LoRA wraps (peft.tuners.lora's dispatchers): targets among the others fail there.
LORA_TYPES = ("Linear", "Embedding", "Conv1d", "Conv2d", "Conv3d", "Conv1D", "Linear4bit", "Linear8bitLt")


def _module_names(model_path: str, revision: str | None) -> tuple[list[str], list[str]]:
    """(every module's dotted name, the last names of those LoRA can wrap) of the model built from its config on
    the meta device."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model_path, revision=revision)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"--model_name_or_path {model_path}: its config can't build a model ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200] if str(e) else ''}); check config.json") from None
    named = [(n, type(m).__name__) for n, m in model.named_modules() if n]
    return [n for n, _ in named], sorted({n.rsplit(".", 1)[-1] for n, kind in named if kind in LORA_TYPES})


def peft_targets(targets):
    """`--lora_target_modules` as PEFT must get it: PEFT knows the `all-linear` shortcut, and takes a regular
    expression, only as a plain string (a list is names); one plain name stays a list (as a string PEFT would
    fullmatch `q_proj` against `model.layers.0.self_attn.q_proj` and find nothing)."""
    if isinstance(targets, list) and len(targets) == 1 and not re.fullmatch(r"\w+", str(targets[0])):
        return targets[0]
    return targets


def check_lora_targets(model_path: str, revision: str | None, targets) -> None:
    """`--lora_target_modules` against the model's modules, as PEFT matches them (peft_targets): a list of names,
    each the end of some module's dotted name; one string other than `all-linear`, a regular expression a whole name
    matches. Every name that matches nothing is one UsageError listing the names that can take LoRA."""
    targets = peft_targets(targets)
    if not targets or targets == "all-linear":
        return
    names, leaves = _module_names(model_path, revision)
    if isinstance(targets, str):
        try:
            missing = [] if any(re.fullmatch(targets, n) for n in names) else [targets]
        except re.error as e:
            raise UsageError(f"--lora_target_modules {targets!r}: not a regular expression ({e})") from None
    else:
        missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        shown = ", ".join(leaves[:30]) + (" ..." if len(leaves) > 30 else "")
        raise UsageError(f"--lora_target_modules {' '.join(map(str, missing))}: no module of {model_path} has that "
                         f"name; this model's LoRA-able modules: {shown} (or all-linear)")
