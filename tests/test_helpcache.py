"""The trainers' --help printed from the kept text: the same bytes as rendering it, without importing TRL or
transformers (a poisoned import proves it), one text on every host, re-rendered once the installed versions or our
sources change."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import sidebyside
from common import commands
from trainbox import helpcache

ROOT = Path(__file__).resolve().parents[1]


def trainbox(*args, env, pythonpath=()):
    env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([*map(str, pythonpath), str(ROOT)])}
    # The user's cache alone (a checkout's own .cache, the first folder otherwise, is test_hostile_image's subject):
    # a folder below /dev/null can't be made.
    env["TRAINBOX_HELP_DIR"] = "/dev/null/help"
    return subprocess.run([sys.executable, "-m", "trainbox", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture
def poisoned(tmp_path):
    """A folder whose trl and transformers packages raise on import."""
    for pkg in ("trl", "transformers"):
        (tmp_path / "poison" / pkg).mkdir(parents=True)
        (tmp_path / "poison" / pkg / "__init__.py").write_text(f"raise ImportError('{pkg} was imported')\n")
    return tmp_path / "poison"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """The runs that render a --help (each imports TRL: ~10-20 s), started together on a pool (sidebyside); each
    test waits for its own. Per trainer: the first --help with a cache folder of its own; qlora's with no kept text
    anywhere; sft's with a --config file."""
    pool = sidebyside.pool()
    runs = {}
    for name in commands.names(trainer=True):
        cache = tmp_path_factory.mktemp(f"help-{name}") / "cache"
        runs[name] = cache, pool.submit(trainbox, name, "--help", env={"XDG_CACHE_HOME": str(cache)})
    runs["qlora-uncached"] = None, pool.submit(
        subprocess.run, [sys.executable, "-m", "trainbox.cli.qlora", "--help"], cwd=ROOT, capture_output=True,
        text=True, env={**os.environ, "PYTHONPATH": str(ROOT), "TRAINBOX_HELP_DIR": "/nonexistent/x"}, timeout=300)
    folder = tmp_path_factory.mktemp("help-config")
    (folder / "c.yaml").write_text("learning_rate: 0.5\n")
    runs["sft-config"] = folder / "cache", pool.submit(trainbox, "sft", "--config", str(folder / "c.yaml"), "--help",
                                                       env={"XDG_CACHE_HOME": str(folder / "cache")})
    yield runs
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("name", commands.names(trainer=True))
def test_second_help_prints_the_same_text_without_importing_trl(rendered, tmp_path, poisoned, name):
    cache, run = rendered[name]
    first = run.result()
    assert first.returncode == 0 and "--model_name_or_path" in first.stdout, first.stderr[-2000:]
    again = trainbox(name, "--help", env={"XDG_CACHE_HOME": str(cache)}, pythonpath=[poisoned])
    assert again.returncode == 0, again.stderr[-2000:]
    assert again.stdout == first.stdout
    assert (cache / "trainbox" / "help" / f"{name}.txt").is_file()
    # Without the kept text the poisoned import is what runs: the test above would have caught a miss.
    cold = trainbox(name, "--help", env={"XDG_CACHE_HOME": str(tmp_path / "empty")}, pythonpath=[poisoned])
    assert cold.returncode != 0 and "was imported" in cold.stderr


def test_help_is_the_same_on_every_host(rendered):
    """qlora's optimizer default depends on the GPU; its --help shows the GPU's on a CPU host too (and sft's does
    not force use_cpu), so the text kept at image build is right where the image runs."""
    from trainbox.cli import qlora

    assert qlora.qlora_defaults(gpu=True)["optim"] == "paged_adamw_8bit"
    text = rendered["qlora-uncached"][1].result().stdout
    assert "paged_adamw_8bit" in text.split("--optim", 1)[1].split("--", 1)[0]


def test_a_stale_or_foreign_text_is_not_printed(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINBOX_HELP_DIR", str(tmp_path))
    helpcache.store("sft", "usage: trainbox sft ...\n")
    assert helpcache.load("sft") == "usage: trainbox sft ...\n"
    real = helpcache.metadata.version
    monkeypatch.setattr(helpcache.metadata, "version", lambda d: "0.0.1" if d == "trl" else real(d))
    assert helpcache.load("sft") is None  # another TRL: other options
    monkeypatch.undo()
    monkeypatch.setenv("TRAINBOX_HELP_DIR", str(tmp_path))
    (tmp_path / "sft.txt").write_bytes(b"\xff\xfe binary")
    assert helpcache.load("sft") is None


def test_help_with_a_config_file_is_rendered_not_kept(rendered):
    cache, run = rendered["sft-config"]
    r = run.result()
    assert r.returncode == 0 and "--learning_rate" in r.stdout
    assert not (cache / "trainbox" / "help" / "sft.txt").exists()


def test_asked_ignores_arguments_after_double_dash():
    assert helpcache.asked(["--dataset", "d", "-h"]) and not helpcache.asked(["--", "--help"])


def test_image_build_step_renders_every_trainer_and_nothing_in_a_light_image(tmp_path, monkeypatch):
    """`python -m trainbox.helpcache` (the Dockerfile's RUN): every trainer's text kept; without TRL (the light arm64
    smoke image: jupyter and doctor only) nothing to render and no failure."""
    monkeypatch.setenv("TRAINBOX_HELP_DIR", str(tmp_path / "help"))
    assert sorted(helpcache.render_all()) == sorted(commands.names(trainer=True))  # the command table's trainers
    assert all(helpcache.load(n) for n in commands.names(trainer=True))
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    assert helpcache.render_all() == []
