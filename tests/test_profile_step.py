"""benchmarks/profile_step.py: the kernel categories and shares (synthetic kernel lists), and its CPU smoke end to end
(a tiny Llama through `trainbox sft` in the script's process, profiled; ~10 s)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import profile_step as ps  # noqa: E402  (benchmarks/ is no package: its folder goes on the path first)

# Kernel names as the H100 profiles show them (shortened templates) -> category by name.
NAMES = {
    "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT": "matmul",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1": "matmul",
    "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>": "matmul",
    "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<...>>>": "attention",
    "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128>>": "attention",
    "fmha_cutlassF_bf16_aligned_64x128_rf_sm80": "attention",
    "triton_tem_fused_flex_attention_0": "attention",
    "_rms_norm_forward_kernel": "norms+activations",
    "_swiglu_backward_kernel": "norms+activations",
    "_triton_rope": "norms+activations",
    "void kDequantizeBlockwise<__nv_bfloat16, 512, 64, 8, 2>(float*, unsigned char*, float*, __nv_bfloat16*, int, int)":
        "dequantize",
    "liger_cross_entropy_kernel": "loss",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, c10::BFloat16>": ps.OTHER,
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<TensorListMetadata<4>, FusedAdamMathFunctor>":
        "optimizer",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>": ps.OTHER,
    "Memcpy DtoD (Device -> Device)": ps.OTHER,
    "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL": "communication",
    "aten::mm": "matmul",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "attention",
    "ChunkedLogProbFunctionBackward": "loss",
}


@pytest.mark.parametrize("name,category", NAMES.items())
def test_kernel_names_fall_in_their_category(name, category):
    assert ps.categorize(name) == category


def test_shares_sum_to_one_and_a_region_wins_over_the_name():
    kernels = [(name, 10.0 * (i + 1), None) for i, name in enumerate(NAMES)]
    kernels.append(("nvjet_tst_lm_head", 500.0, "loss"))  # a GEMM launched under the fused LM head: loss
    res = ps.summarize(kernels, wall_us=4000.0, busy_us=3000.0, steps=2, top=5)
    shares = [c["share_of_kernels"] for c in res["categories"].values()]
    assert sum(shares) == pytest.approx(1.0)
    assert set(res["categories"]) == set(ps.ORDER)
    total = sum(k[1] for k in kernels)
    assert res["kernel_ms_per_step"] == pytest.approx(total / 2 / 1e3)
    assert sum(c["share_of_step"] for c in res["categories"].values()) == pytest.approx(total / 4000.0)
    assert res["idle_share"] == pytest.approx(0.25) and res["busy_ms_per_step"] == pytest.approx(1.5)
    assert res["top"][0]["name"] == "nvjet_tst_lm_head" and res["top"][0]["category"] == "loss"
    assert len(res["top"]) == 5 and res["top"][0]["calls_per_step"] == 0.5
    assert list(res["categories"])[0] == "loss"  # ordered by time


def test_busy_time_is_the_union_of_overlapping_intervals():
    assert ps.union_us([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25
    assert ps.union_us([]) == 0


def test_a_variant_needs_a_label():
    """One parser for profile_step's --variant and train_throughput's --also (train_throughput.variant)."""
    assert ps.tt.variant('off=--include_num_input_tokens_seen no') == ("off", ["--include_num_input_tokens_seen", "no"])
    assert ps.tt.variant("base=") == ("base", [])
    assert ps.tt.variant("fewer-syncs=--logging_steps 10") == ("fewer-syncs", ["--logging_steps", "10"])
    for bad in ("--packing false", "=--packing false", "a b=--x", "../x=--y"):
        with pytest.raises(Exception, match="LABEL=OPTIONS"):
            ps.tt.variant(bad)
    assert ps.parser().parse_args(["--variant", "base="]).variant == [("base", [])]
    label, extra = ps.tt.variant("keep=TRAINBOX_MLP_RECOMPUTE=0 --packing false")
    assert ps.tt.split_env(extra) == ({"TRAINBOX_MLP_RECOMPUTE": "0"}, ["--packing", "false"])
    assert ps.tt.split_env(["--output_dir=x"]) == ({}, ["--output_dir=x"])  # options stay options


def test_cpu_smoke_profiles_trainbox_sft_in_process(tmp_path):
    out = tmp_path / "profile.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "profile_step.py"), "--device", "cpu", "--warm", "3",
                        "--active", "2", "--skip", "1", "--json", str(out), "--trace", str(tmp_path / "t" / "tr.json"),
                        "--work", str(tmp_path / "w")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (res,) = json.loads(out.read_text())
    assert res["profiled_steps"] == [4, 5] and res["unprofiled_steps"] == [2, 2]
    assert sum(c["share_of_kernels"] for c in res["categories"].values()) == pytest.approx(1.0)
    # TRL's fused LM head (forward and backward) and the decoder's matmuls were seen and told apart
    assert res["categories"]["loss"]["ms_per_step"] > 0 and res["categories"]["matmul"]["ms_per_step"] > 0
    assert res["categories"]["optimizer"]["ms_per_step"] > 0
    assert res["real_tokens_per_step"] > 0 and res["wall_ms_per_step"] > 0
    assert Path(res["trace"]).is_file() and res["trace"].endswith("tr-uniform-default.json")
    assert "GPU idle" not in r.stdout and "kernels:" in r.stdout  # CPU: no busy/idle split


def test_cpu_smoke_takes_another_shape(tmp_path):
    """--shape: gpt-oss's layout (sinks, windows on every other layer, MoE), tiny, through FlexAttention's CPU path."""
    out = tmp_path / "profile.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "profile_step.py"), "--device", "cpu", "--shape",
                        "gpt-oss-2b", "--warm", "3", "--active", "1", "--json", str(out),
                        "--work", str(tmp_path / "w")],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (res,) = json.loads(out.read_text())
    assert res["attn"] == "trainbox_flex" and res["packing"] and res["real_tokens_per_step"] > 0
    conf = json.loads((tmp_path / "w" / "tiny-gpt-oss-2b" / "config.json").read_text())
    assert conf["model_type"] == "gpt_oss" and conf["num_hidden_layers"] == 2


def test_cpu_smoke_profiles_qlora_and_a_variants_settings(tmp_path):
    """--command qlora: bitsandbytes' dequantize kernels get their own category; a variant's NAME=VALUE item is a
    setting of its run (TRAINBOX_LORA_FUSED=0: PEFT's path, so no fused LoRA4bit ops), not an option."""
    out = tmp_path / "profile.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "profile_step.py"), "--device", "cpu", "--command",
                        "qlora", "--warm", "3", "--active", "1", "--top", "60", "--variant", "fused=",
                        "--variant", "peft=TRAINBOX_LORA_FUSED=0", "--json", str(out), "--work", str(tmp_path / "w")],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    runs = {res["variant"]: res for res in json.loads(out.read_text())}
    assert set(runs) == {"fused", "peft"}
    for res in runs.values():
        assert res["command"] == "qlora" and res["gradient_checkpointing"] and res["real_tokens_per_step"] > 0
        assert res["categories"]["dequantize"]["ms_per_step"] > 0
    names = {v: {t["name"] for t in res["top"]} for v, res in runs.items()}
    assert "LoRA4bit" in names["fused"] and "LoRA4bit" not in names["peft"]


