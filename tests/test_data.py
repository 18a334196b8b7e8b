"""data: local loading (parquet/jsonl/json/csv, directories), hub fallback, column checks, format conversion.

The writers below make synthetic data in the real formats; test_sft/test_qlora import them.
"""

import json

import pandas as pd
import pytest

from common.errors import UsageError
from trainbox.training import data

GSM8K = [
    ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many?",
     "Natalia sold 48/2 = 24 clips in May. 48+24 = 72\n#### 72", "72"),
    ("Weng earns $12 an hour for babysitting. Yesterday she did 50 minutes. How much did she earn?",
     "12/60 = 0.2 per minute. 0.2*50 = 10\n#### 10", "10"),
]  # fmt: skip
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def write_verl_gsm8k(path, n=16):
    """verl's examples/data_preprocess/gsm8k.py layout: prompt chat list, reward_model, extra_info dict."""
    rows = []
    for i in range(n):
        q, a, gt = GSM8K[i % len(GSM8K)]
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"{q} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": gt},
                "extra_info": {"split": "train", "index": i, "answer": a, "question": q},
            }
        )
    pd.DataFrame(rows).to_parquet(path)
    return path


def write_messages(path, n=16):
    with open(path, "w") as f:
        for i in range(n):
            msgs = [
                {"role": "user", "content": f"What is {i} plus {i}?"},
                {"role": "assistant", "content": f"It is {2 * i}."},
            ]
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


def write_dolly(path, n=16, alpaca=False):
    """databricks-dolly-15k (instruction/context/response/category) or alpaca (instruction/input/output)."""
    with open(path, "w") as f:
        for i in range(n):
            if alpaca:
                row = {"instruction": f"Add {i} and {i}.", "input": "" if i % 2 else "small numbers", "output": f"{2 * i}"}
            else:
                row = {"instruction": f"Add {i} and {i}.", "context": "" if i % 2 else "Numbers are small.",
                       "response": f"The sum is {2 * i}.", "category": "open_qa"}  # fmt: skip
            f.write(json.dumps(row) + "\n")
    return path


def test_load_parquet_jsonl_csv(tmp_path):
    ds = data.load_table(str(write_verl_gsm8k(tmp_path / "g.parquet", n=5)))
    assert len(ds) == 5 and ds[0]["extra_info"]["answer"].endswith("#### 72")
    assert len(data.load_table(str(write_messages(tmp_path / "m.jsonl", n=3)))) == 3
    (tmp_path / "t.csv").write_text("prompt,completion\nhi,there\nfoo,bar\n")
    assert data.load_table(str(tmp_path / "t.csv"))["completion"] == ["there", "bar"]


def test_directory_picks_the_split(tmp_path):
    d = tmp_path / "gsm8k"
    d.mkdir()
    write_verl_gsm8k(d / "train.parquet", n=6)
    write_verl_gsm8k(d / "test.parquet", n=2)
    assert len(data.load_table(str(d))) == 6
    assert len(data.load_table(str(d), split="test")) == 2


def test_directory_without_data_files(tmp_path):
    (tmp_path / "readme.txt").write_text("x")
    with pytest.raises(UsageError, match="no .parquet"):
        data.load_table(str(tmp_path))


def test_directory_mixing_formats(tmp_path):
    write_messages(tmp_path / "a.jsonl", 2)
    (tmp_path / "b.csv").write_text("x\n1\n")
    with pytest.raises(UsageError, match="mixes file types"):
        data.load_table(str(tmp_path))


@pytest.mark.parametrize("spec", ["/nonexistent/train.parquet", "./missing", "data/x.jsonl", "~/nope/a/b"])
def test_missing_local_path_never_goes_to_hub(spec, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("hub contacted"))
    with pytest.raises(UsageError, match="does not exist"):
        data.load_table(spec)


def test_hub_id_with_config(monkeypatch):
    import datasets

    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append((a, k)) or "DS")
    assert data.load_table("openai/gsm8k:main", split="test") == "DS"
    assert calls == [(("openai/gsm8k", "main"), {"split": "test"})]


