"""The memory plan (trainbox/training/memplan.py): its estimate against the peaks measured on the device, its ladder,
one decision for every rank of a job (two gloo processes with different free memory), refusals whose advice
works, and `trainbox plan` for clusters this machine doesn't have (a 70B config on 2 x 8 GPUs, an 8B on one 24 GB
card), on the CPU with configs only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

import gloo_ranks
import sidebyside
from common.errors import UsageError
from trainbox.training import config, memplan, modelfacts, speed

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
LLAMA_8B = dict(model_type="llama", params=8_030_261_248, embedding_params=525_336_576, layers=32, hidden=4096,
                intermediate=14336, attn_width=4096, vocab=128256)  # Llama-3.1-8B
LLAMA_1B = dict(model_type="llama", params=1_235_814_400, embedding_params=0, layers=16, hidden=2048,
                intermediate=8192, attn_width=2048, vocab=128256)  # Llama-3.2-1B (tied embeddings)
F8, F1 = modelfacts.ModelFacts(**LLAMA_8B), modelfacts.ModelFacts(**LLAMA_1B)
S = memplan.Settings

ONE_GPU = dict(batch=2, max_length=1024, masters_ok=True, states_ok=("bf16", "8bit"))
# Measured on 2 x H100 80GB (torch 2.11, transformers 5.17, trl 1.16; benchmarks/memory_plan.py and
# benchmarks/train_throughput.py sft --nproc 2): trainbox sft, micro-batch 8 x 2048 packed tokens per GPU, Liger on;
# peak allocated GiB of the largest rank.
MEASURED = [
    ("1B, 1 GPU, GA 1", F1, dict(masters_ok=True), S(False, masters=True, batch=8), 38.2),
    ("1B, 1 GPU, GA 4", F1, dict(masters_ok=True, grad_accum=4), S(False, masters=True, batch=8, grad_accum=4), 42.9),
    ("1B, 2 GPUs, GA 1", F1, dict(shards=2, fsdp=True), S(False, reshard=False, batch=8), 31.3),
    ("1B, 2 GPUs, GA 4", F1, dict(shards=2, fsdp=True, grad_accum=4), S(False, reshard=False, batch=8, grad_accum=4),
     35.9),
    ("8B, 2 GPUs, GA 1", F8, dict(shards=2, fsdp=True), S(True, reshard=True, batch=8), 63.7),
    ("8B, 2 GPUs, GA 4", F8, dict(shards=2, fsdp=True, grad_accum=4),
     S(True, reshard=True, sync_each_batch=True, batch=4, grad_accum=8), 66.4),
    # 2 x H200 (137.9 GiB free): the plan left checkpointing off; estimate 117.1 GiB, largest rank 123.8 GiB.
    ("8B, 2 GPUs, GA 1, no ckpt (H200)", F8, dict(shards=2, fsdp=True), S(False, reshard=True, batch=8), 123.8),
    # One H200, 2026-12-02 (benchmarks/results/sft8b_one_gpu-2026-12-02.txt): 8B, batch 2 x 1024, no checkpointing,
    # the one-GPU rungs with smaller AdamW moments.
    ("8B, 1 GPU, masters + bf16 moments", F8, ONE_GPU, S(False, masters=True, states="bf16", batch=2), 89.9),
    ("8B, 1 GPU, masters + 8-bit moments", F8, ONE_GPU, S(False, masters=True, states="8bit", batch=2), 81.0),
    ("8B, 1 GPU, bf16 stochastic rounding + 8-bit", F8, ONE_GPU, S(False, states="8bit", batch=2), 49.1),
]


def job(f=F8, **kw):
    kw = {"batch": 8, "max_length": 2048, "liger": True, **kw}
    return memplan.Job(f, **kw)


@pytest.mark.parametrize("name,f,kw,settings,peak", MEASURED, ids=[m[0] for m in MEASURED])
def test_estimate_is_within_10_percent_of_the_measured_peak(name, f, kw, settings, peak):
    est = memplan.estimate(job(f, **kw), settings)["total"] / GIB
    assert abs(est - peak) / peak < 0.10, f"{name}: estimate {est:.1f} GiB vs measured {peak} GiB"


def test_8b_on_2_gpus_takes_what_trl_runs_and_what_was_measured():
    """The case of the issue: TRL's FSDP2 trains (64.9 GiB); the plan keeps 8 x 2048 with checkpointing and
    resharding (measured 63.7 GiB, 4.6x TRL's tokens/s), instead of refusing."""
    plan = memplan.decide(job(shards=2, fsdp=True), int(76.6 * GIB))
    assert plan.settings == S(True, reshard=True, batch=8, grad_accum=1)
    assert "estimate 64.7 GiB per GPU" in plan.line() and "peak at backward end" in plan.line()


def test_accumulation_syncs_or_splits_instead_of_the_unsharded_buffers_that_oomed():
    """--per_device_train_batch_size 8 --gradient_accumulation_steps 4 died in to_accumulated_grad_if_needed: the
    float32 accumulation buffers (4 bytes x every parameter) are counted, and the plan avoids them."""
    j = job(shards=2, fsdp=True, grad_accum=4)
    oomed = memplan.estimate(j, S(True, reshard=True, batch=8, grad_accum=4))
    assert oomed["accumulation"] == 4 * F8.params and oomed["total"] > memplan.usable(int(77.2 * GIB))
    plan = memplan.decide(j, int(76.6 * GIB))
    assert plan.settings.sync_each_batch and plan.settings.batch * plan.settings.grad_accum == 32


def test_ladder_is_fastest_first_and_keeps_what_the_user_set():
    rungs = memplan.ladder(job(shards=2, fsdp=True, grad_accum=2))
    assert rungs[0] == S(False, reshard=False, batch=8, grad_accum=2)
    assert [-r.batch for r in rungs] == sorted(-r.batch for r in rungs)  # splitting the micro-batch last
    fixed = memplan.ladder(job(shards=2, fsdp=True, fixed={"checkpointing": True, "reshard": True, "batch": True}))
    assert {(r.checkpointing, r.reshard, r.batch) for r in fixed} == {(True, True, 8)}


def test_one_gpu_keeps_master_weights_when_they_fit_and_drops_them_first():
    assert memplan.decide(job(F1, masters_ok=True), int(78 * GIB)).settings == S(False, masters=True, batch=8)
    tight = memplan.decide(job(F1, masters_ok=True), int(40 * GIB))
    assert tight.settings != S(False, masters=True, batch=8) and tight.terms["total"] <= memplan.usable(40 * GIB)


@pytest.mark.parametrize("j,free", [
    (job(shards=1, masters_ok=True), 22.5),           # 8B on one 24 GB card
    (job(shards=1, masters_ok=True), 77.7),           # 8B on one H100
], ids=["8b-24gb", "8b-h100"])
def test_a_refusal_names_changes_that_fit_and_following_them_fits(j, free):
    free_b = int(free * GIB)
    with pytest.raises(UsageError) as e:
        memplan.decide(j, free_b)
    text = str(e.value)
    g = memplan.more_gpus(j, free_b)
    assert g and f"{g} GPUs like these" in text and "trainbox qlora" in text
    assert memplan.fits(replace(j, shards=g, fsdp=True, masters_ok=False), free_b)
    if "--optim adamw_bnb_8bit" in text:
        assert memplan.fits(replace(j, optim="adamw_bnb_8bit", masters_ok=False), free_b)
    prev = g - 1 if g <= 8 else g - 8  # counts go 2..8, then whole nodes of 8
    assert not memplan.fits(replace(j, shards=prev, fsdp=prev > 1, masters_ok=False), free_b)


def test_free_memory_cap_and_mode_are_checked(monkeypatch):
    monkeypatch.setenv(memplan.FREE_ENV, "20")
    assert memplan.cap(80 * GIB) == 20 * GIB
    for bad in ("banana", "-1", "nan", "inf"):
        monkeypatch.setenv(memplan.FREE_ENV, bad)
        with pytest.raises(UsageError, match=memplan.FREE_ENV):
            memplan.cap(80 * GIB)
    monkeypatch.setenv(memplan.MODE_ENV, "report")
    plan = memplan.decide(job(shards=2, fsdp=True, fixed={"checkpointing": True, "reshard": True}), 10 * GIB)
    assert "OVER" in plan.line() and "taken as is" in plan.line()
    monkeypatch.setenv(memplan.MODE_ENV, "yolo")
    with pytest.raises(UsageError, match="auto .* or report"):
        memplan.decide(job(), 80 * GIB)


def sft_args(**set_by_user):
    args = SimpleNamespace(**{"per_device_train_batch_size": 8, "max_length": 2048, "optim": "adamw_torch_fused",
                              "gradient_accumulation_steps": 1, "gradient_checkpointing": False, "fsdp_config": {},
                              "accelerator_config": SimpleNamespace(gradient_accumulation_kwargs=None),
                              "trainbox_liger": True, **set_by_user})
    config.set_explicit(args, set_by_user)
    return args


def test_choose_memory_applies_the_plan_to_the_trainer_arguments(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    args = sft_args(gradient_accumulation_steps=4)
    line, _ = speed.choose_memory(args, F8, 2, int(76.6 * GIB))
    assert line.startswith("memory plan: gradient checkpointing on, reshard after forward on, gradients synchronised")
    assert args.gradient_checkpointing and args.trainbox_reshard
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 32
    assert args.accelerator_config.gradient_accumulation_kwargs == {"sync_each_batch": True}


# ------------------------------------------------------------ one plan for the whole job (two gloo processes)
AGREE = r'''
import json, os, sys
import torch.distributed as dist
sys.path.insert(0, os.environ["ROOT"])
from trainbox.training import memplan, modelfacts, speed
dist.init_process_group("gloo")
GIB = 2**30
facts = modelfacts.ModelFacts(**json.loads(os.environ["FACTS"]))
job = memplan.Job(facts, batch=8, max_length=2048, shards=2, fsdp=True, liger=True)
free = int(float(os.environ["FREE"].split(",")[dist.get_rank()]) * GIB)
def decide(smallest, seen):
    return memplan.decide(job, smallest).line()
if os.environ.get("LOCAL_ONLY"):  # what each rank would do alone (the bug the agreement removes)
    try:
        line = decide(free, None)
    except memplan.UsageError as e:
        line = "refused: " + str(e)
else:
    try:
        line = memplan.agree(free, decide)
    except memplan.UsageError as e:
        line = "refused: " + str(e)
open(os.environ["OUT"] + f".{dist.get_rank()}", "w").write(line)
dist.destroy_process_group()
'''


def two_ranks(tmp_path, free: str, local_only: bool = False) -> dict[int, str]:
    env = dict(os.environ, ROOT=str(ROOT), FACTS=json.dumps(LLAMA_8B), FREE=free,
               **({"LOCAL_ONLY": "1"} if local_only else {}))
    return dict(enumerate(gloo_ranks.run(AGREE, tmp_path, env, name=f"line-{free}-{local_only}")))


def test_ranks_with_different_free_memory_agree_on_one_plan(tmp_path):
    """Rank 0 sees 76.4 GiB free, rank 1 41.5 GiB (as seen on an H100 pair): alone they would take different paths
    (one trains, the other refuses and leaves the first waiting in its first collective); agreed, both get the
    decision for 41.5 GiB, made once on rank 0: here both refuse, with the same words."""
    alone = two_ranks(tmp_path, "76.4,41.5", local_only=True)
    assert alone[0] != alone[1] and alone[1].startswith("refused") and not alone[0].startswith("refused")
    agreed = two_ranks(tmp_path, "76.4,41.5")
    assert agreed[0] == agreed[1]
    assert "of 41.5 GiB free" in agreed[0] or agreed[0].startswith("refused")
    roomy = two_ranks(tmp_path, "77.7,76.6")
    assert roomy[0] == roomy[1] and "of 76.6 GiB free" in roomy[0]


# ------------------------------------------------------------ trainbox plan, on this CPU machine, configs only
def config_dir(tmp_path, name, **shape) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                               "vocab_size": 128256, "num_key_value_heads": 8,
                                               "max_position_embeddings": 131072, "rope_theta": 500000.0,
                                               "tie_word_embeddings": False, "rms_norm_eps": 1e-5, **shape}))
    return d


