"""The memory plan counts what each choice allocates (trainbox/training/memterms.py): experts per token and their
width, the attention width, eager's score matrices and SDPA's mask biases, each optimizer's own states; and
`trainbox plan` is the job's plan: the same refusals, environment, FSDP settings, whole-node advice, exit codes (0
fits, 1 does not, 2 bad input, under TRAINBOX_MEMORY_PLAN=report too), inside an allocation. Hand-written configs
from the published models' shapes, no weights; `trainbox plan` run in this process where it can be (plan.main)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from trainbox.cli import plan
from trainbox.training import memplan, memterms, modelfacts, speed

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
S = memplan.Settings
LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
            "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "max_position_embeddings": 131072, "rope_theta": 500000.0,
            "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
           "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 32768,
           "rms_norm_eps": 1e-5, "rope_theta": 1e6, "sliding_window": None, "tie_word_embeddings": False}  # 8x7B
GPT_OSS_20B = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
               "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
               "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4,
               "vocab_size": 201088, "sliding_window": 128,
               "layer_types": ["sliding_attention", "full_attention"] * 12, "tie_word_embeddings": False}
QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
             "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
             "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
             "num_experts_per_tok": 8, "vocab_size": 151936, "tie_word_embeddings": False}  # Qwen3-30B-A3B


def write(tmp_path, name, conf: dict) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(conf))
    return d


def run_plan(monkeypatch, capsys, *argv, env: dict | None = None) -> tuple[int, str, str]:
    """`trainbox plan ARGV` in this process: (exit code, stdout, stderr). The variables it reads or sets are put
    back after the test."""
    for name in (*plan.LAUNCHER_VARS, memplan.FREE_ENV, memplan.MODE_ENV):
        monkeypatch.setenv(name, "")  # recorded, so that teardown removes what plan sets (WORLD_SIZE)
        monkeypatch.delenv(name)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    rc = plan.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def facts(tmp_path, name, conf):
    return modelfacts.model_facts(str(write(tmp_path, name, conf)))


# ------------------------------------------------------------------ case 3: MoE activations by experts per token
def test_mixtral_with_8_experts_per_token_plans_the_experts_activations_of_8(tmp_path):
    two, eight = facts(tmp_path, "top2", MIXTRAL), facts(tmp_path, "top8", {**MIXTRAL, "num_experts_per_tok": 8})
    assert (two.experts_per_token, eight.experts_per_token, two.expert_intermediate) == (2, 8, 14336)
    assert two.params == eight.params and two.moe_layers == 32
    job = memplan.Job(two, batch=8, max_length=1024, shards=32, nodes=4, fsdp=True)
    s = S(False, reshard=True, batch=8)
    a2 = memplan.estimate(job, s)["activations"]
    a8 = memplan.estimate(replace(job, facts=eight), s)["activations"]
    # six more expert slots a token in each of the 32 layers: each keeps its input, the gate/up output, the
    # activation and product, the output the routing weight multiplies (4 x hidden + 8 x width bytes)
    assert a8 - a2 == 8 * 1024 * 32 * 6 * (4 * 4096 + 8 * 14336)


def test_mixtral_plans_differ_by_experts_per_token_in_trainbox_plan(tmp_path, monkeypatch, capsys):
    """Case 3 as the issue ran it: the two plans used to be identical."""
    lines = {}
    for k in (2, 8):
        d = write(tmp_path, f"mixtral-top{k}", {**MIXTRAL, "num_experts_per_tok": k})
        rc, out, _ = run_plan(monkeypatch, capsys, "--model_name_or_path", d, "--nnodes", 4, "--nproc-per-node", 8,
                              "--gpu-memory", 77.7)
        assert rc in (0, 1), out
        lines[k] = out
    assert lines[2].split("\n", 1)[1] != lines[8].split("\n", 1)[1]


def test_gpt_oss_20b_on_8_gpus_counts_its_4_experts_a_token(tmp_path):
    """gpt-oss-20b on 8 x 80 GB was planned without checkpointing with a dense model's activations (57.8 GiB)."""
    f = facts(tmp_path, "oss", GPT_OSS_20B)
    assert (f.experts, f.experts_per_token, f.moe_layers, f.expert_intermediate) == (32, 4, 24, 2880)
    job = memplan.Job(f, batch=8, max_length=1024, shards=8, fsdp=True)
    no_ckpt = memplan.estimate(job, S(False, reshard=True, batch=8))
    dense = 8 * 1024 * 24 * (16 * 2880 + 10 * 2880)  # what was counted: one MLP's
    assert no_ckpt["activations"] > dense + 8 * 1024 * 24 * 4 * (2 * 2880 + 6 * 2880) - 8 * 1024 * 24 * 10 * 2880
    plan_ = memplan.decide(job, int(77.7 * GIB))
    assert plan_.settings.checkpointing and plan_.fits


