"""`trainbox grpo`: option parsing and checks before any model loads, and real CPU runs on the tiny Llama.

Runs go through `python -m trainbox grpo` in a subprocess (as in the image), on synthetic gsm8k-style data
(`#### N` answers) and a toy task whose reward the policy can learn.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gloo_ranks
from common.errors import UsageError
from trainbox.cli import grpo
from trainbox.training.grpo import (
    data as grpo_data,
    options as grpo_options,
    rewards,
    rollouts as grpo_rollouts,
    trainer as grpo_trainer,
)

ROOT = Path(__file__).resolve().parents[1]

# Small and fast on CPU: 4 completions per prompt, 16 new tokens, a log line per step.
FAST = [
    "--num_generations", "4", "--per_device_train_batch_size", "4", "--max_completion_length", "16",
    "--logging_steps", "1", "--bf16", "false", "--disable_tqdm", "true", "--report_to", "none",
]


def gsm8k_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        rows.append({
            "question": f"Natalia sold {a} clips in April and {b} clips in May. How many clips did she sell?",
            "answer": f"In April and May she sold {a} + {b} = <<{a}+{b}={a + b}>>{a + b} clips.\n#### {a + b}",
        })
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def gsm8k_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("data") / "gsm8k.jsonl", gsm8k_rows(16))


def run_grpo(args, cwd, env=None, timeout=600) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    full_env.pop("OUTPUT_DIR", None) if "OUTPUT_DIR" not in (env or {}) else None
    return subprocess.run(
        [sys.executable, "-m", "trainbox", "grpo", *map(str, args)],
        cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout,
    )


def log_history(output_dir: Path) -> list[dict]:
    ckpts = sorted(output_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    return json.loads((ckpts[-1] / "trainer_state.json").read_text())["log_history"]


def parsed(argv):
    """(script, GRPOConfig, ModelConfig) as a single-process run sees them."""
    script, _launch, raw, model_args = grpo.parse(argv)
    return script, grpo_options.finalize(raw, 1), model_args


# ---------------------------------------------------------------- bad input: one error line, exit 2, no model


@pytest.fixture
def no_model(monkeypatch):
    """Fail the test if a run gets as far as building the trainer (i.e. loading the model)."""

    def forbidden(*a, **k):
        raise AssertionError("a model was about to load despite bad input")

    monkeypatch.setattr(grpo_trainer, "build_trainer", forbidden)


def expect_usage_error(argv, capsys, *fragments):
    rc = grpo.main([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    assert err and err[-1].startswith("error: "), err
    for frag in fragments:
        assert frag in err[-1], (frag, err[-1])
    return err[-1]


def test_unknown_option(no_model, capsys, tiny_model, gsm8k_file):
    expect_usage_error(
        ["--model_name_or_path", tiny_model, "--dataset", gsm8k_file, "--num_generation", "4"], capsys,
        "unknown option --num_generation", "did you mean --num_generations",
    )


@pytest.mark.parametrize(
    "extra, world, fragments",
    [
        (["--per_device_train_batch_size", "3", "--num_generations", "4"], "1",
         ["per_device_train_batch_size 3 x 1 process(es) x steps_per_generation 1", "not a multiple of 4",
          "per_device_train_batch_size 4"]),
        (["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "3", "--num_generations", "4"], "1",
         ["steps_per_generation 3 (= gradient_accumulation_steps) = 6", "per_device_train_batch_size 4",
          "num_generations 2 or 3 or 6"]),
        (["--per_device_train_batch_size", "2", "--num_generations", "8"], "2",
         ["2 x 2 process(es)", "= 4 completions is not a multiple of 8", "per_device_train_batch_size 4"]),
        (["--per_device_train_batch_size", "4", "--generation_batch_size", "12", "--num_generations", "8"], "1",
         ["generation_batch_size 12 completions is not a multiple of 8"]),
        (["--per_device_train_batch_size", "4", "--num_generations", "1"], "1", ["needs at least 2"]),
    ],
)
def test_batch_must_hold_whole_groups(no_model, capsys, monkeypatch, tiny_model, gsm8k_file, extra, world, fragments):
    monkeypatch.setenv("WORLD_SIZE", world)
    expect_usage_error(["--model_name_or_path", tiny_model, "--dataset", gsm8k_file, "--preset", "gsm8k", *extra],
                       capsys, *fragments)


def test_batch_is_judged_for_the_processes_torchrun_will_start(no_model, capsys, monkeypatch, tiny_model, gsm8k_file):
    from common import launch

    def no_torchrun(*a, **k):
        raise AssertionError("torchrun started despite bad input")

    monkeypatch.setattr(launch, "run_torchrun", no_torchrun)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    expect_usage_error(["--model_name_or_path", tiny_model, "--dataset", gsm8k_file, "--preset", "gsm8k",
                        "--nproc_per_node", "2", "--per_device_train_batch_size", "2", "--num_generations", "8"],
                       capsys, "2 x 2 process(es) x steps_per_generation 1", "per_device_train_batch_size 4")


def test_missing_model_path(no_model, capsys, gsm8k_file, tmp_path):
    expect_usage_error(["--model_name_or_path", tmp_path / "nope", "--dataset", gsm8k_file, "--preset", "gsm8k"],
                       capsys, "does not exist")
    (tmp_path / "empty").mkdir()
    expect_usage_error(["--model_name_or_path", tmp_path / "empty", "--dataset", gsm8k_file, "--preset", "gsm8k"],
                       capsys, "has no config.json")
    expect_usage_error(["--dataset", gsm8k_file, "--preset", "gsm8k"], capsys, "no model given")


def test_missing_dataset_column_for_a_reward(no_model, capsys, tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "2+2=", "solution": "4"}] * 4)
    expect_usage_error(
        ["--model_name_or_path", tiny_model, "--dataset", data,
         "--reward_funcs", "rewards:correctness,rewards:xmlcount"],
        capsys, "reward function rewards:correctness", "missing column(s) answer", "prompt, solution",
    )


def test_missing_prompt_column_and_wrong_preset_data(no_model, capsys, tiny_model, tmp_path):
    data = write_jsonl(tmp_path / "q.jsonl", [{"text": "hello", "answer": "4"}] * 4)
    expect_usage_error(["--model_name_or_path", tiny_model, "--dataset", data, "--reward_funcs", "rewards:xmlcount"],
                       capsys, "missing column(s) prompt")
    expect_usage_error(["--model_name_or_path", tiny_model, "--dataset", data, "--preset", "gsm8k"],
                       capsys, "question+answer")


def test_missing_dataset_file(no_model, capsys, tiny_model, tmp_path):
    expect_usage_error(["--model_name_or_path", tiny_model, "--dataset", tmp_path / "nope.parquet",
                        "--preset", "gsm8k"], capsys, "does not exist")


def test_bad_rewards(no_model, capsys, tiny_model, gsm8k_file):
    base = ["--model_name_or_path", tiny_model, "--dataset", gsm8k_file, "--preset", "gsm8k"]
    expect_usage_error([*base, "--reward_funcs", "rewards:corectness"], capsys, "has no function 'corectness'")
    expect_usage_error([*base, "--reward_weights", "1.0", "2.0"], capsys, "2 values for 5 reward functions")
    expect_usage_error(["--model_name_or_path", tiny_model, "--dataset", gsm8k_file], capsys,
                       "no reward functions")


def test_mode_contradictions(no_model, capsys, tiny_model, gsm8k_file):
    base = ["--model_name_or_path", tiny_model, "--dataset", gsm8k_file, "--preset", "gsm8k"]
    expect_usage_error([*base, "--mode", "full", "--use_peft", "true"], capsys, "contradicts use_peft")
    expect_usage_error([*base, "--load_in_4bit", "true"], capsys, "use --mode qlora")
    expect_usage_error([*base, "--mode", "int8"], capsys, "invalid choice")


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_use_vllm_without_vllm(no_model, capsys, tiny_model, gsm8k_file):
    expect_usage_error(["--model_name_or_path", tiny_model, "--dataset", gsm8k_file, "--preset", "gsm8k",
                        "--use_vllm", "true"], capsys, "vllm is not installed")


# ---------------------------------------------------------------- parsing and the pieces of a run


def test_yaml_then_cli_overrides_with_trl_names(tmp_path):
    cfg = tmp_path / "grpo.yaml"
    cfg.write_text(
        "model_name_or_path: m\nnum_generations: 4\nper_device_train_batch_size: 8\nlearning_rate: 1.0e-5\n"
        "reward_funcs: [rewards:correctness, rewards:xmlcount]\nmode: lora\nlora_r: 8\n"
    )
    script, args, model_args = parsed(["--config", str(cfg), "--learning_rate", "2e-5"])
    assert (args.num_generations, args.per_device_train_batch_size, args.learning_rate) == (4, 8, 2e-5)
    assert (model_args.model_name_or_path, model_args.lora_r, script.mode) == ("m", 8, "lora")
    assert grpo_data.reward_refs(script) == ["rewards:correctness", "rewards:xmlcount"]
    assert type(args).__name__ == "GRPOConfig"  # TRL's own class, so checkpoints pickle it


def test_legacy_options_are_translated(capsys, tmp_path):
    script, args, _ = parsed(["--max_prompt_length", "256", "--warmup_ratio", "0.1", "--num_generations", "4",
                                  "--per_device_train_batch_size", "4"])
    err = capsys.readouterr().err
    assert script.max_prompt_tokens == 256 and args.warmup_steps == pytest.approx(0.1)
    assert "max_prompt_length was removed upstream; translated to max_prompt_tokens=256" in err
    assert "warmup_ratio" in err
    # Unsloth / TRL 0.x GRPO recipes in YAML: renamed ones land on the new names, dead ones are dropped with a word.
    cfg = tmp_path / "old.yaml"
    cfg.write_text("torch_dtype: bfloat16\nvllm_max_model_len: 2048\nvllm_guided_decoding_regex: '\\d+'\n"
                   "wandb_log_unique_prompts: true\nvllm_device: cuda:1\nnum_generations: 4\n"
                   "per_device_train_batch_size: 4\n")
    _, args, model_args = parsed(["--config", str(cfg)])
    err = capsys.readouterr().err
    assert (model_args.dtype, args.vllm_max_model_length) == ("bfloat16", 2048)
    assert (args.vllm_structured_outputs_regex, args.log_unique_prompts) == ("\\d+", True)
    assert "option vllm_device was removed upstream; translated to nothing" in err


def test_reward_refs_commas_spaces_and_preset():
    script, _, _ = parsed(["--reward_funcs", "rewards:correctness,rewards:int_format", "x.py:f",
                               "--num_generations", "4", "--per_device_train_batch_size", "4"])
    assert grpo_data.reward_refs(script) == ["rewards:correctness", "rewards:int_format", "x.py:f"]
    script, _, _ = parsed(["--preset", "gsm8k", "--num_generations", "4", "--per_device_train_batch_size", "4"])
    assert grpo_data.reward_refs(script) == list(rewards.GSM8K)


def test_rollout_choice_is_automatic_and_reported(monkeypatch):
    import importlib.util

    import torch

    _, args, _ = parsed(["--num_generations", "4", "--per_device_train_batch_size", "4"])
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "vllm" else real_find_spec(n, *a))
    assert grpo_rollouts.resolve_rollouts(args) == "rollouts: transformers generate (auto: vllm not installed)"
    assert args.use_vllm is False

    # With vllm importable and a GPU, vLLM is chosen; colocate by default, server when asked. (Parse first: the
    # config's own setup would touch the pretend GPU.)
    _, colocate, _ = parsed(["--num_generations", "4", "--per_device_train_batch_size", "4"])
    _, server, _ = parsed(["--num_generations", "4", "--per_device_train_batch_size", "4", "--vllm_mode", "server",
                               "--vllm_server_port", "8123"])
    _, off, _ = parsed(["--num_generations", "4", "--per_device_train_batch_size", "4", "--use_vllm", "false"])
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "vllm" else real_find_spec(n, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (100 * 2**30, 141 * 2**30))
    line = grpo_rollouts.resolve_rollouts(colocate)
    assert line.startswith("rollouts: vLLM colocate, sleep mode by the memory plan, gpu_memory_utilization 0.17 "
                           "(sized: 24 GiB of 141 GiB)")
    assert colocate.use_vllm is True and colocate.vllm_mode == "colocate" and colocate.vllm_enable_sleep_mode
    assert "vLLM server at 0.0.0.0:8123" in grpo_rollouts.resolve_rollouts(server)
    assert grpo_rollouts.resolve_rollouts(off) == "rollouts: transformers generate (use_vllm set)"
    assert off.use_vllm is False
    # Colocated vLLM skips detokenizing (TRL decodes the ids); the server and transformers keep theirs.
    assert line.endswith(", no detokenizing (TRL decodes the ids) (auto: vllm installed, GPU present)")
    assert colocate.generation_kwargs == {"detokenize": False}
    assert not server.generation_kwargs and not off.generation_kwargs


def test_static_decode_is_chosen_where_it_applies(monkeypatch, no_model, capsys, tiny_model, gsm8k_file):
    """Without vLLM: on by default with a GPU for plain sampling, under adapters (lora, qlora: the adapter merged
    into its copy) only where its copy fits beside the policy; off (and said why) for sampling it does not do; asked
    for where it cannot run, one usage error."""
    import torch

    from trainbox.training import modelfacts

    base = ["--num_generations", "4", "--per_device_train_batch_size", "4", "--use_vllm", "false"]

    def line(argv, mode="full", gpu=True, total=80 * 2**30):
        script, args, model_args = parsed([*base, "--model_name_or_path", str(tiny_model), *argv])
        with monkeypatch.context() as m:
            m.setattr(torch.cuda, "is_available", lambda: gpu)
            m.setattr(torch.cuda, "mem_get_info", lambda *a: (total, total))
            return grpo_rollouts.resolve_rollouts(args, None, script, mode, model_args), script.static_decode

    assert line([]) == ("rollouts: static-cache decode (a bfloat16 copy of the policy, one CUDA-graphed step a "
                        "token) (use_vllm set)", True)
    assert line([], gpu=False) == ("rollouts: transformers generate (use_vllm set)", False)
    for mode in ("lora", "qlora"):
        assert line([], mode=mode) == ("rollouts: static-cache decode (a bfloat16 copy of the policy, its adapter "
                                       "merged in each step, one CUDA-graphed step a token) (use_vllm set)", True)
        # a small GPU (a qlora user's 12 GB card, here scaled to the tiny model): the decoder's copy does not fit
        facts = modelfacts.model_facts(str(tiny_model))
        _, args, _ = parsed([*base, "--model_name_or_path", str(tiny_model)])
        need = grpo_rollouts.training_state_bytes(args, facts, mode) + grpo_rollouts.decoder_bytes(args, facts)
        text, on = line([], mode=mode, total=int(need / grpo_rollouts.STATIC_FITS) - 1)
        assert not on and text.startswith("rollouts: transformers generate; static decode off: the policy's "
                                          "training state and a decoder copy"), text
        assert line([], mode=mode, total=int(need / grpo_rollouts.STATIC_FITS) + 1)[1] is True
    assert line(["--top_p", "0.9"])[1] is False and "static decode off: top_p=0.9" in line(["--top_p", "0.9"])[0]
    assert line(["--static_decode", "false"]) == ("rollouts: transformers generate (use_vllm set)", False)
    assert line(["--static_decode", "true"], gpu=False)[1] is True  # asked for on CPU: it runs, uncompiled
    for argv, what in ((["--top_k", "50"], "top_k=50"), (["--repetition_penalty", "1.1"], "repetition_penalty=1.1"),
                       (["--min_p", "0.05"], "min_p=0.05")):
        expect_usage_error(["--model_name_or_path", tiny_model, "--dataset", gsm8k_file, "--preset", "gsm8k", *base,
                            *argv,
                            "--static_decode", "true"], capsys, "static_decode=true but", what,
                           "drop static_decode")


def test_the_static_decoder_stands_in_for_installed_vllm_where_it_is_faster(monkeypatch, tiny_model, tmp_path):
    """vLLM installed and a GPU: a dense text model at full fine-tuning with plain sampling decodes through the
    static decoder (measured faster on an H100, and it holds 2 bytes a parameter instead of vLLM's GPU share);
    everything else keeps vLLM, and the line says why."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM

    from tiny import make_tokenizer
    from zoo import make_config

    moe = tmp_path / "tiny-mixtral"
    AutoModelForCausalLM.from_config(make_config("mixtral", make_tokenizer())).save_pretrained(moe)
    base = ["--num_generations", "4", "--per_device_train_batch_size", "4"]
    real_find_spec = importlib.util.find_spec

    def choose(argv, mode="full", total=80 * 2**30, model=tiny_model):
        script, args, model_args = parsed([*base, "--model_name_or_path", str(model), *argv])
        with monkeypatch.context() as m:
            m.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "vllm" else real_find_spec(n, *a))
            m.setattr(torch.cuda, "is_available", lambda: True)
            m.setattr(torch.cuda, "mem_get_info", lambda *a: (total, total))
            line = grpo_rollouts.resolve_rollouts(args, None, script, mode, model_args)
        return line, args.use_vllm, script.static_decode

    line, vllm, static = choose([])
    assert (vllm, static) == (False, True)
    assert line == ("rollouts: static-cache decode (a bfloat16 copy of the policy, one CUDA-graphed step a token) "
                    "(auto: vllm installed, but faster on a dense text model at full fine-tuning; --use_vllm true "
                    "for vLLM)")
    assert choose(["--static_decode", "true"])[1:] == (False, True)
    kept = {
        "MoE experts (their loops do not capture": choose([], model=moe),
        "static decode off: mode lora: vLLM where it is installed": choose([], mode="lora"),
        "static decode off: mode qlora: vLLM where it is installed": choose([], mode="qlora"),
        "static decode off: top_p=0.9": choose(["--top_p", "0.9"]),
        "vLLM options set (vllm_gpu_memory_utilization)": choose(["--vllm_gpu_memory_utilization", "0.3"]),
        "pass 80% of the GPU's 0 GiB; vLLM sleeps while the policy trains": choose([], total=2**20),
    }
    for why, (line, vllm, static) in kept.items():
        assert line.startswith("rollouts: vLLM colocate") and why in line and vllm and not static, (why, line)
    # The decoder's cache is sized for --max_prompt_tokens where given (as the memory plan sizes it), 512 if not:
    # a GPU with room for 512-token prompts but not for 64k-token ones keeps vLLM for the latter only.
    from trainbox.training import modelfacts

    facts = modelfacts.model_facts(str(tiny_model))
    _, args, _ = parsed([*base, "--model_name_or_path", str(tiny_model)])
    room = int((16 * facts.params + grpo_rollouts.decoder_bytes(args, facts, 2048)) / grpo_rollouts.STATIC_FITS)
    assert choose(["--max_prompt_tokens", "1024"], total=room)[1:] == (False, True)
    assert choose(["--max_prompt_tokens", "65536"], total=room)[1:] == (True, None)
    # The training state is the memory plan's (memplan.resident): a KL reference model (beta > 0) adds 4 bytes a
    # parameter, an 8-bit optimizer's states take 2 instead of 8.
    assert choose(["--max_prompt_tokens", "2048", "--beta", "0.04"], total=room)[1:] == (True, None)
    assert choose(["--max_prompt_tokens", "2048", "--beta", "0.04"], total=room + int(4 * facts.params / 0.8) + 1)[1:] \
        == (False, True)
    tight = room - int(6 * facts.params / 0.8)
    assert choose(["--max_prompt_tokens", "2048"], total=tight)[1:] == (True, None)
    assert choose(["--max_prompt_tokens", "2048", "--optim", "adamw_8bit"], total=tight + 1)[1:] == (False, True)
    for argv in (["--static_decode", "false"], ["--use_vllm", "true"]):
        line, vllm, static = choose(argv)
        assert line.startswith("rollouts: vLLM colocate") and "static decode off" not in line and vllm and not static


