"""A model's config.json checked before anything is planned or loaded (`trainbox plan`, sft, qlora, grpo: through
config.check_model_path): readable JSON, a model_type transformers knows, the size keys its architecture declares
present, whole numbers in range and bounded (a config of 10^7 layers would keep the meta-device build, and with it the
plan, busy for hours), then the config class's own validation (types, heads dividing the width). Any fault is one
UsageError naming the file and the key: exit 2, never a traceback or a plan made from the library's defaults.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from common.errors import UsageError

# The size keys (transformers' standard names; a config class's attribute_map gives its own spelling): required where
# the architecture's config class declares them, whole numbers from 1 to the bound.
SIZES = {
    "num_hidden_layers": 1_000,
    "hidden_size": 1_000_000,
    "intermediate_size": 10_000_000,
    "num_attention_heads": 100_000,
    "vocab_size": 10_000_000,
}
# Checked where given, never required (the class derives them or has no such part).
OPTIONAL = {
    "num_key_value_heads": 100_000,
    "head_dim": 100_000,
    "moe_intermediate_size": 10_000_000,
    "num_local_experts": 100_000,
    "num_experts": 100_000,
    "n_routed_experts": 100_000,
    "num_experts_per_tok": 100_000,
    "max_position_embeddings": 100_000_000,
}
MOE = ("num_local_experts", "num_experts", "n_routed_experts")  # a model with these declares num_experts_per_tok
MAX_BYTES = 16 * 2**20  # a config.json is a few kB; a bigger one is not a config


def check(path, where: str | None = None) -> None:
    """UsageError unless `path` (a config.json) describes a model this run can plan and build (module docstring).
    `where`: how the user named the model (the folder or hub id), for the message."""
    p = Path(path)
    name = f"{p}" + (f" (model {where})" if where and where not in str(p) else "")
    data = _read(p, name)
    _check_one(data, name, "")
    text = data.get("text_config")
    if isinstance(text, dict):
        _check_one(text, name, "text_config.")
    elif text is not None:
        raise UsageError(f"{name}: text_config must be a mapping of the language model's settings, got "
                         f"{type(text).__name__}")
    _validate(data, name)


def _read(p: Path, name: str) -> dict:
    try:
        raw = p.read_bytes()[: MAX_BYTES + 1]
    except OSError as e:
        raise UsageError(f"{name}: can't read it ({e.strerror}); check its permissions") from None
    if len(raw) > MAX_BYTES:
        raise UsageError(f"{name}: over {MAX_BYTES // 2**20} MiB, not a model config; point at the model's folder")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise UsageError(f"{name}: not UTF-8 text; a model's config.json is JSON") from None
    except RecursionError:
        raise UsageError(f"{name}: nested too deeply to be a model config") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{name}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}; cut short?); "
                         "copy the model's config.json again") from None
    if not isinstance(data, dict):
        raise UsageError(f"{name}: must be a JSON object of the model's settings, got {type(data).__name__}")
    return data


def _config_class(model_type, name: str, key: str):
    from transformers import CONFIG_MAPPING

    if model_type is None:
        raise UsageError(f"{name}: no {key}model_type (e.g. \"llama\"): transformers reads the architecture from it; "
                         "add it or copy the model's config.json again")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        close = __import__("difflib").get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise UsageError(f"{name}: {key}model_type {str(model_type)[:60]!r} is not an architecture this transformers "
                         f"knows{hint}")
    return CONFIG_MAPPING[model_type]


def _check_one(data: dict, name: str, key: str) -> None:
    """model_type, then the size keys of this (sub)config: present where its class declares them, whole, bounded."""
    if key and "model_type" not in data:
        cls = None  # a sub-config may leave its type to the parent's class
    else:
        cls = _config_class(data.get("model_type"), name, key)
    declared = set()
    if cls is not None and dataclasses.is_dataclass(cls):
        declared = {f.name for f in dataclasses.fields(cls)}
    alias = dict(getattr(cls, "attribute_map", {}) or {})
    if cls is not None and getattr(cls, "sub_configs", {}).get("text_config") is not None:
        declared = set()  # the sizes live in text_config (checked on their own)
    for std, bound in {**SIZES, **OPTIONAL}.items():
        own = alias.get(std, std)
        spelled = own if own in data else std if std in data else None
        if spelled is None:
            if std in SIZES and own in declared and not (std == "intermediate_size" and _moe_only(data)):
                raise UsageError(f"{name}: {key}{own} is missing: the {data.get('model_type')} architecture needs "
                                 "it (without it the library's default would be planned, not this model)")
            continue
        _whole(data[spelled], bound, name, key + spelled)
    experts = next((data[k] for k in MOE if isinstance(data.get(k), int) and data[k] > 0), None)
    top = data.get("num_experts_per_tok")
    if experts and isinstance(top, int) and top > experts:
        raise UsageError(f"{name}: {key}num_experts_per_tok {top} is more than the {experts} experts")


def _moe_only(data: dict) -> bool:
    return any(k in data for k in MOE) and "moe_intermediate_size" in data


def _whole(value, bound: int, name: str, key: str) -> None:
    if value is None:
        return
    if isinstance(value, list) and value and len(value) <= SIZES["num_hidden_layers"]:  # per layer (Gemma 3n)
        for item in value:
            _whole(item, bound, name, key)
        return
    if isinstance(value, bool) or not isinstance(value, int):
        shown = json.dumps(value)[:40]
        fix = f"; write {value.strip()} without quotes" if isinstance(value, str) and value.strip().isdigit() else ""
        raise UsageError(f"{name}: {key} is {shown}, not a whole number{fix}")
    if not 1 <= value <= bound:
        raise UsageError(f"{name}: {key} {value} is out of range: from 1 to {bound:,}")


def _validate(data: dict, name: str) -> None:
    """The config class's own checks (its field types, heads dividing the width...), as from_pretrained runs them."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[data["model_type"]]
    try:
        cls.from_dict(cls._decode_special_floats(data))  # (Infinity as transformers writes it: {"__float__": ...})
    except Exception as e:  # noqa: BLE001 - whatever the class refuses is the user's config: one line naming it
        first = " ".join(str(e).split())[:300] or type(e).__name__
        raise UsageError(f"{name}: transformers refuses it: {first}") from None