def test_attention_width_apart_from_hidden_is_counted(tmp_path):
    """Qwen3-30B-A3B: 32 heads x 128 = 4096 wide attention on a 2048 hidden; its 128 experts' width is
    moe_intermediate_size, not the dense intermediate_size."""
    f = facts(tmp_path, "qwen3moe", QWEN3_MOE)
    assert (f.attn_width, f.kv_width, f.expert_intermediate, f.moe_layers) == (4096, 512, 768, 48)
    narrow = memterms.per_token_layer(replace(f, attn_width=2048), liger=False)["attention block"]
    assert memterms.per_token_layer(f, liger=False)["attention block"] - narrow == 48 * 8 * 2048


# ------------------------------------------------------------------ case 4: eager / SDPA score matrices
def test_eager_costs_more_than_sdpa_and_sdpa_more_than_a_flash_kernel(tmp_path):
    f = facts(tmp_path, "llama8b", LLAMA_8B)
    job = memplan.Job(f, batch=4, max_length=4096, shards=8, fsdp=True)
    est = {a: memplan.estimate(replace(job, attn=a), S(False, reshard=True, batch=4))["activations"]
           for a in ("", "sdpa", "eager")}
    assert est["eager"] > est["sdpa"] > est[""]
    # eager keeps the float32 softmax and the bf16 probabilities of every head and layer: 4 x 32 x 4096^2 x 6 x 32
    assert est["eager"] - est[""] >= 32 * 6 * 4 * 32 * 4096 * 4096
    ckpt = {a: memplan.estimate(replace(job, attn=a), S(True, reshard=True, batch=4))["activations"] for a in ("", "eager")}
    assert 0 < ckpt["eager"] - ckpt[""] < est["eager"] - est[""]  # checkpointing keeps one layer's scores


def test_plan_reads_attn_implementation(tmp_path, monkeypatch, capsys):
    d = write(tmp_path, "llama8b-eager", LLAMA_8B)
    common = ("--model_name_or_path", d, "--nproc-per-node", 8, "--gpu-memory", 139, "--max_length", 4096,
              "--per_device_train_batch_size", 4, "--gradient_checkpointing", "false")
    rc_flash, flash, _ = run_plan(monkeypatch, capsys, *common)
    rc_eager, eager, _ = run_plan(monkeypatch, capsys, *common, "--attn_implementation", "eager")
    assert rc_flash == 0 and "attention eager" in eager and "attention eager" not in flash
    assert rc_eager == 1 and "does not fit" in eager  # 256 GiB of scores without checkpointing


