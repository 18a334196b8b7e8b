"""`python -m builder.pins`: which pins could move and what blocks them, [facts] refreshed from metadata, matrix.toml
rewritten in place. Against a real PEP 503 index on 127.0.0.1 (wheels whose METADATA carries Requires-Dist, asked
through pip as the command asks the default index); one `network` test checks the committed [facts] against the
live index."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

import liveindex
import simpleindex
from builder import pins
from builder.errors import UserError

ROOT = Path(__file__).resolve().parents[1]

# name, version, Requires-Dist: a small world shaped like the real one
RELEASES = [
    ("torch", "2.13.0", []), ("torch", "2.14.0", []),
    ("transformers", "5.17.0", []), ("transformers", "5.20.0", []),
    ("vllm", "0.31.0", ["torch==2.13.0", "transformers<5.18.0,>=5.10.4"]),
    ("vllm", "0.33.0", ["torch==2.14.0", "transformers<5.21.0,>=5.16.1"]),
    ("trl", "1.16.0", ["transformers>=4.56.2", 'vllm<=0.31.0,>=0.22.0; extra == "vllm"']),
    ("trl", "1.15.0", ["transformers>=4.56.2", 'vllm<=0.31.0,>=0.21.0; extra == "vllm"']),
    ("peft", "0.21.2", []),
    ("accelerate", "1.15.0", []), ("accelerate", "1.16.0", ["peft>=0.22.0"]),
    ("pyyaml", "6.0.3", []), ("pyyaml", "6.0.4", []),
    ("unsloth", "2026.10.9", ["unsloth_zoo>=2026.10.9", "torch<2.15.0,>=2.4.0", "trl!=0.19.0,<=1.15.0,>=0.18.2",
                              "datasets<5.0.0,>=3.4.1"]),
    ("unsloth_zoo", "2026.10.9", ['torch<2.15.0,>=2.1.0; sys_platform != "darwin" or platform_machine != "arm64"',
                                  "trl!=0.19.0,<=1.15.0,>=0.18.2", "datasets>=3.0.0,<5.0.0,!=4.0.*",
                                  'mlx==0.32.4; sys_platform == "darwin"']),
    # what the verl flavour installs comes partly through an extra (verl[verl-core] brings transferqueue)
    ("verl", "0.9.1", ["transformers<5.11", 'transferqueue>=0.1.10; extra == "verl-core"']),
]

MATRIX = '''# a matrix with only what builder.pins reads; this comment stays
[stack.train]
packages = { torch = "2.13.0", transformers = "5.17.0", trl = "1.16.0", peft = "0.21.2", accelerate = "1.15.0", pyyaml = "6.0.3" }

[stack.gpu]
extends = "train"
packages = { vllm = "0.31.0" }

[extras]
trl = ["vllm"]
verl = ["verl-core"]

# Facts from package metadata.
[facts]
# Checked against the package index on 2026-01-02 (keep this line).
vllm_torch = { "0.31.0" = "2.12.0" }
trl_vllm_extra = { "1.16.0" = ">=0.22.0,<=0.31" }
vllm_transformers = { "0.31.0" = ">=5.10.4,<5.18" }
# unsloth and unsloth-zoo, the tighter of the two
unsloth = { version = "2026.10.9", torch = ">=2.4.0,<2.15.0", trl = ">=0.18.2,<=1.15.0,!=0.19.0", datasets = ">=3.4.1,<5.0.0" }
verl = { version = "0.9.1", transformers = "<5.11", transferqueue = ">=0.1.10" }

[flavour.uns]
packages = { trl = "1.15.0", unsloth = "2026.10.9", unsloth-zoo = "2026.10.9" }

[[rule]]
id = "unsloth-fits"
facts = "unsloth"
packages = ["unsloth", "unsloth-zoo"]
reason = "unsloth and unsloth-zoo, the tighter of the two"

[[rule]]
id = "verl-fits"
facts = "verl"
reason = "verl's own"

[[rule]]
reason = "a last rule (no [facts] table of its own): the rewrite keeps the lines after [facts]"
facts = "after-facts"
id = "after-facts"
'''


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """A PEP 503 index of RELEASES on 127.0.0.1; yields its URL."""
    tmp = tmp_path_factory.mktemp("pins-index")
    (tmp / "wheels").mkdir()
    for name, version, requires in RELEASES:
        simpleindex.stand_in_wheel(tmp / "wheels", name, version, requires=requires)
    simpleindex.write_index(tmp / "wheels", tmp / "root")
    with simpleindex.serve(tmp / "root", tmp / "http.log") as url:
        yield url


@pytest.fixture
def pip_env(index, monkeypatch):
    """pip asks the local index only: no config file, no find-links, no extra index."""
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", index)
    for var in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX"):
        monkeypatch.delenv(var, raising=False)
    return index


@pytest.fixture
def matrix(tmp_path):
    path = tmp_path / "matrix.toml"
    path.write_text(MATRIX)
    return path


def test_table_says_what_could_move_and_what_blocks_it(pip_env, matrix):
    rep = pins.check(matrix)
    by = {r.package: r for r in rep.rows}
    assert (by["vllm"].newest, by["vllm"].verdict) == ("0.33.0", "no")
    assert by["vllm"].blockers == ["trl[vllm] 1.16.0 caps vllm<=0.31.0"]
    assert by["torch"].verdict == "no" and by["torch"].blockers == ["vllm 0.31.0 pins torch==2.13.0"]
    assert by["transformers"].blockers == ["vllm 0.31.0 caps transformers<5.18.0"]
    assert (by["pyyaml"].newest, by["pyyaml"].verdict, by["pyyaml"].blockers) == ("6.0.4", "yes", [])
    assert by["peft"].verdict == "up to date"
    # nothing pinned holds accelerate back, but its newest release needs a newer peft: they move together
    assert by["accelerate"].verdict == "with peft" and by["accelerate"].needs == ["peft>=0.22.0 (pinned 0.21.2)"]
    # a flavour's own pins, checked together with the stack's: unsloth holds its trl back
    assert (by["trl (uns)"].pin, by["trl (uns)"].newest, by["trl (uns)"].verdict) == ("1.15.0", "1.16.0", "no")
    assert by["trl (uns)"].blockers == ["unsloth 2026.10.9 caps trl<=1.15.0", "unsloth_zoo 2026.10.9 caps trl<=1.15.0"]
    assert by["unsloth (uns)"].verdict == "up to date" and "trl" in by and by["trl"].verdict == "up to date"
    text = pins.table(rep.rows)
    assert re.search(r"^vllm\s+0\.31\.0\s+0\.33\.0\s+no\s+trl\[vllm\] 1\.16\.0 caps vllm<=0\.31\.0$", text, re.M)
    assert re.search(r"^accelerate .* with peft\s+accelerate 1\.16\.0 needs peft>=0\.22\.0 \(pinned 0\.21\.2\)$",
                     text, re.M)


def test_facts_are_refreshed_from_metadata(pip_env, matrix):
    rep = pins.check(matrix)
    new = rep.new_facts
    assert new["vllm_torch"] == {"0.31.0": "2.13.0", "0.33.0": "2.14.0"}   # the wrong fact corrected, newest added
    # a recorded range that means what the metadata says keeps its text (order and trailing zeros don't matter)
    assert new["trl_vllm_extra"] == {"1.16.0": ">=0.22.0,<=0.31"}
    assert new["vllm_transformers"] == {"0.31.0": ">=5.10.4,<5.18", "0.33.0": ">=5.16.1,<5.21.0"}
    # unsloth: the tighter bound of unsloth and unsloth-zoo; a darwin-only requirement of the zoo doesn't count
    assert new["unsloth"]["torch"] == ">=2.4.0,<2.15.0"
    assert SpecifierSet(new["unsloth"]["datasets"]) == SpecifierSet(">=3.4.1,<5.0.0,!=4.0.*")
    # a requirement behind the extra the flavour installs is read with that extra on
    assert new["verl"] == {"version": "0.9.1", "transformers": "<5.11", "transferqueue": ">=0.1.10"}
    assert pins.differences(rep.facts, new) == [
        "facts.vllm_torch.0.31.0: recorded '2.12.0', the index says '2.13.0'",
        "facts.unsloth.datasets: recorded '>=3.4.1,<5.0.0', the index says '>=3.4.1,<5.0.0,!=4.0.*'"]


def test_write_changes_only_the_facts_values_and_date(pip_env, matrix):
    before = matrix.read_text()
    r = subprocess.run([sys.executable, "-m", "builder.pins", "--matrix", str(matrix), "--write"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "stale: facts.vllm_torch.0.31.0" in r.stdout and "new: facts.vllm_torch.0.33.0 = '2.14.0'" in r.stdout
    after = matrix.read_text()
    changed = [(a, b) for a, b in zip(before.splitlines(), after.splitlines()) if a != b]
    assert len(before.splitlines()) == len(after.splitlines())
    assert {a.split(" =")[0].split(" on ")[0] for a, _ in changed} == {
        "vllm_torch", "vllm_transformers", "unsloth", "# Checked against the package index"}
    assert 'vllm_torch = { "0.31.0" = "2.13.0", "0.33.0" = "2.14.0" }' in after
    assert re.search(r"^# Checked against the package index on \d{4}-\d{2}-\d{2} \(keep this line\)\.$", after, re.M)
    assert "# unsloth and unsloth-zoo, the tighter of the two" in after and after.endswith('id = "after-facts"\n')
    # a second run finds nothing to change
    r = subprocess.run([sys.executable, "-m", "builder.pins", "--matrix", str(matrix), "--write"], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0 and "stale:" not in r.stdout and matrix.read_text() == after


def test_unreachable_index_is_one_error_and_nothing_written(matrix, monkeypatch):
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{simpleindex.free_port()}/simple/")
    monkeypatch.setenv("PIP_RETRIES", "1")   # one retry: pip names the connection error
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    before = matrix.read_text()
    r = subprocess.run([sys.executable, "-m", "builder.pins", "--matrix", str(matrix), "--write"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "cannot reach the package index" in r.stderr and matrix.read_text() == before


def test_rewrite_refuses_a_facts_table_it_cannot_rewrite_in_place():
    text = MATRIX.replace('vllm_torch = { "0.31.0" = "2.12.0" }', '[facts.vllm_torch]\n"0.31.0" = "2.12.0"')
    with pytest.raises(UserError, match="not a one-line inline table"):
        pins.rewrite(text, {"vllm_torch": {"0.31.0": "2.13.0"}}, "2026-02-03")


def test_tightest_keeps_the_narrower_bounds():
    assert str(pins.tightest(SpecifierSet(">=2.1.0,<2.15.0,>=2.4.0,<=2.16"))) == "<2.15.0,>=2.4.0"
    assert pins.spec_text(SpecifierSet("!=0.19.0,<=1.15.0,>=0.18.2")) == ">=0.18.2,<=1.15.0,!=0.19.0"


@pytest.mark.network
def test_recorded_facts_agree_with_the_index():
    """Fails when a [facts] entry of matrix.toml disagrees with the live index (run `python -m builder.pins`)."""
    try:
        rep = pins.check(ROOT / "matrix.toml", pins_too=False)
    except UserError as e:
        if "cannot reach the package index" in str(e):
            liveindex.unreachable(str(e)[:200])
        raise
    assert pins.differences(rep.facts, rep.new_facts) == []