def plan_cli(*argv):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1")
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "trainbox", "plan", *argv], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)


def test_plan_for_70b_on_2_nodes_of_8_and_8b_on_one_24gb_card(tmp_path):
    big = config_dir(tmp_path, "llama-70b", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                     num_attention_heads=64)
    small = config_dir(tmp_path, "llama-8b", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32)
    two_nodes, three_nodes, one_card, r = sidebyside.in_parallel([
        lambda: plan_cli("--model_name_or_path", str(big), "--nnodes", "2", "--nproc-per-node", "8",
                         "--gpu-memory", "77.7"),
        lambda: plan_cli("--model_name_or_path", str(big), "--nnodes", "3", "--nproc-per-node", "8",
                         "--gpu-memory", "77.7"),
        lambda: plan_cli("--model_name_or_path", str(small), "--gpu-memory", "22.5"),
        lambda: plan_cli("--model_name_or_path", str(small), "--gpu-memory", "banana"),
    ])
    # 16 bytes per parameter over 16 GPUs is 70.6 GB each before any activation: one node more is what fits
    assert two_nodes.returncode == 1, two_nodes.stdout + two_nodes.stderr
    assert "70.6 B parameters (llama) on 2 node(s) x 8 GPU(s)" in two_nodes.stdout
    assert "24 GPUs like these" in two_nodes.stdout and "--optim adamw_torch_8bit" in two_nodes.stdout
    assert three_nodes.returncode == 0, three_nodes.stdout + three_nodes.stderr
    assert "memory plan:" in three_nodes.stdout and "usable" in three_nodes.stdout
    assert one_card.returncode == 1, one_card.stdout + one_card.stderr
    assert "does not fit" in one_card.stdout and "GPUs like these" in one_card.stdout
    assert "trainbox qlora" in one_card.stdout
    assert r.returncode == 2 and r.stderr.startswith("error: --gpu-memory 'banana'")


