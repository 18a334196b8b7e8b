"""Every input path of the commands gives one line and exit 2, before any model loads, and leaves nothing behind:
output folders that can't be one, models and datasets the hub can't serve, every dataset row checked (the message
names the row), numbers out of range, YAML values of the wrong type, binary files. Then a hypothesis fuzz over
options and YAML through the real parser: a UsageError or a parse, never another exception."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import sidebyside
from common.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def env(tmp: Path) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k not in ("ARTIFACT_DIR", "OUTPUT_DIR")}
    e.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HOME=str(tmp),
             HF_HOME=str(tmp / "hf"), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return e


def rows(path: Path, *items) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in items))
    return path


@pytest.fixture
def files(tmp_path):
    return make_files(tmp_path)


def make_files(tmp_path: Path) -> Path:
    ro = tmp_path / "ro"
    ro.mkdir()
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00\x01\x80")
    (tmp_path / "list.yaml").write_text("learning_rate: [1, 2]\n")
    (tmp_path / "nan.yaml").write_text("learning_rate: nan\n")
    (tmp_path / "dict.yaml").write_text("max_length: {a: 1}\n")
    rows(tmp_path / "good.jsonl", GOOD, GOOD)
    rows(tmp_path / "bad_row3.jsonl", GOOD, GOOD, {"messages": 5})
    rows(tmp_path / "bad_content.jsonl", GOOD, {"messages": [{"role": "user", "content": {"x": 1}}]})
    rows(tmp_path / "dolly_missing.jsonl", {"instruction": "a", "response": "b"}, {"instruction": "a", "response": None})
    rows(tmp_path / "gsm_bad.jsonl", {"question": "1+1", "answer": "#### 2"}, {"question": ["x"], "answer": "#### 2"})
    return tmp_path


# (entrypoint, args, what the one line must say). {m} = the tiny model, {n} = a copy of it whose tokenizer has no chat
# template, {t} = this test's folder.
CASES = [
    # the commonest mistake (issue 64: a NameError traceback and exit 1 once sftlib lost its UsageError import)
    ("sft", [], "no dataset given: pass --dataset PATH"),
    ("qlora", [], "no dataset given: pass --dataset PATH"),
    ("qlora", ["--model_name_or_path", "{n}", "--dataset", "{t}/good.jsonl"], "has no chat template"),
    ("sft", ["--model_name_or_path", "{n}", "--dataset", "{t}/good.jsonl"], "has no chat template"),
    ("sft", ["--dataset", "{t}/good.jsonl", "--output_dir", "{t}/a_file"], "is a file, not a folder"),
    ("sft", ["--dataset", "{t}/good.jsonl", "--output_dir", "{t}/a_file/sub"], "is a file, not a folder"),
    ("qlora", ["--dataset", "{t}/good.jsonl", "--output_dir", "/proc/trainbox"], "under /proc"),
    ("grpo", ["--dataset", "{t}/good.jsonl", "--output_dir", "/proc/trainbox", "--preset", "gsm8k"], "under /proc"),
    ("sft", ["--dataset", "{t}/good.jsonl", "--output_dir", "/sys/x"], "under /sys"),
    ("sft", ["--model_name_or_path", "typo-model-name"], "the hub can't serve it"),
    ("sft", ["--dataset", "typo/dataset-name"], "the hub can't serve it"),
    ("sft", ["--dataset", "{t}/empty.jsonl"], "is empty (no rows)"),
    ("sft", ["--dataset", "{t}/bad_row3.jsonl"], "row 3: column messages must be a list"),
    ("sft", ["--dataset", "{t}/bad_content.jsonl"], "row 2: column messages: message 1 needs a text role and content"),
    ("sft", ["--dataset", "{t}/dolly_missing.jsonl"], "row 2: response is missing"),
    ("grpo", ["--dataset", "{t}/gsm_bad.jsonl", "--preset", "gsm8k"], "row 2: question is list"),
    ("sft", ["--dataset", "{t}/good.jsonl", "--max_length", "0"], "--max_length 0: must be above 0"),
    ("sft", ["--dataset", "{t}/good.jsonl", "--max_length", "-5"], "--max_length -5: must be above 0"),
    ("qlora", ["--dataset", "{t}/good.jsonl", "--lora_r", "0"], "--lora_r 0: must be above 0"),
    ("grpo", ["--dataset", "{t}/good.jsonl", "--max_completion_length", "0", "--preset", "gsm8k"],
     "--max_completion_length 0"),
    ("sft", ["--dataset", "{t}/good.jsonl", "--learning_rate", "inf"], "must be a finite number"),
    ("sft", ["--dataset", "{t}/good.jsonl", "--config", "{t}/list.yaml"], "expected a single value, got a list"),
    ("sft", ["--dataset", "{t}/good.jsonl", "--config", "{t}/nan.yaml"], "must be a finite number"),
    ("sft", ["--dataset", "{t}/good.jsonl", "--config", "{t}/dict.yaml"], "expected a single value, got a dict"),
    ("sft", ["--dataset", "{t}/good.jsonl", "--config", "{t}/binary.yaml"], "is not UTF-8 text"),
]


def without_chat_template(model: Path, folder: Path) -> Path:
    """A copy of MODEL whose tokenizer has no chat template (a base model's)."""
    out = folder / "no-chat-template"
    shutil.copytree(model, out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def run_case(tiny_model, files: Path, name: str, args: list[str]) -> subprocess.CompletedProcess:
    nochat = without_chat_template(tiny_model, files) if any("{n}" in a for a in args) else None
    argv = [a.format(t=files, m=tiny_model, n=nochat) for a in args]
    if "--model_name_or_path" not in argv:
        argv = ["--model_name_or_path", str(tiny_model), *argv]
    if "--output_dir" not in argv:
        argv += ["--output_dir", str(files / "out")]
    return subprocess.run([sys.executable, "-m", "trainbox", name, *argv, "--max_steps", "1"], cwd=files,
                          env=env(files), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def case_runs(request, tiny_model, tmp_path_factory):
    """The CASES this session runs, each in a fresh folder of its own (make_files), started together on a pool
    (the module's wall time was one python start-up per case in a row); a test waits for its own case's run."""
    selected = sorted({item.callspec.indices["name"] for item in request.session.items
                       if getattr(item, "originalname", None) == "test_bad_input_is_one_line_and_exit_2"
                       and item.module is request.module})
    pool = sidebyside.pool()
    runs = {}
    for i in selected:
        folder = make_files(tmp_path_factory.mktemp("case"))
        runs[i] = folder, pool.submit(run_case, tiny_model, folder, CASES[i][0], CASES[i][1])
    yield runs
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("name,args,needle", CASES, ids=[f"{c[0]}:{c[2][:30]}" for c in CASES])
def test_bad_input_is_one_line_and_exit_2(case_runs, request, name, args, needle):
    files, run = case_runs[request.node.callspec.indices["name"]]
    r = run.result()
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if "error" in ln.lower() or "Traceback" in ln]
    assert len(errors) == 1 and needle in errors[0], r.stderr[-3000:]
    assert not (files / "out").exists(), "bad input left an output folder behind"


# ---------------------------------------------------------------------------- fuzz: the parser never raises else
SETTINGS = settings(max_examples=int(os.environ.get("TRAINBOX_FUZZ_EXAMPLES", "150")), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
OPTIONS = ["--max_length", "--learning_rate", "--lora_r", "--num_train_epochs", "--per_device_train_batch_size",
           "--gradient_accumulation_steps", "--warmup_steps", "--bf16", "--packing", "--seed", "--lr_scheduler_type",
           "--report_to", "--max_steps", "--logging_steps", "--dataset", "--no_such_option", "--hub_token"]
values = st.one_of(st.text(max_size=12), st.sampled_from(["0", "-1", "nan", "inf", "1e400", "true", "[1]", "", "2"]),
                   st.integers(-10**6, 10**6).map(str), st.floats(allow_nan=True).map(str))
yaml_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=8)),
                           lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=4), c,
                                                                                        max_size=2)), max_leaves=5)


