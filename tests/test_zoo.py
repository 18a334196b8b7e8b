"""The model zoo on CPU: for every architecture in tests/zoo.py the attention choice sees what the model needs
(windows, softcaps, sinks), the chosen kernel gives eager's logits, and sft (with a resume), qlora and grpo each train
it and write a model that loads. The GPU half (every kernel trainbox may pick, packed/padded/single rows against
eager in bf16) is tests/gpu/zoo_logits.py."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sidebyside
from test_data import write_dolly, write_messages
from test_grpo import gsm8k_rows, write_jsonl
from trainbox.training import attention, modelfacts
from zoo import WINDOW, ZOO, expected_features, make_zoo_model

ROOT = Path(__file__).resolve().parents[1]
NAMES = list(ZOO)


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory):
    base = tmp_path_factory.mktemp("zoo")
    for name in NAMES:
        make_zoo_model(base / name, name)
    return base


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("zoo-data")
    return {"chat": write_messages(d / "chat.jsonl", 16), "dolly": write_dolly(d / "dolly.jsonl", 16),
            "gsm8k": write_jsonl(d / "gsm8k.jsonl", gsm8k_rows(8))}


# ---------------------------------------------------------------- the choice sees the model


@pytest.mark.parametrize("name", NAMES)
def test_needs_reads_every_feature_from_the_saved_model(zoo_dir, name):
    facts = modelfacts.model_facts(str(zoo_dir / name))
    assert facts.attention.features() == expected_features(name)
    if "window" in expected_features(name):
        assert facts.attention.window == WINDOW


@pytest.mark.parametrize("name", NAMES)
def test_mfu_counts_the_flops_a_forward_runs(zoo_dir, name):
    """The summary line's FLOPs per token (throughput.flops_per_token) against PyTorch's own count of a forward
    (FlopCounterMode), x3 for forward + backward. Rows of one token leave only the matmuls, where an MoE token runs its
    top-k experts. Windowed layers: within the window they count as full ones, past it less."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    from trainbox.run import throughput

    facts = modelfacts.model_facts(str(zoo_dir / name))
    # eager experts: a loop of plain matmuls over each expert's tokens, which FlopCounterMode counts (grouped_mm it
    # does not)
    model = AutoModelForCausalLM.from_pretrained(zoo_dir / name, dtype=torch.float32, attn_implementation="eager",
                                                 experts_implementation="eager")
    rows = 64
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(input_ids=torch.randint(3, 90, (rows, 1)))
    counted = 3 * counter.get_total_flops() / rows
    ours = throughput.flops_per_token(facts, [1] * rows)
    # biases and sinks are parameters no matmul runs: within 3 %
    assert ours == pytest.approx(counted, rel=0.03), (name, ours, counted, facts)
    if facts.experts:
        assert facts.active_matmul_params < facts.matmul_params  # idle experts are not counted
    long = 4 * WINDOW
    dense = throughput.flops_per_token(facts, [long])
    if facts.windowed_layers:
        unwindowed = dataclasses.replace(facts, windowed_layers=0)
        assert dense < throughput.flops_per_token(unwindowed, [long])
        # within the window a windowed layer is a full one
        assert throughput.flops_per_token(facts, [WINDOW]) == throughput.flops_per_token(unwindowed, [WINDOW])
    assert ("window" in expected_features(name)) == bool(facts.windowed_layers)


@pytest.mark.parametrize("name", NAMES)
def test_no_kernel_that_drops_a_feature_is_picked(zoo_dir, name):
    """On a pretend sm90 where every kernel runs, and where only some do: the pick honours all the model needs, and
    each kernel passed over for the model says which feature it would drop."""
    needs = modelfacts.model_facts(str(zoo_dir / name)).attention
    want = expected_features(name)
    for runs in (set(attention.KERNELS), {"varlen", "sdpa", "eager"}, {"fa4", "sdpa", "eager"}):
        c = attention.decide({"attention_backend": "fa3"}, (9, 0), lambda n: None if n in runs else "absent",
                             model=needs)
        assert want <= attention.KERNELS[c.name].honours, (runs, c)
        for skipped, why in c.skipped:
            if skipped in runs:
                assert "would drop" in why and not want <= attention.KERNELS[skipped].honours
    cpu = attention.decide(None, None, lambda n: None, model=needs)
    assert want <= attention.KERNELS[cpu.name].honours and cpu.packed == (cpu.name == "flex")


def test_a_requested_kernel_that_drops_a_feature_is_kept_but_warned():
    c = attention.decide({"attention_backend": "fa3"}, (9, 0), lambda n: None, "sdpa",
                         model=attention.Needs(window=WINDOW, softcap=50.0))
    assert c.impl == "sdpa" and "WARNING" in c.reason and "softcap" in c.reason


