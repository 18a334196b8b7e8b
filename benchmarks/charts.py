"""The performance page's charts, drawn from the measurements in benchmarks/results/ (never by hand).

Each chart names the results files and model shapes it shows; its bars are the `SUMMARY ... ours X vs TOOL Y` lines
that benchmarks/train_throughput.py printed there, each paired with the `# sft SHAPE ...` / `# grpo: SHAPE shape ...`
header above it. The SVG is plain text written the same way every time, so tests/test_charts.py can check that the
committed files in docs/img/ are what this script writes from the committed results.

    python benchmarks/charts.py            # (re)write docs/img/*.svg
    python benchmarks/charts.py --check    # exit 1 naming each chart that differs from what the results give
"""

from __future__ import annotations

import argparse
import re
import sys
from html import escape
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "img"

HEADER = re.compile(r"^# (?:sft|grpo):? (?P<shape>[a-z0-9][a-z0-9.-]*)(?: shape)?[ ,:]")
SUMMARY = re.compile(r"^SUMMARY (?:sft|grpo)[^:]*: ours (?P<ours>[\d,.]+) vs (?P<tool>.+?) (?P<plain>[\d,.]+) "
                     r"(?P<unit>real tok/s|steps/s)")


class Bar(NamedTuple):
    shape: str
    file: str  # in benchmarks/results/
    nth: int = 0  # which of that shape's summaries in the file


class Chart(NamedTuple):
    name: str  # docs/img/<name>.svg
    title: str
    bars: tuple[Bar, ...]


CHARTS = (
    Chart("sft-h200-2026-11-29", "trainbox sft vs trl sft (defaults), long-tailed chat mix, one H200, 2026-11-29",
          tuple(Bar(s, "final_h200-2026-11-29.txt") for s in ("gpt-oss-2b", "mixtral-2b", "llama-1b", "gemma2-1b"))),
    Chart("grpo-h100-2026-11-27", "trainbox grpo vs trl grpo (vLLM colocate), one H100, 2026-11-27",
          (Bar("llama-1b", "grpo_static-2026-11-27.txt"), Bar("gemma2-1b", "grpo_static-2026-11-27c.txt"))),
)


class Measured(NamedTuple):
    shape: str
    ours: float
    plain: float
    tool: str
    unit: str


def summaries(path: Path) -> list[Measured]:
    """Every `SUMMARY ... ours X vs TOOL Y UNIT` line of a results file, with the shape of the header above it."""
    out, shape = [], None
    for line in path.read_text(encoding="utf-8").splitlines():
        if m := HEADER.match(line):
            shape = m["shape"]
        elif (m := SUMMARY.match(line)) and shape:
            out.append(Measured(shape, float(m["ours"].replace(",", "")), float(m["plain"].replace(",", "")),
                                m["tool"], m["unit"]))
    return out


def measure(chart: Chart, results: Path = RESULTS) -> list[Measured]:
    got = []
    for bar in chart.bars:
        found = [s for s in summaries(results / bar.file) if s.shape == bar.shape]
        if len(found) <= bar.nth:
            raise SystemExit(f"error: {chart.name}: {bar.file} has {len(found)} summaries for shape {bar.shape} "
                             f"(wanted number {bar.nth + 1}); fix CHARTS in benchmarks/charts.py")
        got.append(found[bar.nth])
    if len({m.unit for m in got}) != 1:
        raise SystemExit(f"error: {chart.name}: bars in different units {sorted({m.unit for m in got})}")
    return got


def _num(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:g}"


def svg(chart: Chart, rows: list[Measured]) -> str:
    """Horizontal bars, two per shape (trainbox above, the plain tool below), each labelled with its value."""
    width, left, bar_h, gap, top = 760, 110, 18, 14, 48
    top_value = max(max(r.ours, r.plain) for r in rows)
    scale = (width - left - 150) / top_value
    height = top + len(rows) * (2 * bar_h + gap) + 36
    unit, tool = rows[0].unit, rows[0].tool
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
             f'<title>{escape(chart.title)}</title>',
             f'<text x="8" y="18" font-size="14" font-weight="bold">{escape(chart.title)}</text>',
             f'<rect x="{left}" y="28" width="12" height="10" fill="#3b6ea8"/>'
             f'<text x="{left + 16}" y="37">trainbox</text>',
             f'<rect x="{left + 90}" y="28" width="12" height="10" fill="#b0b0b0"/>'
             f'<text x="{left + 106}" y="37">{escape(tool)}</text>']
    y = top
    for r in rows:
        parts.append(f'<text x="{left - 8}" y="{y + bar_h + 4}" text-anchor="end">{escape(r.shape)}</text>')
        for value, colour in ((r.ours, "#3b6ea8"), (r.plain, "#b0b0b0")):
            w = max(1, round(value * scale))
            label = _num(value) + (f" ({r.ours / r.plain:.2f}x)" if value == r.ours else "")
            parts.append(f'<rect x="{left}" y="{y}" width="{w}" height="{bar_h}" fill="{colour}"/>')
            parts.append(f'<text x="{left + w + 6}" y="{y + bar_h - 5}">{label}</text>')
            y += bar_h
        y += gap
    parts.append(f'<text x="{left}" y="{y + 16}" fill="#555">{escape(unit)}; from benchmarks/results/'
                 f'{escape(", ".join(sorted({b.file for b in chart.bars})))}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def render_all(results: Path = RESULTS) -> dict[str, str]:
    return {f"{c.name}.svg": svg(c, measure(c, results)) for c in CHARTS}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with docs/img/ instead of writing")
    args = ap.parse_args(argv)
    charts = render_all()
    if args.check:
        stale = [n for n, text in charts.items()
                 if not (OUT / n).is_file() or (OUT / n).read_text(encoding="utf-8") != text]
        if stale:
            print(f"error: docs/img/ charts not what benchmarks/results gives: {', '.join(stale)}; "
                  "run python benchmarks/charts.py", file=sys.stderr)
            return 1
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    for n, text in charts.items():
        (OUT / n).write_text(text, encoding="utf-8")
        print(f"wrote docs/img/{n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