ENGINE_AGREE = r'''
import importlib.util, json, os, sys
import torch, torch.distributed as dist
sys.path.insert(0, os.environ["ROOT"])
dist.init_process_group("gloo")
from trainbox.cli import grpo
from trainbox.training.grpo import options as grpo_options, rollouts as grpo_rollouts
rank = dist.get_rank()
script, _, raw, model_args = grpo.parse(["--model_name_or_path", os.environ["MODEL"], "--num_generations", "4",
                                         "--per_device_train_batch_size", "4", "--bf16", "false"])
args = grpo_options.finalize(raw, 2)
total = int(os.environ["TOTALS"].split(",")[rank])  # this rank's GPU, as torch would report it
real = importlib.util.find_spec
importlib.util.find_spec = lambda n, *a: object() if n == "vllm" else real(n, *a)
torch.cuda.is_available = lambda: True
torch.cuda.mem_get_info = lambda *a: (total, total)
line = grpo_rollouts.resolve_rollouts(args, None, script, "full", model_args)
open(os.environ["OUT"] + f".{rank}", "w").write(json.dumps([line, args.use_vllm, script.static_decode]))
dist.destroy_process_group()
'''


def test_ranks_with_different_gpus_pick_one_rollout_engine(tiny_model, tmp_path):
    """vLLM installed, two ranks whose GPUs differ (80 GiB and 1 MiB): alone, rank 0 would decode statically and
    rank 1 start colocated vLLM, whose collectives would then wait forever for rank 0. Agreed (memplan.agree), rank 0
    judges the smallest GPU of the job and both ranks get vLLM, with the same line."""
    env = dict(os.environ, ROOT=str(ROOT), MODEL=str(tiny_model), TOTALS=f"{80 * 2**30},{2**20}")
    got = [json.loads(text) for text in gloo_ranks.run(ENGINE_AGREE, tmp_path, env, name="engine")]
    for line, vllm, static in got:  # (vLLM's share stays each rank's own: sized from its own GPU)
        assert vllm and not static and line.startswith("rollouts: vLLM colocate"), line
        why = line[line.index("static decode off: "):]
        assert why == ("static decode off: the policy's training state and a decoder copy (0 GiB) pass 80% of the "
                       "smallest GPU's 0 GiB (of 2 ranks); vLLM sleeps while the policy trains)"), why


