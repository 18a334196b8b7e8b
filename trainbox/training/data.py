"""Datasets for the training commands: load a local file/directory or a hub id, check columns, convert formats.

Formats understood (detected from the columns, or named with `dataset_format`):
- `messages`: a chat list `[{"role", "content"}, ...]` per row (TRL's conversational format).
- `dolly`: instruction + optional context/input + response/output (databricks-dolly-15k, alpaca).
- `verl`: verl's gsm8k parquet: `prompt` (chat list), `reward_model.ground_truth`, `extra_info{question, answer}`;
  SFT uses `extra_info.question` -> `extra_info.answer` like verl's own SFT recipe (prompt_key/response_key).
- `prompt_completion`: `prompt` + `completion` columns (strings or chat lists), TRL's format.
- `keys`: any `prompt_key` / `response_key` pair, dotted for dict columns (`extra_info.question`).
All SFT conversions produce TRL's conversational prompt/completion (loss on the completion only) or `messages`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from common.errors import UsageError

LOCAL_SUFFIXES = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
FORMATS = ("auto", "messages", "dolly", "verl", "prompt_completion", "keys")


def _looks_local(spec: str) -> bool:
    return (
        spec.startswith(("/", "./", "../", "~"))
        or Path(spec).suffix.lower() in LOCAL_SUFFIXES
        or os.sep in spec.strip("/") and spec.count("/") > 1
    )


def _split_of(p: Path, split: str) -> bool:
    return p.stem == split or p.stem.startswith((f"{split}-", f"{split}_"))


# The names datasets' own loaders give a folder's files for its splits (data/test-00000-of-00001.parquet...).
OTHER_SPLITS = ("test", "validation", "valid", "val", "dev", "eval")


def _files_in(directory: Path, split: str) -> list[Path]:
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.suffix.lower() in LOCAL_SUFFIXES)
    if not files:
        raise UsageError(
            f"dataset directory {directory} has no .parquet/.jsonl/.json/.csv files; point to a file or a directory with some"
        )
    # `train.parquet`, `train-00000-of-00001.parquet`, `data/train-*.parquet`: the split's files if named so.
    named = [p for p in files if _split_of(p, split)]
    if named:
        return named
    others = sorted({s for s in OTHER_SPLITS for p in files if _split_of(p, s)})
    if split != "train" or others:
        # Training on every file (the test rows among them) for a split that is not there was the silent default.
        have = f"files named for the split(s) {', '.join(others)}" if others else "no files named for a split"
        raise UsageError(f"--dataset_split {split}: dataset directory {directory} has no {split}*.{{jsonl,parquet,...}} "
                         f"file ({have}); name the split's files so, or pass the file itself as --dataset")
    return files


def _check_split(path: Path, split: str) -> None:
    """One local file is one split, train: another split name would be trained on the whole file."""
    if split != "train":
        raise UsageError(f"--dataset_split {split}: the local file {path} has one split, train; pass the file that "
                         f"holds the {split} rows as --dataset (or a folder with {split}.jsonl in it), or drop "
                         "--dataset_split")


def _bad_json_line(path: Path) -> str | None:
    """`FILE:LINE: what is wrong` for the first line of a JSON Lines file that is not one JSON object; None if
    every line is (then the loader's own complaint stands)."""
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    return f"{path}:{n}: not valid JSON ({getattr(e, 'msg', e)} at column {getattr(e, 'colno', '?')})"
                if not isinstance(row, dict):
                    return f"{path}:{n}: a row must be a JSON object ({{...}}), got {type(row).__name__}"
    except UnicodeDecodeError as e:
        return f"{path}: not UTF-8 text (byte {e.start})"
    except OSError as e:
        return f"{path}: can't be read ({e.strerror})"
    return None


def load_table(spec: str, *, split: str = "train"):
    """A `datasets.Dataset` from a local .parquet/.jsonl/.json/.csv file or directory, or a hub id `name[:config]`.

    A spec that exists locally, or looks like a path (absolute, ./, a data-file suffix), is never sent to the hub:
    a missing local path is a UsageError.
    """
    import datasets

    if not spec:
        raise UsageError("no dataset given: pass --dataset PATH (a .parquet/.jsonl/.json/.csv file or directory) or a hub id")
    path = Path(os.path.expanduser(spec))
    if path.exists():
        if path.is_file():
            _check_split(path, split)
        files = [path] if path.is_file() else _files_in(path, split)
        kinds = {LOCAL_SUFFIXES.get(p.suffix.lower()) for p in files}
        if None in kinds:
            raise UsageError(f"dataset file {path} has an unsupported suffix; use .parquet, .jsonl, .json or .csv")
        if len(kinds) > 1:
            raise UsageError(f"dataset directory {path} mixes file types {sorted(kinds)}; keep one format per directory")
        empty = [p for p in files if p.stat().st_size == 0]
        if empty:
            raise UsageError(f"dataset file {empty[0]} is empty (no rows); put rows in it or point --dataset elsewhere")
        try:
            ds = datasets.load_dataset(kinds.pop(), data_files=[str(p) for p in files], split="train")
        except Exception as e:  # a corrupt or malformed file: say which (and for JSON Lines, which line)
            lines = (_bad_json_line(p) for p in files if p.suffix.lower() == ".jsonl")
            where = next((w for w in lines if w), None)
            if where:
                raise UsageError(f"dataset {where}; fix or drop that line") from None
            raise UsageError(f"cannot read dataset {path}: {type(e).__name__}: {e}".replace("\n", " ")) from None
        if len(ds) == 0:
            raise UsageError(f"dataset {path} has no rows; put rows in it or point --dataset elsewhere")
        return ds
    if _looks_local(spec):
        raise UsageError(f"dataset path {spec} does not exist; check the path (and the container's mounts)")
    name, _, config = spec.partition(":")
    try:
        return datasets.load_dataset(name, config or None, split=split)
    except Exception as e:  # not found, offline, no such config/split: the hub's own words, on one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UsageError(f"dataset {spec!r} is not a local path and the hub can't serve it ({type(e).__name__}: "
                         f"{first[:300]}); check the name (a local file needs ./ or a path), or mount the data and "
                         "pass its path") from None