def test_the_measure_hook_profiles_steps_after_the_timed_ones(tmp_path, capsys):
    """train_throughput's hook with BENCH_KERNELS=A:B (qlora --kernels): steps A+1..B run under the profiler (each
    op's time on a CPU run) into LABEL.json.kernels, and the rate is measured up to step A only."""
    tt = ps.tt
    model = tt.make_model(tmp_path / "tiny", "llama-1b", device="cpu", **ps.tiny("llama-1b"))
    data = tt.write_chat(tmp_path / "data", tt.lengths("uniform", 24, 64))
    argv = [sys.executable, "-m", "trainbox", "sft", "--dataset", str(data / "train.jsonl"), "--output_dir",
            str(tmp_path / "o"), "--max_steps", "5", "--resume", "never", "--use_cpu", "true",
            *tt.sft_common(model, 64, 2)]
    res = tt.run("k", argv, tmp_path, tmp_path / "log", {"BENCH_KERNELS": "3:5", "BENCH_SKIP": "1"}, timeout=240)
    assert not res.get("failed"), (tmp_path / "log").read_text()[-3000:]
    assert res["steps"] == 1  # from the mark at step 2 to step 3's (5 steps, 3 without the hook's window)
    got = json.loads((tmp_path / "k.json.kernels").read_text())
    assert got["steps"] == 2 and any(name == "aten::mm" and us > 0 for name, us, _ in got["kernels"])
    # the choices the run printed, as the sft side by side reports them beside its figures
    assert any(line.startswith("packing") for line in tt.planned(tmp_path / "log", 0)), tt.planned(tmp_path / "log", 0)
    tt.kernel_table("k", tmp_path / "k.json.kernels")
    out = capsys.readouterr().out
    assert "KERNELS k:" in out and "[matmul] aten::mm" in out


def _events(linked: bool):
    """A profile's events as the parsed profiler gives them: the fused LM head's op and the GEMM it launched, a
    decoder GEMM, an optimizer step's kernel; GPU events name their CPU op by linked_correlation_id."""
    from types import SimpleNamespace as E

    from torch.autograd import DeviceType

    def cpu(id, name, parent=None, kernels=()):
        return E(id=id, name=name, cpu_parent=parent, device_type=DeviceType.CPU, is_async=False,
                 linked_correlation_id=0, kernels=list(kernels))

    def gpu(name, start, end, op):
        e = E(name=name, time_range=E(start=start, end=end), device_type=DeviceType.CUDA)
        if linked:
            e.linked_correlation_id = op
        return e

    head = cpu(1, "ChunkedLogProbFunction")
    opt = cpu(3, "Optimizer.step#AdamW.step")
    k = [("nvjet_tst_lm_head", 0, 50, 2), ("nvjet_tst_mlp", 40, 100, 4), ("multi_tensor_apply_kernel", 200, 210, 5)]
    ops = [head, cpu(2, "aten::mm", head, [E(name=k[0][0], duration=50)]), opt,
           cpu(4, "aten::mm", None, [E(name=k[1][0], duration=60)]),
           cpu(5, "aten::_foreach_add_", opt, [E(name=k[2][0], duration=10)])]
    return ops + [gpu(n, s, e, op) for n, s, e, op in k]


