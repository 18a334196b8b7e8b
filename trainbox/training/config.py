"""Options for every entrypoint: `--config FILE.yaml` gives defaults, `--option value` on the command line overrides.

Option names are exactly the dataclass fields (TRL's GRPOConfig/SFTConfig, transformers' TrainingArguments and our
own script dataclasses) and are parsed by transformers' `HfArgumentParser`, so types, choices and `--no_flag`
complements behave as upstream documents them. What we add: YAML defaults, one clear `UsageError` for an unknown
option (with the closest valid names), and translation of options that newer releases removed (`legacy`).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.errors import UsageError
from trainbox import helpcache
from trainbox.training import modelcheck  # check_model_path checks the model's config.json too

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
    configs = {c.__name__ for t in dataclass_types for c in t.__mro__}  # (grpo parses a GRPOConfig subclass)
    for action in parser._actions:
        if action.dest in CHOICES and action.choices is None:
            values = CHOICES[action.dest]
            if isinstance(values, dict):  # the values of the config class among these (none: argparse's own)
                values = next((v for k, v in values.items() if k in configs), None)
            action.choices = values
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
        data = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError:
        raise UsageError(f"config file {path} is not UTF-8 text (a binary file?); pass a YAML file") from None
    except OSError as e:
        raise UsageError(f"config file {path}: can't read it ({e.strerror}); check its permissions") from None
    except RecursionError:
        raise UsageError(f"config file {path} is nested too deeply; options are a flat mapping") from None
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

    helping = helpcache.asked(argv)
    if "use_cpu" in known and not helping and not _cuda_available():
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
        for key, value in list(defaults.items()):
            action = dests[key]
            defaults[key] = value = _yaml_value(key, action, value, config_path)
            # argparse only type-converts string defaults; keep YAML's own types, but honour choices.
            if action.choices is not None and value is not None and value not in action.choices:
                if not (isinstance(value, str) and action.type and _converts(action.type, value, action.choices)):
                    raise UsageError(
                        f"option {key} in {config_path}: {value!r} is not one of {list(action.choices)}"
                    )
            action.required = False
        parser.set_defaults(**defaults)
        explicit |= set(defaults)

    if helping:
        # Printed here (not by argparse) so it can be kept: the dispatcher prints it next time without importing
        # the trainers (helpcache.py). With --config the defaults shown are the file's, so that one isn't kept.
        text = parser.format_help()
        if config_path is None:
            helpcache.store(prog.split()[-1], text)
        print(text, end="")
        raise SystemExit(0)

    argv = _translate_cli(argv, legacy)
    for a in argv:
        # A word with a space is a value, as argparse reads it (`--vllm_serve_args '--port 8000'`).
        if a.startswith("--") and " " not in a.split("=", 1)[0]:
            name = a[2:].split("=", 1)[0]
            if name in known:
                explicit.add(known[name].dest)
            elif name not in ("help",):
                raise UsageError(f"unknown option --{name}{_suggest(name, known)} (see `{prog} --help`)")

    try:
        parsed = parser.parse_args_into_dataclasses(argv, return_remaining_strings=True, look_for_args_file=False)
    except UsageError:
        raise
    except (ValueError, TypeError, ArithmeticError, AttributeError, KeyError) as e:
        # __post_init__ of TrainingArguments & co. rejects inconsistent combinations with ValueError (and chokes on
        # some values with others: warmup_steps inf -> OverflowError).
        where = f" (config file {config_path} + command line)" if config_path else ""
        raise UsageError(f"invalid options{where}: {e}".replace("\n", " ")) from None

    remaining = parsed[-1]
    if remaining:
        raise UsageError(f"unexpected argument(s) {' '.join(remaining)} (options are --name value; see `{prog} --help`)")
    objs = parsed[: len(dataclass_types)]
    for obj in objs:
        check_ranges(obj)
        _token_to_environment(obj)
    for obj in objs:
        fields = {f.name for f in dataclasses.fields(obj)}
        try:
            object.__setattr__(obj, _EXPLICIT_ATTR, frozenset(explicit & fields))
        except (AttributeError, TypeError):  # slots dataclass: explicit() then reports nothing
            pass
    return tuple(objs)


def _yaml_value(key: str, action, value: Any, path: str) -> Any:
    """A YAML value as the option's own type would parse it (argparse converts only string defaults), or one line:
    `learning_rate: [1, 2]` or a mapping where a number belongs used to crash deep inside the Trainer."""
    if value is None or action.type is None:
        return value
    many = action.nargs in ("+", "*") or isinstance(action.nargs, int)
    items = value if many and isinstance(value, list) else [value]
    if any(isinstance(v, (list, dict, set)) for v in items):
        kind = "a list" if isinstance(value, list) else f"a {type(value).__name__}"
        raise UsageError(f"option {key} in config file {path}: expected a single value, got {kind} "
                         f"({str(value)[:80]}); write `{key}: VALUE`")
    try:
        out = [v if isinstance(v, bool) and action.type is not int else action.type(v if isinstance(v, str) else str(v))
               for v in items]
    except (TypeError, ValueError, ArithmeticError, argparse.ArgumentTypeError):
        name = getattr(action.type, "__name__", "the option's type")
        raise UsageError(f"option {key} in config file {path}: {str(value)[:80]!r} is not a valid {name}") from None
    return out if many else out[0]


# The range of every numeric option any entrypoint accepts, checked in one place when the options are parsed, whether
# the run will use the option or not: a value the program would only judge when it reaches it (after the model
# loaded: `--lora_dropout 1.5`), or never (`--vllm_server_wait -1` with vLLM unused), is one error up front.
# tests/test_hostile_image.py fails when a trainer gains a numeric option that is in neither table.
INF = math.inf
ABOVE_0 = (0, INF, False, True)  # (low, high, low allowed, high allowed)
AT_LEAST_0 = (0, INF, True, True)
UNIT = (0, 1, True, True)
UNIT_OPEN = (0, 1, True, False)  # a dropout or an Adam beta of 1 trains nothing
SHARE = (0, 1, False, True)
PORT = (1, 65535, True, True)
RANGES: dict[str, tuple] = {
    **dict.fromkeys((
        "max_length", "max_seq_length", "max_completion_length", "max_prompt_length", "max_prompt_tokens", "lora_r",
        "lora_alpha", "num_generations", "num_generations_eval", "per_device_train_batch_size",
        "per_device_eval_batch_size", "gradient_accumulation_steps", "eval_accumulation_steps",
        "generation_batch_size", "steps_per_generation", "num_iterations", "num_train_epochs", "save_steps",
        "logging_steps", "eval_steps", "adam_epsilon", "dataloader_prefetch_factor", "dataset_num_proc",
        "ddp_bucket_cap_mb", "ddp_timeout", "max_tool_calling_iterations", "ref_model_sync_steps",
        "torch_empty_cache_steps", "vllm_max_model_length", "vllm_server_timeout", "vllm_tensor_parallel_size",
        "vllm_server_wait", "repetition_penalty", "temperature", "sapo_temperature_neg", "sapo_temperature_pos",
        "neftune_noise_alpha", "pad_to_multiple_of", "delta", "nnodes", "nproc_per_node", "max_samples",
        "precompute_ref_batch_size", "discopop_tau"), ABOVE_0),
    **dict.fromkeys((
        "learning_rate", "weight_decay", "warmup_steps", "beta", "dataloader_num_workers", "save_total_limit", "seed",
        "data_seed", "max_grad_norm", "eval_delay", "entropy_coef", "entropy_coef_delta", "entropy_coef_max",
        "entropy_coef_min", "entropy_target", "epsilon", "epsilon_high", "num_completions_to_print",
        "off_policy_mask_threshold", "router_aux_loss_coef", "top_k", "vllm_importance_sampling_cap",
        "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min", "vespo_k_neg", "vespo_k_pos",
        "vespo_lambda_neg", "vespo_lambda_pos", "vllm_server_nodes", "vllm_server_gpus", "node_rank",
        "f_alpha_divergence_coef", "loss_weights"), AT_LEAST_0),
    **dict.fromkeys(("min_p", "label_smoothing_factor", "top_entropy_quantile", "ref_model_mixup_alpha", "ld_alpha"),
                    UNIT),
    "label_smoothing": (0, 0.5, True, False),  # DPO's: the chance a preference label is flipped (robust, exo_pair)
    **dict.fromkeys(("lora_dropout", "adam_beta1", "adam_beta2"), UNIT_OPEN),
    **dict.fromkeys(("top_p", "vllm_gpu_memory_utilization"), SHARE),
    **dict.fromkeys(("master_port", "vllm_server_port", "vllm_group_port"), PORT),
    "max_steps": (-1, INF, True, True),  # -1: train for num_train_epochs
}
# Values inside a range that mean nothing to train: name -> (value, what to pass instead). The Trainer reads
# `--max_steps 0` as "no limit given" and its epoch arithmetic then ran one step ("steps 1/0").
EMPTY_VALUES: dict[str, tuple] = {
    "max_steps": (0, "a number of steps above 0, or -1 (the default) to train for --num_train_epochs"),
}
# Numeric options with no range of their own: set by a launcher (local_rank), or signed on purpose (a reward weight
# may be a penalty).
UNBOUNDED = frozenset({"local_rank", "reward_weights"})
# String options whose dataclass declares no choices (argparse can't refuse a typo) and that the trainer reads only
# when it gets there: name -> the values it accepts (TRL 1.16's help texts; YAML booleans where TRL maps them).
# Given to argparse as the option's choices where it has none (SFT's loss_type has its own).
CHOICES: dict[str, tuple] = {
    "vllm_mode": ("server", "colocate"),
    "vllm_model_impl": ("vllm", "transformers"),
    "importance_sampling_level": ("token", "sequence"),
    "multi_objective_aggregation": ("sum_then_normalize", "normalize_then_sum"),
    "scale_rewards": ("group", "batch", "none", True, False),
    # per trainer config where the name means different things (TRL's config class name -> its values)
    "loss_type": {"GRPOConfig": ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"),
                  "DPOConfig": ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard",
                                "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")},
    "f_divergence_type": ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"),
    "vllm_importance_sampling_mode": ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
}


def _range_text(low, high, low_in, high_in) -> str:
    if high == INF:
        return f"{'at least' if low_in else 'above'} {low:g}"
    return f"from {low:g} {'' if low_in else '(not included) '}to {high:g}{'' if high_in else ' (not included)'}"


def check_ranges(obj) -> None:
    """Checked before anything loads: finite numbers, every numeric option in its range (RANGES). CHOICES are
    argparse's own (set on the parser: _make_parser), so the command line and YAML are both checked."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name, None)
        values = v if isinstance(v, (list, tuple)) else [v]
        for x in values:
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                continue
            if isinstance(x, float) and not math.isfinite(x):
                raise UsageError(f"--{f.name} {x}: must be a finite number")
            if f.name in RANGES:
                low, high, low_in, high_in = RANGES[f.name]
                if x < low or x > high or (x == low and not low_in) or (x == high and not high_in):
                    raise UsageError(f"--{f.name} {x}: must be {_range_text(low, high, low_in, high_in)}")
            if f.name in EMPTY_VALUES and x == EMPTY_VALUES[f.name][0]:
                raise UsageError(f"--{f.name} {x} trains nothing; pass {EMPTY_VALUES[f.name][1]}")