def parse(name: str, argv: list[str]):
    if name == "sft":
        from trainbox.cli.sft import parse
    else:
        from trainbox.cli.qlora import parse
    return parse(argv)


@SETTINGS
@given(name=st.sampled_from(["sft", "qlora"]), pairs=st.lists(st.tuples(st.sampled_from(OPTIONS), values), max_size=4))
def test_fuzzed_options_parse_or_are_one_usage_error(name, pairs):
    argv = ["--model_name_or_path", "/m", "--dataset", "d.jsonl", "--output_dir", "/tmp/trainbox-fuzz-out"]
    for opt, v in pairs:
        argv += [opt, v]
    try:
        parse(name, argv)
    except UsageError:
        pass  # the dispatcher prints it on one line (dispatch.run_main); any other exception fails the test
    except SystemExit as e:  # --help only
        assert e.code == 0


@SETTINGS
@given(doc=st.dictionaries(st.sampled_from([o[2:] for o in OPTIONS]), yaml_values, max_size=4))
def test_fuzzed_yaml_parses_or_is_one_usage_error(doc, tmp_path_factory):
    import yaml

    path = tmp_path_factory.mktemp("yaml") / "c.yaml"
    path.write_text(yaml.safe_dump(doc))
    try:
        parse("sft", ["--config", str(path), "--model_name_or_path", "/m", "--dataset", "d.jsonl"])
    except UsageError:
        pass


