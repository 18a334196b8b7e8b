"""A model's config.json is checked before anything is planned or loaded (trainbox/training/modelcheck.py, through
config.check_model_path): for `trainbox plan` and for the trainers, a fault is one `error:` line naming the file and
the key, exit 2; every causal LM config transformers writes passes; a fuzzer over mutated configs finds no traceback
and no exit code but 0, 1, 2 (issue 65, case 7)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from common.errors import UsageError
from trainbox.cli import plan
from trainbox.training import memplan, modelcheck

ROOT = Path(__file__).resolve().parents[1]
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
TINY_MOE = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 512, "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 256}
LEFT_OUT = object()
# (name, the config's text, the key the one line names)
BAD = [
    ("no-model-type", json.dumps({k: v for k, v in TINY.items() if k != "model_type"}), "model_type"),
    ("hidden-as-string", json.dumps({**TINY, "hidden_size": "256"}), "hidden_size"),
    ("cut-short", json.dumps(TINY)[:70], "not valid JSON"),
    ("banana", json.dumps({**TINY, "model_type": "banana"}), "model_type 'banana'"),
    ("zero-layers", json.dumps({**TINY, "num_hidden_layers": 0}), "num_hidden_layers 0"),
    ("ten-million-layers", json.dumps({**TINY, "num_hidden_layers": 10**7}), "num_hidden_layers 10000000"),
    ("no-hidden", json.dumps({k: v for k, v in TINY.items() if k != "hidden_size"}), "hidden_size is missing"),
    ("no-experts-top-k-too-big", json.dumps({**TINY_MOE, "num_experts_per_tok": 9}), "num_experts_per_tok 9"),
    ("heads-dont-divide", json.dumps({**TINY, "num_attention_heads": 7}), "number of attention heads"),
    ("a-list", json.dumps([TINY]), "must be a JSON object"),
]


def model_dir(tmp_path: Path, name: str, text: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(text)
    return d


@pytest.mark.parametrize("name,text,key", BAD, ids=[b[0] for b in BAD])
def test_a_bad_config_is_one_line_naming_the_file_and_key(tmp_path, name, text, key):
    modelcheck.check(model_dir(tmp_path, "good", json.dumps(TINY)) / "config.json")  # imports before the clock
    d = model_dir(tmp_path, name, text)
    started = time.monotonic()
    with pytest.raises(UsageError) as e:
        modelcheck.check(d / "config.json")
    assert time.monotonic() - started < 5  # 10^7 layers: refused, not built
    assert str(d / "config.json") in str(e.value) and key in str(e.value), str(e.value)


def test_every_causal_lm_config_transformers_writes_passes(tmp_path):
    """The check refuses faults, not architectures: each causal LM's default config as transformers saves it (its
    own spelling of the sizes, per-layer lists, Infinity as it writes it) passes."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    checked = 0
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            conf = CONFIG_MAPPING[model_type]()
        except Exception:  # noqa: BLE001 - a class with no usable defaults: nothing to save
            continue
        path = tmp_path / f"{model_type}.json"
        path.write_text(conf.to_json_string())
        modelcheck.check(path)
        checked += 1
    assert checked > 100


def cli(*argv):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1")
    for name in plan.LAUNCHER_VARS:
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "trainbox", *argv], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=300)


def clear_env(monkeypatch):
    for name in (*plan.LAUNCHER_VARS, memplan.FREE_ENV, memplan.MODE_ENV):
        monkeypatch.setenv(name, "")  # recorded, so that teardown removes what plan sets (WORLD_SIZE)
        monkeypatch.delenv(name)


@pytest.mark.parametrize("name,text,key", BAD[:4], ids=[b[0] for b in BAD[:4]])
def test_plan_stops_on_a_bad_config_with_one_line(tmp_path, monkeypatch, capsys, name, text, key):
    """`trainbox plan` used to print a traceback with its "does not fit" code (1)."""
    d = model_dir(tmp_path, name, text)
    clear_env(monkeypatch)
    rc = plan.main(["--model_name_or_path", str(d), "--gpu-memory", "77.7"])
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert rc == 2 and out.out == "" and len(lines) == 1, out
    assert lines[0].startswith("error: ") and str(d / "config.json") in lines[0] and key in lines[0], lines


def test_sft_stops_on_a_bad_config_with_one_line(tmp_path):
    """sft on the same folder: a traceback and "the run crashed" before (qlora and grpo check through the same
    config.check_model_path)."""
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    d = model_dir(tmp_path, "as-string", BAD[1][1])
    r = cli("sft", "--model_name_or_path", str(d), "--dataset", str(data), "--output_dir", str(tmp_path / "out"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert lines[-1].startswith("error: ") and str(d / "config.json") in lines[-1] and "hidden_size" in lines[-1]


# ------------------------------------------------------------------ the fuzzer: mutated configs through plan
FUZZ = settings(max_examples=int(os.environ.get("TRAINBOX_FUZZ_EXAMPLES", "40")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
KEYS = sorted({*TINY, *TINY_MOE, "head_dim", "text_config", "layer_types", "sliding_window", "rope_theta"})
values = st.one_of(
    st.integers(min_value=-3, max_value=12), st.sampled_from([0, 1, 2, 3, 4, 64, 10**4, 10**7, 2**63, -(2**63)]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6), st.sampled_from(["256", "llama", "", "1e3"]),
    st.booleans(), st.none(), st.lists(st.integers(-1, 4), max_size=3), st.dictionaries(st.text(max_size=3),
                                                                                           st.integers(), max_size=2),
    st.just(LEFT_OUT))
mutations = st.lists(st.tuples(st.sampled_from(KEYS), values), max_size=3)


@FUZZ
@given(base=st.sampled_from([TINY, TINY_MOE]), changes=mutations, cut=st.one_of(st.none(), st.integers(0, 400)))
def test_fuzzed_configs_plan_or_stop_with_one_line(tmp_path_factory, monkeypatch, capsys, base, changes, cut):
    conf = dict(base)
    for key, value in changes:
        if value is LEFT_OUT:
            conf.pop(key, None)
        else:
            conf[key] = value
    text = json.dumps(conf)  # NaN/Infinity as Python writes them: not JSON, refused as such
    text = text if cut is None else text[:cut]
    d = model_dir(tmp_path_factory.mktemp("fuzz"), "m", text)
    clear_env(monkeypatch)
    rc = plan.main(["--model_name_or_path", str(d), "--gpu-memory", "77.7", "--max_length", "64"])
    out = capsys.readouterr()
    assert rc in (0, 1, 2), (conf, out)
    if rc == 2:
        lines = out.err.strip().splitlines()
        assert out.out == "" and len(lines) == 1 and lines[0].startswith("error: ") and "config.json" in lines[0], \
            (conf, out.err)
    else:
        assert "memory plan:" in out.out or "does not fit" in out.out, (conf, out)