def test_corrupt_file(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(UsageError, match="cannot read dataset"):
        data.load_table(str(tmp_path / "bad.parquet"))


def test_require_columns_lists_what_is_there(tmp_path):
    ds = data.load_table(str(write_messages(tmp_path / "m.jsonl", 2)))
    with pytest.raises(UsageError) as e:
        data.require_columns(ds, ["prompt", "messages"], "dataset m.jsonl")
    assert "missing column(s) prompt" in str(e.value) and "has messages" in str(e.value)


def test_messages_conversion_with_system_prompt(tmp_path):
    ds = data.load_table(str(write_messages(tmp_path / "m.jsonl", 3)))
    out = data.to_sft(ds, system_prompt="Be brief.")
    assert out.column_names == ["messages"]
    assert [m["role"] for m in out[1]["messages"]] == ["system", "user", "assistant"]
    assert out[1]["messages"][2]["content"] == "It is 2."


@pytest.mark.parametrize("alpaca", [False, True])
def test_dolly_and_alpaca(tmp_path, alpaca):
    ds = data.load_table(str(write_dolly(tmp_path / "d.jsonl", 4, alpaca=alpaca)))
    assert data.detect_format(ds) == "dolly"
    out = data.to_sft(ds)
    assert set(out.column_names) == {"prompt", "completion"}
    row0 = out[0]
    assert row0["prompt"][0]["role"] == "user" and row0["prompt"][0]["content"].startswith("Add 0 and 0.")
    # context/input is appended after the instruction when present
    assert ("Numbers are small." if not alpaca else "small numbers") in row0["prompt"][0]["content"]
    assert out[1]["prompt"][0]["content"] == "Add 1 and 1."
    assert row0["completion"] == [{"role": "assistant", "content": "The sum is 0." if not alpaca else "0"}]


def test_verl_gsm8k_defaults_to_extra_info_question_answer(tmp_path):
    ds = data.load_table(str(write_verl_gsm8k(tmp_path / "g.parquet", 4)))
    assert data.detect_format(ds) == "verl"
    out = data.to_sft(ds)
    assert out[0]["prompt"] == [{"role": "user", "content": GSM8K[0][0]}]
    assert out[0]["completion"][0]["content"] == GSM8K[0][1]


def test_verl_prompt_chat_with_dotted_response_key(tmp_path):
    ds = data.load_table(str(write_verl_gsm8k(tmp_path / "g.parquet", 2)))
    out = data.to_sft(ds, prompt_key="prompt", response_key="extra_info.answer")
    assert out[1]["prompt"][0]["content"].endswith(INSTRUCTION)
    assert out[1]["completion"][0]["content"].endswith("#### 10")


def test_missing_dotted_key_lists_the_keys_there(tmp_path):
    ds = data.load_table(str(write_verl_gsm8k(tmp_path / "g.parquet", 2)))
    with pytest.raises(UsageError) as e:
        data.to_sft(ds, prompt_key="extra_info.query", response_key="extra_info.answer")
    msg = str(e.value)
    assert "extra_info.query" in msg and "answer, index, question, split" in msg


def test_keys_need_both(tmp_path):
    ds = data.load_table(str(write_verl_gsm8k(tmp_path / "g.parquet", 2)))
    with pytest.raises(UsageError, match="go together"):
        data.to_sft(ds, fmt="keys", prompt_key="prompt")


def test_undetectable_format(tmp_path):
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    ds = data.load_table(str(tmp_path / "x.csv"))
    with pytest.raises(UsageError, match="cannot tell the dataset format"):
        data.to_sft(ds)
    with pytest.raises(UsageError, match="not one of"):
        data.to_sft(ds, fmt="sharegpt")


def test_messages_column_must_hold_chats(tmp_path):
    (tmp_path / "m.jsonl").write_text(json.dumps({"messages": "just text"}) + "\n")
    ds = data.load_table(str(tmp_path / "m.jsonl"))
    with pytest.raises(UsageError, match="row 1: column messages must be a list of"):
        data.to_sft(ds)


def test_prompt_answer_for_rl(tmp_path):
    ds = data.load_table(str(write_verl_gsm8k(tmp_path / "g.parquet", 2)))
    out = data.to_prompt_answer(ds)
    assert out["answer"] == ["72", "10"] and out[0]["prompt"][0]["role"] == "user"
    hf = pd.DataFrame({"question": [q for q, _, _ in GSM8K], "answer": [a for _, a, _ in GSM8K]})
    hf.to_parquet(tmp_path / "hf.parquet")
    out = data.to_prompt_answer(data.load_table(str(tmp_path / "hf.parquet")), system_prompt="S")
    assert out["answer"] == ["72", "10"] and out[0]["prompt"][0] == {"role": "system", "content": "S"}
    with pytest.raises(UsageError, match="need verl gsm8k columns"):
        data.to_prompt_answer(data.load_table(str(write_messages(tmp_path / "m.jsonl", 2))))
