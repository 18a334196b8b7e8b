"""The report's registry line: bytes a registry stores (each blob once) against the sum of the images' sizes."""
from builder.engine import BuildResult
from builder.report import storage, table


def _res(tag, blobs):
    return BuildResult(cell=tag, tag=tag, arch="x86_64", platform="linux/amd64", builder="buildkit", blobs=blobs)


def test_shared_layers_are_counted_once():
    venv = {"sha256:venv": 4_000_000_000, "sha256:base": 100_000_000}
    a = _res("cu130-hopper-x86_64", {**venv, "sha256:cfg-a": 10_000, "sha256:record-a": 1_000})
    b = _res("cu130-blackwell-x86_64", {**venv, "sha256:cfg-b": 10_000, "sha256:record-b": 1_000})
    s = storage([a, b])
    assert s["stored_bytes"] == 4_100_022_000 and s["images_bytes"] == 2 * 4_100_011_000
    assert s["stored_bytes"] <= 1.1 * s["largest_image_bytes"] and s["ratio"] == 0.5
    assert "registry stores 4100.0 MB for 2 image(s) of 8200.0 MB together (50.0 %" in table([a, b])


def test_nothing_pushed_no_line():
    assert storage([_res("smoke-x86_64", {})]) is None
    assert "registry stores" not in table([_res("smoke-x86_64", {})])


def test_the_workflow_reports_join_into_the_whole_matrix(tmp_path):
    """`python -m builder.report` over several runs' --report files (the workflow's venv jobs): cells of one venv
    share their layers, cells of different venvs share nothing, and the whole-matrix ratio is judged against 40 %."""
    import dataclasses
    import json
    import subprocess
    import sys

    from builder.paths import ROOT

    def venv(n):
        return {f"sha256:venv-{n}": 4_000_000_000, f"sha256:base-{n}": 100_000_000}
    reports = []
    for n in range(2):   # two venv jobs of three GPU generations each
        cells = [_res(f"c{n}-{gpu}", {**venv(n), f"sha256:attn-{n}-{gpu}": 50_000_000, f"sha256:rec-{n}-{gpu}": 1_000})
                 for gpu in ("ampere", "hopper", "blackwell")]
        path = tmp_path / f"report-{n}.json"
        path.write_text(json.dumps({"cells": [dataclasses.asdict(c) for c in cells], "manifest_lists": []}))
        reports.append(str(path))
    p = subprocess.run([sys.executable, "-m", "builder.report", *reports], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    stored, total = 2 * (4_100_000_000 + 3 * 50_001_000), 6 * 4_150_001_000
    assert f"registry stores {stored / 1e6:.1f} MB for 6 image(s) of {total / 1e6:.1f} MB together " \
           f"({100 * stored / total:.1f} %" in p.stdout
    assert "goal: at most 40 % (met)" in p.stdout
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    p = subprocess.run([sys.executable, "-m", "builder.report", reports[0], str(bad)], capture_output=True, text=True,
                       cwd=ROOT)
    assert p.returncode == 2 and p.stderr.startswith(f"error: {bad}: not a build report") and p.stdout == ""
