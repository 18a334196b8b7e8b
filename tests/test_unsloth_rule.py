"""The Unsloth notebook flavour rule (issue 12): unsloth/unsloth-zoo metadata ([facts] unsloth) against each stack's
pins, reported by --explain; the cells' pins are never loosened to make it fit."""

from __future__ import annotations

import subprocess
import sys

from builder import rules
from builder.matrix import load_matrix as load
from conftest import ROOT


def test_wildcard_exclusions_and_plain_ranges():
    spec = ">=3.4.1,<5.0.0,!=4.0.*,!=4.1.0"
    assert rules.satisfies("4.3.0", spec, "t") and rules.satisfies("3.4.1", spec, "t")
    assert not rules.satisfies("4.0.2", spec, "t") and not rules.satisfies("4.1.0", spec, "t")
    assert not rules.satisfies("5.2.0", spec, "t")


def test_conflicts_name_the_pins_and_a_fitting_stack_fits():
    facts = load(ROOT / "matrix.toml").data["facts"]
    gpu = next(c for c in load(ROOT / "matrix.toml").cells if c.stack == "gpu")
    conflicts = rules.requirement_conflicts("unsloth", facts["unsloth"], gpu.pins)
    assert any(c.startswith(f"trl {gpu.pins['trl']} ") for c in conflicts), conflicts
    fitting = {**gpu.pins, "trl": "1.15.0", "datasets": "4.3.0"}
    assert rules.requirement_conflicts("unsloth", facts["unsloth"], fitting) == []
    assert rules.requirement_conflicts("unsloth", facts["unsloth"], {"jupyterlab": "4.6.6"}) is None  # no training stack: not offered


def test_explain_says_per_stack_whether_unsloth_fits():
    r = subprocess.run([sys.executable, "build.py", "--explain"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if "unsloth" in ln or ln.startswith("  stack ")]
    assert lines[0].startswith("unsloth flavour (unsloth ") and "rule=unsloth-fits" in lines[0]
    assert any("stack gpu (" in ln and "does not fit: trl 1.16.0" in ln for ln in lines), lines
    assert any("stack light (" in ln and "not offered" in ln for ln in lines), lines


def test_the_unsloth_flavour_pins_what_unsloth_accepts_and_keeps_the_cells_vllm():
    m = load(ROOT / "matrix.toml")
    facts = m.data["facts"]
    cells = [c for c in m.cells if c.flavour == "unsloth"]
    assert {c.base.name for c in cells} == {"cu130-ampere", "cu130-hopper", "cu130-blackwell"}
    for c in cells:
        assert rules.requirement_conflicts("unsloth", facts["unsloth"], c.pins) == [], c.tag
        assert c.pins["unsloth"] == c.pins["unsloth-zoo"] == facts["unsloth"]["version"]
        assert c.pins["vllm"] == c.base.pins["vllm"] and c.pins["torch"] == c.base.pins["torch"]
        assert rules.satisfies(c.pins["vllm"], facts["trl_vllm_extra"][c.pins["trl"]], "t")