def _token_to_environment(obj) -> None:
    """`--hub_token X` goes to huggingface_hub through HF_TOKEN and is dropped from the arguments: the Trainer pickles
    its arguments into every checkpoint (training_args.bin), which ARTIFACT_DIR then carries."""
    token = getattr(obj, "hub_token", None)
    if token:
        os.environ.setdefault("HF_TOKEN", token)
        object.__setattr__(obj, "hub_token", None)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return torch.cuda.is_available()


def _converts(type_fn, value, choices) -> bool:
    try:
        return type_fn(value) in choices
    except Exception:
        return False


def explicit(obj) -> frozenset[str]:
    """Names of the fields of a parsed dataclass that the user set (in YAML or on the command line)."""
    return getattr(obj, _EXPLICIT_ATTR, frozenset())


def configured_output_dir(args) -> str | None:
    """`args.output_dir` if the user set it, else None (so outputs.output_dir applies $OUTPUT_DIR / the default)."""
    return args.output_dir if "output_dir" in explicit(args) else None


def set_explicit(obj, names) -> None:
    """Record which options the user set on `obj` (for dataclasses built outside parse_args)."""
    object.__setattr__(obj, _EXPLICIT_ATTR, frozenset(names))


# TRL's ModelConfig options that only a LoRA / k-bit run reads: in a run that trains every weight (sft, grpo --mode
# full) they would be accepted and ignored (`sft --use_peft true --lora_r 8` saved a full model, no adapter).
PEFT_OPTIONS = ("use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_parameters",
                "lora_modules_to_save", "lora_task_type", "use_rslora", "use_dora")
