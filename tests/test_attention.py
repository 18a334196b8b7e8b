"""The attention kernel per image record (attention.decide), as doctor and the trainers both use it, and the
transformers registration of PyTorch's varlen kernel."""

import pytest

from trainbox.training import attention
from trainbox.training.kernels import varlenattn


def record(backend):
    return {"attention_backend": backend}


def usable_only(*names):
    return lambda name: None if name in names else "not installed"


HOPPER, AMPERE, BLACKWELL = (9, 0), (8, 0), (10, 0)


@pytest.mark.parametrize("backend,cc,usable,want", [
    ("fa3", HOPPER, ("fa3", "fa4", "fa2", "varlen"), "fa3"),       # Hopper image on Hopper: its FA3
    ("fa3", HOPPER, ("fa2", "varlen"), "fa2"),                     # FA3 missing: the next that runs
    ("fa3", HOPPER, ("varlen",), "varlen"),                        # no flash-attn at all: torch's varlen kernel
    ("fa3", HOPPER, (), "sdpa"),                                   # nothing runs: SDPA
    ("fa3", AMPERE, ("fa3", "fa2", "varlen"), "fa2"),              # FA3 can't run on sm80 even when installed
    ("fa2", AMPERE, ("fa2", "varlen"), "fa2"),                     # Ampere image on Ampere
    ("fa2", (8, 6), ("varlen",), "varlen"),
    ("fa2", BLACKWELL, ("fa2", "varlen"), "varlen"),               # FA2 has no sm100 kernels
    ("sdpa", BLACKWELL, ("varlen",), "varlen"),                    # Blackwell image: varlen flash, then SDPA
    ("sdpa", BLACKWELL, ("fa4", "varlen"), "fa4"),                 # FA4 where someone installed it
    ("sdpa", (7, 5), ("varlen",), "sdpa"),                         # varlen flash needs sm80+
], ids=str)  # fmt: skip
def test_choice_per_image_record(backend, cc, usable, want):
    choice = attention.decide(record(backend), cc, usable_only(*usable))
    assert choice.name == want
    assert choice.impl == attention.KERNELS[want].impl
    if want == backend:
        assert choice.reason == "the image's default" and not choice.skipped
    else:
        assert backend in choice.reason or want == "sdpa"


def test_fallback_names_what_was_skipped_and_why():
    choice = attention.decide(record("fa3"), HOPPER, usable_only("varlen"))
    line = choice.line()
    assert line.startswith("attention: PyTorch varlen flash attention (trainbox_varlen)")
    assert "FlashAttention 3: not installed" in line and "FlashAttention 2: not installed" in line


def test_wrong_gpu_generation_is_named():
    line = attention.decide(record("fa3"), AMPERE, usable_only("varlen")).line()
    assert "FlashAttention 3: needs a Hopper GPU (sm90); this GPU is sm80" in line


def test_no_gpu_is_sdpa_and_user_flag_wins():
    assert attention.decide(record("fa3"), None, usable_only("fa3")).name == "sdpa"
    assert attention.decide(None, None, usable_only()).impl == "sdpa"
    user = attention.decide(record("fa3"), HOPPER, usable_only("fa3"), requested="eager")
    assert (user.impl, user.reason) == ("eager", "set by --attn_implementation")
    assert attention.decide(record("sdpa"), HOPPER, usable_only(), requested="fa2").impl == "flash_attention_2"


def test_packing_needs_a_kernel_that_keeps_examples_apart():
    assert attention.decide(record("fa3"), HOPPER, usable_only("fa3")).packed
    assert attention.decide(record("fa3"), HOPPER, usable_only("varlen")).packed
    assert not attention.decide(record("fa3"), HOPPER, usable_only()).packed  # dense-mask SDPA


def test_runtime_usable_on_cpu_says_why_not():
    # This machine has no GPU and no flash-attn: every kernel but SDPA says why it can't run.
    assert attention.runtime_usable("sdpa") is None
    assert "not installed" in attention.runtime_usable("fa3")
    assert "not installed" in attention.runtime_usable("fa2")