@pytest.mark.parametrize("name", NAMES)
def test_chosen_kernel_gives_eager_logits(zoo_dir, name):
    """Single rows and a padded batch (64 tokens: four times the window) through the kernel the CPU run picks."""
    from transformers import AutoModelForCausalLM

    path = zoo_dir / name
    choice = attention.decide(None, None, lambda n: None, model=modelfacts.model_facts(str(path)).attention)
    attention.register(choice.impl)
    ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    ours = AutoModelForCausalLM.from_pretrained(path, attn_implementation=choice.impl).eval()
    torch.manual_seed(0)
    rows = [torch.randint(10, 300, (n,)) for n in (64, 40)]
    ids, mask = torch.zeros(2, 64, dtype=torch.long), torch.zeros(2, 64, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
    with torch.no_grad():
        single = [ref(r[None]).logits[0] for r in rows]
        padded = ours(ids, attention_mask=mask).logits
        for i, r in enumerate(rows):
            assert (ours(r[None]).logits[0] - single[i]).abs().max() < 1e-4
            assert (padded[i, : len(r)] - single[i]).abs().max() < 1e-4
        if expected_features(name) and name != "gpt-oss":  # (its sinks are weights: the window alone is checked)
            # The features matter at this length: the same weights without window and softcap give other logits.
            from transformers import AutoConfig

            conf = AutoConfig.from_pretrained(path)
            conf.sliding_window, conf.attn_logit_softcapping = 1 << 20, None
            plain = AutoModelForCausalLM.from_pretrained(path, config=conf, attn_implementation="eager").eval()
            assert (plain(rows[0][None]).logits[0] - single[0]).abs().max() > 1e-3


# ---------------------------------------------------------------- every entrypoint trains every architecture

# One process per model runs the jobs in turn (the imports dominate a tiny run's time on CPU).
DRIVER = """
import json, sys
from trainbox.cli import grpo, qlora, sft
for job, argv in json.loads(sys.argv[1]):
    rc = {"sft": sft, "qlora": qlora, "grpo": grpo}[job].main(argv)
    print("ZOO-RC", job, rc, flush=True)
"""
COMMON = ["--logging_steps", "1", "--disable_tqdm", "true", "--report_to", "none", "--dataloader_num_workers", "0"]


def jobs(model: Path, data: dict, out: Path, gpu: bool = False, extra: tuple = ()) -> list:
    """The DRIVER's jobs for one model. `gpu`: as trainbox runs there by default (tests/gpu/zoo_train.py), grpo in
    bf16 too; `extra`: options added to every job."""
    sft_args = ["--model_name_or_path", str(model), "--dataset", str(data["chat"]), "--output_dir", str(out / "sft"),
                "--max_length", "64", "--per_device_train_batch_size", "2", "--save_steps", "2", *COMMON]
    return [(job, [*argv, *extra]) for job, argv in [
        ("sft", [*sft_args, "--max_steps", "2"]),
        ("sft", [*sft_args, "--max_steps", "3"]),  # resumes from checkpoint-2
        ("qlora", ["--model_name_or_path", str(model), "--dataset", str(data["dolly"]), "--output_dir",
                   str(out / "qlora"), "--max_length", "64", "--per_device_train_batch_size", "2", "--max_steps", "1",
                   "--merge", *COMMON]),
        ("grpo", ["--model_name_or_path", str(model), "--dataset", str(data["gsm8k"]), "--preset", "gsm8k",
                  "--output_dir", str(out / "grpo"), "--max_steps", "1", "--num_generations", "4",
                  "--per_device_train_batch_size", "4", "--max_completion_length", "8",
                  *([] if gpu else ["--bf16", "false"]), *COMMON]),
    ]]


def train_all(model: Path, data: dict, tmp_path: Path, gpu: bool = False, extra: tuple = (), env: dict | None = None,
              timeout: float = 600) -> subprocess.CompletedProcess:
    """One DRIVER process running jobs(...) for MODEL, outputs under TMP_PATH/out. `env`: the process's whole
    environment (default: a bare CPU one, one thread)."""
    env = env or {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                  "OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": str(tmp_path / "hf"), "PATH": "/usr/bin:/bin",
                  "HOME": str(tmp_path)}
    argv = [sys.executable, "-u", "-c", DRIVER, json.dumps(jobs(model, data, tmp_path / "out", gpu, extra))]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def zoo_runs(request, zoo_dir, data, tmp_path_factory):
    """Each selected model's DRIVER process, in a folder of its own, started together on a pool of one worker per
    core (OMP_NUM_THREADS=1: each process uses one core; in a row they cost the sum); a test waits for its own."""
    selected = [n for n in NAMES if any(getattr(item, "originalname", None) == "test_sft_resume_qlora_grpo_train_and_"
                                        "save_loadable_models" and item.module is request.module
                                        and item.callspec.params["name"] == n for item in request.session.items)]
    pool = sidebyside.pool()
    runs = {}
    for name in selected:
        folder = tmp_path_factory.mktemp(f"train-{name}")
        runs[name] = folder / "out", pool.submit(train_all, zoo_dir / name, data, folder)
    yield runs
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("name", NAMES)
def test_sft_resume_qlora_grpo_train_and_save_loadable_models(zoo_runs, name):
    from transformers import AutoModelForCausalLM

    out, run = zoo_runs[name]
    r = run.result()
    log = r.stdout + r.stderr
    assert [line for line in r.stdout.splitlines() if line.startswith("ZOO-RC")] == [
        "ZOO-RC sft 0", "ZOO-RC sft 0", "ZOO-RC qlora 0", "ZOO-RC grpo 0"], log[-4000:]
    # PEFT's fused-expert LoRA refuses dropout; qlora's default is 0 for every model (lora4bit.py), so the adapter
    # trained without it on MoE models too (adapters.choose_lora_dropout covers a dropout default above 0)
    adapter = json.loads((out / "qlora" / "adapter_config.json").read_text())
    assert adapter["lora_dropout"] == 0, adapter
    assert "resuming from" in log.lower() and "checkpoint-2" in log, log[-4000:]
    if {"softcap", "sinks"} & expected_features(name):  # SDPA would drop them: FlexAttention's math, packed
        assert f"attention: PyTorch FlexAttention ({attention.FLEX})" in log and "packing on (bfd" in log, log[-4000:]
        assert "policy forward: padding-free" in log, log[-4000:]
    state = json.loads((out / "sft" / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and [e["step"] for e in state["log_history"] if "loss" in e] == [1, 2, 3]
    for saved in (out / "sft", out / "qlora" / "merged", out / "grpo"):
        AutoModelForCausalLM.from_pretrained(saved)
    assert (out / "qlora" / "adapter_model.safetensors").is_file()