class BadRow(Exception):
    """A row that a conversion can't use: which field and what is wrong (the row number is added by `convert`)."""


def convert(ds, conv, where: str):
    """`ds.map(conv)` that checks every row: a bad one is one UsageError naming its number (from 1) and field."""
    def checked(row, i):
        try:
            return conv(row)
        except BadRow as e:
            raise UsageError(f"{where}: row {i + 1}: {e}") from None
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            raise UsageError(f"{where}: row {i + 1} can't be used ({type(e).__name__}: {str(e)[:200]}); fix or "
                             "drop that row") from None

    return ds.map(checked, with_indices=True, remove_columns=ds.column_names)


# The roles chat templates know (gpt-oss's harmony adds developer); any other is a typo the template would drop or
# render as text the model then learns.
ROLES = ("system", "developer", "user", "assistant", "tool")


def _chat(value: Any, field: str) -> list:
    """A chat list of {role, content} messages with known text roles, or BadRow naming the field and message."""
    if not isinstance(value, list):
        raise BadRow(f"{field} must be a list of {{role, content}} messages, got {type(value).__name__}")
    for i, m in enumerate(value, 1):
        if not isinstance(m, Mapping):
            raise BadRow(f"{field}: message {i} must be a {{role, content}} object, got {type(m).__name__}")
        missing = [k for k in ("role", "content") if k not in m or m[k] is None]
        if missing:
            raise BadRow(f"{field}: message {i} has no {' and no '.join(missing)}")
        if not isinstance(m["role"], str) or not isinstance(m["content"], (str, list)):
            raise BadRow(f"{field}: message {i} needs a text role and content, got role={str(m['role'])[:40]!r} "
                         f"content={type(m['content']).__name__}")
        if m["role"] not in ROLES:
            raise BadRow(f"{field}: message {i} has role {m['role'][:40]!r}; use one of {', '.join(ROLES)}")
    return list(value)


