"""benchmarks/grpo_learning.py's synthetic problems: the worked lines add up to the answer the correctness reward
checks, the answer in the notebook's format scores as right (and a wrong number as wrong), answers of varied length."""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import grpo_learning as gl  # noqa: E402  (benchmarks/ is no package: its folder goes on the path first)
from trainbox.training.grpo import rewards  # noqa: E402


def test_worked_lines_reach_the_answer_and_score_right():
    rows = gl.problems(300, seed=5)
    for p in rows:
        value = int(re.search(r"has (\d+) ", p["question"]).group(1))
        for line in p["lines"]:
            a, op, b, _, c = line.split()
            assert int(a) == value and c == str(int(a) + int(b) if op == "+" else int(a) - int(b))
            value = int(c)
        assert str(value) == p["answer"] and value >= 0
        good = [{"role": "assistant", "content": gl.completion(p)}]
        bad = [{"role": "assistant", "content": gl.completion({**p, "answer": str(value + 1)})}]
        assert rewards.correctness([good, bad], answer=[p["answer"]] * 2) == [2.0, 0.0]
    assert len({len(p["lines"]) for p in rows}) == 3  # 1-3 steps: answers end at different lengths


def test_rows_carry_the_presets_prompt_and_are_reproducible():
    a, b = gl.problems(20, seed=7), gl.problems(20, seed=7)
    assert a == b and a != gl.problems(20, seed=8)
    msgs = gl.prompt(a[0])
    assert [m["role"] for m in msgs] == ["system", "user"] and msgs[0]["content"] == rewards.SYSTEM_PROMPT
    assert gl.problem(random.Random(0))["question"].endswith("have now?")