# ------------------------------------------------------------------ case 5: each optimizer's own states
def test_optimizer_states_by_optimizer():
    n = 1000
    got = {o: memterms.optimizer_state_bytes(o, n, factored_state=30) for o in (
        "adamw_torch_fused", "adamw_torch", "adamw_bnb_8bit", "adamw_torch_8bit", "adamw_torch_4bit", "sgd",
        "adafactor", "lion_32bit", "lion_8bit", "ademamix", "lomo", "no_such_optimizer")}
    assert got == {"adamw_torch_fused": 8000, "adamw_torch": 8000, "adamw_bnb_8bit": 2000, "adamw_torch_8bit": 2000,
                   "adamw_torch_4bit": 1000, "sgd": 0, "adafactor": 120, "lion_32bit": 4000, "lion_8bit": 1000,
                   "ademamix": 12000, "lomo": 0, "no_such_optimizer": 8000}
    assert memterms.optimizer_state_bytes("sgd", n, optim_args="momentum=0.9") == 4000  # a float32 buffer
    assert memterms.optimizer_state_bytes("rmsprop", n, optim_args="momentum=0.9,centered=True") == 12000


def test_sgd_and_adafactor_estimate_below_adamw(tmp_path):
    f = facts(tmp_path, "llama8b-opt", LLAMA_8B)
    assert 0 < f.factored_state < f.params // 100  # rows + columns of each matrix
    job = memplan.Job(f, batch=8, max_length=1024)
    total = {o: memplan.estimate(replace(job, optim=o), S(True, batch=8))["total"]
             for o in ("adamw_torch_fused", "adafactor", "sgd")}
    assert total["sgd"] < total["adafactor"] < total["adamw_torch_fused"]
    assert total["adamw_torch_fused"] - total["sgd"] == 8 * f.params


def test_sgd_fits_where_weights_and_gradients_alone_fit(tmp_path, monkeypatch, capsys):
    """8B on one H100: float32 weights and gradients are 59.8 GiB; AdamW's moments don't fit beside them (AdamW
    set by the user: the plan's smaller moments are only for an --optim left to it)."""
    d = write(tmp_path, "llama8b-sgd", LLAMA_8B)
    rc_adam, adam, _ = run_plan(monkeypatch, capsys, "--model_name_or_path", d, "--gpu-memory", 77.7,
                                "--optim", "adamw_torch_fused")
    rc_sgd, sgd, _ = run_plan(monkeypatch, capsys, "--model_name_or_path", d, "--gpu-memory", 77.7, "--optim", "sgd")
    assert (rc_adam, rc_sgd) == (1, 0), sgd
    assert "optimizer" not in sgd.split("memory plan:", 1)[1].split("\n")[0]


# ------------------------------------------------------------------ case 6: whole nodes past one node
@pytest.mark.parametrize("conf,gib", [(MIXTRAL, 77.7), (LLAMA_8B, 22.5)], ids=["mixtral-h100", "8b-24gb"])
def test_gpu_advice_is_whole_nodes_past_one_node(tmp_path, monkeypatch, capsys, conf, gib):
    d = write(tmp_path, f"nodes-{conf['model_type']}", conf)
    rc, out, _ = run_plan(monkeypatch, capsys, "--model_name_or_path", d, "--nproc-per-node", 8, "--gpu-memory", gib)
    assert rc == 1 and "16 GPUs like these" in out, out


def test_gpu_counts_are_whole_nodes():
    f = modelfacts.ModelFacts("llama", 8_030_261_248, 525_336_576, 32, 4096, 14336, 4096, vocab=128256)
    counts = lambda **kw: list(memplan.gpu_counts(memplan.Job(f, batch=8, max_length=1024, **kw), 40))  # noqa: E731
    assert counts() == [2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 40]
    assert counts(shards=8, fsdp=True) == [16, 24, 32, 40]
    assert counts(shards=16, nodes=2, fsdp=True) == [24, 32, 40]
    assert counts(shards=8, nodes=2, fsdp=True) == [12, 16, 20, 24, 28, 32, 36, 40]  # nodes of 4


