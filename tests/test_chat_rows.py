"""Chat rows and local splits (issue 65 cases 13, 14): each bad row is one error naming the file and the row (a
broken JSON Lines row: FILE:LINE); a split a local file does not have is refused, not trained on the whole file.
The fuzzer: any JSON Lines file of chat rows is either trained on (every row a conversation the model can learn
from) or refused with one UsageError naming the first bad row; never another exception."""

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from common.errors import UsageError
from trainbox.training import data

SETTINGS = settings(max_examples=int(os.environ.get("TRAINBOX_FUZZ_EXAMPLES", "40")), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _load(path: Path, split: str = "train"):
    return data.to_sft(data.load_table(str(path), split=split), where=f"dataset {path}")


GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.mark.parametrize("bad, words", [
    ([{"role": "user", "content": "hi"}, {"role": "banana", "content": "x"}], "message 2 has role 'banana'; use one of"),
    ([{"role": "system", "content": "be brief"}], "has no assistant message"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
     "ends with a user message"),
    ([{"role": "user", "content": "a"}, {"role": "assistant"}], "message 2 has no content"),
    ([], "is an empty list"),
])
def test_a_bad_chat_row_is_one_error_naming_file_and_row(tmp_path, bad, words):
    path = _jsonl(tmp_path / "chat.jsonl", [GOOD, GOOD, {"messages": bad}, GOOD])
    with pytest.raises(UsageError) as e:
        _load(path)
    msg = str(e.value)
    assert f"dataset {path}: row 3: " in msg and words in msg and "\n" not in msg, msg
    assert "got list" not in msg


def test_a_broken_json_lines_row_names_its_line(tmp_path):
    path = _jsonl(tmp_path / "chat.jsonl", [GOOD, GOOD, '{"messages": [{"role": "user", "content": "cut sho', GOOD])
    with pytest.raises(UsageError, match=rf"^dataset {path}:3: not valid JSON .*; fix or drop that line$"):
        _load(path)
    path = _jsonl(tmp_path / "list.jsonl", [GOOD, "[1, 2]"])
    with pytest.raises(UsageError, match=rf"{path}:2: a row must be a JSON object"):
        _load(path)


def test_good_conversations_train(tmp_path):
    rows = [GOOD, {"messages": [{"role": "system", "content": "s"}, *GOOD["messages"],
                                {"role": "user", "content": "more"}, {"role": "assistant", "content": "ok"}]}]
    assert len(_load(_jsonl(tmp_path / "chat.jsonl", rows))) == 2


def test_a_split_a_local_file_does_not_have_is_refused(tmp_path):
    path = _jsonl(tmp_path / "chat.jsonl", [GOOD])
    with pytest.raises(UsageError, match=r"--dataset_split test: the local file .* has one split, train"):
        data.load_table(str(path), split="test")
    assert len(data.load_table(str(path), split="train")) == 1
    # A folder: the split's own files; a split it has no file for is refused, not trained on every file.
    folder = tmp_path / "d"
    folder.mkdir()
    _jsonl(folder / "train.jsonl", [GOOD, GOOD])
    _jsonl(folder / "test.jsonl", [GOOD])
    assert len(data.load_table(str(folder), split="test")) == 1
    assert len(data.load_table(str(folder), split="train")) == 2
    with pytest.raises(UsageError, match=r"--dataset_split validation: dataset directory"):
        data.load_table(str(folder), split="validation")
    (folder / "train.jsonl").unlink()  # only test rows left: the default train split must not take them
    with pytest.raises(UsageError, match=r"files named for the split\(s\) test"):
        data.load_table(str(folder), split="train")
    plain = tmp_path / "plain"
    plain.mkdir()
    _jsonl(plain / "part1.jsonl", [GOOD])
    assert len(data.load_table(str(plain), split="train")) == 1  # unnamed files: the one split, train


ROLES = st.sampled_from([*data.ROLES, "banana", ""])
message = st.one_of(
    st.fixed_dictionaries({"role": ROLES, "content": st.text(max_size=6)}),
    st.fixed_dictionaries({"role": ROLES}),  # no content
    st.fixed_dictionaries({"content": st.text(max_size=6)}),  # no role
)
row = st.one_of(
    st.builds(lambda m: {"messages": m}, st.lists(message, max_size=4)),
    st.just({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}),
    st.just("{not json"),
)


def _row_ok(r) -> bool:
    msgs = r["messages"]
    return (bool(msgs) and all(m.get("role") in data.ROLES and "content" in m for m in msgs)
            and any(m["role"] == "assistant" for m in msgs) and msgs[-1]["role"] == "assistant")


@SETTINGS
@given(rows=st.lists(row, min_size=1, max_size=5))
def test_fuzz_chat_rows_train_or_name_the_first_bad_row(rows, tmp_path_factory):
    path = _jsonl(tmp_path_factory.mktemp("fuzz") / "chat.jsonl", rows)
    broken = [i for i, r in enumerate(rows, 1) if isinstance(r, str)]
    bad = [i for i, r in enumerate(rows, 1) if not isinstance(r, str) and not _row_ok(r)]
    try:
        ds = _load(path)
    except UsageError as e:
        msg = str(e)
        assert "\n" not in msg and str(path) in msg, msg
        if broken:
            assert f"{path}:{broken[0]}: not valid JSON" in msg, msg
        else:
            assert bad and f": row {bad[0]}: " in msg, (rows, msg)
        return
    assert not broken and not bad, (rows, "accepted")
    assert len(ds) == len(rows)