# ------------------------------------------------------------ one GPU: smaller AdamW moments (issue 60)
def one_gpu_8b(states=("bf16", "8bit"), batch=2, **kw):
    return job(F8, batch=batch, max_length=1024, masters_ok=True, states_ok=states, **kw)


@pytest.mark.parametrize("free,masters,states", [(139.2, True, "bf16"), (94.5, True, "8bit"), (77.7, False, "8bit")],
                         ids=["h200", "gh200-96gb", "80gb"])
def test_8b_on_one_gpu_keeps_bf16_weights_without_checkpointing(free, masters, states):
    plan = memplan.decide(one_gpu_8b(), int(free * GIB))
    s = plan.settings
    assert (s.checkpointing, s.masters, s.states) == (False, masters, states)
    assert plan.terms["total"] <= memplan.usable(int(free * GIB))
    assert "float32 weights" not in plan.line()
    for earlier in memplan.ladder(one_gpu_8b())[:plan.rung]:  # every faster or more exact rung did not fit
        assert memplan.estimate(one_gpu_8b(), earlier)["total"] > memplan.usable(int(free * GIB))


def test_a_bigger_micro_batch_takes_the_bf16_moments_before_checkpointing():
    plan = memplan.decide(one_gpu_8b(batch=8), int(139.2 * GIB))
    assert (plan.settings.checkpointing, plan.settings.masters, plan.settings.states) == (False, True, "bf16")
    assert "bf16 AdamW states" in plan.line()