def test_fuzz_sample_through_the_real_command(tiny_model, files):
    """A few fuzz-shaped inputs through `python -m trainbox sft` itself: exit 0 or 2, never a traceback."""
    extras = (["--max_length", "1e400"], ["--learning_rate", "nan"], ["--per_device_train_batch_size", "-1"],
              ["--warmup_steps", "abc"], ["--report_to", "nonsense"])

    def call(extra):
        return lambda: subprocess.run([sys.executable, "-m", "trainbox", "sft", "--model_name_or_path", str(tiny_model),
                                       "--dataset", str(files / "good.jsonl"), "--output_dir", str(files / "out"),
                                       *extra], cwd=files, env=env(files), capture_output=True, text=True, timeout=300)

    for extra, r in zip(extras, sidebyside.in_parallel([call(extra) for extra in extras]), strict=True):
        assert r.returncode == 2 and "Traceback" not in r.stderr, (extra, r.stderr[-2000:])


def test_a_binary_image_record_is_one_line(tmp_path):
    record = tmp_path / "image.json"
    record.write_bytes(b"\xff\xfe{\x00\x80")
    r = subprocess.run([sys.executable, "-m", "trainbox", "doctor"], cwd=tmp_path, capture_output=True, text=True,
                       env={**env(tmp_path), "TRAINBOX_IMAGE_INFO": str(record)}, timeout=300)
    # doctor diagnoses: the broken record is its FAIL row and the verdict is "broken" (exit 1), not a traceback.
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    assert [ln for ln in r.stdout.splitlines() if ln.startswith("image record") and "FAIL" in ln
            and "not UTF-8 text" in ln], r.stdout


@pytest.mark.skipif(os.geteuid() != 0 or not __import__("shutil").which("setpriv"), reason="needs root to switch user")
def test_an_output_folder_this_user_cannot_write_is_one_line(tiny_model, tmp_path):
    import shutil
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="trainbox-ro-", dir="/tmp"))  # pytest's tmp is root's only (0700)
    try:
        base.chmod(0o755)
        (base / "ro").mkdir(mode=0o555)
        (base / "ro").chmod(0o555)
        data = rows(base / "good.jsonl", GOOD, GOOD)
        model = base / "model"
        shutil.copytree(tiny_model, model)
        r = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-m",
                            "trainbox.cli.sft", "--model_name_or_path", str(model), "--dataset", str(data),
                            "--output_dir", str(base / "ro" / "out")], cwd=base, capture_output=True, text=True,
                           env={**env(base), "HOME": str(base)}, timeout=300)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert r.returncode == 2 and "not writable" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