def test_a_failure_inside_the_vllm_we_chose_says_how_to_go_without_it(monkeypatch, tmp_path):
    """vLLM chosen by us (installed, a GPU) and failing inside its own code as the trainer starts its engine (seen on
    an H100: gpt-oss's MoE op missing from a vLLM whose MoE extension was left out): the error carries a note naming
    `--use_vllm false`. Not when the user asked for vLLM, nor for an error from elsewhere."""
    import importlib.util

    fake = tmp_path / "site-packages" / "vllm" / "engine_fake.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("def start():\n    raise AttributeError(\"'_OpNamespace' '_moe_C' object has no attribute "
                    "'topk_softmax'\")\n")
    spec = importlib.util.spec_from_file_location("engine_fake", fake)
    engine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(engine)

    class EngineFails:
        def __init__(self, **kw):
            engine.start()

    class ModelFails:
        def __init__(self, **kw):
            raise AttributeError("not vLLM's")

    def build(argv, cls):
        monkeypatch.setattr(grpo_trainer, "trainer_class", lambda *bases: cls)
        _, args, model_args = parsed(["--num_generations", "4", "--per_device_train_batch_size", "4", *argv])
        if "--use_vllm" not in argv:
            args.use_vllm = True  # what resolve_rollouts chooses with vllm installed and a GPU
        with pytest.raises(AttributeError) as caught:
            grpo_trainer.build_trainer(args, model_args, "full", [], None, None)
        return getattr(caught.value, "__notes__", [])

    notes = build([], EngineFails)
    assert len(notes) == 1 and "`--use_vllm false` generates with transformers" in notes[0], notes
    assert build(["--use_vllm", "true"], EngineFails) == []
    assert build([], ModelFails) == []
    assert build(["--use_vllm", "false"], EngineFails) == []


