"""Options for every entrypoint: `--config FILE.yaml` gives defaults, `--option value` on the command line overrides.

Option names are exactly the dataclass fields (TRL's GRPOConfig/SFTConfig, transformers' TrainingArguments and our
own script dataclasses) and are parsed by transformers' `HfArgumentParser`, so types, choices and `--no_flag`
complements behave as upstream documents them. What we add: YAML defaults, one clear `UsageError` for an unknown
option (with the closest valid names), and translation of options that newer releases removed (`legacy`).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Callable

from .errors import UsageError

Translator = Callable[[Any], dict]


def _set_tensorboard_dir(value: Any) -> dict:
    # transformers 5 dropped `logging_dir`; its TensorBoard callback reads this variable instead.
    os.environ.setdefault("TENSORBOARD_LOGGING_DIR", str(value))
    return {}


def truthy(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in {"1", "true", "yes", "y", "on"}


# Options that transformers 5 / TRL 1.x removed or renamed, translated so that older recipes keep working.
LEGACY_TRAINING: dict[str, Translator] = {
    # warmup_steps < 1 is read as a fraction of the total steps, which is what warmup_ratio meant.
    "warmup_ratio": lambda v: {"warmup_steps": float(v)},
    "evaluation_strategy": lambda v: {"eval_strategy": str(v)},
    "no_cuda": lambda v: {"use_cpu": truthy(v)},
    "per_gpu_train_batch_size": lambda v: {"per_device_train_batch_size": int(v)},
    "per_gpu_eval_batch_size": lambda v: {"per_device_eval_batch_size": int(v)},
    "logging_dir": _set_tensorboard_dir,
    # Always true now (checkpoints are safetensors; the output dir is reused for resume).
    "save_safetensors": lambda v: {},
    "overwrite_output_dir": lambda v: {},
    "include_tokens_per_second": lambda v: {"include_num_input_tokens_seen": truthy(v)},
}

# TRL renamed SFT's `max_seq_length` to `max_length`.
LEGACY_SFT: dict[str, Translator] = {
    "max_seq_length": lambda v: {"max_length": int(v)},
}

_EXPLICIT_ATTR = "_trainbox_explicit"


def _make_parser(dataclass_types: tuple, prog: str):
    from transformers import HfArgumentParser

    class _Parser(HfArgumentParser):
        # argparse would print its own message and sys.exit(2); we want one UsageError the caller formats.
        def error(self, message):  # noqa: D102
            raise UsageError(f"{prog}: {message} (see `{prog} --help`)")

    parser = _Parser(dataclass_types, prog=prog, allow_abbrev=False)
    parser.add_argument("--config", default=None, help="YAML file with option defaults; command-line options override")
    return parser


def _known_names(parser) -> dict[str, Any]:
    """Every accepted long option (without `--`) -> its argparse action."""
    names = {}
    for action in parser._actions:
        for opt in action.option_strings:
            if opt.startswith("--"):
                names[opt[2:]] = action
    return names


def _suggest(name: str, known) -> str:
    # Suggest the canonical (underscore) spelling once, not also its dashed alias.
    canon = sorted({k.replace("-", "_") for k in known} - {"help", "config"})
    close = difflib.get_close_matches(name.replace("-", "_"), canon, n=3, cutoff=0.6)
    return f"; did you mean {', '.join('--' + c for c in close)}?" if close else ""


def _load_yaml(path: str) -> dict:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise UsageError(f"config file {path} does not exist; pass an existing YAML file to --config")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise UsageError(f"config file {path} is not valid YAML: {e}".replace("\n", " ")) from None
    if not isinstance(data, dict):
        raise UsageError(f"config file {path} must be a mapping of option: value, got {type(data).__name__}")
    return data


def _split_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """Take `--config FILE` / `--config=FILE` out of argv (the last one wins, like any other option)."""
    config, rest, i = None, [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--config":
            if i + 1 >= len(argv):
                raise UsageError("--config needs a file: --config FILE.yaml")
            config, i = argv[i + 1], i + 2
            continue
        if a.startswith("--config="):
            config = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    return config, rest


def _translate_cli(argv: list[str], legacy: dict[str, Translator]) -> list[str]:
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--"):
            name, has_eq, value = a[2:].partition("=")
            key = name.replace("-", "_")
            if key in legacy:
                if not has_eq:
                    # A bare flag (`--no_cuda`) means true; otherwise the next token is the value.
                    if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                        value, i = argv[i + 1], i + 1
                    else:
                        value = True
                new = legacy[key](value)
                _warn_legacy(key, new)
                for k, v in new.items():
                    out += [f"--{k}", *(_cli_value(v))]
                i += 1
                continue
        out.append(a)
        i += 1
    return out


def _cli_value(v: Any) -> list[str]:
    if isinstance(v, (list, tuple)):
        return [str(x) for x in v]
    return [str(v)]


def _warn_legacy(old: str, new: dict) -> None:
    repl = ", ".join(f"{k}={v!r}" for k, v in new.items()) or "nothing (it has no effect any more)"
    print(f"warning: option {old} was removed upstream; translated to {repl}", file=sys.stderr)


def parse_args(
    dataclass_types: tuple,
    argv: list[str],
    *,
    prog: str,
    legacy: dict[str, Translator] | None = None,
    defaults: dict[str, Any] | None = None,
) -> tuple:
    """Parse YAML (`--config`) + CLI into one instance of each dataclass, in order.

    Raises UsageError for an unknown option (YAML or CLI), a missing config file, a bad value or a rejected
    combination (the dataclasses' own `__post_init__` checks). `--help` prints the help and exits 0 (SystemExit).
    Each returned instance records which of its fields were given explicitly (see `explicit`).
    `defaults` are the program's own defaults (e.g. qlora's 4-bit settings); YAML and CLI override them.
    """
    legacy = dict(legacy or {})
    parser = _make_parser(tuple(dataclass_types), prog)
    known = _known_names(parser)

    config_path, argv = _split_config(list(argv))
    explicit: set[str] = set()

    if "use_cpu" in known and not _cuda_available():
        # No GPU here: TrainingArguments would reject its bf16 default; say so instead of failing.
        parser.set_defaults(use_cpu=True)
    if defaults:
        dests = {a.dest for a in parser._actions}
        unknown = sorted(set(defaults) - dests)
        if unknown:  # a programming error in the caller, not user input
            raise ValueError(f"parse_args defaults name unknown options: {unknown}")
        for action in parser._actions:
            if action.dest in defaults:
                action.required = False
        parser.set_defaults(**defaults)

    if config_path is not None:
        raw = _load_yaml(config_path)
        defaults: dict[str, Any] = {}
        for key, value in raw.items():
            key = str(key)
            if key in legacy:
                new = legacy[key](value)
                _warn_legacy(key, new)
                defaults.update(new)
                continue
            defaults[key] = value
        dests = {a.dest: a for a in parser._actions}
        for key in defaults:
            if key not in dests or key == "config":
                raise UsageError(
                    f"unknown option {key!r} in config file {config_path}{_suggest(key, [d for d in dests if d not in ('help', 'config')])}"
                )
        for key, value in defaults.items():
            action = dests[key]
            # argparse only type-converts string defaults; keep YAML's own types, but honour choices.
            if action.choices is not None and value is not None and value not in action.choices:
                if not (isinstance(value, str) and action.type and _converts(action.type, value, action.choices)):
                    raise UsageError(
                        f"option {key} in {config_path}: {value!r} is not one of {list(action.choices)}"
                    )
            action.required = False
        parser.set_defaults(**defaults)
        explicit |= set(defaults)

    argv = _translate_cli(argv, legacy)
    for a in argv:
        if a.startswith("--"):
            name = a[2:].split("=", 1)[0]
            if name in known:
                explicit.add(known[name].dest)
            elif name not in ("help",):
                raise UsageError(f"unknown option --{name}{_suggest(name, known)} (see `{prog} --help`)")

    try:
        parsed = parser.parse_args_into_dataclasses(argv, return_remaining_strings=True, look_for_args_file=False)
    except UsageError:
        raise
    except (ValueError, TypeError) as e:
        # __post_init__ of TrainingArguments & co. rejects inconsistent combinations with ValueError.
        where = f" (config file {config_path} + command line)" if config_path else ""
        raise UsageError(f"invalid options{where}: {e}".replace("\n", " ")) from None

    remaining = parsed[-1]
    if remaining:
        raise UsageError(f"unexpected argument(s) {' '.join(remaining)} (options are --name value; see `{prog} --help`)")
    objs = parsed[: len(dataclass_types)]
    for obj in objs:
        fields = {f.name for f in dataclasses.fields(obj)}
        try:
            object.__setattr__(obj, _EXPLICIT_ATTR, frozenset(explicit & fields))
        except (AttributeError, TypeError):  # slots dataclass: explicit() then reports nothing
            pass
    return tuple(objs)


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


def _converts(type_fn, value, choices) -> bool:
    try:
        return type_fn(value) in choices
    except Exception:
        return False


def explicit(obj) -> frozenset[str]:
    """Names of the fields of a parsed dataclass that the user set (in YAML or on the command line)."""
    return getattr(obj, _EXPLICIT_ATTR, frozenset())


def configured_output_dir(args) -> str | None:
    """`args.output_dir` if the user set it, else None (so lifecycle.output_dir applies $OUTPUT_DIR / the default)."""
    return args.output_dir if "output_dir" in explicit(args) else None


def set_explicit(obj, names) -> None:
    """Record which options the user set on `obj` (for dataclasses built outside parse_args)."""
    object.__setattr__(obj, _EXPLICIT_ATTR, frozenset(names))


# Checks every training entrypoint runs before any model loads.
REPORT_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "comet_ml": "comet_ml"}


def check_model_path(spec: str | None, option: str = "--model_name_or_path") -> None:
    if not spec:
        raise UsageError(f"no model given: pass {option} PATH (a directory with config.json) or a hub id")
    p = Path(os.path.expanduser(spec))
    if p.exists():
        if not (p / "config.json").is_file():
            raise UsageError(f"model path {spec} has no config.json; point {option} at a saved model directory")
        return
    if spec.startswith(("/", "./", "../", "~")) or spec.count("/") > 1:
        raise UsageError(f"model path {spec} does not exist; check {option} (and the container's mounts)")


def check_report_to(report_to) -> None:
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    for name in names:
        pkg = REPORT_PACKAGES.get(name)
        if pkg and importlib.util.find_spec(pkg) is None:
            raise UsageError(f"--report_to {name} needs the {pkg} package, which this image lacks; use tensorboard or none")
