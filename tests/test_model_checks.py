"""A model's files and LoRA targets checked before any weight loads (issue 65 case 15): `--lora_target_modules
nosuch` is one line listing the model's names (it was a traceback from PEFT after the 4-bit model loaded), an
unreadable or cut-short weights file is one line naming it (a traceback from from_pretrained)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.errors import UsageError
from trainbox.training import modelfiles

ROOT = Path(__file__).resolve().parent.parent


def test_lora_targets_are_checked_against_the_models_module_names(tiny_model):
    for ok in (["q_proj"], ["q_proj", "v_proj"], ["all-linear"], "all-linear", [".*_proj"], None):
        modelfiles.check_lora_targets(str(tiny_model), None, ok)
    with pytest.raises(UsageError) as e:
        modelfiles.check_lora_targets(str(tiny_model), None, ["q_proj", "v_porj"])
    msg = str(e.value)
    assert msg.startswith("--lora_target_modules v_porj: no module of") and "q_proj" in msg and "v_proj" in msg
    assert "\n" not in msg
    with pytest.raises(UsageError, match=r"not a regular expression"):
        modelfiles.check_lora_targets(str(tiny_model), None, ["q_proj("])
    # One plain name stays a list for PEFT (as a string PEFT fullmatches it against the whole dotted name).
    assert modelfiles.peft_targets(["q_proj"]) == ["q_proj"]
    assert modelfiles.peft_targets(["all-linear"]) == "all-linear" and modelfiles.peft_targets([".*proj"]) == ".*proj"


def test_a_cut_short_or_foreign_weights_file_is_one_line(tiny_model, tmp_path):
    modelfiles.check_weights(str(tiny_model))
    broken = tmp_path / "m"
    shutil.copytree(tiny_model, broken)
    weights = next(broken.glob("*.safetensors"))
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(UsageError, match=rf"the weights file {weights.name} can't be loaded: it is cut short"):
        modelfiles.check_weights(str(broken))
    weights.write_bytes(b"<html>not a model</html>")
    with pytest.raises(UsageError, match=r"its header is not a safetensors header"):
        modelfiles.check_weights(str(broken))
    weights.write_bytes(b"\x01")
    with pytest.raises(UsageError, match=r"too short for a safetensors file"):
        modelfiles.check_weights(str(broken))
    modelfiles.check_weights("org/hub-id")  # not a local folder: the hub's business


def test_qlora_nosuch_target_is_one_line_before_the_model_loads(tiny_model, tmp_path):
    from test_data import write_messages
    from test_sft import FAST, env_for

    data = write_messages(tmp_path / "chat.jsonl", 4)
    r = subprocess.run([sys.executable, "-m", "trainbox", "qlora", "--model_name_or_path", str(tiny_model),
                        "--dataset", str(data), "--output_dir", str(tmp_path / "out"), "--max_steps", "1",
                        "--lora_target_modules", "nosuch", *FAST], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=env_for(tmp_path))
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--lora_target_modules nosuch" in errors[0] and "q_proj" in errors[0], r.stderr
    assert "Traceback" not in r.stderr and "[trainbox] qlora: model" not in r.stdout  # nothing loaded