@pytest.mark.parametrize("kwargs, regex, kept, note", [
    ({}, None, {"detokenize": False}, ", no detokenizing (TRL decodes the ids)"),
    ({"min_tokens": 4}, None, {"min_tokens": 4, "detokenize": False}, ", no detokenizing (TRL decodes the ids)"),
    ({"stop": ["</answer>"]}, None, {"stop": ["</answer>"]}, ", detokenizing (stop strings / structured outputs)"),
    ({}, r"\d+", {}, ", detokenizing (stop strings / structured outputs)"),
    ({"structured_outputs": {"regex": "a"}}, None, {"structured_outputs": {"regex": "a"}},
     ", detokenizing (stop strings / structured outputs)"),
    ({"detokenize": True}, None, {"detokenize": True}, ""),
])
def test_colocated_vllm_detokenizes_only_where_text_is_needed(kwargs, regex, kept, note):
    """vLLM refuses stop strings without detokenizing; structured outputs and the user's own choice are kept."""
    from types import SimpleNamespace

    args = SimpleNamespace(generation_kwargs=dict(kwargs), vllm_structured_outputs_regex=regex)
    assert grpo_rollouts.skip_detokenizing(args) == note
    assert (args.generation_kwargs or {}) == kept


def test_detokenizing_choice_is_fuzzed():
    """Any generation_kwargs: no exception; detokenize is only ever added as False, never where stop strings or
    structured outputs need text, and nothing the user set is changed."""
    from types import SimpleNamespace

    from hypothesis import given, settings, strategies as st

    values = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=5), st.lists(st.text(max_size=3)))
    keys = st.one_of(st.sampled_from(["stop", "detokenize", "structured_outputs", "min_tokens", "seed"]), st.text())

    @settings(max_examples=300, deadline=None)
    @given(st.dictionaries(keys, values, max_size=4), st.one_of(st.none(), st.text(max_size=4)))
    def check(kwargs, regex):
        args = SimpleNamespace(generation_kwargs=dict(kwargs), vllm_structured_outputs_regex=regex)
        note = grpo_rollouts.skip_detokenizing(args)
        added = {k: v for k, v in args.generation_kwargs.items() if k not in kwargs}
        assert {k: args.generation_kwargs[k] for k in kwargs} == kwargs
        assert added in ({}, {"detokenize": False})
        if added:
            assert not kwargs.get("stop") and "structured_outputs" not in kwargs and not regex
            assert note == ", no detokenizing (TRL decodes the ids)"

    check()


def test_gsm8k_preset_builds_the_notebooks_prompts(tiny_model, gsm8k_file):
    script, _, _ = parsed(["--dataset", str(gsm8k_file), "--preset", "gsm8k", "--num_generations", "4",
                               "--per_device_train_batch_size", "4"])
    refs = grpo_data.reward_refs(script)
    ds = grpo_data.prepare_dataset(script, refs, [rewards.load(r) for r in refs])
    row, src = ds[0], gsm8k_rows(16)[0]
    assert row["prompt"] == [{"role": "system", "content": rewards.SYSTEM_PROMPT},
                             {"role": "user", "content": src["question"]}]
    assert row["answer"] == src["answer"].split("#### ")[1]


