"""Ours vs the plain tool a user would run, each with its defaults, same data, same steps, one run.

    python benchmarks/train_throughput.py sft   [--steps 40] [--work DIR]   # trl sft vs trainbox sft (Llama-3.2-1B shape)
    python benchmarks/train_throughput.py sft --nproc 2 --kinds mix        # 8B shape on 2 GPUs, FSDP2 both sides
    python benchmarks/train_throughput.py sft --shape gemma2-1b --kinds mix # Gemma 2 (softcaps, window), 1.27 B
    python benchmarks/train_throughput.py sft --shape gpt-oss-2b --kinds mix # gpt-oss (sinks, window, MoE 8x top-2)
    python benchmarks/train_throughput.py sft --shape mixtral-2b --kinds mix # Mixtral (MoE 8x top-2, SwiGLU experts)
    python benchmarks/train_throughput.py sft --shape llama-8b --batch 2 --max-length 1024 --runs 2  # 8B, one GPU
    python benchmarks/train_throughput.py qlora [--steps 20] [--unsloth-site DIR]  # plain PEFT+bnb, Unsloth, trainbox (8B)
    python benchmarks/train_throughput.py grpo  [--steps 12] [--plain vllm|defaults]  # trl grpo vs trainbox grpo (1B)
    python benchmarks/train_throughput.py dpo   [--steps 20] [--runs 3]     # trl dpo vs trainbox dpo (1B, chat pairs)
    python benchmarks/train_throughput.py check                             # packed == alone with the GPU's kernel
    python benchmarks/train_throughput.py memory [--steps 6]                # 8B full sft on one GPU: peak memory

Models are random-init shapes built here, tokenizers are word-level ones built here (one token per word, so the
generated lengths are the token lengths), data is chat `messages` JSONL. Lengths: "mix" is lognormal (median 350
tokens, ~5 % over 1,500, capped at the max length), "uniform" is every row at the max length.

Measured the same way for every run: a sitecustomize hook (benchmarks/_measure) adds a callback to any transformers
Trainer that records, at each optimizer step end, a CUDA event and the trainer's count of real (non-padding) tokens,
and at the end the peak allocated memory and the logged losses. Rates are from the end of the first `--skip` steps
to the last step. MFU: (6N + 6 x layers x attention width x E[n^2]/E[n]) x real tokens/s / the GPU's dense bf16 peak,
with N the matmul parameters and n the example lengths, so padding is never counted as work. A first process warms
the GPU up; the runs then alternate (plain, ours, ours, plain).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {
    # Llama-3.2-1B: 1.24 B parameters, tied embeddings.
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
                     max_position_embeddings=4096),
    # Llama-3.1-8B.
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
                     max_position_embeddings=4096),
    # Gemma 2 at the Llama-1B size: 1.27 B parameters, head size 256, attention softcap 50, final softcap 30,
    # a 1,024-token window on every other layer (Gemma2Config's default layer types).
    "gemma2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=8,
                      num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, vocab_size=128256,
                      tie_word_embeddings=True, sliding_window=1024, attn_logit_softcapping=50.0,
                      final_logit_softcapping=30.0, max_position_embeddings=4096),
    # gpt-oss's layout (learned sinks, a 128-token window on every other layer, MoE, untied head) at 1.86 B
    # parameters (0.9 B active: top-2 of 8 experts), small enough to train in full on one GPU.
    "gpt-oss-2b": dict(hidden_size=2048, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=64, num_local_experts=8, num_experts_per_tok=2,
                       vocab_size=128256, tie_word_embeddings=False, sliding_window=128,
                       layer_types=["sliding_attention", "full_attention"] * 6),
    # Mixtral's layout (8 SwiGLU experts, top-2, no window, no biases) at 1.9 B parameters (0.6 B active).
    "mixtral-2b": dict(hidden_size=2048, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                       num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                       tie_word_embeddings=False, sliding_window=None, max_position_embeddings=4096),
}
CONFIG_CLASS = {"gemma2-1b": "Gemma2Config", "gpt-oss-2b": "GptOssConfig", "mixtral-2b": "MixtralConfig"}  # else Llama
WORDS = 4000
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def make_tokenizer(path: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<|pad|>", "<|bos|>", "<|end|>", "<|unk|>", "<|system|>", "<|user|>", "<|assistant|>"]
    vocab = {t: i for i, t in enumerate(special + [f"w{i}" for i in range(WORDS)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>",
                                   eos_token="<|end|>", unk_token="<|unk|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)


def make_model(path: Path, shape: str, device: str = "cuda", **overrides) -> Path:
    """The shape's random-init bf16 model and the word-level tokenizer in `path` (kept if already there);
    `overrides`: config fields over the shape's (profile_step.py's CPU smoke: a tiny Llama)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    if (path / "config.json").is_file():
        return path
    conf = getattr(transformers, CONFIG_CLASS.get(shape, "LlamaConfig"))(**{**SHAPES[shape], **overrides},
                                                                         pad_token_id=0, bos_token_id=1,
                                                                         eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(conf).to(torch.bfloat16)
    model.save_pretrained(path)
    make_tokenizer(path)
    del model
    torch.cuda.empty_cache()
    return path


def lengths(kind: str, n: int, max_len: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    if kind == "uniform":
        return [max_len] * n
    mu, sigma = math.log(350), (math.log(1500) - math.log(350)) / 1.645  # median 350, P(>1500) = 5 %
    return [max(16, min(max_len, int(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


# Template overhead per row: "<|user|> ... <|end|> <|assistant|> ... <|end|>" = 4 tokens around the words.
OVERHEAD = 4


def write_chat(path: Path, lens: list[int], seed: int = 0) -> Path:
    rng = random.Random(seed)
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "train.jsonl", "w") as f:
        for n in lens:
            words = [f"w{rng.randrange(WORDS)}" for _ in range(max(2, n - OVERHEAD))]
            cut = max(1, len(words) // 4)
            f.write(json.dumps({"messages": [{"role": "user", "content": " ".join(words[:cut])},
                                             {"role": "assistant", "content": " ".join(words[cut:])}]}) + "\n")
    return path


def flops_per_token(model: Path, lens: list[int]) -> float:
    """The trainers' own formula (throughput.flops_per_token: 6N over the parameters a token goes through, MoE top-k
    of E, plus causal attention, windowed layers counting their window) for the model built here."""
    from trainbox.run import throughput
    from trainbox.training import modelfacts

    return throughput.flops_per_token(modelfacts.model_facts(str(model)), lens)


# Name patterns, first match wins: attention before matmul (FA3's kernels are cutlass::device_kernel<flash::..Sm90>),
# loss before the rest (liger's fused linear CE runs GEMMs of its own).
CATEGORIES = [
    ("communication", r"nccl"),
    ("loss", r"cross_?entropy|fused_linear|logprob|log_softmax|nll_loss"),
    ("dequantize", r"dequant"),  # bitsandbytes' 4-bit weights to bf16 before each GEMM (qlora)
    ("optimizer", r"adam|foreach|multi_tensor|optimizer"),
    ("attention", r"flash|fmha|flex|attention|triton_tem|sdpa|_efficient_attention"),
    ("norms+activations", r"rms|norm|silu|swiglu|rope|rotary|gelu|act_and_mul"),
    ("matmul", r"gemm|cutlass|nvjet|xmma|sm90|sm80|wgmma|aten::mm|aten::addmm|aten::bmm|matmul|linear"),
]
OTHER = "elementwise/copies/casts"
ORDER = [c for c, _ in CATEGORIES] + [OTHER]
_COMPILED = [(c, re.compile(p, re.I)) for c, p in CATEGORIES]


def categorize(name: str) -> str:
    """A kernel's (or CPU op's) category from its name (profile_step.py's categories too)."""
    return next((c for c, rx in _COMPILED if rx.search(name)), OTHER)


def summarize(kernels: list[tuple], wall_us: float, busy_us: float | None, steps: int, top: int = 15) -> dict:
    """kernels: (name, microseconds, category or None: from the name[, calls: 1 if absent]). Shares of kernel time
    sum to 1; shares of the step are of the wall time (idle is the rest when busy is known)."""
    total = sum(k[1] for k in kernels) or 1.0
    by_cat = {c: 0.0 for c in ORDER}
    by_name: dict[str, list] = {}
    for name, us, cat, *calls in kernels:
        cat = cat or categorize(name)
        by_cat[cat] += us
        entry = by_name.setdefault(name, [0.0, 0, cat])
        entry[0] += us
        entry[1] += calls[0] if calls else 1
    cats = {c: {"ms_per_step": us / steps / 1e3, "share_of_kernels": us / total, "share_of_step": us / wall_us}
            for c, us in sorted(by_cat.items(), key=lambda kv: -kv[1])}
    tops = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "wall_ms_per_step": wall_us / steps / 1e3,
        "kernel_ms_per_step": total / steps / 1e3,
        "busy_ms_per_step": None if busy_us is None else busy_us / steps / 1e3,
        "busy_share": None if busy_us is None else busy_us / wall_us,
        "idle_share": None if busy_us is None else 1 - busy_us / wall_us,
        "categories": cats,
        "top": [{"name": n, "category": cat, "ms_per_step": us / steps / 1e3, "calls_per_step": k / steps,
                 "share_of_kernels": us / total} for n, (us, k, cat) in tops],
    }


def kernel_table(label: str, path: Path, top: int = 10) -> None:
    """The kernels BENCH_KERNELS profiled in a run (the hook's LABEL.json.kernels): GPU ms a step by category (by
    name alone: no launching op here, so an LM head's GEMMs count as matmul) and the `top` costliest kernels."""
    if not path.is_file():
        return
    got = json.loads(path.read_text())
    kernels = [(name, us, None, calls) for name, us, calls in got["kernels"]]
    res = summarize(kernels, sum(k[1] for k in kernels) or 1.0, None, got["steps"], top)
    print(f"KERNELS {label}: {res['kernel_ms_per_step']:.1f} GPU ms a step over {got['steps']} profiled steps: "
          + ", ".join(f"{c} {v['ms_per_step']:.1f}" for c, v in res["categories"].items() if v["ms_per_step"] > 0),
          flush=True)
    for k in res["top"]:
        print(f"KERNELS {label}: {k['ms_per_step']:8.2f} ms x{k['calls_per_step']:<5.0f} [{k['category']}] "
              f"{k['name'][:120]}", flush=True)


MEASURE = '''
import json, os, time
if os.environ.get("BENCH_FIRST_IMPORT"):  # Unsloth patches transformers and TRL on import: it must come first
    __import__(os.environ["BENCH_FIRST_IMPORT"])
_out = os.environ.get("BENCH_MEASURE")
if _out and os.environ.get("RANK", "0") != "0":  # several processes: one file per rank, joined by run()
    _out = f"{_out}.rank{os.environ['RANK']}"
if _out:
    import transformers
    from transformers import TrainerCallback

    _phases = []  # GRPO: (end time, name, seconds) of TRL's own profiled sections (generate, sync_weights, rewards)
    if os.environ.get("BENCH_PHASES"):
        try:
            from trl.extras import profiling as _prof
            _log = _prof.ProfilingContext._log_metrics
            def _log_metrics(self, duration):
                _phases.append((time.perf_counter(), self.name, duration))
                return _log(self, duration)
            _prof.ProfilingContext._log_metrics = _log_metrics
        except Exception:
            pass

    # "A:B": steps A+1..B run under torch's profiler (GPU kernels by name into LABEL.json.kernels), after the
    # timed steps: the rate is measured up to step A only
    _kern = [int(x) for x in os.environ.get("BENCH_KERNELS", "").split(":") if x]

    class _Measure(TrainerCallback):
        def __init__(self, trainer):
            self.trainer, self.marks, self.losses, self.num_tokens, self.rewards = trainer, [], [], [], []
            self.series, self.device_peak = {}, 0  # GRPO: completion lengths, sampler log-prob diagnostics
        def on_train_begin(self, args, state, control, **kw):
            # Wrapped here, on the instance, once every __init__ has run: a library that replaces training_step
            # as its trainer is made (Unsloth) stays counted.
            from collections.abc import Mapping
            import torch
            tr, inner = self.trainer, self.trainer.training_step
            def training_step(model, inputs, *a, **k):
                # Real tokens of this micro-batch, summed on the GPU (no host sync): the mask where there is
                # padding, every position of a padding-free (flattened) batch.
                if isinstance(inputs, Mapping):  # GRPO: raw prompts; its tokens come from the logged num_tokens
                    n = (inputs["attention_mask"].sum() if "attention_mask" in inputs
                         else torch.tensor(inputs["input_ids"].numel()))
                    n = n.to(inputs["input_ids"].device, torch.int64)
                    tr._bench_tokens = n if not hasattr(tr, "_bench_tokens") else tr._bench_tokens + n
                return inner(model, inputs, *a, **k)
            tr.training_step = training_step
        def on_step_end(self, args, state, control, **kw):
            import torch
            ev = None
            if torch.cuda.is_available():  # CPU smoke runs: wall time only
                ev = torch.cuda.Event(enable_timing=True); ev.record()
                if os.environ.get("BENCH_DEVICE_MEM"):  # what the whole process holds (vLLM's pool included)
                    free, total = torch.cuda.mem_get_info()
                    self.device_peak = max(self.device_peak, total - free)
            tokens = getattr(self.trainer, "_bench_tokens", None)
            self.marks.append((state.global_step, ev, tokens.clone() if tokens is not None else torch.zeros(()),
                               time.perf_counter()))
            if _kern and state.global_step == _kern[0]:
                if ev is not None:
                    torch.cuda.synchronize()
                acts = [torch.profiler.ProfilerActivity.CPU]
                if ev is not None:
                    acts.append(torch.profiler.ProfilerActivity.CUDA)
                self.prof = torch.profiler.profile(activities=acts)
                self.prof.start()
            elif _kern and state.global_step == _kern[1] and getattr(self, "prof", None):
                import re
                from torch.autograd import DeviceType
                if ev is not None:
                    torch.cuda.synchronize()
                self.prof.stop()
                by = {}
                if ev is not None:
                    for e in self.prof.events():  # the GPU's own work, not the annotations put on its timeline
                        if e.device_type == DeviceType.CUDA and not re.search(r"^ProfilerStep|#", e.name):
                            d = by.setdefault(e.name, [0.0, 0])
                            d[0] += e.time_range.end - e.time_range.start
                            d[1] += 1
                else:  # a CPU run: each op's own time (the plumbing, not a GPU profile)
                    by = {k.key: [k.self_cpu_time_total, k.count] for k in self.prof.key_averages()
                          if k.self_cpu_time_total > 0}
                json.dump({"steps": _kern[1] - _kern[0], "kernels": [[n, us, c] for n, (us, c) in by.items()]},
                          open(_out + ".kernels", "w"))
                self.prof = None
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.losses.append((state.global_step, logs["loss"]))
            if logs and "reward" in logs:  # GRPO: the mean reward of the step's completions
                self.rewards.append((state.global_step, logs["reward"]))
            if logs and "num_tokens" in logs:  # GRPO: prompt + completion tokens so far (its batches are rollouts)
                self.num_tokens.append((state.global_step, logs["num_tokens"]))
            for k, v in (logs or {}).items():
                if k.startswith(("completions/", "sampling/")) and isinstance(v, (int, float)):
                    self.series.setdefault(k, []).append((state.global_step, v))
            if os.environ.get("BENCH_EACH_STEP") and len(self.marks) >= 2:  # a run cut short keeps its steps so far
                self.dump(args)
        def on_train_end(self, args, state, control, **kw):
            self.dump(args, complete=True)
        def dump(self, args, complete=False):
            import torch
            m = [x for x in self.marks if not _kern or x[0] <= _kern[0]]
            skip = int(os.environ.get("BENCH_SKIP", "5"))
            a, b = m[min(skip, len(m) - 2)], m[-1]
            if a[1] is not None:
                torch.cuda.synchronize()
                secs = a[1].elapsed_time(b[1]) / 1000
            else:
                secs = b[3] - a[3]
            cuda = torch.cuda.is_available()
            tok = int((b[2] - a[2]).item())
            phases = {}
            for end, name, d in _phases:  # per step, over the same steady window as `seconds`
                if a[3] < end <= b[3]:
                    phases[name] = phases.get(name, 0.0) + d / max(1, b[0] - a[0])
            json.dump({"steps": b[0] - a[0], "seconds": secs, "real_tokens": tok,
                       "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
                       "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else 0.0,
                       "peak_device_gib": self.device_peak / 2**30, "losses": self.losses,
                       "num_tokens": self.num_tokens, "rewards": self.rewards, "phases": phases,
                       "series": self.series,
                       "gradient_checkpointing": bool(args.gradient_checkpointing),
                       "packing": bool(getattr(args, "packing", False)),
                       "padding_free": bool(getattr(args, "padding_free", False)),
                       "liger": bool(getattr(args, "use_liger_kernel", False) or getattr(args, "trainbox_liger", False)),
                       "attn": str(getattr(self.trainer.model.config, "_attn_implementation", "?")),
                       "param_dtype": str(next(self.trainer.model.parameters()).dtype), "complete": complete},
                      open(_out + ".tmp", "w"))
            os.replace(_out + ".tmp", _out)  # whole or not at all: a run killed mid-write keeps the last figures

    _init = transformers.Trainer.__init__
    def __init__(self, *a, **k):
        _init(self, *a, **k)
        self.add_callback(_Measure(self))
    transformers.Trainer.__init__ = __init__
'''


def measured_env(work: Path, label: str) -> tuple[dict, Path]:
    hook = work / "_measure"
    hook.mkdir(parents=True, exist_ok=True)
    (hook / "sitecustomize.py").write_text(MEASURE)
    out = work / f"{label}.json"
    for stale in (out, *work.glob(f"{label}.json.rank*")):
        stale.unlink(missing_ok=True)
    env = dict(os.environ, BENCH_MEASURE=str(out), TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(hook), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return env, out


ENV_ITEM = re.compile(r"[A-Z][A-Z0-9_]*=.*")


def split_env(extra: list[str]) -> tuple[dict, list[str]]:
    """A variant's items: NAME=VALUE (upper-case NAME) set the run's environment, the rest are its options."""
    env = dict(t.split("=", 1) for t in extra if ENV_ITEM.fullmatch(t))
    return env, [t for t in extra if not ENV_ITEM.fullmatch(t)]


def run(label: str, argv: list[str], work: Path, log: Path, extra_env: dict | None = None,
        timeout: float | None = None) -> dict:
    """One measured run; `timeout` (seconds): past it the run and its children (a launcher's, which hold the GPU) are
    killed and the run counts as failed, with the figures of the steps it finished where BENCH_EACH_STEP=1 wrote
    them ("cut": True)."""
    env, out = measured_env(work, label)
    env.update(extra_env or {})
    t = time.time()
    with open(log, "a") as f:
        f.write(f"\n===== {label}: {' '.join(argv)}\n")
        f.flush()
        proc = subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            import psutil

            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
            proc.wait()
            code = f"killed after {timeout:.0f} s"
    if "--output_dir" in argv:  # only the figures are kept: four 8B runs' saved weights (32 GB each) fill a disk
        shutil.rmtree(argv[argv.index("--output_dir") + 1], ignore_errors=True)
    if code != 0 or not out.is_file():
        print(f"{label}: FAILED (exit {code}); see {log}", flush=True)
        os.system(f"tail -n 30 {log}")
        # What was measured up to the end of training (a failed save comes after it) is still reported.
        return {**(json.loads(out.read_text()) if out.is_file() else {}), "label": label, "failed": True,
                "cut": isinstance(code, str)}
    res = json.loads(out.read_text())
    ranks = [json.loads(p.read_text()) for p in sorted(out.parent.glob(out.name + ".rank*"))]
    if ranks:  # several processes: real tokens/s per GPU is the mean of the ranks' own rates; peak is the largest
        every = [res, *ranks]
        res["per_gpu_tokens_per_s"] = sum(r["real_tokens"] / r["seconds"] for r in every) / len(every)
        res["peak_gib"] = max(r["peak_gib"] for r in every)
        res["ranks"] = len(every)
    res.update(label=label, wall=time.time() - t)
    return res


def peak_tflops() -> float:
    import torch

    from trainbox.run.throughput import peak_tflops as peak

    return peak(torch.cuda.get_device_name()) or 989.4


def usable(res: dict) -> bool:
    """Figures to report: a finished run's, or those a run cut at its timeout wrote for the steps it finished."""
    return "seconds" in res and res.get("steps", 0) > 0 and (not res.get("failed") or res.get("cut", False))


def show(res: dict, fpt: float, peak: float) -> dict:
    if not usable(res):
        return res
    res["tokens_per_s"] = res.get("per_gpu_tokens_per_s") or res["real_tokens"] / res["seconds"]  # per GPU
    res["mfu"] = fpt * res["tokens_per_s"] / (peak * 1e12)
    print(f"RESULT {json.dumps({k: v for k, v in res.items() if k != 'losses'})}", flush=True)
    print(f"  {res['label']:<28} {res['tokens_per_s']:>9,.0f} real tok/s  MFU {100 * res['mfu']:5.1f} %  "
          f"peak {res['peak_gib']:5.1f} GiB  attn={res['attn']} packing={res['packing']} "
          f"padding_free={res['padding_free']} ckpt={res['gradient_checkpointing']} liger={res['liger']} "
          f"params={res['param_dtype']}" + (f" (cut at its timeout after {res['steps']} timed steps)"
                                             if res.get("cut") else ""), flush=True)
    return res


def planned(log: Path, start: int) -> list[str]:
    """The choices trainbox printed in the log since byte `start` (one run's part): its memory plan, checkpointing,
    precision and packing lines, without the `[trainbox] ` prefix."""
    text = log.read_text(errors="replace")[start:] if log.is_file() else ""
    return re.findall(r"^\[trainbox\] ((?:memory plan|gradient checkpointing|precision|packing).*)$", text, re.M)


def sft_common(model: Path, max_length: int = 2048, batch: int = 8) -> list[str]:
    """The options both sft runs share (trl sft and trainbox sft; profile_step.py runs ours with them too). Logging
    is each tool's default (every 10 steps on both): a log line reads the loss, the gradient norm and the metrics
    from the GPU, and logging every step would time those reads instead of what users run."""
    return ["--model_name_or_path", str(model), "--max_length", str(max_length), "--per_device_train_batch_size",
            str(batch), "--save_strategy", "no", "--report_to", "none", "--seed", "0", "--disable_tqdm", "true"]


def sft(a) -> None:
    """One GPU: the Llama-3.2-1B shape. `--nproc N` (N > 1): the Llama-3.1-8B shape on N GPUs, `trl sft` launched as
    TRL's docs say (`--accelerate_config fsdp2 --num_processes N`: accelerate with TRL's FSDP2 config) vs `trainbox
    sft --nproc-per-node N` (torchrun, its FSDP2 defaults); rates are real tokens/s per GPU, peaks the largest rank's."""
    work = Path(a.work)
    log = work / "sft.log"
    shape = a.shape or ("llama-1b" if a.nproc == 1 else "llama-8b")
    model = make_model(work / shape, shape)
    peak = peak_tflops()
    common = sft_common(model, a.max_length, a.batch)
    py = sys.executable
    launch_trl = ["--accelerate_config", "fsdp2", "--num_processes", str(a.nproc)] if a.nproc > 1 else []
    launch_ours = ["--nproc-per-node", str(a.nproc)] if a.nproc > 1 else []

    def trl(data, out, steps):
        return [py, "-m", "trl.cli.main", "sft", *launch_trl, "--dataset_name", str(data), "--output_dir", str(out),
                "--max_steps", str(steps), *common]

    def ours(data, out, steps, *extra):
        return [py, "-m", "trainbox", "sft", *launch_ours, "--dataset", str(data / "train.jsonl"), "--output_dir",
                str(out), "--max_steps", str(steps), "--resume", "never", *common, *extra]

    results = {}
    for kind in a.kinds:
        lens = lengths(kind, a.steps * a.batch * 6 * a.nproc, a.max_length)
        data = write_chat(work / f"data-{kind}", lens)
        fpt = flops_per_token(model, lens)
        print(f"# sft {shape} {kind}: {len(lens)} rows, median {sorted(lens)[len(lens) // 2]} tokens, "
              f"{100 * sum(n > 1500 for n in lens) / len(lens):.1f} % over 1,500; {fpt / 1e9:.2f} GFLOP/token", flush=True)
        if a.loss_only:  # every step's loss, on both sides
            every = ["--logging_steps", "1"]
            results["mix-trl-0"] = show(run("mix-trl-0", trl(data, work / "o-lt", a.steps) + every, work, log), fpt,
                                        peak)
            label = "mix-ours-nopacking"
            results[label] = show(run(label, ours(data, work / f"o-{label}", a.steps, "--packing", "false", *every),
                                      work, log), fpt, peak)
            break
        if not results and a.warmup:  # warm-up process on a fresh GPU: not reported
            run("warmup", ours(data, work / "o-warm", 8), work, log)
        order = ([("trl", trl, []), ("ours", ours, []), ("ours", ours, []), ("trl", trl, [])] if kind == "mix" else
                 [("ours", ours, []), ("trl", trl, [])])[: a.runs]
        order += [(f"ours+{name}", ours, extra) for name, extra in a.also]
        for i, (who, fn, extra) in enumerate(order):
            label = f"{kind}-{who}-{i}"
            env, opts = split_env(extra)
            start = log.stat().st_size if log.is_file() else 0
            results[label] = show(run(label, fn(data, work / f"o-{label}", a.steps) + opts, work, log, env), fpt,
                                  peak)
            results[label]["plan"] = planned(log, start)
            for line in results[label]["plan"]:
                print(f"PLAN {label}: {line}", flush=True)
        if kind == "mix" and a.loss_check:
            # Same batches as plain TRL (padded, no packing): the loss per step must match TRL's.
            label = "mix-ours-nopacking"
            # Same max_steps as the TRL runs: the learning-rate schedule decays over max_steps.
            results[label] = show(run(label, ours(data, work / f"o-{label}", a.steps, "--packing", "false"), work,
                                      log), fpt, peak)
    summarize_sft(results, a.max_length)
    json.dump(results, open(work / "sft-results.json", "w"), indent=1, default=str)


def summarize_sft(results: dict, max_length: int = 2048) -> None:
    def rate(prefix):
        xs = [r["tokens_per_s"] for k, r in results.items()
              if k.startswith(prefix) and k[len(prefix):].lstrip("-").isdigit() and "tokens_per_s" in r]
        return sum(xs) / len(xs) if xs else None

    ranks = max((r.get("ranks", 1) for r in results.values()), default=1)
    per = f" per GPU ({ranks} GPUs)" if ranks > 1 else ""
    for kind in ("mix", "uniform"):
        o, t = rate(f"{kind}-ours"), rate(f"{kind}-trl")
        if o and t:
            print(f"SUMMARY sft {kind}: ours {o:,.0f} vs trl sft {t:,.0f} real tok/s{per} = {o / t:.2f}x", flush=True)
    for who in ("ours", "trl"):
        peaks = [r["peak_gib"] for k, r in results.items() if f"-{who}-" in k and "peak_gib" in r]
        failed = [k for k, r in results.items() if f"-{who}-" in k and r.get("failed")]
        if peaks or failed:
            print(f"SUMMARY sft {who}: peak {max(peaks, default=0):.2f} GiB{' per GPU' if ranks > 1 else ''}"
                  + (f"; FAILED: {', '.join(failed)}" if failed else ""), flush=True)
    mfu = [r["mfu"] for k, r in results.items() if k.startswith("uniform-ours") and "mfu" in r]
    if mfu:
        print(f"SUMMARY sft uniform {max_length}: ours MFU {100 * max(mfu):.1f} %", flush=True)
    ref = results.get("mix-trl-0", {}).get("losses")
    mine = results.get("mix-ours-nopacking", {}).get("losses")
    if ref and mine:
        pairs = [(a[1], b[1]) for a, b in zip(ref[:20], mine[:20])]
        worst = max(abs(x - y) / abs(x) for x, y in pairs)
        at = ",".join(str(a[0]) for a in ref[:len(pairs)])
        print(f"SUMMARY sft loss logged at steps {at} (each the mean since the last), same batches: max relative "
              f"difference {100 * worst:.2f} % "
              f"(trl {pairs[0][0]:.4f}->{pairs[-1][0]:.4f}, ours {pairs[0][1]:.4f}->{pairs[-1][1]:.4f})", flush=True)


def write_pairs(path: Path, n: int, max_len: int, seed: int = 0) -> tuple[Path, list[int]]:
    """Chat preference pairs with long tails: prompt and completions lognormal (medians 120 and 240 words), each
    pair fitting `max_len`. The preference is learnable (chosen answers draw their words from the first half of the
    word list, rejected ones from the second), so that the loss falls and the two sides' curves differ by more than
    bf16's noise: on pairs with no preference the loss stays at ln 2 give or take the policy's random drift, which
    is all rounding. Returns the folder (train.jsonl) and the token length of every row a batch holds (prompt +
    chosen, prompt + rejected)."""
    rng = random.Random(seed)
    path.mkdir(parents=True, exist_ok=True)

    def draw(median):
        return max(4, int(rng.lognormvariate(math.log(median), (math.log(1500) - math.log(350)) / 1.645)))

    rows = []
    with open(path / "train.jsonl", "w") as f:
        for _ in range(n):
            p = min(draw(120), max_len // 2)
            c, r = (min(draw(240), max_len - p - 2 * OVERHEAD) for _ in range(2))
            text = [" ".join(f"w{lo + rng.randrange(span)}" for _ in range(k))
                    for k, (lo, span) in zip((p, c, r), ((0, WORDS), (0, WORDS // 2), (WORDS // 2, WORDS // 2)))]
            f.write(json.dumps({"prompt": [{"role": "user", "content": text[0]}],
                                "chosen": [{"role": "assistant", "content": text[1]}],
                                "rejected": [{"role": "assistant", "content": text[2]}]}) + "\n")
            rows += [p + c + OVERHEAD, p + r + OVERHEAD]
    return path, rows


def dpo(a) -> None:
    """`trl dpo` with its defaults vs `trainbox dpo`, one GPU, the Llama-3.2-1B shape (or --shape), long-tailed chat
    pairs, batch 4 pairs x 2048 tokens on both sides. TRL's DPOTrainer pads; ours packs each batch's rows in its
    forward only (kernels/packedrows.py), so the two see the same batches: the losses logged at every step must
    agree within 1 %. MFU counts the reference forward
    (8N per token, not 6N)."""
    work = Path(a.work)
    log = work / "dpo.log"
    shape = a.shape or "llama-1b"
    model = make_model(work / shape, shape)
    peak = peak_tflops()
    common = ["--model_name_or_path", str(model), "--max_length", "2048", "--per_device_train_batch_size", "4",
              "--save_strategy", "no", "--report_to", "none", "--seed", "0", "--disable_tqdm", "true",
              "--logging_steps", "1"]  # every step's loss on both sides: the same batches compared step by step
    if a.lr:
        common += ["--learning_rate", str(a.lr)]
    data, rows = write_pairs(work / "data-pairs", a.steps * 4 * 2, 2048)
    fpt = flops_per_token(model, rows) * 8 / 6
    print(f"# dpo {shape}: {len(rows) // 2} pairs, row median {sorted(rows)[len(rows) // 2]} tokens, "
          f"{100 * sum(n > 1500 for n in rows) / len(rows):.1f} % over 1,500; {fpt / 1e9:.2f} GFLOP/token; "
          f"learning rate {a.lr or 'TRL default 1e-6'}", flush=True)
    py = sys.executable

    def trl(out, steps):
        return [py, "-m", "trl.cli.main", "dpo", "--dataset_name", str(data), "--output_dir", str(out),
                "--max_steps", str(steps), *common]

    def ours(out, steps):
        return [py, "-m", "trainbox", "dpo", "--dataset", str(data / "train.jsonl"), "--output_dir", str(out),
                "--max_steps", str(steps), "--resume", "never", *common]

    if a.warmup:
        run("warmup", ours(work / "o-warm", 6), work, log)
    results = {}
    order = [("trl", trl, []), ("ours", ours, []), ("ours", ours, []), ("trl", trl, [])][: a.runs]
    order += [(f"ours+{name}", ours, extra) for name, extra in a.also]
    order += [(f"trl+{name}", trl, extra) for name, extra in a.also_plain]
    for i, (who, fn, extra) in enumerate(order):
        label = f"pairs-{who}-{i}"
        env, opts = split_env(extra)
        results[label] = show(run(label, fn(work / f"o-{label}", a.steps) + opts, work, log, env), fpt, peak)
    rate = {who: [r["tokens_per_s"] for k, r in results.items() if k.split("-")[1] == who and "tokens_per_s" in r]
            for who in ("ours", "trl")}
    if rate["ours"] and rate["trl"]:
        o, t = (sum(v) / len(v) for v in (rate["ours"], rate["trl"]))
        print(f"SUMMARY dpo: ours {o:,.0f} vs trl dpo {t:,.0f} real tok/s = {o / t:.2f}x", flush=True)
    for who in ("ours", "trl"):
        peaks = [r["peak_gib"] for k, r in results.items() if k.split("-")[1] == who and "peak_gib" in r]
        if peaks:
            print(f"SUMMARY dpo {who}: peak {max(peaks):.2f} GiB", flush=True)
    ref, mine = results.get("pairs-trl-0", {}).get("losses"), results.get("pairs-ours-1", {}).get("losses")
    if ref and mine:
        pairs = [(x[1], y[1]) for x, y in zip(ref, mine)]
        worst = max(abs(x - y) / abs(x) for x, y in pairs)
        print(f"SUMMARY dpo loss at steps {ref[0][0]}-{ref[len(pairs) - 1][0]}, same batches: max relative difference "
              f"{100 * worst:.2f} % (trl {pairs[0][0]:.4f}->{pairs[-1][0]:.4f}, ours {pairs[0][1]:.4f}->"
              f"{pairs[-1][1]:.4f})", flush=True)
        print("DPO loss step  " + " ".join(f"{x[0]:>6}" for x in ref[:len(pairs)]), flush=True)
        print("DPO loss trl   " + " ".join(f"{x:6.4f}" for x, _ in pairs), flush=True)
        print("DPO loss ours  " + " ".join(f"{y:6.4f}" for _, y in pairs), flush=True)
        for label, res in results.items():  # --also / --also-plain runs: e.g. trl in bf16, the rounding's own spread
            extra = res.get("losses")
            if extra and label not in ("pairs-trl-0", "pairs-ours-1"):
                worst = max(abs(x - y[1]) / abs(x) for (x, _), y in zip(pairs, extra))
                print(f"DPO loss {label} " + " ".join(f"{y[1]:6.4f}" for y in extra[:len(pairs)])
                      + f"  (max {100 * worst:.2f} % from trl-0)", flush=True)
        means = [(sum(x for x, _ in pairs[i:i + 10]) / len(pairs[i:i + 10]),
                  sum(y for _, y in pairs[i:i + 10]) / len(pairs[i:i + 10])) for i in range(0, len(pairs), 10)]
        print("SUMMARY dpo loss, means of 10 steps (what TRL logs by default): " + ", ".join(
            f"trl {x:.4f} ours {y:.4f} ({100 * abs(x - y) / x:.2f} %)" for x, y in means), flush=True)
    json.dump(results, open(work / "dpo-results.json", "w"), indent=1, default=str)


PLAIN_QLORA = '''
"""A plain PEFT + bitsandbytes QLoRA script, as the PEFT/bitsandbytes docs show it: nf4 + double quant, bf16
compute, LoRA r16 on all linear layers, gradient checkpointing, paged 8-bit AdamW, padded batches."""
import sys, torch
from datasets import load_dataset
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import (AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, DataCollatorForLanguageModeling,
                          Trainer, TrainingArguments)
model_path, data, out, steps, max_len = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
tok = AutoTokenizer.from_pretrained(model_path)
bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                         bnb_4bit_compute_dtype=torch.bfloat16)
model = AutoModelForCausalLM.from_pretrained(model_path, quantization_config=bnb, dtype=torch.bfloat16,
                                             device_map={"": 0})
model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear",
                                         task_type="CAUSAL_LM"))
ds = load_dataset("json", data_files=data, split="train")
ds = ds.map(lambda r: tok(tok.apply_chat_template(r["messages"], tokenize=False), truncation=True,
                          max_length=max_len), remove_columns=ds.column_names)
args = TrainingArguments(out, max_steps=steps, per_device_train_batch_size=4, learning_rate=2e-4, bf16=True,
                         optim="paged_adamw_8bit", logging_steps=1, save_strategy="no", report_to="none",
                         gradient_checkpointing=True, seed=0, disable_tqdm=True)
Trainer(model=model, args=args, train_dataset=ds,
        data_collator=DataCollatorForLanguageModeling(tok, mlm=False)).train()
'''


def qlora(a) -> None:
    """The 8B shape, QLoRA r16 on all linear layers, batch 4, max length 1024, same rows and steps on every side: a
    plain PEFT + bitsandbytes script, `trainbox qlora` (its defaults) and Unsloth (benchmarks/unsloth_sides.py sft:
    FastLanguageModel 4-bit + its LoRA, gradient checkpointing and SFT trainer, packing), each kind in an order the
    next kind reverses; first `trainbox qlora` under TRAINBOX_GPU_FREE_GIB=11 (a 12 GB card: the memory plan must
    choose what fits), which also warms the GPU and the page cache of the 16 GB model for the timed runs."""
    work = Path(a.work)
    log = work / "qlora.log"
    steps = a.steps + a.kernels  # --kernels: that many more, profiled, after the timed ones (not in the rate)
    rows, max_len = steps * 4 * 4, 1024
    kinds = {kind: write_chat(work / f"data-qlora-{kind}", lengths(kind, rows, max_len)) for kind in a.kinds}
    script = work / "plain_qlora.py"
    script.write_text(PLAIN_QLORA)
    model = work / "llama-8b"
    py = sys.executable

    def plain(data, out):
        return [py, str(script), str(model), str(data / "train.jsonl"), str(out), str(steps), str(max_len)]

    def ours(data, out):
        return [py, "-m", "trainbox", "qlora", "--model_name_or_path", str(model), "--dataset",
                str(data / "train.jsonl"), "--output_dir", str(out), "--max_steps", str(steps),
                "--max_length", str(max_len), "--per_device_train_batch_size", "4", "--logging_steps", "1",
                "--save_strategy", "no", "--report_to", "none", "--seed", "0", "--resume", "never",
                "--disable_tqdm", "true"]  # fmt: skip

    def unsloth(data, out):
        return [py, str(ROOT / "benchmarks" / "unsloth_sides.py"), "sft", str(model), str(data / "train.jsonl"),
                str(out), "--steps", str(steps), "--max-length", str(max_len), "--batch", "4", "--rank", "16",
                "--packing", a.unsloth_packing]

    # Unsloth needs TRL <= 1.15 and patches transformers on import: its own site (--unsloth-site) and the hook
    # importing it first; the other sides keep the inherited PYTHONPATH (TRL 1.16, Liger).
    site = [a.unsloth_site] if a.unsloth_site else [os.environ.get("PYTHONPATH", "")]
    unsloth_env = {"BENCH_FIRST_IMPORT": "unsloth", "PYTHONPATH": os.pathsep.join([str(work / "_measure"), str(ROOT),
                                                                                   *site])}
    sides = {"plain": (plain, {}), "ours": (ours, {}), "unsloth": (unsloth, unsloth_env)}
    first = next(iter(kinds))
    plan = ([("12gb", first, "ours", {"TRAINBOX_GPU_FREE_GIB": "11"})] if a.small_gpu else [])
    for i, kind in enumerate(kinds):
        order = [w for w in ("plain", "unsloth", "ours") if w in a.sides]
        plan += [(f"{kind}-{who}", kind, who, {}) for who in (order if i % 2 == 0 else order[::-1])]
    if a.dry_run:
        for label, kind, who, env in plan:
            fn, side_env = sides[who]
            print(f"{label}: {' '.join(f'{k}={v}' for k, v in {**side_env, **env}.items())} "
                  f"{shlex.join(fn(kinds[kind], work / f'o-{label}'))}")
        return
    make_model(model, "llama-8b")
    peak = peak_tflops()
    fpt = {kind: flops_per_token(model, lengths(kind, rows, max_len)) for kind in kinds}
    for kind in kinds:
        lens = lengths(kind, rows, max_len)
        print(f"# qlora 8B {kind}: {rows} rows capped at {max_len}, median {sorted(lens)[len(lens) // 2]} tokens; "
              f"sides {', '.join(a.sides)}", flush=True)
    results = {}
    for label, kind, who, env in plan:
        fn, side_env = sides[who]
        start = log.stat().st_size if log.is_file() else 0
        timed = {"BENCH_EACH_STEP": "1"} if a.run_timeout else {}
        if a.kernels:
            timed["BENCH_KERNELS"] = f"{a.steps}:{steps}"
        results[label] = show(run(f"qlora-{label}", fn(kinds[kind], work / f"o-{label}"), work, log,
                                  {**side_env, **env, **timed}, a.run_timeout), fpt[kind], peak)
        kernel_table(f"qlora-{label}", work / f"qlora-{label}.json.kernels")
        if label == "12gb":
            r = results[label]
            print("SUMMARY qlora 8B in 12 GB (TRAINBOX_GPU_FREE_GIB=11): "
                  + ("FAILED" if r.get("failed") else
                     f"trained {r['steps']} timed steps, {r['tokens_per_s']:,.0f} real tok/s, peak allocated "
                     f"{r['peak_gib']:.2f} GiB, reserved {r['peak_reserved_gib']:.2f} GiB "
                     f"({'within' if r['peak_reserved_gib'] <= 11 else 'OVER'} 11 GiB)")
                  + "".join(f"\n    {line}" for line in planned(log, start)), flush=True)
    print("QLORA kind     side       real tok/s  peak GiB  packing  ckpt", flush=True)
    for kind in kinds:
        for who in a.sides:
            r = results.get(f"{kind}-{who}", {})
            print(f"QLORA {kind:<8} {who:<9} " + (f"{r['tokens_per_s']:>11,.0f} {r['peak_gib']:>9.2f}  "
                                                 f"{str(r['packing']):<7}  {r['gradient_checkpointing']}"
                                                 if "tokens_per_s" in r else "     FAILED"), flush=True)
        o, u = results.get(f"{kind}-ours", {}), results.get(f"{kind}-unsloth", {})
        p = results.get(f"{kind}-plain", {})
        if "tokens_per_s" in o:
            vs = [f"{o['tokens_per_s'] / r['tokens_per_s']:.2f}x {name} at {o['peak_gib']:.2f} vs "
                  f"{r['peak_gib']:.2f} GiB" for name, r in (("unsloth", u), ("plain", p)) if "tokens_per_s" in r]
            print(f"SUMMARY qlora 8B {kind}: ours " + "; ".join(vs), flush=True)
    json.dump(results, open(work / "qlora-results.json", "w"), indent=1, default=str)


def memory(a) -> None:
    """Full fine-tuning of the 8B shape on one GPU, each tool with its defaults (batch 2, max length 1024, a save of
    the model only): does it train, its peak allocated memory, and our plan's estimate beside it."""
    import re
    import shutil

    work = Path(a.work)
    log = work / "memory.log"
    model = make_model(work / "llama-8b", "llama-8b")
    data = write_chat(work / "data-8b", lengths("uniform", a.steps * 2 * 2, 1024))
    common = ["--model_name_or_path", str(model), "--max_length", "1024", "--per_device_train_batch_size", "2",
              "--max_steps", str(a.steps), "--save_only_model", "true", "--logging_steps", "1", "--report_to", "none",
              "--seed", "0", "--disable_tqdm", "true"]  # fmt: skip
    # The final save is 32 GB of float32 weights: on the fullest-free of the work folder and /dev/shm (RAM).
    where = [d for d in (work, Path("/dev/shm")) if d.is_dir()]
    py, out = sys.executable, max(where, key=lambda d: shutil.disk_usage(d).free) / "o-8b"
    runs = [("8b-trl", [py, "-m", "trl.cli.main", "sft", "--dataset_name", str(data), "--output_dir", str(out),
                        *common]),
            ("8b-ours", [py, "-m", "trainbox", "sft", "--dataset", str(data / "train.jsonl"), "--output_dir",
                         str(out), "--resume", "never", *common])]
    for label, argv in runs:
        start = log.stat().st_size if log.is_file() else 0
        res = run(label, argv, work, log)
        saved = sorted(p.name for p in out.glob("*.safetensors")) if out.is_dir() else []
        shutil.rmtree(out, ignore_errors=True)  # 32 GB of float32 weights: the next run needs the disk
        text = log.read_text(errors="replace")[start:]
        est = re.findall(r"^\[trainbox\] (gradient checkpointing.*|precision:.*)$", text, re.M)
        print(f"RESULT {json.dumps({k: v for k, v in res.items() if k != 'losses'})}", flush=True)
        print(f"SUMMARY memory {label}: {'trained' if not res.get('failed') else 'FAILED'}, "
              + (f"peak allocated {res['peak_gib']:.2f} GiB, {res['steps']} timed steps, " if 'peak_gib' in res else "")
              + f"saved {len(saved)} safetensors file(s)" + "".join(f"\n    {e}" for e in est), flush=True)


def write_prompts(path: Path, rows: int, seed: int = 0) -> Path:
    """GRPO rows as `grpo --preset gsm8k` makes them: the system prompt + a question (prompt messages), an answer."""
    from trainbox.training.grpo.rewards import SYSTEM_PROMPT

    rng = random.Random(seed)
    path.mkdir(parents=True, exist_ok=True)
    with open(path / "train.jsonl", "w") as f:
        for _ in range(rows):
            question = " ".join(f"w{rng.randrange(WORDS)}" for _ in range(rng.randint(40, 160)))
            f.write(json.dumps({"prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                                           {"role": "user", "content": question}],
                                "answer": str(rng.randint(2, 1000))}) + "\n")
    return path


def low_words(completions, **kwargs) -> list[float]:
    """A reward a random-init model can learn in tens of steps (`grpo --reward low-words`): the share of a
    completion's words from the lower half of the benchmark tokenizer's vocabulary (w0 .. w1999 of w0 .. w3999).
    A random model starts near 0.5; a GRPO run that learns pushes it up, so two engines' curves can be compared."""
    out = []
    for c in completions:
        text = c[-1]["content"] if isinstance(c, list) else c
        nums = [int(w[1:]) for w in text.split() if re.fullmatch(r"w\d+", w)]
        out.append(sum(n < WORDS // 2 for n in nums) / len(nums) if nums else 0.0)
    return out


def grpo(a) -> None:
    """`trl grpo` (GRPOTrainer with its defaults: transformers generate) vs `trainbox grpo` (its defaults: vLLM
    colocate when vllm is installed), same model, prompts, rewards, batch, generations and completion length.
    `--shape`: another model layout (default llama-1b); `--nproc N`: N GPUs, `trl grpo` launched as TRL's docs say
    (`--accelerate_config multi_gpu --num_processes N`) vs `trainbox grpo --nproc-per-node N` (torchrun)."""
    import importlib.util

    work = Path(a.work)
    log = work / "grpo.log"
    shape = a.shape or "llama-1b"
    model = make_model(work / shape, shape)
    data = write_prompts(work / "data-grpo", 64 * a.steps * a.nproc)
    launch_trl = ["--accelerate_config", "multi_gpu", "--num_processes", str(a.nproc)] if a.nproc > 1 else []
    launch_ours = ["--nproc-per-node", str(a.nproc)] if a.nproc > 1 else []
    rewards = ["correctness", "int_format", "strict_format", "soft_format", "xmlcount"]
    trl_rewards = [f"trainbox.training.grpo.rewards.{r}" for r in rewards]
    our_rewards = ",".join(f"rewards:{r}" for r in rewards)
    if a.reward == "low-words":  # importable on both sides: the measured runs have ROOT on PYTHONPATH
        trl_rewards, our_rewards = ["benchmarks.train_throughput.low_words"], "benchmarks.train_throughput:low_words"
    common = ["--model_name_or_path", str(model), "--per_device_train_batch_size", "16", "--num_generations", "8",
              "--max_completion_length", "256", "--logging_steps", "1", "--save_strategy", "no", "--report_to",
              "none", "--seed", "0", "--disable_tqdm", "true"]  # fmt: skip
    if a.lr:
        common += ["--learning_rate", str(a.lr)]
    py = sys.executable

    plain = a.plain or ("vllm" if importlib.util.find_spec("vllm") else "defaults")
    # What TRL's docs show for vLLM: colocate mode, TRL's own memory share and sleep settings.
    plain_vllm = ["--use_vllm", "true", "--vllm_mode", "colocate"] if plain == "vllm" else []

    def trl(out, steps):
        return [py, "-m", "trl.cli.main", "grpo", *launch_trl, "--dataset_name", str(data), "--output_dir", str(out),
                "--max_steps", str(steps), "--reward_funcs", *trl_rewards,
                *common, *plain_vllm]

    def ours(out, steps):
        return [py, "-m", "trainbox", "grpo", *launch_ours, "--dataset", str(data / "train.jsonl"), "--output_dir",
                str(out),
                "--max_steps", str(steps), "--resume", "never", "--reward_funcs", our_rewards, *common]

    print(f"# grpo: {shape} shape, {a.nproc} GPU(s), 16 completions/step per GPU (2 prompts x 8), 256 completion "
          f"tokens; vllm "
          f"{'installed' if importlib.util.find_spec('vllm') else 'NOT installed'}; plain = trl grpo with "
          f"{'vLLM colocate' if plain == 'vllm' else 'its defaults (transformers generate)'}", flush=True)
    results = {}
    os.environ["BENCH_PHASES"] = "1"  # TRL's profiled sections per step (generate, weight sync, rewards) in results
    if a.warmup:
        run("warmup", trl(work / "o-warm", 3), work, log)  # a fresh GPU's first process: not reported
    order = [("trl", trl, []), ("ours", ours, []), ("ours", ours, []), ("trl", trl, [])][: a.runs]
    order += [(f"ours+{name}", ours, extra) for name, extra in a.also]
    for i, (who, fn, extra) in enumerate(order):
        label = f"grpo-{who}-{i}"
        env, opts = split_env(extra)
        res = run(label, fn(work / f"o-{label}", a.steps) + opts, work, log, env)
        if not res.get("failed"):
            res["steps_per_s"] = res["steps"] / res["seconds"]
            toks = dict(res.pop("num_tokens"))
            print(f"RESULT {json.dumps({k: v for k, v in res.items() if k not in ('losses', 'rewards')})}", flush=True)
            print(f"  {label:<16} {res['steps_per_s']:.3f} steps/s  peak {res['peak_gib']:5.1f} GiB  "
                  f"ckpt={res['gradient_checkpointing']} attn={res['attn']} params={res['param_dtype']} "
                  f"tokens logged {max(toks.values()) if toks else 0:,.0f}", flush=True)
            if res.get("phases"):
                print("    per step: " + ", ".join(f"{k} {v:.3f} s" for k, v in sorted(res["phases"].items(),
                                                                                    key=lambda kv: -kv[1])), flush=True)
        results[label] = res
    o = [r["steps_per_s"] for k, r in results.items() if k.startswith("grpo-ours-") and "steps_per_s" in r]
    t = [r["steps_per_s"] for k, r in results.items() if k.startswith("grpo-trl-") and "steps_per_s" in r]
    if o and t:
        print(f"SUMMARY grpo: ours {sum(o) / len(o):.3f} vs trl grpo ({plain}) {sum(t) / len(t):.3f} steps/s = "
              f"{sum(o) / len(o) / (sum(t) / len(t)):.2f}x (runs {o} vs {t})", flush=True)
        for k, r in results.items():
            if k.startswith("grpo-ours+") and "steps_per_s" in r:
                print(f"SUMMARY grpo: {k} {r['steps_per_s']:.3f} steps/s = {r['steps_per_s'] / (sum(t) / len(t)):.2f}x "
                      f"trl", flush=True)
    curves = {k: dict(r["rewards"]) for k, r in results.items() if r.get("rewards")}
    if curves:  # the same seed, prompts and reward: the engines should learn alike
        steps = sorted({s for c in curves.values() for s in c})
        print("REWARD step " + " ".join(f"{k:>16}" for k in curves), flush=True)
        for s in steps:
            print(f"REWARD {s:>4} " + " ".join(f"{c[s]:16.3f}" if s in c else " " * 16 for c in curves.values()))
        for k, c in curves.items():
            v = [c[s] for s in sorted(c)]
            q = max(1, len(v) // 4)
            print(f"SUMMARY reward {k}: first {q} steps {sum(v[:q]) / q:.3f} -> last {q} steps "
                  f"{sum(v[-q:]) / q:.3f}", flush=True)
    json.dump(results, open(work / "grpo-results.json", "w"), indent=1, default=str)


def check(a) -> None:
    """Packed rows through the attention kernel this GPU gets == each example alone (bf16 tolerance)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from trainbox.image import imageinfo
    from trainbox.training import attention

    choice = attention.choose(None, imageinfo.load())  # the image's kernel default, as the trainers take it
    print(choice.line(), flush=True)
    conf = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
                       num_key_value_heads=2, vocab_size=1000)
    torch.manual_seed(0)
    model = LlamaForCausalLM(conf).cuda().to(torch.bfloat16).eval()
    model.set_attn_implementation(choice.impl)  # same weights, the chosen kernel
    ref = LlamaForCausalLM(conf).cuda().to(torch.bfloat16).eval()
    ref.load_state_dict(model.state_dict())
    ref.set_attn_implementation("sdpa")
    examples = [torch.randint(3, 1000, (n,)).tolist() for n in (300, 17, 1024, 5, 700)]
    batch = {k: v.cuda() if hasattr(v, "cuda") else v for k, v in
             DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)([{"input_ids": e} for e in examples]).items()}
    with torch.no_grad():
        packed = model(**{k: v for k, v in batch.items() if k != "labels" and k != "seq_idx"}, use_cache=False).logits[0]
        start, worst = 0, 0.0
        for e in examples:
            alone = ref(input_ids=torch.tensor([e], device="cuda")).logits[0]
            worst = max(worst, (packed[start:start + len(e)].float() - alone.float()).abs().max().item())
            start += len(e)
    ok = worst < 0.1
    print(f"SUMMARY check: packed vs alone with {choice.impl}: max |logit diff| {worst:.4f} (bf16) -> "
          f"{'OK' if ok else 'FAIL'}", flush=True)
    if not ok:
        raise SystemExit(1)


def variant(text: str) -> tuple[str, list[str]]:
    """LABEL=OPTIONS (--also here, --variant in profile_step.py): a run's label and its extra options."""
    label, eq, args = text.partition("=")
    if not eq or not re.fullmatch(r"[\w.-]+", label):
        raise argparse.ArgumentTypeError(f"{text!r}: expected LABEL=OPTIONS (LABEL: letters, digits, '.', '-', '_'; "
                                         "OPTIONS: the command's options, may be empty), e.g. "
                                         "nosleep='--vllm_enable_sleep_mode false'")
    return label, shlex.split(args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["sft", "qlora", "grpo", "dpo", "check", "memory"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kinds", nargs="+", default=["mix", "uniform"], choices=["mix", "uniform"])
    ap.add_argument("--nproc", type=int, default=1,
                    help="sft: GPUs (> 1: the 8B shape, FSDP2 on both sides); grpo: GPUs (the same shape, each "
                         "side's own multi-GPU defaults)")
    ap.add_argument("--shape", choices=list(SHAPES), default=None,
                    help="sft: the model shape (default llama-1b on one GPU, llama-8b on several); grpo: the model "
                         "shape (default llama-1b)")
    ap.add_argument("--plain", choices=["vllm", "defaults"], default=None,
                    help="grpo: the plain run is TRL's GRPOTrainer with vLLM colocate (what TRL's docs show; the "
                         "default where vllm imports) or with its defaults (transformers generate)")
    ap.add_argument("--runs", type=int, default=4, help="how many of plain, ours, ours, plain")
    ap.add_argument("--batch", type=int, default=8, help="sft: per-device micro-batch (rows), both sides")
    ap.add_argument("--max-length", type=int, default=2048, help="sft: tokens per row (the longest), both sides")
    ap.add_argument("--reward", choices=["gsm8k", "low-words"], default="gsm8k",
                    help="grpo: the notebook's five gsm8k rewards (a random model scores ~0 on them) or low_words, "
                         "one a random model learns within tens of steps (to compare reward curves)")
    ap.add_argument("--lr", type=float, default=None,
                    help="grpo, dpo: --learning_rate for both sides (default: each side's own, TRL's 1e-6)")
    ap.add_argument("--also", action="append", default=[], type=variant, metavar="LABEL=OPTIONS",
                    help="sft, grpo: one more run of ours with these extra arguments, e.g. "
                         "nosleep='--vllm_enable_sleep_mode false'; upper-case NAME=VALUE items set the run's "
                         "environment instead, e.g. keep='TRAINBOX_MLP_RECOMPUTE=0' (repeatable; not in the ours "
                         "average)")
    ap.add_argument("--also-plain", action="append", default=[], type=variant, metavar="LABEL=OPTIONS",
                    help="dpo: one more run of the plain side (`trl dpo`) with these extra arguments, e.g. "
                         "bf16='--dtype bfloat16' (how far TRL moves from itself in bf16: the rounding's spread); "
                         "its per-step losses are printed beside the others (repeatable)")
    ap.add_argument("--sides", nargs="+", default=["plain", "unsloth", "ours"], choices=["plain", "unsloth", "ours"],
                    help="qlora: which sides run (each once per kind)")
    ap.add_argument("--unsloth-site", default=os.environ.get("BENCH_UNSLOTH_SITE"),
                    help="qlora: the folder Unsloth and its TRL <= 1.15 are installed in (pip --target), the "
                         "Unsloth side's PYTHONPATH instead of the inherited one (default: $BENCH_UNSLOTH_SITE)")
    ap.add_argument("--unsloth-packing", choices=["true", "false"], default="true",
                    help="qlora: SFTConfig(packing=...) on the Unsloth side (default true: it packs)")
    ap.add_argument("--no-12gb", dest="small_gpu", action="store_false",
                    help="qlora: skip the first run, trainbox qlora under TRAINBOX_GPU_FREE_GIB=11")
    ap.add_argument("--dry-run", action="store_true", help="qlora: write the data, print each run's command, stop")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="qlora: N more steps on every side after the timed ones, under torch's profiler: GPU ms a "
                         "step by kernel category and the costliest kernels (KERNELS lines; not in the rates)")
    ap.add_argument("--run-timeout", type=float, default=None,
                    help="qlora: seconds a run may take; past it the run is killed and its steps so far reported")
    ap.add_argument("--no-loss-check", dest="loss_check", action="store_false")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="sft, grpo: no warm-up process first (the first --skip steps of every run are not timed "
                         "anyway)")
    ap.add_argument("--loss-only", action="store_true", help="sft: only plain TRL vs ours on the same padded batches")
    ap.add_argument("--work", default=tempfile.mkdtemp(prefix="bench-"))
    a = ap.parse_args()
    Path(a.work).mkdir(parents=True, exist_ok=True)
    {"sft": sft, "qlora": qlora, "grpo": grpo, "dpo": dpo, "check": check, "memory": memory}[a.what](a)


if __name__ == "__main__":
    main()
