"""matrix.toml is the one home of flavours and rules (issue 30 item 2): a new flavour with its own package facts,
extras and packages shipped together is a matrix edit and nothing else; rules are registered by id; reasons are
filled from the tables; the image record carries the GPU generations and driver floor doctor reads."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from builder import pins, rules
from builder.matrix import load_matrix
from builder.paths import ROOT

FLAVOUR = '''
[flavour.axo]
description = "a flavour added with no Python edit"
cells = ["smoke-x86_64"]
packages = { axo = "0.9.0", Axo_Core = "0.9.0", pyyaml = "6.0.3" }
rules = ["axo-fits"]
files = { "images/notebooks/unsloth" = "/workspace/axo" }
cmd = ["jupyter"]

[[rule]]
id = "axo-fits"
facts = "axo"
packages = ["axo", "axo-core"]
reason = "axo + axo-core install only where their metadata ([facts] axo) accepts every pin"
'''


def new_flavour(tmp_path: Path, trl_range: str = ">=1.16.0,<1.17") -> Path:
    text = (ROOT / "matrix.toml").read_text()
    text = text.replace("\n[facts]\n", f'\n[facts]\naxo = {{ version = "0.9.0", trl = "{trl_range}", '
                                      'transformers = ">=5.10" }\n', 1)
    text = text.replace("\n[extras]\n", '\n[extras]\naxo = ["train"]\n', 1)
    path = tmp_path / "tmp.toml"
    path.write_text(text + FLAVOUR)
    return path


def build(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "build.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_a_new_flavour_is_a_matrix_edit(tmp_path):
    path = new_flavour(tmp_path)
    r = build("--matrix", str(path), "--list", "--quiet")
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("smoke-x86_64-axo "))
    assert "x86_64" in line
    out = tmp_path / "out"
    r = build("--matrix", str(path), "--cell", "smoke-x86_64-axo", "--dry-run", "--output-dir", str(out))
    assert r.returncode == 0, r.stderr
    assert "1. smoke-x86_64 " in r.stdout and "2. smoke-x86_64-axo " in r.stdout   # built FROM its base cell
    dockerfile = (out / "images/smoke-x86_64-axo/Dockerfile").read_text()
    assert "COPY --chown=1000:1000 images/notebooks/unsloth/ /workspace/axo/" in dockerfile
    assert "locks/smoke-x86_64-axo.txt" in dockerfile
    record = json.loads((out / "images/smoke-x86_64-axo/image.json").read_text())
    assert record["flavour"] == "axo" and record["versions"]["axo-core"] == "0.9.0"
    r = build("--matrix", str(path), "--explain")
    assert r.returncode == 0 and re.search(r"^  rule=axo-fits: fits — axo \+ axo-core install", r.stdout, re.M)
    # pins reads the new flavour's facts, its extras and the packages shipped together from the matrix alone
    extras, together = pins.shape(pins.read_matrix(path))
    assert extras["axo"] == ("train",) and together == {"unsloth": ("unsloth", "unsloth-zoo"),
                                                        "axo": ("axo", "axo-core")}
    assert pins.fact_requirements(pins.read_matrix(path)["facts"], together).count("axo-core==0.9.0") == 1


def test_the_new_flavours_facts_rule_holds_its_pins(tmp_path):
    path = new_flavour(tmp_path, trl_range=">=1.17")
    r = build("--matrix", str(path), "--list")
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "flavour 'axo' on cell smoke-x86_64 breaks rule 'axo-fits': trl 1.16.0 is outside axo's trl>=1.17" in r.stderr


def test_rules_are_registered_by_id_one_function_each():
    assert len({id(r.check) for r in rules.REGISTRY.values()}) == len(rules.REGISTRY)
    assert rules.CHECKS == tuple(rules.REGISTRY)
    # no rule id is spelled in a tuple or an if-chain outside its own registration
    source = (ROOT / "builder/rules.py").read_text()
    for rule_id in rules.REGISTRY:
        assert source.count(f'"{rule_id}"') == 1, rule_id
    # one generic flavour path: Unsloth is named only by the wrapper builder/cli.py still calls
    assert [ln for ln in source.splitlines() if "unsloth" in ln.lower()] == [
        'def unsloth_lines(facts: dict, cells, reason: str, file: str = "matrix.toml") -> list[str]:',
        '    return fit_lines("unsloth", facts, cells, reason, "unsloth-fits", file)']


def test_reasons_are_filled_from_the_tables():
    m = load_matrix()
    text = (ROOT / "matrix.toml").read_text()
    reasons = dict(re.findall(r'^id = "([^"]+)"\n(?:[a-z]+ = .*\n)*?reason = "([^"]*)"', text, re.M))
    assert "{torch}" in reasons["torch-variant-exists"] and "2.13" not in reasons["torch-variant-exists"]
    assert m.rules["torch-variant-exists"].startswith(f"torch {m.data['stack']['train']['packages']['torch']} ")
    assert "{fa3_gpus}" in reasons["fa3-hopper-only"] and "Hopper-only" in m.rules["fa3-hopper-only"]
    assert not re.search(r"\d+\.\d+", reasons["gpu-min-cuda"] + reasons["vllm-variant-exists"])


def test_fa3_reads_its_gpus_from_the_attention_table(tmp_path):
    """`[attention.fa3] gpus` decides where FA3 may go; the rule repeats no GPU name of its own."""
    text = (ROOT / "matrix.toml").read_text().replace('max_jobs = 8\ngpus = ["hopper"]',
                                                       'max_jobs = 8\ngpus = ["hopper", "blackwell"]', 1)
    path = tmp_path / "m.toml"
    path.write_text(text)
    m = load_matrix(path)
    assert not [e for e in m.exclusions if e.gpu == "blackwell" and e.attention == "fa3"]
    assert "Hopper and Blackwell-only" in m.rules["fa3-hopper-only"]


def test_the_image_record_carries_gpu_generations_and_the_driver_floor():
    data = load_matrix().data
    for tag in ("cu130-hopper-x86_64", "smoke-x86_64", "cu130-ampere-aarch64-verl"):
        record = json.loads((ROOT / "images" / tag / "image.json").read_text())
        assert record["gpu_generations"] == {g: t["sm"] for g, t in data["gpu"].items()}
    record = json.loads((ROOT / "images/cu130-hopper-x86_64/image.json").read_text())
    assert record["min_driver"] == data["cuda"]["13.0"]["min_driver"]


def test_no_import_cycle_between_the_workflow_generators():
    for name in ("workflow", "flashwheels"):
        source = (ROOT / f"builder/{name}.py").read_text()
        other = "flashwheels" if name == "workflow" else "workflow"
        imports = re.findall(r"^\s*(?:from builder(?:\.(\w+))? import ([\w, ]+)|import builder\.(\w+))", source, re.M)
        named = {m for a, b, c in imports for m in ([a] if a else [x.strip() for x in b.split(",")]) + [c] if m}
        assert (other in named) == (name == "workflow"), (name, named)
