"""Copies of the real matrix.toml with one defect each, written at test time (so they never drift from it);
`python tests/brokenmatrix.py DIR` writes them all, e.g. for `python build.py --matrix DIR/broken.toml --list`.

Each defect is a text edit whose anchor must occur exactly once: when matrix.toml changes shape, this fails loudly
instead of testing a defect that no longer exists."""

from __future__ import annotations

from pathlib import Path

MATRIX = Path(__file__).resolve().parents[1] / "matrix.toml"

FA3_ON_AMPERE = '''
# An explicit cell that asks for FA3 on Ampere.
[[cell]]
name = "fa3-ampere"
arch = "x86_64"
cuda = "12.9"
gpu = "ampere"
attention = "fa3"
base_image = "nvidia/cuda:12.9.1-devel-ubuntu24.04"
python = "3.12"
stack = "gpu"
'''

# name -> (anchor, replacement); anchor None appends the replacement.
DEFECTS: dict[str, tuple[str | None, str]] = {
    # TOML syntax error: an unclosed array in [gpu.hopper]
    "broken.toml": ('[gpu.hopper]\nsm = ["9.0"]\n', '[gpu.hopper]\nsm = ["9.0"\n'),
    # a misspelt key
    "unknown_key.toml": ('[gpu.hopper]\nsm = ["9.0"]\n', '[gpu.hopper]\nsm = ["9.0"]\ncuda_arch_lst = "9.0"\n'),
    # an arch the matrix does not know
    "unknown_arch.toml": ('[expand]\narch = ["x86_64", "aarch64"]\n', '[expand]\narch = ["x86_64", "aarch64", "ppc64le"]\n'),
    # vllm 0.33.0 pins torch 2.14.0; the stack has torch 2.13.0
    "conflicting_pins.toml": ('packages = { vllm = "0.31.0",', 'packages = { vllm = "0.33.0",'),
    # an explicit cell that breaks a rule (FA3 is Hopper-only)
    "rule_violation.toml": (None, FA3_ON_AMPERE),
}


def write_broken(name: str, directory: Path) -> Path:
    anchor, replacement = DEFECTS[name]
    text = MATRIX.read_text()
    if anchor is None:
        text += replacement
    else:
        assert text.count(anchor) == 1, f"{name}: anchor {anchor!r} is not in matrix.toml exactly once"
        text = text.replace(anchor, replacement)
    path = Path(directory) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def defect_line(name: str) -> int:
    """1-based line of the edit in the broken copy (where a parser error points, give or take one)."""
    anchor, _ = DEFECTS[name]
    return MATRIX.read_text().split(anchor)[0].count("\n") + 2 if anchor else 0


if __name__ == "__main__":  # python tests/brokenmatrix.py DIR: write all of them, to try `build.py --matrix` on
    import sys

    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    for n in DEFECTS:
        print(write_broken(n, out))