QUANT_OPTIONS = ("load_in_8bit", "load_in_4bit", "bnb_4bit_quant_type", "use_bnb_nested_quant",
                 "bnb_4bit_quant_storage")


def changed_options(obj, names) -> list[str]:
    """Those of `names` the user set (explicit) to something other than the dataclass's default."""
    fields = {f.name: f for f in dataclasses.fields(obj)}
    out = []
    for name in names:
        f = fields.get(name)
        if f is None or name not in explicit(obj):
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING and f.default_factory is not \
            dataclasses.MISSING else f.default
        if getattr(obj, name) != default:
            out.append(name)
    return out


def refuse_unused(model_args, names, what: str, fix: str) -> None:
    """One UsageError naming each option of `names` the user set that this run would ignore."""
    unused = changed_options(model_args, names)
    if unused:
        them = "it" if len(unused) == 1 else "them"
        raise UsageError(f"{', '.join('--' + n for n in unused)}: {what} would ignore {them}; {fix}")


def check_full_training(model_args, prog: str = "sft") -> None:
    """sft trains every weight in the model's own dtype: LoRA and 4/8-bit options are refused, not ignored."""
    refuse_unused(model_args, PEFT_OPTIONS + QUANT_OPTIONS,
                  f"{prog} trains every weight (no LoRA, no 4/8-bit base) and",
                  "use `trainbox qlora` for LoRA on a 4-bit base (or `trainbox grpo --mode lora|qlora`), or drop them")