def test_without_torchao_the_h200_still_keeps_masters_and_the_80gb_card_is_refused():
    assert memplan.decide(one_gpu_8b(states=("bf16",), batch=8), int(139.2 * GIB)).settings.states == "bf16"
    with pytest.raises(UsageError):
        memplan.decide(one_gpu_8b(states=("bf16",)), int(77.7 * GIB))


def test_exact_rungs_come_before_stochastic_rounding_and_smaller_states_only_when_allowed():
    rungs = memplan.ladder(one_gpu_8b())
    sr = [i for i, r in enumerate(rungs) if r.states == "8bit" and not r.masters]
    exact = [i for i, r in enumerate(rungs) if r.masters and r.batch == rungs[sr[0]].batch]
    assert sr and max(exact) < min(sr)  # masters kept (checkpointing too) before giving them up
    plain = memplan.ladder(job(F8, batch=2, max_length=1024, masters_ok=True))
    assert plain and {r.states for r in plain} == {"float32"}
    sizes = {st: memplan.estimate(one_gpu_8b(), S(False, masters=True, states=st, batch=2))["total"]
             for st in ("float32", "bf16", "8bit")}
    assert sizes["float32"] > sizes["bf16"] > sizes["8bit"]  # each rung holds less than the one before


def test_a_model_that_fits_exactly_is_planned_as_before():
    assert memplan.decide(job(F1, masters_ok=True, states_ok=("bf16", "8bit")), int(78 * GIB)).settings == S(
        False, masters=True, states="bf16", batch=8)
    # an --optim of your own (no smaller states allowed): AdamW's own float32 moments
    assert memplan.decide(job(F1, masters_ok=True), int(78 * GIB)).settings == S(False, masters=True, batch=8)


def test_choose_precision_takes_transformers_torchao_optimizer_for_stochastic_rounding(monkeypatch):
    monkeypatch.setattr(memplan, "lowbit_reason", lambda: None)
    args = sft_args(per_device_train_batch_size=2, max_length=1024, bf16=True, optim_args=None)
    model_args = SimpleNamespace(dtype=None, load_in_4bit=False)
    config.set_explicit(model_args, set())
    line, masters_off = speed.choose_memory(args, F8, 1, int(77.7 * GIB), masters_ok=True)
    assert "stochastic rounding" in line and masters_off
    prec = speed.choose_precision(args, model_args, True, 1, masters_off)
    assert str(getattr(args.optim, "value", args.optim)) == "adamw_torch_8bit"
    assert "bf16_stochastic_round=True" in args.optim_args and model_args.dtype == "bfloat16"
    assert "stochastic rounding" in prec and not args.trainbox_master_weights


