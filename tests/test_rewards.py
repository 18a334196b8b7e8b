"""The gsm8k rewards score hand-written completions exactly as the GRPO gsm8k notebook does.

Every expected value below is worked out by hand from the notebook's code (regexes without re.DOTALL, 0.125 per
tag, 0.001 per trailing character), not by calling the functions under test.
"""

import pytest

from common.errors import UsageError
from trainbox.training.grpo import rewards

FUNCS = {
    "correctness": rewards.correctness,
    "int": rewards.int_format,
    "strict": rewards.strict_format,
    "soft": rewards.soft_format,
    "xml": rewards.xmlcount,
}

# (completion, reference answer, expected scores)
CASES = {
    # The notebook's ideal output: every reward except soft (its `.` can't cross the newline after <reasoning>).
    "ideal": (
        "<reasoning>\n48 / 2 = 24, 48 + 24 = 72\n</reasoning>\n<answer>\n72\n</answer>\n",
        "72",
        dict(correctness=2.0, int=0.5, strict=0.5, soft=0.0, xml=0.5),
    ),
    # All on one line: soft matches, strict and the newline-anchored tag count don't.
    "one_line": (
        "<reasoning>48 + 24 = 72</reasoning> <answer>72</answer>",
        "72",
        dict(correctness=2.0, int=0.5, strict=0.0, soft=0.5, xml=0.0),
    ),
    # Two-line reasoning breaks strict; "extra" (5 chars) after the answer costs 0.005 twice: 0.5 - 0.010.
    "multiline_trailing": (
        "<reasoning>\nstep one\nstep two\n</reasoning>\n<answer>\n71\n</answer>\nextra",
        "72",
        dict(correctness=0.0, int=0.5, strict=0.0, soft=0.0, xml=0.49),
    ),
    # No tags at all: the whole text is the "answer", not digits.
    "plain": ("The answer is 72.", "72", dict(correctness=0.0, int=0.0, strict=0.0, soft=0.0, xml=0.0)),
    # No newline after </answer>: "\n</answer>\n" never occurs, so the third tag's penalty is the whole text's length
    # (12 + 2 + 13 + 9 + 6 + 9 = 51 chars -> -0.051), and the fourth tag's (len("") - 1) * 0.001 adds 0.001:
    # 0.5 - 0.051 + 0.001 = 0.45. "72.0" is neither the reference nor all digits. The reference is a raw gsm8k
    # answer: its final number after #### is what counts.
    "no_final_newline": (
        "<reasoning>\nx\n</reasoning>\n<answer>\n 72.0\n</answer>",
        "Natalia sold 48 + 24 = 72 clips.\n#### 72",
        dict(correctness=0.0, int=0.0, strict=0.0, soft=0.0, xml=0.45),
    ),
    # Two answer blocks: the last one is extracted (correct), the duplicate tags earn nothing: 0.125 * 2.
    "two_answers": (
        "<reasoning>\na\n</reasoning>\n<answer>\n1\n</answer>\n<answer>\n2\n</answer>\n",
        "2",
        dict(correctness=2.0, int=0.5, strict=0.0, soft=0.0, xml=0.25),
    ),
    # Negative numbers are not str.isdigit(): int reward 0 even though correct.
    "negative": (
        "<reasoning>\n3 - 5\n</reasoning>\n<answer>\n-2\n</answer>\n",
        "-2",
        dict(correctness=2.0, int=0.0, strict=0.5, soft=0.0, xml=0.5),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("conversational", [False, True])
def test_scores_match_the_notebook(case, conversational):
    text, answer, expected = CASES[case]
    completion = [{"role": "assistant", "content": text}] if conversational else text
    for key, func in FUNCS.items():
        got = func(prompts=["q"], completions=[completion], answer=[answer])
        assert got == [pytest.approx(expected[key], abs=1e-9)], (case, key, got)


def test_batch_scores_line_up_with_completions():
    texts = [CASES[c][0] for c in ("ideal", "plain", "two_answers")]
    answers = [CASES[c][1] for c in ("ideal", "plain", "two_answers")]
    assert rewards.correctness(completions=texts, answer=answers) == [2.0, 0.0, 2.0]
    assert rewards.xmlcount(completions=texts) == [pytest.approx(0.5), 0.0, pytest.approx(0.25)]


def test_answer_parsing():
    assert rewards.extract_hash_answer("48 / 2 = 24\n#### 1,000") == "1,000"
    assert rewards.extract_hash_answer("no marker") is None
    assert rewards.extract_xml_answer("a <answer> 7 </answer> b") == "7"
    assert rewards.extract_xml_answer("no tags ") == "no tags"


def test_notebook_names_are_the_same_functions():
    assert rewards.load("rewards:correctness_reward_func") is rewards.correctness
    assert rewards.load("rewards:int_reward_func") is rewards.int_format
    assert rewards.load("rewards:strict_format_reward_func") is rewards.strict_format
    assert rewards.load("rewards:soft_format_reward_func") is rewards.soft_format
    assert rewards.load("trainbox.training.grpo.rewards:xmlcount_reward_func") is rewards.xmlcount
    assert [rewards.load(r) for r in rewards.GSM8K] == [
        rewards.xmlcount, rewards.soft_format, rewards.strict_format, rewards.int_format, rewards.correctness
    ]


def test_system_prompt_is_the_notebooks():
    assert rewards.SYSTEM_PROMPT == (
        "\nRespond in the following format:\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>\n"
    )


def test_load_from_file_and_module(tmp_path):
    f = tmp_path / "my_rewards.py"
    f.write_text("def has_x(completions, target, **kw):\n    return [float('x' in c) for c in completions]\n")
    func = rewards.load(f"{f}:has_x")
    assert func(completions=["ax", "b"], target=[0, 0]) == [1.0, 0.0]
    assert rewards.required_columns(func) == ["target"]
    assert rewards.load("os.path:join").__name__ == "join"


def test_required_columns():
    assert rewards.required_columns(rewards.correctness) == ["answer"]
    assert rewards.required_columns(rewards.xmlcount) == []


@pytest.mark.parametrize(
    "ref, message",
    [
        ("correctness", "expected MODULE:FUNCTION"),
        ("rewards:nope", "has no function 'nope'; it has: "),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("missing/file.py:f", "file missing/file.py not found"),
    ],
)
def test_bad_references(ref, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        rewards.load(ref)


def test_broken_file_is_a_usage_error(tmp_path):
    f = tmp_path / "broken.py"
    f.write_text("def f(:\n")
    with pytest.raises(UsageError, match="importing .*broken.py failed: SyntaxError"):
        rewards.load(f"{f}:f")
