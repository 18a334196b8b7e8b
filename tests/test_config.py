"""config.parse_args: YAML defaults, CLI overrides, unknown options, legacy translation, program defaults."""

from dataclasses import dataclass, field

import pytest
from transformers import TrainingArguments

from common.errors import UsageError
from trainbox.training import config


@dataclass
class Script:
    dataset: str | None = field(default=None)
    prompt_key: str = "prompt"
    merge: bool = False


TYPES = (Script, TrainingArguments)


def parse(argv, **kw):
    return config.parse_args(TYPES, argv, prog="test", legacy=config.LEGACY_TRAINING, **kw)


def write(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_yaml_defaults_and_cli_overrides(tmp_path):
    cfg = write(tmp_path, "learning_rate: 0.001\nmax_steps: 3\ndataset: /data/x.parquet\nlr_scheduler_type: cosine\n")
    script, args = parse(["--config", cfg, "--max_steps", "7", "--merge"])
    assert args.learning_rate == 0.001  # from YAML
    assert args.max_steps == 7  # CLI wins
    assert args.lr_scheduler_type.value == "cosine"
    assert script.dataset == "/data/x.parquet" and script.merge is True
    assert config.explicit(args) == {"learning_rate", "max_steps", "lr_scheduler_type"}
    assert config.explicit(script) == {"dataset", "merge"}


def test_config_equals_form_and_dashed_names(tmp_path):
    cfg = write(tmp_path, "max_steps: 2\n")
    _, args = parse([f"--config={cfg}", "--per-device-train-batch-size", "3"])
    assert args.max_steps == 2 and args.per_device_train_batch_size == 3


def test_unknown_cli_option_suggests_close_names():
    with pytest.raises(UsageError) as e:
        parse(["--learning_rat", "1e-4"])
    msg = str(e.value)
    assert "--learning_rat" in msg and "--learning_rate" in msg


def test_unknown_yaml_key_names_the_file_and_suggests(tmp_path):
    cfg = write(tmp_path, "max_step: 3\n")
    with pytest.raises(UsageError) as e:
        parse(["--config", cfg])
    msg = str(e.value)
    assert "'max_step'" in msg and cfg in msg and "--max_steps" in msg


@pytest.mark.parametrize(
    "text, needle",
    [("- a\n- b\n", "must be a mapping"), ("a: [1,\n", "not valid YAML")],
)
def test_bad_yaml(tmp_path, text, needle):
    with pytest.raises(UsageError, match=needle):
        parse(["--config", write(tmp_path, text)])


def test_missing_config_file(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        parse(["--config", str(tmp_path / "nope.yaml")])


def test_bad_value_type_is_usage_error():
    with pytest.raises(UsageError, match="invalid int value"):
        parse(["--max_steps", "many"])


def test_bad_choice_in_yaml(tmp_path):
    with pytest.raises(UsageError, match="not one of"):
        parse(["--config", write(tmp_path, "lr_scheduler_type: wiggly\n")])


def test_rejected_combination_is_usage_error():
    # TrainingArguments.__post_init__ refuses this pair with ValueError.
    with pytest.raises(UsageError, match="invalid options"):
        parse(["--load_best_model_at_end", "--eval_strategy", "steps", "--save_strategy", "epoch"])


def test_stray_positional_argument():
    with pytest.raises(UsageError, match="unexpected argument"):
        parse(["stray"])


def test_legacy_warmup_ratio_yaml_and_cli(tmp_path, capsys):
    _, args = parse(["--config", write(tmp_path, "warmup_ratio: 0.1\n")])
    assert args.warmup_steps == pytest.approx(0.1)
    assert "warmup_ratio" in capsys.readouterr().err
    _, args = parse(["--warmup-ratio", "0.25"])
    assert args.warmup_steps == pytest.approx(0.25)
    assert "warmup_steps" in config.explicit(args)


def test_legacy_bare_flag_and_renames(capsys):
    _, args = parse(["--no_cuda", "--evaluation_strategy", "steps", "--per_gpu_train_batch_size", "5"])
    assert args.use_cpu is True
    assert args.eval_strategy.value == "steps"
    assert args.per_device_train_batch_size == 5
    err = capsys.readouterr().err
    assert err.count("warning: option") == 3


def test_legacy_max_seq_length_for_sft():
    from trl import SFTConfig

    (args,) = config.parse_args(
        (SFTConfig,), ["--max_seq_length", "77"], prog="t", legacy={**config.LEGACY_TRAINING, **config.LEGACY_SFT}
    )
    assert args.max_length == 77


def test_program_defaults_are_overridable(tmp_path):
    script, args = parse([], defaults={"max_steps": 11, "merge": True})
    assert args.max_steps == 11 and script.merge is True
    assert "max_steps" not in config.explicit(args)
    _, args = parse(["--config", write(tmp_path, "max_steps: 4\n")], defaults={"max_steps": 11})
    assert args.max_steps == 4
    _, args = parse(["--max_steps", "5"], defaults={"max_steps": 11})
    assert args.max_steps == 5


def test_configured_output_dir_only_when_set():
    _, args = parse([])
    assert config.configured_output_dir(args) is None
    _, args = parse(["--output_dir", "/tmp/x"])
    assert config.configured_output_dir(args) == "/tmp/x"


def test_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as e:
        parse(["--help"])
    assert e.value.code == 0
    assert "--learning_rate" in capsys.readouterr().out
