"""The performance page's charts are what benchmarks/charts.py draws from benchmarks/results/ (never drawn by hand),
and each bar is a figure that its results file states."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import charts  # noqa: E402


def test_committed_charts_are_what_the_results_give():
    drawn = charts.render_all()
    assert set(drawn) == {p.name for p in (ROOT / "docs" / "img").glob("*.svg")}, "a chart with no script, or stale"
    for name, text in drawn.items():
        assert (ROOT / "docs" / "img" / name).read_text(encoding="utf-8") == text, "run python benchmarks/charts.py"
    page = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    for name in drawn:
        assert f"(img/{name})" in page, f"docs/performance.md shows no {name}"


def test_each_bar_is_a_summary_line_of_its_file():
    for chart in charts.CHARTS:
        for bar, m in zip(chart.bars, charts.measure(chart)):
            text = (charts.RESULTS / bar.file).read_text()
            assert f"ours {m.ours:,.0f}" in text or f"ours {m.ours:.3f}" in text, (bar, m)
            assert m.shape == bar.shape and m.ours > 0 and m.plain > 0


def test_a_bar_its_file_lacks_is_one_error(tmp_path):
    (tmp_path / "r.txt").write_text("# sft llama-1b mix: 960 rows\nSUMMARY sft mix: ours 10 vs trl sft 5 real tok/s = 2x\n")
    ok = charts.Chart("t", "t", (charts.Bar("llama-1b", "r.txt"),))
    assert charts.measure(ok, tmp_path)[0].ours == 10
    gone = charts.Chart("t", "t", (charts.Bar("gemma2-1b", "r.txt"),))
    with pytest.raises(SystemExit, match="error: t: r.txt has 0 summaries for shape gemma2-1b"):
        charts.measure(gone, tmp_path)
