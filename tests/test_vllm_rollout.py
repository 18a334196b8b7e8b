"""benchmarks/vllm_rollout.py without vLLM: its variant syntax (JSON keyword arguments and NAME=VALUE environment
items, one clear error otherwise), the prompts it rolls out (train_throughput's GRPO prompts, 2 x 8, templated), and
train_throughput's learnable GRPO reward."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import train_throughput as tt  # noqa: E402  (benchmarks/ is no package: its folder goes on the path first)
import vllm_rollout as vr  # noqa: E402


def test_variant_items_split_into_keyword_arguments_and_environment():
    assert vr.variants(["v2=VLLM_USE_V2_MODEL_RUNNER=1", 'eager={"enforce_eager": true}'], "engine") == [
        ("v2", "VLLM_USE_V2_MODEL_RUNNER=1"), ("eager", '{"enforce_eager": true}')]
    assert vr.parse_items("x", '{"compilation_config": {"cudagraph_mode": "FULL"}} OMP_NUM_THREADS=1') == (
        {"OMP_NUM_THREADS": "1"}, {"compilation_config": {"cudagraph_mode": "FULL"}})
    assert vr.parse_items("x", "") == ({}, {})


@pytest.mark.parametrize("items, fragment", [
    (["noequals"], "write LABEL=ITEMS"),
    (["=x"], "write LABEL=ITEMS"),
])
def test_bad_variant_says_how_to_write_it(items, fragment):
    with pytest.raises(SystemExit) as e:
        vr.variants(items, "engine")
    assert fragment in str(e.value)


@pytest.mark.parametrize("rest, fragment", [('{"a": }', "not a JSON object"), ("lower=1", "neither a JSON object")])
def test_bad_variant_items_are_named(rest, fragment):
    with pytest.raises(SystemExit) as e:
        vr.parse_items("lbl", rest)
    assert fragment in str(e.value) and "lbl" in str(e.value)


def test_prompts_are_the_grpo_benchmarks_repeated_per_generation(tmp_path):
    from transformers import AutoTokenizer

    tt.make_tokenizer(tmp_path)
    rows = vr.prompt_ids(tmp_path)
    assert len(rows) == vr.PROMPTS * vr.GENERATIONS
    firsts = rows[:: vr.GENERATIONS]
    assert all(rows[i] == firsts[i // vr.GENERATIONS] for i in range(len(rows)))  # each prompt 8 times in a row
    assert firsts[0] != firsts[1]
    text = AutoTokenizer.from_pretrained(tmp_path).decode(firsts[0])
    assert text.startswith("<|system|>") and text.rstrip().endswith("<|assistant|>")
    assert all(isinstance(t, int) for t in firsts[0])


def test_the_learnable_reward_scores_the_lower_half_share_and_loads_on_both_sides():
    """train_throughput grpo --reward low-words: the share of w0..w1999 among a completion's words, for TRL's dotted
    reference and trainbox's MODULE:FUNCTION alike (reward curves compare the two engines on it)."""
    import importlib

    from trainbox.training.grpo import rewards

    assert tt.low_words([[{"role": "assistant", "content": "w1 w3999 w10 other"}], "w2000 w1999", "", "no words"]) == [
        2 / 3, 0.5, 0.0, 0.0]
    trl_ref = importlib.import_module("benchmarks.train_throughput").low_words  # TRL: --reward_funcs pkg.mod.func
    ours = rewards.load("benchmarks.train_throughput:low_words")
    assert trl_ref(["w0 w3000"]) == ours(["w0 w3000"]) == [0.5]
    assert rewards.required_columns(ours) == []