@pytest.mark.parametrize("linked", [True, False])
def test_gpu_kernels_take_the_region_they_were_launched_in(linked):
    kernels, busy = ps.device_kernels(_events(linked))
    assert busy == 110  # [0, 100) and [200, 210)
    assert sorted(kernels) == [("multi_tensor_apply_kernel", 10, "optimizer"), ("nvjet_tst_lm_head", 50, "loss"),
                               ("nvjet_tst_mlp", 60, None)]


class _Evt:
    """A profiler event as sources()/origin() read it."""

    def __init__(self, name, parent=None, device="CPU", id=0, link=0, us=0.0):
        from types import SimpleNamespace

        from torch.autograd import DeviceType

        self.name, self.cpu_parent, self.id, self.linked_correlation_id = name, parent, id, link
        self.device_type, self.is_async = getattr(DeviceType, device), False
        self.time_range = SimpleNamespace(start=0.0, end=us)


def test_sources_name_where_elementwise_kernels_come_from():
    """Each kernel goes to its launching op < the outermost aten op < the first op that is not aten; other
    categories and the optimizer's region are left out; ms per step over the profiled steps."""
    step = _Evt("ProfilerStep#9")
    bwd = _Evt("autograd::engine::evaluate_function: ToCopyBackward0", step)
    to = _Evt("aten::to", bwd)
    copy = _Evt("aten::copy_", _Evt("aten::_to_copy", to), id=1)
    opt = _Evt("aten::mul_", _Evt("Optimizer.step#AdamW.step", step), id=2)
    fwd_add = _Evt("aten::add", step, id=3)
    events = [step, bwd, to, copy, opt, fwd_add,
              _Evt("void at::native::unrolled_elementwise_kernel<direct_copy>", device="CUDA", link=1, us=300.0),
              _Evt("void at::native::unrolled_elementwise_kernel<direct_copy>", device="CUDA", link=1, us=100.0),
              _Evt("void at::native::vectorized_elementwise_kernel<mul>", device="CUDA", link=2, us=900.0),
              _Evt("void at::native::vectorized_elementwise_kernel<CUDAFunctor_add>", device="CUDA", link=3, us=200.0),
              _Evt("nvjet_sm90_tst_128x16", device="CUDA", link=3, us=5000.0)]
    got = ps.sources(events, ps.OTHER, top=5, steps=2)
    assert got == [{"origin": "aten::copy_ < aten::to < ToCopyBackward0", "ms_per_step": 0.2, "calls_per_step": 1.0},
                   {"origin": "aten::add < ProfilerStep#9", "ms_per_step": 0.1, "calls_per_step": 0.5}]
    assert ps.sources(events, ps.OTHER, top=1, steps=1)[0]["ms_per_step"] == pytest.approx(0.4)


def _event(name, start, end, device, id=0, linked=0, parent=None):
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), id=id, is_async=False,
                           device_type=DeviceType.CUDA if device else DeviceType.CPU, linked_correlation_id=linked,
                           cpu_parent=parent)


def test_gaps_are_the_gpus_idle_time_without_the_annotations():
    """The profiler mirrors the step's and the optimizer's ranges on the GPU's timeline (torch 2.11: no activity
    type on them): they are no work, and counted as work they hid every idle gap (session 27's first runs)."""
    op = _event("aten::mm", 0, 5, device=False, id=7)
    events = [op,
              _event("ProfilerStep*", 0, 100, device=True), _event("Optimizer.step#AdamW.step", 60, 90, device=True),
              _event("nvjet_a", 10, 20, device=True, linked=7), _event("nvjet_b", 15, 30, device=True),
              _event("triton_x", 45, 50, device=True), _event("Memcpy DtoD", 52, 60, device=True, linked=7)]
    assert [e.name for e in ps.device_activities(events)] == ["nvjet_a", "nvjet_b", "triton_x", "Memcpy DtoD"]
    kernels, busy = ps.launched(events)
    assert busy == 20 + 5 + 8 and sum(k[1] for k in kernels) == 10 + 15 + 5 + 8
    res = ps.gaps(events, top=5, steps=1)
    assert res["ms_per_step"] == pytest.approx((15 + 2) / 1e3)  # 30 -> 45 and 50 -> 52 (us)
    assert res["where"][0] == {"origin": "(kernel) triton_x", "ms_per_step": pytest.approx(0.015), "gaps_per_step": 1}
    assert res["where"][1]["origin"] == "aten::mm"  # the launching op, where the profile links one