def test_gsm8k_preset_reads_verl_parquet(tmp_path):
    import pandas as pd

    # verl's examples/data_preprocess/gsm8k.py row shape.
    rows = [{
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"What is {i} + {i}? Let's think step by step and output the final "
                                               "answer after \"####\"."}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
        "extra_info": {"split": "train", "index": i, "question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"},
    } for i in range(4)]
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    script, _, _ = parsed(["--dataset", str(tmp_path), "--preset", "gsm8k", "--num_generations", "4",
                           "--per_device_train_batch_size", "4"])
    refs = grpo_data.reward_refs(script)
    ds = grpo_data.prepare_dataset(script, refs, [rewards.load(r) for r in refs])
    assert ds[3]["answer"] == "6"
    assert ds[3]["prompt"][0] == {"role": "system", "content": rewards.SYSTEM_PROMPT}
    assert ds[3]["prompt"][-1]["content"].startswith("What is 3 + 3?")


def test_long_prompts_are_dropped_not_cut(tiny_model, capsys):
    import datasets

    ds = datasets.Dataset.from_list([{"prompt": "one two"}, {"prompt": " ".join(["clips"] * 50)}, {"prompt": "3 4"}])
    kept = grpo_data.drop_long_prompts(ds, str(tiny_model), 10)
    assert kept["prompt"] == ["one two", "3 4"]
    assert "dropped 1 of 3 prompts" in capsys.readouterr().out
    with pytest.raises(UsageError, match="every prompt is longer"):
        grpo_data.drop_long_prompts(ds, str(tiny_model), 1)


# ---------------------------------------------------------------- real runs on CPU


