"""qlora on CPU in real 4-bit (bitsandbytes' CPU backend): nf4 + double quant, LoRA on all linear layers,
adapter + merged model, resume from an adapter checkpoint, bad config -> exit 2 before any model loads."""

import json
import signal
from pathlib import Path

import pytest

from test_data import write_dolly, write_messages
from test_sft import FAST, env_for, run, state

LINEAR = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_quantized_load_is_nf4_double_quant_bf16_compute(tiny_model):
    import bitsandbytes as bnb
    import torch

    from trainbox.cli import qlora
    from trainbox.training import adapters

    _, _, _, model_args, _ = qlora.parse(["--model_name_or_path", str(tiny_model)])
    model = adapters.load_quantized(model_args)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert {n.rsplit(".", 1)[1] for n in layers} == LINEAR and len(layers) == 2 * len(LINEAR)
    for m in layers.values():
        qs = m.weight.quant_state
        assert qs.quant_type == "nf4" and qs.nested is True  # nested = double quantization
        assert m.compute_dtype == torch.bfloat16 and m.weight.dtype == torch.uint8
    assert not isinstance(model.lm_head, bnb.nn.Linear4bit)  # the head stays unquantized


def test_dolly_4bit_adapter_and_merged(tiny_model, tmp_path):
    from safetensors.torch import load_file

    data = write_dolly(tmp_path / "dolly.jsonl", 16)
    out = tmp_path / "out"
    r = run("trainbox.cli.qlora", ["--model_name_or_path", str(tiny_model), "--dataset", str(data),
                                  "--output_dir", str(out), "--max_steps", "2", "--save_steps", "2", "--merge",
                                  *FAST], env_for(tmp_path))  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "4-bit nf4, LoRA r=16 on all-linear, optim adamw_torch" in r.stdout
    assert "[trainbox] qlora done: steps 2/2" in r.stdout
    adapter = json.loads((out / "adapter_config.json").read_text())
    # all-linear resolves to every linear layer but the head (peft stores the resolved names)
    assert {t.rsplit(".", 1)[-1] for t in adapter["target_modules"]} == LINEAR
    assert adapter["r"] == 16 and adapter["lora_alpha"] == 32
    lora = load_file(out / "adapter_model.safetensors")
    assert any("lora_B" in k and lora[k].abs().sum() > 0 for k in lora)  # B starts at zero: training moved it
    merged = out / "merged"
    weights = load_file(merged / "model.safetensors")
    assert not any("lora" in k for k in weights) and (merged / "tokenizer.json").is_file()
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(merged)  # a plain, loadable model


def test_sigterm_then_resume_from_adapter_checkpoint(tiny_model, tmp_path):
    from test_sft import spawn

    data = write_messages(tmp_path / "chat.jsonl", 32)
    out = tmp_path / "out"
    args = ["--model_name_or_path", str(tiny_model), "--dataset", str(data), "--output_dir", str(out),
            "--save_steps", "1000", *FAST]  # fmt: skip
    p = spawn("trainbox.cli.qlora", args + ["--max_steps", "1000"], env_for(tmp_path))
    seen = []
    for line in p.stdout:
        seen.append(line)
        if "'loss'" in line:
            p.send_signal(signal.SIGUSR1)  # Slurm's --signal=USR1@N warning
            break
    seen.append(p.stdout.read())
    assert p.wait(timeout=120) == 0, "".join(seen)
    (ckpt,) = out.glob("checkpoint-*")
    n = state(ckpt)["global_step"]
    assert (ckpt / "adapter_model.safetensors").is_file()
    r = run("trainbox.cli.qlora", args + ["--max_steps", str(n + 1)], env_for(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"resuming from {ckpt}" in r.stdout
    assert state(out / f"checkpoint-{n + 1}")["global_step"] == n + 1


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--use_peft", "false"], "--use_peft must stay true"),
        (["--load_in_8bit"], "8 bit and 4 bit precision at the same time"),  # ModelConfig's own check
        (["--dtype", "auto"], "qlora needs bfloat16"),
        (["--lora_rank", "8"], "unknown option --lora_rank; did you mean"),
    ],
)
def test_bad_config_exits_2(tiny_model, tmp_path, monkeypatch, capsys, args, needle):
    import transformers

    from trainbox.cli import qlora

    monkeypatch.setattr(
        transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("model loaded")
    )
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    data = write_dolly(tmp_path / "d.jsonl", 4)
    try:
        rc = qlora.main(["--model_name_or_path", str(tiny_model), "--dataset", str(data),
                         "--output_dir", str(tmp_path / "o"), *args])  # fmt: skip
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and needle in err[-1], err
    assert not Path(tmp_path / "o").exists()