def test_varlen_registers_with_transformers():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    varlenattn.register()
    assert AttentionInterface._global_mapping[attention.VARLEN] is varlenattn.attention_forward
    assert attention.VARLEN in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping


# ------------------------------------------------------------ one kernel for the whole job (two gloo processes)
AGREE = r'''
import json, os, sys
import torch.distributed as dist
sys.path.insert(0, os.environ["ROOT"])
from trainbox.training import attention
dist.init_process_group("gloo")
rank = dist.get_rank()
gemma = attention.Needs(window=1024, softcap=50.0, head_dim=256)
out = {}
for case, per_rank in json.loads(os.environ["CASES"]).items():
    works = per_rank[rank].split(",")
    asked = []
    def usable(name):
        asked.append(name)
        return None if name in works else f"test op failed (rank {rank} pretends)"
    cc = None if case.startswith("cpu") else (9, 0)
    decide = lambda u: attention.decide({"attention_backend": "fa3"}, cc, u, model=gemma)
    alone = decide(usable).line()
    asked.clear()
    agreed = attention.agree(decide, usable)
    out[case] = {"alone": alone, "line": agreed.line(), "packed": agreed.packed, "asked": list(asked)}
def broken(u):
    raise ValueError("boom")
try:  # rank 0's decision raising: every rank gets the error, none waits in the broadcast
    attention.agree(broken if rank == 0 else decide, lambda n: None)
except RuntimeError as e:
    out["raised"] = str(e)
open(os.environ["OUT"] + f".{rank}", "w").write(json.dumps(out))
dist.destroy_process_group()
'''


def test_ranks_agree_on_one_kernel(tmp_path):
    """Each rank tries its kernels itself (a wheel or a compile can fail on one GPU only): alone, a rank whose
    FlexAttention fails would train Gemma 2 on eager, unpacked, beside a rank training packed on FlexAttention. Agreed,
    rank 0 decides, the others try only what it chose, and a kernel that fails anywhere is ruled out for all."""
    import json
    import os
    from pathlib import Path

    import gloo_ranks

    cases = {"split": ["flex", "varlen"], "same": ["flex", "flex"], "rank0-lacks": ["varlen", "flex"],
             "cpu": ["", ""]}
    env = dict(os.environ, ROOT=str(Path(__file__).resolve().parents[1]), CASES=json.dumps(cases))
    got = [json.loads(text) for text in gloo_ranks.run(AGREE, tmp_path, env, name="agree")]

    split = [g["split"] for g in got]
    assert "FlexAttention" in split[0]["alone"] and "eager" in split[1]["alone"]  # the bug agreement removes
    assert split[0]["line"] == split[1]["line"] and split[0]["packed"] is split[1]["packed"] is False
    assert split[0]["line"].startswith("attention: eager")
    assert "PyTorch FlexAttention: fails on rank 1 of 2: test op failed (rank 1 pretends)" in split[0]["line"]
    assert split[1]["asked"] == ["flex"]  # rank 1 tried rank 0's choice only, not the whole order

    same = [g["same"] for g in got]
    assert same[0]["line"] == same[1]["line"] and "FlexAttention (trainbox_flex)" in same[0]["line"]
    assert same[0]["packed"] and same[1]["asked"] == ["flex"] and "fails on rank" not in same[0]["line"]

    lacks = [g["rank0-lacks"] for g in got]  # rank 0's own failure: the group follows rank 0 to eager
    assert lacks[0]["line"] == lacks[1]["line"] and lacks[0]["line"].startswith("attention: eager")
    assert lacks[1]["asked"] == []  # eager needs no trial

    assert got[0]["raised"] == got[1]["raised"] == "choosing the attention kernel failed on rank 0: ValueError: boom"
    cpu = [g["cpu"] for g in got]  # no GPU: FlexAttention's dense math is chosen without a trial, on every rank
    assert cpu[0]["line"] == cpu[1]["line"] and "FlexAttention" in cpu[0]["line"] and cpu[1]["asked"] == []