def test_gsm8k_end_to_end_with_default_output_artifacts_and_tensorboard(tiny_model, gsm8k_file, tmp_path):
    out, art = tmp_path / "outputs", tmp_path / "artifacts"
    r = run_grpo(["--model_name_or_path", tiny_model, "--dataset", gsm8k_file, "--preset", "gsm8k",
                  "--max_steps", "2", "--save_steps", "2", *FAST, "--report_to", "tensorboard"],
                 cwd=tmp_path, env={"OUTPUT_DIR": str(out), "SAKURA_ARTIFACT_DIR": str(art)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rollouts: transformers generate (auto: vllm not installed)" in r.stdout
    # SDPA (CPU) keeps TRL's padded policy forward (test_padding_free_* check the packed one against TRL's).
    assert "grpo: policy forward: padded rows (TRL's)" in r.stdout
    summary = [line for line in r.stdout.splitlines() if line.startswith("[trainbox] grpo done:")]
    assert summary and "steps 2/2" in summary[0] and f"outputs {out}" in summary[0] and "tokens/s" in summary[0]
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert (art / "outputs" / "model.safetensors").is_file()
    assert list((out / "runs").rglob("events.out.tfevents.*")), "report_to tensorboard wrote no event file"
    logged = [h for h in log_history(out) if "reward" in h]
    assert len(logged) == 2
    for name in ("xmlcount", "soft_format", "strict_format", "int_format", "correctness"):
        assert f"rewards/{name}/mean" in logged[0]


@pytest.mark.parametrize("mode, weights", [("lora", "float32, LoRA adapters"), ("qlora", "4-bit nf4")])
def test_lora_and_qlora(tiny_model, gsm8k_file, tmp_path, mode, weights):
    out = tmp_path / "out"
    r = run_grpo(["--model_name_or_path", tiny_model, "--dataset", gsm8k_file, "--preset", "gsm8k",
                  "--mode", mode, "--max_steps", "1", "--output_dir", out, *FAST], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    loaded = [line for line in r.stdout.splitlines() if "grpo: loaded:" in line]
    assert loaded and weights in loaded[0] and "LoRA adapters" in loaded[0], r.stdout
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert not (out / "model.safetensors").exists()
    assert json.loads((out / "adapter_config.json").read_text())["peft_type"] == "LORA"


TOY_REWARD = '''
def digit_share(completions, **kwargs):
    """Share of the completion's characters that are digits: the policy can learn to emit digit tokens."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]
'''


@pytest.mark.parametrize("decoder", ["transformers generate", "static-cache decode"])
def test_reward_rises_on_a_learnable_toy_task(tiny_model, tmp_path, decoder):
    # The random tiny Llama emits a digit token ~5% of the time; GRPO with a high learning rate makes it ~3x more
    # frequent within 30 steps (seeds 0-6 measured: first-10 mean 0.046-0.063, last-10 mean 0.123-0.177). With the
    # static decoder (on CPU only when asked) the rise also shows its copy of the weights follows the policy.
    (tmp_path / "toy_reward.py").write_text(TOY_REWARD)
    data = write_jsonl(tmp_path / "toy.jsonl", [{"prompt": f"Count: {i}"} for i in range(64)])
    out = tmp_path / "out"
    r = run_grpo(["--model_name_or_path", tiny_model, "--dataset", data, "--reward_funcs",
                  "toy_reward.py:digit_share", "--max_steps", "30", "--num_generations", "8",
                  "--per_device_train_batch_size", "8", "--max_completion_length", "8", "--learning_rate", "5e-3",
                  "--logging_steps", "1", "--save_steps", "30", "--seed", "1", "--bf16", "false",
                  "--disable_tqdm", "true", "--report_to", "none", "--output_dir", out,
                  "--static_decode", str(decoder.startswith("static"))], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"rollouts: {decoder}" in r.stdout and "static decode off" not in r.stderr
    rewards_per_step = [h["reward"] for h in log_history(out) if "reward" in h]
    assert len(rewards_per_step) == 30
    first, last = statistics.mean(rewards_per_step[:10]), statistics.mean(rewards_per_step[-10:])
    assert last > first + 0.03, rewards_per_step


def test_sigterm_saves_a_checkpoint_and_the_next_run_resumes(tiny_model, gsm8k_file, tmp_path):
    out, log = tmp_path / "out", tmp_path / "run.log"
    argv = ["--model_name_or_path", tiny_model, "--dataset", gsm8k_file, "--preset", "gsm8k",
            "--output_dir", out, "--save_steps", "1000", *FAST]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "trainbox", "grpo", *map(str, argv), "--max_steps", "500"],
                                cwd=tmp_path, env=env, stdout=fh, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 300
            while "'loss'" not in log.read_text():  # a step has been logged: training is under way
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "no training step within 300 s"
                time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert rc == 0, text[-3000:]
    assert "got signal SIGTERM" in text and "grpo preempted (checkpoint saved)" in text
    ckpts = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert len(ckpts) == 1 and 1 <= ckpts[0] < 500, ckpts
    step = ckpts[0]
    assert (out / f"checkpoint-{step}" / "trainer_state.json").is_file()
    assert not (out / "model.safetensors").exists()  # preempted: the final model isn't written

    r = run_grpo([*argv, "--max_steps", step + 2], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming from {out / f'checkpoint-{step}'}" in r.stdout
    assert f"steps {step + 2}/{step + 2} (this run 2)" in r.stdout
    assert (out / "model.safetensors").is_file()


def test_two_processes_through_torchrun(tiny_model, gsm8k_file, tmp_path):
    # 2 prompts x 2 processes = one group of 4: valid only because both processes count (1 alone would be refused).
    out = tmp_path / "out"
    r = run_grpo(["--model_name_or_path", tiny_model, "--dataset", gsm8k_file, "--preset", "gsm8k",
                  "--nproc_per_node", "2", "--max_steps", "2", "--output_dir", out, *FAST,
                  "--per_device_train_batch_size", "2"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "torchrun nnodes=1 nproc_per_node=2" in r.stdout
    assert "2 process(es)" in r.stdout
    assert "steps 2/2" in r.stdout and (out / "model.safetensors").is_file()


def test_colocated_vllm_share_is_sized_from_the_gpu():
    from trainbox.training.grpo.rollouts import rollout_memory_share

    gib = 2**30
    assert rollout_memory_share(141 * gib)[0] == 0.17  # H200: 24 GiB of 141
    assert rollout_memory_share(80 * gib)[0] == 0.3  # H100
    assert rollout_memory_share(24 * gib)[0] == 0.5  # a 24 GiB card: at most half for rollouts
    assert rollout_memory_share(1000 * gib)[0] == 0.15  # floor


def test_checkpointing_is_chosen_for_full_and_left_to_trl_for_adapters(tiny_model, gsm8k_file, tmp_path):
    """TRL turns checkpointing on for GRPO; full fine-tuning decides from the memory estimate (CPU: off, memory is
    not the limit), lora/qlora keep TRL's choice, and the user's flag wins."""
    from trainbox.cli.grpo import parse
    from trainbox.training.grpo.options import finalize
    from trainbox.training.grpo.trainer import choose_checkpointing
    from trainbox.training.modelfacts import model_facts

    facts = model_facts(str(tiny_model))

    def decide(mode, *extra):
        script, _launch, raw, model_args = parse(["--model_name_or_path", str(tiny_model), "--dataset", str(gsm8k_file),
                                                  "--preset", "gsm8k", "--output_dir", str(tmp_path), *extra])
        args = finalize(raw, 1)
        args.use_vllm = False
        return choose_checkpointing(args, model_args, mode, None, facts), args.gradient_checkpointing

    line, on = decide("full")
    assert (line, on) == ("gradient checkpointing off (CPU: memory is not the limit)", False)
    assert decide("lora") == ("gradient checkpointing on (lora: TRL's default)", True)
    assert decide("full", "--gradient_checkpointing", "true") == ("gradient checkpointing on (set by you)", True)


def test_static_decode_with_vllm_is_one_usage_error(monkeypatch):
    script, args, _ = parsed(["--num_generations", "4", "--per_device_train_batch_size", "4", "--use_vllm", "true",
                              "--static_decode", "true"])
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "vllm" else real_find_spec(n, *a))
    with pytest.raises(UsageError, match="static_decode=true stands in for transformers' generate, but vLLM "
                                         "generates here .use_vllm set.; drop static_decode, or set --use_vllm false"):
        grpo_rollouts.resolve_rollouts(args, None, script, "full")


def test_static_decoder_rollouts_and_their_fallback_to_transformers(tiny_model, tmp_path, monkeypatch, capsys):
    """The trainer with the static decoder mixin: completions come from the decoder (built once, synced when the
    step changed); a decode step that does not compile hands this and every later rollout to TRL's generate, said
    once."""
    import datasets
    from trl import GRPOConfig

    from trainbox.training.grpo import static_decode

    args = GRPOConfig(output_dir=str(tmp_path), num_generations=2, per_device_train_batch_size=4,
                      max_completion_length=5, bf16=False, report_to="none", use_cpu=True, seed=0,
                      model_init_kwargs={"attn_implementation": "sdpa", "dtype": "float32"})
    trainer = grpo_trainer.trainer_class(False, True)(
        model=str(tiny_model), reward_funcs=lambda completions, **k: [0.0] * len(completions), args=args,
        train_dataset=datasets.Dataset.from_list([{"prompt": "a b"}] * 4))
    prompts = [[5, 6, 7], [8, 9]]
    out, logprobs = trainer._generate_single_turn(prompts, None, {}, 2)
    assert logprobs is None and len(out) == 2 and all(1 <= len(c) <= 5 for c in out)
    first = trainer._decoder
    synced = []
    monkeypatch.setattr(first, "sync", lambda policy: synced.append(policy))
    trainer._generate_single_turn(prompts, None, {}, 2)
    assert synced == [] and trainer._decoder is first  # same step: no sync
    trainer.state.global_step += 1
    trainer._generate_single_turn(prompts, None, {}, 2)
    assert len(synced) == 1 and trainer._decoder is first

    def not_compiled(self, prompts):
        raise static_decode.StepNotCompiled("RuntimeError: a host copy during capture")

    monkeypatch.setattr(static_decode.StaticDecoder, "generate", not_compiled)
    capsys.readouterr()
    for _ in range(2):
        out, logprobs = trainer._generate_single_turn(prompts, None, {}, 2)
        assert logprobs is None and len(out) == 2  # TRL's own transformers generate
    err = capsys.readouterr().err
    assert err.count("static decode off (its decode step did not compile: RuntimeError: a host copy during "
                     "capture): transformers generate") == 1, err
    assert trainer._decoder is None


def test_the_memory_plan_counts_the_static_decoder(tiny_model, gsm8k_file, tmp_path, monkeypatch):
    """The static decoder's bfloat16 weights and cache come out of the memory the policy's plan may use."""
    from trainbox.cli.grpo import parse
    from trainbox.training import memplan, modelfacts, speed
    from trainbox.training.grpo import static_decode, trainer as grpo_trainer
    from trainbox.training.grpo.options import finalize

    facts = modelfacts.model_facts(str(tiny_model))
    seen = []
    monkeypatch.setattr(memplan, "free_memory", lambda: 40 * 2**30)
    monkeypatch.setattr(speed, "choose_memory", lambda args, facts, **kw: (seen.append(kw["free"]) or ("plan",)))
    _s, _l, raw, model_args = parse(["--model_name_or_path", str(tiny_model), "--dataset", str(gsm8k_file),
                                     "--preset", "gsm8k", "--output_dir", str(tmp_path), "--max_completion_length",
                                     "300", "--per_device_train_batch_size", "8", "--num_generations", "8"])
    args = finalize(raw, 1)
    args.use_vllm = False
    for decoder in (False, True):
        grpo_trainer.choose_checkpointing(args, model_args, "full", 700, facts, static_decode=decoder)
    rows = 8 * args.steps_per_generation
    want = 2 * facts.params + rows * (1024 + 300) * facts.layers * 2 * facts.attn_width * 2
    assert static_decode.memory_bytes(facts.params, facts.layers, facts.attn_width, rows, 700, 300) == want
    assert seen == [40 * 2**30, 40 * 2**30 - want]


def test_colocated_sleep_mode_follows_the_memory_plan(tiny_model, gsm8k_file, tmp_path):
    """Sleeping costs colocated vLLM a weight reload every step (0.95x TRL with it, 1.05x without, one H100): off
    where the plan kept checkpointing off beside vLLM's share, on where it had to save memory or made no plan, and
    the user's choice is kept."""
    from trainbox.cli.grpo import parse
    from trainbox.training.grpo.options import finalize
    from trainbox.training.grpo.trainer import choose_sleep_mode

    def args_for(*extra, ckpt=False):
        _s, _l, raw, _m = parse(["--model_name_or_path", str(tiny_model), "--dataset", str(gsm8k_file), "--preset",
                                 "gsm8k", "--output_dir", str(tmp_path), *extra])
        args = finalize(raw, 1)
        args.use_vllm, args.vllm_mode, args.vllm_enable_sleep_mode = True, "colocate", True
        args.gradient_checkpointing = ckpt
        return args

    fast = args_for()
    assert choose_sleep_mode(fast, planned=True) == "; vLLM sleep mode off (training fits beside its share)"
    assert fast.vllm_enable_sleep_mode is False
    tight = args_for(ckpt=True)
    assert choose_sleep_mode(tight, planned=True) == "; vLLM sleep mode on (the plan saves memory)"
    assert tight.vllm_enable_sleep_mode is True
    unplanned = args_for()
    assert choose_sleep_mode(unplanned, planned=False) == "; vLLM sleep mode on (no memory plan here)"
    assert unplanned.vllm_enable_sleep_mode is True
    mine = args_for("--vllm_enable_sleep_mode", "true")
    assert choose_sleep_mode(mine, planned=True) == "" and mine.vllm_enable_sleep_mode is True
    server = args_for()
    server.vllm_mode = "server"
    assert choose_sleep_mode(server, planned=True) == ""


# ---------------------------------------------------------------- padding-free policy forward


@pytest.fixture(scope="module")
def scoring_trainer(tiny_model, tmp_path_factory):
    """A real (padding-free) GRPOTrainer on the tiny Llama: TRL's fused LM head is on the model as in training."""
    import datasets
    from trl import GRPOConfig

    from trainbox.training.grpo.padding_free import PaddingFreeGRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path_factory.mktemp("pf")), num_generations=2, per_device_train_batch_size=4,
                      max_completion_length=8, bf16=False, report_to="none", use_cpu=True,
                      model_init_kwargs={"attn_implementation": "sdpa", "dtype": "float32"})
    return PaddingFreeGRPOTrainer(model=str(tiny_model), reward_funcs=lambda completions, **k: [0.0] * len(completions),
                                  args=args, train_dataset=datasets.Dataset.from_list([{"prompt": "a b"}] * 4))


def scoring_batch(trainer):
    """TRL's layout: prompts left-padded, completions right-padded; every row's prompt and completion differ in length
    (one completion empty, as mask_truncated_completions leaves a truncated one)."""
    import torch

    prompts = [[5, 17, 33], [8, 9, 10, 11, 12, 13, 40], [21], [7, 7, 30, 31, 32]]
    completions = [[44, 45, 46, 47, 48], [50, 51], [60, 61, 62, 63, 64, 65, 66], []]
    pad = trainer.processing_class.pad_token_id
    p, c = max(map(len, prompts)), max(map(len, completions))
    ids = torch.tensor([[pad] * (p - len(a)) + a + b + [pad] * (c - len(b)) for a, b in zip(prompts, completions)])
    mask = torch.tensor([[0] * (p - len(a)) + [1] * (len(a) + len(b)) + [0] * (c - len(b))
                         for a, b in zip(prompts, completions)])
    return ids, mask, mask[:, p:], c


@pytest.mark.parametrize("chunk", [None, 3])  # TRL chunks rows by per_device_train_batch_size when scoring
def test_padding_free_logps_and_entropies_match_the_padded_forward(scoring_trainer, chunk):
    import torch
    from trl import GRPOTrainer

    trainer = scoring_trainer
    model = trainer.model
    ids, mask, completion_mask, k = scoring_batch(trainer)
    keep = completion_mask.bool()

    def score(method):
        model.zero_grad()
        logps, ents, _ = method(trainer, model, ids, mask, k, batch_size=chunk, compute_entropy=True)
        (logps * completion_mask).sum().backward()  # the loss only sees completion positions
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        return logps.detach(), ents.detach(), grads

    padded = score(GRPOTrainer._get_per_token_logps_and_entropies)
    packed = score(type(trainer)._get_per_token_logps_and_entropies)
    assert padded[0].shape == packed[0].shape == (4, k)
    torch.testing.assert_close(packed[0][keep], padded[0][keep], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(packed[1][keep], padded[1][keep], rtol=1e-4, atol=1e-4)
    # Padding positions: 0, as TRL's fused head gives them (masked by the loss anyway).
    assert not packed[0][~keep].any() and not packed[1][~keep].any()
    assert (packed[0][keep] < 0).all()  # real log-probs, not the zeros of an unscored position
    for a, b in zip(packed[2], padded[2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_padding_free_falls_back_to_trl_where_it_cannot_pack(scoring_trainer, monkeypatch):
    """Multimodal inputs and rows whose real tokens are not one run go to TRL's own padded method."""
    import torch
    from trl import GRPOTrainer

    from trainbox.training.grpo.padding_free import packable

    calls = []
    real = GRPOTrainer._get_per_token_logps_and_entropies
    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies",
                        lambda self, *a, **k: calls.append(k) or real(self, *a, **k))
    ids, mask, _, k = scoring_batch(scoring_trainer)
    model = scoring_trainer.model
    with torch.no_grad():
        scoring_trainer._get_per_token_logps_and_entropies(model, ids, mask, k)
        assert calls == []  # packed: TRL's method not called
        holed = mask.clone()
        holed[1, -k] = 0  # a hole inside row 1's completion
        assert not packable(holed, k) and packable(mask, k)
        scoring_trainer._get_per_token_logps_and_entropies(model, ids, holed, k)
        scoring_trainer._get_per_token_logps_and_entropies(model, ids, mask, k, token_type_ids=torch.zeros_like(ids))
    assert len(calls) == 2 and calls[1]["token_type_ids"] is not None


def test_policy_forward_choice(tiny_model, gsm8k_file, monkeypatch):
    import torch

    from trainbox.training import attention

    def decide(*extra, gpu=False, runs=()):
        script, args, model_args = parsed(["--model_name_or_path", str(tiny_model), "--dataset", str(gsm8k_file),
                                           "--num_generations", "4", "--per_device_train_batch_size", "4", *extra])
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
        args.use_cpu = not gpu  # parsed here without a GPU, the config says CPU
        # attention.choose's own decision on a pretend sm90 GPU where only the kernels in `runs` work.
        monkeypatch.setattr(attention, "choose", lambda req=None, info=None, model=None: attention.decide(
            {"attention_backend": "fa3"}, (9, 0) if gpu else None, lambda n: None if n in runs else "absent", req,
            model=model))
        lines = grpo_trainer.choose_policy_forward(script, args, model_args)
        monkeypatch.undo()
        return script.padding_free, model_args.attn_implementation, lines[-1]

    assert decide() == (False, "sdpa", f"policy forward: padded rows (TRL's): sdpa: {attention.UNPACKED_WHY}")
    on, impl, line = decide(gpu=True, runs=("varlen",))
    assert (on, impl) == (True, attention.VARLEN) and line.endswith("the kernel keeps packed sequences apart")
    on, impl, line = decide(gpu=True)
    assert (on, impl) == (False, "sdpa") and "padded rows (TRL's)" in line
    assert decide("--padding_free", "false")[0] is False
    assert decide("--attn_implementation", "flash_attention_2", gpu=True)[:2] == (True, "flash_attention_2")


# ------------------------------------------------------- vLLM's importance-sampling ratio from the loss forward


def ratio_trainer(tiny_model, tmp_path, **config):
    """Our GRPO trainer class (the ratio mixin over the padding-free trainer) on the tiny Llama, generating with
    transformers but made to look like vLLM to TRL: vLLM's per-token logprobs are the trainer's own plus noise (one
    NaN, as vLLM gives for a token it could not score)."""
    import datasets
    import torch
    from trl import GRPOConfig

    args = GRPOConfig(output_dir=str(tmp_path), num_generations=2, per_device_train_batch_size=4,
                      max_completion_length=6, bf16=False, report_to="none", use_cpu=True, seed=0,
                      model_init_kwargs={"attn_implementation": "sdpa", "dtype": "float32"}, **config)
    cls = grpo_trainer.trainer_class(padding_free=True)
    trainer = cls(model=str(tiny_model), reward_funcs=lambda completions, **k: [float(len(c)) for c in completions],
                  args=args, train_dataset=datasets.Dataset.from_list([{"prompt": "a b"}] * 4))
    real = trainer._generate

    def generate_like_vllm(prompts):
        trainer.use_vllm = False
        try:
            out = list(real(prompts))
        finally:
            trainer.use_vllm = True
        g = torch.Generator().manual_seed(1)
        noisy = []
        with torch.no_grad():
            for prompt, completion in zip(out[0], out[1], strict=True):
                logits = trainer.model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
                own = logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]
                noisy.append((own + 0.4 * torch.randn(len(completion), generator=g)).tolist())
        noisy[0][0] = float("nan")
        out[4] = noisy  # sampling_per_token_logps_list
        return tuple(out)

    trainer._generate = generate_like_vllm
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    return trainer


@pytest.mark.parametrize("mode", ["sequence_mask", "token_truncate"])
def test_vllm_ratio_from_the_loss_forward_equals_trls_extra_forward(tiny_model, tmp_path, mode):
    """TRL's own path (an old-policy forward at generation, its ratio code) and ours (no extra forward; the ratio from
    the loss forward) give the same ratio, loss, gradients and sampling/* metrics when the weights did not change."""
    import torch
    from trl import GRPOTrainer

    from trainbox.training.grpo.padding_free import PaddingFreeGRPOTrainer

    trainer = ratio_trainer(tiny_model, tmp_path, vllm_importance_sampling_mode=mode,
                            vllm_importance_sampling_clip_min=0.7 if mode == "token_truncate" else None,
                            vllm_importance_sampling_clip_max=1.4)
    assert trainer._ratio_from_loss()
    model, rows = trainer.model, [{"prompt": "a b"}] * 4
    forwards = []
    real_forward = PaddingFreeGRPOTrainer._get_per_token_logps_and_entropies

    def counted(self, *a, **k):
        forwards.append(torch.is_grad_enabled())
        return real_forward(self, *a, **k)

    def run(generate_and_score, compute_loss):
        torch.manual_seed(0)
        model.train()  # TRL files metrics under the model's mode
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which isn't running here
        trainer._metrics["train"].clear()
        forwards.clear()
        batch = generate_and_score(rows)
        model.zero_grad()
        loss = compute_loss(model, batch)
        loss.backward()
        metrics = {k: v for k, v in trainer._metrics["train"].items() if k.startswith("sampling/")}
        return batch, loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None], \
            metrics, list(forwards)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(PaddingFreeGRPOTrainer, "_get_per_token_logps_and_entropies", counted)
        theirs = run(lambda r: GRPOTrainer._generate_and_score_completions(trainer, r),
                     lambda m, b: GRPOTrainer._compute_loss(trainer, m, b))
        ours = run(trainer._generate_and_score_completions, trainer._compute_loss)
    torch.testing.assert_close(theirs[0]["completion_ids"], ours[0]["completion_ids"], rtol=0, atol=0)
    assert "old_per_token_logps" in theirs[0] and "old_per_token_logps" not in ours[0]
    assert theirs[4] == [False, True] and ours[4] == [True]  # the extra no-grad forward is gone
    torch.testing.assert_close(ours[0]["importance_sampling_ratio"], theirs[0]["importance_sampling_ratio"])
    assert ours[0]["importance_sampling_ratio"].shape == theirs[0]["importance_sampling_ratio"].shape
    torch.testing.assert_close(ours[1], theirs[1])
    for a, b in zip(ours[2], theirs[2], strict=True):
        torch.testing.assert_close(a, b)
    assert ours[3].keys() == theirs[3].keys() and len(ours[3]) == 5
    for k in ours[3]:
        assert ours[3][k] == pytest.approx(theirs[3][k], rel=1e-5, abs=1e-6), k


def test_vllm_ratio_keeps_trls_forward_where_weights_may_change(tiny_model, tmp_path):
    """A generation batch spread over two optimizer steps (steps_per_generation 2 > gradient_accumulation_steps 1)
    is scored by weights that changed since it was generated: TRL's old-policy forward stays, as does VESPO's."""
    later = ratio_trainer(tiny_model, tmp_path / "a", steps_per_generation=2)
    assert not later._ratio_from_loss()
    batch = later._generate_and_score_completions([{"prompt": "a b"}] * 4)
    assert "old_per_token_logps" in batch and "importance_sampling_ratio" in batch
    from trainbox.training.grpo.trainer import describe_ratio

    assert "TRL's old-policy forward" in describe_ratio(later)
    same = ratio_trainer(tiny_model, tmp_path / "b")
    assert "from the loss forward" in describe_ratio(same)
    same.loss_type = "vespo"
    assert not same._ratio_from_loss()
