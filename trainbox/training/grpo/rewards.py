"""Built-in TRL-compatible reward functions (the gsm8k set) and the loader for `module:function` references.

The gsm8k set reproduces the well-known GRPO gsm8k notebook (willccbb's gist, copied by Unsloth) exactly: the same
regular expressions (no re.DOTALL, so the strict pattern needs single-line reasoning and answer, as there), the same
scores and the same tag-count arithmetic. Each function takes TRL's keyword arguments (`prompts`, `completions`,
dataset columns such as `answer`, ...) and returns one float per completion.

Reference them as `rewards:correctness` (short names below) or by the notebook's names
(`rewards:correctness_reward_func`); your own as `my.module:fn` or `path/to/file.py:fn`.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path

from common.errors import UsageError

# The notebook's system prompt, verbatim (leading and trailing newline included).
SYSTEM_PROMPT = """
Respond in the following format:
<reasoning>
...
</reasoning>
<answer>
...
</answer>
"""

STRICT_FORMAT = r"^<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\n$"
SOFT_FORMAT = r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>"


def extract_hash_answer(text: str) -> str | None:
    """gsm8k's reference answer: the text after `####`, stripped (None if there is no `####`)."""
    if "####" not in text:
        return None
    return text.split("####")[1].strip()


def extract_xml_answer(text: str) -> str:
    """The model's answer: what lies between the last `<answer>` and the following `</answer>`, stripped."""
    answer = text.split("<answer>")[-1]
    answer = answer.split("</answer>")[0]
    return answer.strip()


def completion_text(completion) -> str:
    """TRL passes a string (standard format) or a list of messages (conversational): the notebook reads message 0."""
    if isinstance(completion, str):
        return completion
    return completion[0]["content"]


def _reference(answer) -> str:
    # A raw gsm8k answer (worked solution + `#### 72`) is reduced to its final number; a bare one is used as is.
    text = str(answer)
    parsed = extract_hash_answer(text)
    return parsed if parsed is not None else text.strip()


def correctness(completions, answer, **kwargs) -> list[float]:
    """2.0 when the `<answer>` text equals the reference answer exactly, else 0.0."""
    responses = [extract_xml_answer(completion_text(c)) for c in completions]
    return [2.0 if r == _reference(a) else 0.0 for r, a in zip(responses, answer, strict=True)]


def int_format(completions, **kwargs) -> list[float]:
    """0.5 when the `<answer>` text is all digits (str.isdigit, as in the notebook), else 0.0."""
    responses = [extract_xml_answer(completion_text(c)) for c in completions]
    return [0.5 if r.isdigit() else 0.0 for r in responses]


def strict_format(completions, **kwargs) -> list[float]:
    """0.5 for exactly `<reasoning>\\n...\\n</reasoning>\\n<answer>\\n...\\n</answer>\\n` (single-line parts)."""
    return [0.5 if re.match(STRICT_FORMAT, completion_text(c)) else 0.0 for c in completions]


def soft_format(completions, **kwargs) -> list[float]:
    """0.5 when the completion starts with `<reasoning>...</reasoning>` then `<answer>...</answer>` (one line)."""
    return [0.5 if re.match(SOFT_FORMAT, completion_text(c)) else 0.0 for c in completions]


def count_xml(text: str) -> float:
    """0.125 per well-placed tag, minus 0.001 per character of trailing text after the answer (the notebook's sum)."""
    count = 0.0
    if text.count("<reasoning>\n") == 1:
        count += 0.125
    if text.count("\n</reasoning>\n") == 1:
        count += 0.125
    if text.count("\n<answer>\n") == 1:
        count += 0.125
        count -= len(text.split("\n</answer>\n")[-1]) * 0.001
    if text.count("\n</answer>") == 1:
        count += 0.125
        count -= (len(text.split("\n</answer>")[-1]) - 1) * 0.001
    return count


def xmlcount(completions, **kwargs) -> list[float]:
    """count_xml of each completion."""
    return [count_xml(completion_text(c)) for c in completions]


# The notebook's names, so its recipes can be referenced unchanged.
correctness_reward_func = correctness
int_reward_func = int_format
strict_format_reward_func = strict_format
soft_format_reward_func = soft_format
xmlcount_reward_func = xmlcount

# The gsm8k preset's reward set, in the notebook's order.
GSM8K = (
    "rewards:xmlcount", "rewards:soft_format", "rewards:strict_format", "rewards:int_format", "rewards:correctness"
)

# Keyword arguments TRL itself passes to every reward function (not dataset columns).
TRL_KWARGS = {"prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments"}


def load(ref: str) -> Callable:
    """Resolve `module:function` or `path/to/file.py:function` to a callable; bad reference -> UsageError."""
    module_ref, sep, name = ref.rpartition(":")
    if not sep or not module_ref or not name:
        raise UsageError(
            f"reward function {ref!r}: expected MODULE:FUNCTION or path/to/file.py:FUNCTION "
            f"(built-ins: rewards:correctness, rewards:int_format, rewards:strict_format, rewards:soft_format, "
            f"rewards:xmlcount)"
        )
    if module_ref.endswith(".py") or "/" in module_ref:
        path = Path(module_ref)
        if not path.is_file():
            raise UsageError(f"reward function {ref!r}: file {path} not found; give an existing .py file")
        spec = importlib.util.spec_from_file_location(f"trainbox_rewards_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as exc:  # the user's file: show what broke, not a traceback
            raise UsageError(f"reward function {ref!r}: importing {path} failed: {type(exc).__name__}: {exc}") from exc
    else:
        if module_ref in ("rewards", "trainbox.training.rewards", "trainbox.training.grpo.rewards"):
            module = sys.modules[__name__]
        else:
            try:
                module = importlib.import_module(module_ref)
            except ImportError as exc:
                raise UsageError(
                    f"reward function {ref!r}: cannot import module {module_ref!r} ({exc}); put it on PYTHONPATH "
                    f"or give a file path like path/to/{module_ref.replace('.', '/')}.py:{name}"
                ) from exc
    func = getattr(module, name, None)
    if not callable(func):
        available = sorted(
            n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_")
            and getattr(v, "__module__", None) == module.__name__
        )
        raise UsageError(
            f"reward function {ref!r}: {module_ref} has no function {name!r}"
            + (f"; it has: {', '.join(available)}" if available else "")
        )
    return func


def required_columns(func: Callable) -> list[str]:
    """Dataset columns a reward function needs: its named parameters without defaults that TRL doesn't supply."""
    cols = []
    for p in inspect.signature(func).parameters.values():
        if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) or p.default is not p.empty:
            continue
        if p.name not in TRL_KWARGS:
            cols.append(p.name)
    return cols