def _conversation(value: Any, field: str) -> list:
    """A chat list that teaches something: at least one assistant message, and the last one is the assistant's
    (a lone system message, or a conversation ending with the user, trained on nothing or on the user's words)."""
    msgs = _chat(value, field)
    if not msgs:
        raise BadRow(f"{field} is an empty list")
    if not any(m["role"] == "assistant" for m in msgs):
        raise BadRow(f"{field} has no assistant message ({len(msgs)} message(s): "
                     f"{', '.join(m['role'] for m in msgs[:6])}); a conversation needs the assistant's reply to learn")
    if msgs[-1]["role"] != "assistant":
        raise BadRow(f"{field} ends with a {msgs[-1]['role']} message; end each conversation with the assistant's "
                     "reply (drop the trailing turn)")
    return msgs


def _text(value: Any, field: str) -> str:
    if isinstance(value, list) and value and all(isinstance(m, Mapping) for m in value):
        return _chat(value, field)  # a chat list: each message checked, so a bad one is named
    if value is None or isinstance(value, (Mapping, list)):
        raise BadRow(f"{field} is {'missing' if value is None else type(value).__name__}, expected text")
    return value


def require_columns(ds, cols, where: str) -> None:
    missing = [c for c in cols if c not in ds.column_names]
    if missing:
        raise UsageError(
            f"{where}: missing column(s) {', '.join(missing)}; the dataset has {', '.join(ds.column_names) or 'no columns'}"
        )


def get_key(row: dict, dotted: str) -> Any:
    """`row["extra_info"]["question"]` for `extra_info.question` (verl's prompt_key + dict keys)."""
    value: Any = row
    for part in dotted.split("."):
        # map() hands rows as lazy Mappings, not dicts.
        if not isinstance(value, Mapping) or part not in value:
            raise KeyError(dotted)
        value = value[part]
    return value


def require_key(ds, dotted: str, where: str) -> None:
    """Check a (possibly dotted) key on the first row, listing what is there when it is not."""
    head = dotted.split(".")[0]
    require_columns(ds, [head], where)
    if len(ds) == 0:
        raise UsageError(f"{where}: the dataset is empty")
    try:
        get_key(ds[0], dotted)
    except KeyError:
        value: Any = ds[0]
        for part in dotted.split(".")[:-1]:
            value = value.get(part, {}) if isinstance(value, Mapping) else {}
        have = ", ".join(sorted(value)) if isinstance(value, Mapping) and value else "nothing"
        raise UsageError(f"{where}: key {dotted} not found in the first row; at that level it has {have}") from None


def _is_chat(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in value)


def detect_format(ds, messages_key: str = "messages") -> str:
    cols = set(ds.column_names)
    if messages_key in cols:
        return "messages"
    if "instruction" in cols and cols & {"response", "output"}:
        return "dolly"
    if "prompt" in cols and "extra_info" in cols:
        return "verl"
    if {"prompt", "completion"} <= cols:
        return "prompt_completion"
    raise UsageError(
        f"cannot tell the dataset format from its columns ({', '.join(sorted(cols))}); expected `{messages_key}`, "
        "instruction+response/output (dolly), prompt+extra_info (verl gsm8k), prompt+completion, or set "
        "--prompt_key/--response_key"
    )


def _user(text: str, system_prompt: str | None) -> list[dict]:
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return msgs + [{"role": "user", "content": str(text)}]


def _as_prompt(value: Any, system_prompt: str | None) -> list[dict]:
    if _is_chat(value):
        return ([{"role": "system", "content": system_prompt}] if system_prompt else []) + list(value)
    return _user(value, system_prompt)