# ------------------------------------------------------------------ case 8: exit codes, usable, qlora's advice
def test_report_mode_over_exits_1_and_a_bad_mode_is_bad_input(tmp_path, monkeypatch, capsys):
    big = write(tmp_path, "llama-70b", {**LLAMA_8B, "hidden_size": 8192, "intermediate_size": 28672,
                                         "num_hidden_layers": 80, "num_attention_heads": 64})
    argv = ("--model_name_or_path", big, "--nnodes", 2, "--nproc-per-node", 8, "--gpu-memory", 77.7)
    rc, out, _ = run_plan(monkeypatch, capsys, *argv, env={memplan.MODE_ENV: "report"})
    assert rc == 1 and "OVER" in out and "does not fit" in out
    rc, out, err = run_plan(monkeypatch, capsys, *argv, env={memplan.MODE_ENV: "banana"})
    assert rc == 2 and out == "" and err.startswith(f"error: {memplan.MODE_ENV}='banana'") and err.count("\n") == 1


def test_usable_is_never_negative_and_says_the_gpu_has_too_little(tmp_path, monkeypatch, capsys):
    assert memplan.usable(int(0.5 * GIB)) == 0 and memplan.too_little(int(0.5 * GIB))
    d = write(tmp_path, "llama8b-small", LLAMA_8B)
    rc, out, _ = run_plan(monkeypatch, capsys, "--model_name_or_path", d, "--gpu-memory", 1)
    assert rc == 1 and "too little free memory" in out and "-" not in out.split("GiB usable")[0][-8:]
    rc, out, _ = run_plan(monkeypatch, capsys, "--model_name_or_path", d, "--gpu-memory", 1,
                          env={memplan.MODE_ENV: "report"})
    assert rc == 1 and "OVER 0.0 GiB usable" in out and "too little free memory" in out


def test_qlora_is_offered_only_where_its_own_estimate_fits(tmp_path, monkeypatch, capsys):
    huge = write(tmp_path, "huge", {**LLAMA_8B, "hidden_size": 65536, "intermediate_size": 262144,
                                    "num_hidden_layers": 640, "num_attention_heads": 512})  # 35,186 B parameters
    rc, out, _ = run_plan(monkeypatch, capsys, "--model_name_or_path", huge, "--gpu-memory", 77.7)
    assert rc == 1 and "`trainbox qlora` (a 4-bit" not in out and "nothing this plan knows fits" in out, out
    small = write(tmp_path, "llama8b-qlora", LLAMA_8B)
    rc, out, _ = run_plan(monkeypatch, capsys, "--model_name_or_path", small, "--gpu-memory", 22.5)
    assert rc == 1 and "trainbox qlora" in out
    f = modelfacts.model_facts(str(small))
    assert memplan.qlora_estimate(memplan.Job(f, batch=8, max_length=1024)) <= memplan.usable(int(22.5 * GIB))


# ------------------------------------------------------------------ case 9: the job's inputs, the job's checks
def test_plan_obeys_the_free_memory_cap_the_job_obeys(tmp_path, monkeypatch, capsys):
    d = write(tmp_path, "llama8b-cap", LLAMA_8B)
    argv = ("--model_name_or_path", d, "--nproc-per-node", 2, "--gpu-memory", 77.7)
    rc, out, _ = run_plan(monkeypatch, capsys, *argv)
    assert rc == 0
    rc, out, _ = run_plan(monkeypatch, capsys, *argv, env={memplan.FREE_ENV: "10"})
    assert rc == 1 and "10 GiB free each (capped by TRAINBOX_GPU_FREE_GIB)" in out
    rc, _, err = run_plan(monkeypatch, capsys, *argv, env={memplan.FREE_ENV: "banana"})
    assert rc == 2 and err.startswith(f"error: {memplan.FREE_ENV}=")