# Checks every training entrypoint runs before any model loads.
REPORT_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "comet_ml": "comet_ml"}


def check_model_path(spec: str | None, option: str = "--model_name_or_path") -> None:
    if not spec:
        raise UsageError(f"no model given: pass {option} PATH (a directory with config.json) or a hub id")
    p = Path(os.path.expanduser(spec))
    if p.exists():
        if not (p / "config.json").is_file():
            raise UsageError(f"model path {spec} has no config.json; point {option} at a saved model directory")
        return modelcheck.check(p / "config.json", spec)
    if spec.startswith(("/", "./", "../", "~")) or spec.count("/") > 1:
        raise UsageError(f"model path {spec} does not exist; check {option} (and the container's mounts)")
    # A hub id: its config.json (small) is fetched or found in the cache now, so a typo or an offline machine is one
    # line before anything loads rather than a traceback from deep inside from_pretrained.
    from transformers.utils import cached_file

    try:
        found = cached_file(spec, "config.json")
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"model {spec!r} is not a local directory and the hub can't serve it ({first[:300]}); check "
                         f"{option} (a local folder needs ./ or a path), or mount the model and pass its path") from None
    modelcheck.check(found, spec)


def check_report_to(report_to) -> None:
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    for name in names:
        if name not in ("none", "all") and name not in INTEGRATION_TO_CALLBACK:
            raise UsageError(f"--report_to {str(name)[:60]!r} is not a known integration; use one of none, "
                             f"{', '.join(sorted(INTEGRATION_TO_CALLBACK))}")
        pkg = REPORT_PACKAGES.get(name)
        if pkg and importlib.util.find_spec(pkg) is None:
            raise UsageError(f"--report_to {name} needs the {pkg} package, which this image lacks; use tensorboard or none")