def _as_completion(value: Any, field: str = "completion") -> list[dict]:
    if not _is_chat(value):
        return [{"role": "assistant", "content": str(value)}]
    if not any(m["role"] == "assistant" for m in value):
        raise BadRow(f"{field} has no assistant message; the completion is what the model learns to say")
    return list(value)


def _dolly_prompt(row: dict) -> str:
    context = row.get("context") or row.get("input") or ""
    return f"{row['instruction']}\n\n{context}".strip() if context else str(row["instruction"])


def to_sft(
    ds,
    *,
    fmt: str = "auto",
    prompt_key: str | None = None,
    response_key: str | None = None,
    messages_key: str = "messages",
    system_prompt: str | None = None,
    where: str = "dataset",
):
    """Convert to TRL's conversational SFT format. Validates the needed columns first (UsageError)."""
    if fmt not in FORMATS:
        raise UsageError(f"--dataset_format {fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt == "auto":
        fmt = "keys" if (prompt_key or response_key) else detect_format(ds, messages_key)

    if fmt == "messages":
        require_columns(ds, [messages_key], where)

        def conv(row):
            msgs = _conversation(row[messages_key], f"column {messages_key}")
            if system_prompt and msgs[0]["role"] != "system":
                msgs = [{"role": "system", "content": system_prompt}] + msgs
            return {"messages": [{"role": m["role"], "content": m["content"]} for m in msgs]}

        return convert(ds, conv, where)

    if fmt == "dolly":
        require_columns(ds, ["instruction"], where)
        resp = "response" if "response" in ds.column_names else "output"
        require_columns(ds, [resp], where)

        def conv(row):
            _text(row["instruction"], "instruction")
            return {"prompt": _user(_dolly_prompt(row), system_prompt),
                    "completion": _as_completion(_text(row[resp], resp), resp)}

        return convert(ds, conv, where)

    if fmt == "verl":
        prompt_key = prompt_key or "extra_info.question"
        response_key = response_key or "extra_info.answer"
    elif fmt == "prompt_completion":
        prompt_key = prompt_key or "prompt"
        response_key = response_key or "completion"
    elif not (prompt_key and response_key):
        raise UsageError("--prompt_key and --response_key go together: set both (dotted for dict columns)")
    require_key(ds, prompt_key, where)
    require_key(ds, response_key, where)

    def conv(row):
        try:
            prompt, response = get_key(row, prompt_key), get_key(row, response_key)
        except KeyError as e:
            raise BadRow(f"key {e.args[0]} is missing") from None
        return {
            "prompt": _as_prompt(_text(prompt, prompt_key), system_prompt),
            "completion": _as_completion(_text(response, response_key), response_key),
        }

    return convert(ds, conv, where)


def to_prompt_answer(ds, *, where: str = "dataset", system_prompt: str | None = None):
    """For RL: `prompt` (chat list) + `answer` (ground truth) from verl gsm8k parquet or HF gsm8k (question/answer).

    HF gsm8k answers end with `#### N`; the ground truth kept is N.
    """
    cols = set(ds.column_names)
    if "prompt" in cols and "reward_model" in cols:
        require_key(ds, "reward_model.ground_truth", where)

        def conv(row):
            try:
                truth = get_key(row, "reward_model.ground_truth")
            except KeyError:
                raise BadRow("reward_model.ground_truth is missing") from None
            return {"prompt": _as_prompt(_text(row["prompt"], "prompt"), system_prompt),
                    "answer": str(_text(truth, "reward_model.ground_truth"))}

    elif {"question", "answer"} <= cols:

        def conv(row):
            return {"prompt": _user(_text(row["question"], "question"), system_prompt),
                    "answer": str(_text(row["answer"], "answer")).split("####")[-1].strip()}

    else:
        raise UsageError(
            f"{where}: need verl gsm8k columns (prompt, reward_model.ground_truth) or question+answer; "
            f"the dataset has {', '.join(sorted(cols))}"
        )
    return convert(ds, conv, where)