@pytest.mark.parametrize("extra,says", [
    (["--use_peft", "true"], "error: --use_peft: sft trains every weight"),
    (["--load_in_4bit", "true"], "error: --load_in_4bit: sft trains every weight"),
    (["--fsdp_config", "MAYBE"], "error: --fsdp_config reshard_after_forward 'maybe': expected true or false"),
], ids=["use_peft", "4bit", "reshard-maybe"])
def test_plan_refuses_what_sft_refuses(tmp_path, monkeypatch, capsys, extra, says):
    d = write(tmp_path, "llama8b-refuse", LLAMA_8B)
    maybe = tmp_path / "fsdp.json"
    maybe.write_text(json.dumps({"version": 2, "reshard_after_forward": "maybe"}))
    extra = [str(maybe) if a == "MAYBE" else a for a in extra]
    rc, out, err = run_plan(monkeypatch, capsys, "--model_name_or_path", d, "--nproc-per-node", 2,
                            "--gpu-memory", 77.7, *extra)
    assert rc == 2 and out == "" and err.startswith(says) and err.count("\n") == 1, err


@pytest.mark.parametrize("value,read", [(True, True), ("false", False), ("FALSE", False), (0, False), ("yes", True)])
def test_reshard_after_forward_read_as_accelerate_reads_it(value, read):
    from types import SimpleNamespace

    assert speed.fsdp_reshard(SimpleNamespace(fsdp_config={"reshard_after_forward": value})) is read
    assert speed.fsdp_reshard(SimpleNamespace(fsdp_config={})) is None


def sft_cli(*argv, env=None, timeout=300):
    full = dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "trainbox", *argv], capture_output=True, text=True, cwd=ROOT,
                          env=full, timeout=timeout)


def test_sft_refuses_reshard_maybe_as_plan_does(tmp_path):
    d = write(tmp_path, "llama8b-sft-maybe", LLAMA_8B)
    maybe = tmp_path / "fsdp.json"
    maybe.write_text(json.dumps({"version": 2, "reshard_after_forward": "maybe"}))
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    r = sft_cli("sft", "--model_name_or_path", str(d), "--dataset", str(data), "--fsdp_config", str(maybe),
                "--output_dir", str(tmp_path / "out"))
    assert r.returncode == 2 and "reshard_after_forward 'maybe'" in r.stderr and "Traceback" not in r.stderr


# ------------------------------------------------------------------ case 10: inside an allocation
def test_plan_inside_an_allocation_neither_fails_nor_hangs(tmp_path):
    """RANK/WORLD_SIZE/MASTER_ADDR of an allocation (the master an address that answers nothing): transformers'
    TrainingArguments used to join that process group and wait for it."""
    d = write(tmp_path, "llama8b-alloc", LLAMA_8B)
    r = sft_cli("plan", "--model_name_or_path", str(d), "--nproc-per-node", "2", "--gpu-memory", "77.7",
                env={"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8",
                     "MASTER_ADDR": "192.0.2.1", "MASTER_PORT": "29500"}, timeout=120)
    assert r.returncode == 0 and "memory plan:" in r.stdout and "on 1 node(s) x 2 GPU(s)" in r.stdout, r.stderr


def test_the_job_plans_with_the_kernel_it_loads(monkeypatch):
    """sft passes the attention kernel it chose (speed.apply: choice.impl) to its plan: eager's scores are counted
    there as in `trainbox plan --attn_implementation eager`."""
    from types import SimpleNamespace

    from trainbox.training import config

    f = modelfacts.ModelFacts("llama", 1_235_814_400, 0, 16, 2048, 8192, 2048, vocab=128256, heads=32, kv_width=512)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    lines = {}
    for attn in ("", "eager"):
        args = SimpleNamespace(per_device_train_batch_size=4, max_length=2048, optim="adamw_torch_fused",
                               gradient_accumulation_steps=1, gradient_checkpointing=False, fsdp_config={},
                               accelerator_config=SimpleNamespace(gradient_accumulation_kwargs=None),
                               trainbox_liger=True)
        config.set_explicit(args, set())
        lines[attn], _ = speed.choose_memory(args, f, 1, int(139 * GIB), attn=attn)
    flash = float(lines[""].split("estimate ")[1].split()[0])
    eager = float(lines["eager"].split("estimate ")[1].split()[0])
    assert eager > flash, lines