def test_an_optimizer_you_set_is_never_swapped_for_smaller_states(monkeypatch):
    args = sft_args(per_device_train_batch_size=2, max_length=1024, optim="adamw_torch_fused")
    assert speed.job_for(args, F8, 1, masters_ok=True).states_ok == ()
    args = sft_args(per_device_train_batch_size=2, max_length=1024)
    assert "bf16" in speed.job_for(args, F8, 1, masters_ok=True).states_ok


def test_70b_on_8_h200s_is_told_torchaos_8bit_states_and_they_fit(monkeypatch):
    """FSDP2 shards float32 weights, gradients and AdamW's moments (16 bytes a parameter over 8 GPUs): a 70B model
    does not fit 8 H200s; torchao's 8-bit AdamW steps FSDP2's DTensors (bitsandbytes' does not) and then it fits."""
    monkeypatch.setattr(memplan, "lowbit_reason", lambda: None)
    f70 = modelfacts.ModelFacts(model_type="llama", params=70_553_706_496, embedding_params=1_050_673_152, layers=80,
                           hidden=8192, intermediate=28672, attn_width=8192, vocab=128256)
    j = job(f70, shards=8, fsdp=True, max_length=1024)
    free = int(139.2 * GIB)
    with pytest.raises(UsageError) as e:
        memplan.decide(j, free)
    assert "--optim adamw_torch_8bit" in str(e.value) and "adamw_bnb_8bit" not in str(e.value)
    assert memplan.fits(replace(j, optim="adamw_torch_8bit"), free)


def test_the_allocator_is_held_only_where_a_cap_is_set_on_a_gpu(monkeypatch):
    """hold_to_cap: nothing without TRAINBOX_GPU_FREE_GIB, and nothing without a GPU even with it (the device's
    12 GB QLoRA run is where the held allocator is exercised: benchmarks/results)."""
    import torch

    monkeypatch.delenv(memplan.FREE_ENV, raising=False)
    assert memplan.hold_to_cap() is None
    monkeypatch.setenv(memplan.FREE_ENV, "11")
    assert torch.cuda.is_available() or memplan.hold_to_cap() is None


def _shape_facts(tmp_path, shape: str):
    """The benchmark shape's facts from its config.json (config only, no weights), as the device run read them."""
    import transformers

    if str(ROOT / "benchmarks") not in sys.path:  # once, not a new entry per parameter
        sys.path.insert(0, str(ROOT / "benchmarks"))
    import train_throughput as tt

    conf = getattr(transformers, tt.CONFIG_CLASS.get(shape, "LlamaConfig"))(**tt.SHAPES[shape])
    conf.save_pretrained(tmp_path / shape)
    return modelfacts.model_facts(str(tmp_path / shape))


# One H200, 2026-12-02 (benchmarks/results/memory_plan-2026-12-02.txt): `python benchmarks/memory_plan.py --shapes
# gpt-oss-2b --gpus 1 --accum 1` (MoE, 8 x 2048 chat-mix rows packed) and `--shapes llama-1b --attn eager --data
# uniform --batch 4 --max-length 1024` (eager: the L x L score matrices counted); peak allocated GiB.
MEASURED_SHAPES = [
    ("gpt-oss 2B (MoE), 1 GPU", "gpt-oss-2b", dict(batch=8, max_length=2048, masters_ok=True, liger=True),
     S(False, masters=True, batch=8), 37.6),
    ("llama 1B eager, 1 GPU", "llama-1b", dict(batch=4, max_length=1024, masters_ok=True, liger=True, attn="eager"),
     S(False, masters=True, batch=4), 34.2),
]


@pytest.mark.parametrize("name,shape,kw,settings,peak", MEASURED_SHAPES, ids=[m[0] for m in MEASURED_SHAPES])
def test_moe_and_eager_estimates_are_within_10_percent_of_the_device(tmp_path, name, shape, kw, settings, peak):
    est = memplan.estimate(memplan.Job(_shape_facts(tmp_path, shape), **kw), settings)["total"] / GIB
    assert abs(est - peak) / peak < 0.10, f"{name}: estimate {est:.1f} GiB vs measured {peak} GiB"
