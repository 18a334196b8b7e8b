"""examples/*.yaml, the configs a user starts from: one per trainer of the command table, each read by that trainer's
own parser (every key lands on an option, nothing dropped; the checks that need no model or data pass), and the Slurm
jobs of the trainers that have one, rendered from such a config or from the options after -- alone (issue 64 case 4:
a job without a YAML was refused even with every option after --)."""

import importlib

import pytest
import yaml

from builder import slurm
from builder.paths import ROOT
from common import commands

EXAMPLES = ROOT / "examples"
TRAINERS = commands.names(trainer=True)


def test_every_trainer_has_an_example_and_every_example_a_trainer():
    assert sorted(p.stem for p in EXAMPLES.glob("*.yaml")) == sorted(TRAINERS)


def _checks(name, options):
    """The trainer's own checks on parsed options that read neither the model nor the data: a declared trainer's
    recipe check (skeleton.Recipe), grpo's batch arithmetic."""
    from trainbox.training import skeleton
    from trainbox.training.grpo import options as grpo_options

    recipe = getattr(importlib.import_module(commands.qualified(name)), "RECIPE", None)
    if recipe is not None:
        if recipe.check:
            recipe.check(skeleton.Run.of(recipe, options))
    elif name == "grpo":
        grpo_options.finalize(options[2], 1)   # the batch arithmetic, then TRL's GRPOConfig's own checks


@pytest.mark.parametrize("name", TRAINERS)
def test_each_example_parses_through_its_trainer(name, monkeypatch):
    from trainbox.training import config

    # the examples name hub models, which the tests never fetch: the path check is the one check left out
    monkeypatch.setattr(config, "check_model_path", lambda spec: None)
    path = EXAMPLES / f"{name}.yaml"
    options = importlib.import_module(commands.qualified(name)).parse(["--config", str(path)])
    _checks(name, options)
    given = set(yaml.safe_load(path.read_text()))
    landed = set().union(*(config.explicit(o) for o in options))
    assert given <= landed, f"{path.name}: keys no option took: {sorted(given - landed)}"


def _job(tmp_path, name, *args):
    out = tmp_path / f"{name}.sh"
    assert slurm.main(["--tag", "cu129-hopper-x86_64", "--entrypoint", name, "--sqsh", "/shared/t.sqsh",
                       "--nodes", "2", "--gpus-per-node", "8", "-o", str(out), *args]) == 0
    return out.read_text()


@pytest.mark.parametrize("name", commands.names(slurm=True, trainer=True))
def test_a_trainer_job_renders_from_its_example_or_from_options_alone(tmp_path, name):
    job = _job(tmp_path, name, "--data", "/shared/data", "--config", f"/data/{name}.yaml")
    assert f"ARGS=({name} --config /data/{name}.yaml)" in job
    job = _job(tmp_path, name, "--", "--model_name_or_path", "/models/m", "--dataset", "/data/train.jsonl")
    assert f"ARGS=({name} --model_name_or_path /models/m --dataset /data/train.jsonl)" in job
    assert "--config" not in job.split("ARGS=(", 1)[1].split(")", 1)[0]


@pytest.mark.parametrize("name", commands.names(slurm=True, trainer=True))
def test_a_trainer_job_with_neither_config_nor_options_is_one_line(tmp_path, name, capsys):
    out = tmp_path / "job.sh"
    assert slurm.main(["--tag", "t", "--entrypoint", name, "--sqsh", "/shared/t.sqsh", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: no --config given") and "options after --" in err, err
    assert not out.exists()
