"""trainbox_flex (FlexAttention, fused and compiled) on a GPU against float32 eager: a correctness table.

Usage: python tests/gpu/flex_check.py [--seq 512] [--impl trainbox_varlen] [--json FILE]   (torch with CUDA,
transformers; no trl)

--impl trainbox_varlen: the same model table for torch's varlen FlashAttention with gpt-oss's sinks (varlen_sinks.py)
on the models it takes (not Gemma 2's softcap); its trial is attention.runtime_usable("varlen"); no kernel table (the
kernel against dense math: benchmarks/sink_kernels.py).

1. Models: Gemma 2 (window + softcap), gpt-oss (window + sinks, MoE) and the Llama control from tests/zoo.py, plus
   Gemma 2 / gpt-oss with their real head sizes (256 / 64; windows of 128). For each, rows of --seq, 3/4 and 1/2 of
   it as single rows, one right-padded batch and one packed row (position_ids restarting per example), with
   loss = sum(logits * W) for a fixed random W. Reference: float32 eager, each row alone. Rows: bf16 FlexAttention
   (trainbox_flex) and, as the bound bf16 rounding alone sets, bf16 eager (eager never packs: its packed bound is
   its single-row figure). Columns: max |logit diff| and max |grad diff| over all parameters, the gradient diff
   taken relative to each parameter's largest gradient. OK: flex within 2x the bf16-eager bound (+0.02).
   Each model runs as training does: Dynamo's caches emptied, the choice trial (flexattn.trial at the model's head
   size: another softcap, window and scale than the model's) first, then the model through the same compiled
   function; then `train`: train mode, reentrant gradient checkpointing, bf16 autocast, packed rows of 6 lengths.
   Columns `graphs` (compiled graphs for the model so far, trial included: a handful, bounded by grad on/off, first
   then symbolic shape, batch 1 or more, lse or not) and `breaks` (graph breaks; fullgraph makes one an error, so 0);
   `train` is OK when its last two of 6 steps compiled nothing (`late_graphs` in the JSON).
2. Kernel: random q/k/v of one packed row (16 examples) for head sizes 64, 128 and 256, window + softcap + sinks:
   bf16 fused vs float32 dense math, output and dq/dk/dv/dsinks; compile time of the first call, the time of a
   call after the packed length changes (no recompile expected: automatic dynamic shapes), the block mask's build.
3. What attention.choose picks for Gemma 2 and gpt-oss here (the line trainbox prints).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEV = "cuda"  # --device cpu: a smoke run of this script's plumbing (compiled with aot_eager: no kernel)
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

# name: (zoo entry, config overrides)
# The model comparison (rows fed single / padded / packed; logits and every gradient against float32 eager) is
# `trainbox selftest`'s attention check: one home.
from trainbox.image.selftestkernels import diffs, run  # noqa: E402

MODELS = {
    "gemma2": ("gemma2", {}),
    "gemma2-hd256": ("gemma2", dict(head_dim=256, hidden_size=512, intermediate_size=1024, num_attention_heads=4,
                                    num_key_value_heads=2, sliding_window=128, query_pre_attn_scalar=256)),
    "gpt-oss": ("gpt-oss", {}),
    "gpt-oss-hd64": ("gpt-oss", dict(head_dim=64, hidden_size=512, intermediate_size=512, num_attention_heads=8,
                                     num_key_value_heads=2, sliding_window=128)),
    "llama3": ("llama3", {}),
}


def build(base: Path, name: str) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from tiny import make_tokenizer
    from zoo import make_config

    zoo_name, over = MODELS[name]
    tok = make_tokenizer()
    conf = make_config(zoo_name, tok)
    for k, v in over.items():
        setattr(conf, k, v)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(conf, dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("sinks"):
                p.normal_(0, 1)
    path = base / name
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def train_steps(model, seq: int) -> int:
    """Training's setting: train mode (no dropout in these configs), reentrant checkpointing (a no-grad forward, then
    its recomputation with grad), bf16 autocast, packed rows of 6 lengths. The graphs compiled during the last two steps
    (lengths again, no other novelty): 0 unless something recompiles per batch."""
    import torch
    from torch._dynamo.utils import counters

    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    g = torch.Generator(device=DEV).manual_seed(1)
    steps = ((seq, seq // 2), (seq // 4,) * 5, (seq, seq), (seq // 3,) * 3, (seq * 3 // 4, seq), (seq // 5,) * 4)
    for i, n in enumerate(steps):
        if i == len(steps) - 2:
            graphs = counters["stats"]["unique_graphs"]
        pos = torch.cat([torch.arange(k, device=DEV) for k in n])[None]
        ids = torch.randint(10, 300, (1, sum(n)), device=DEV, generator=g)
        with torch.autocast(DEV, dtype=torch.bfloat16):
            loss = model(ids, position_ids=pos, use_cache=False).logits.float().square().mean()
        loss.backward()
        if not all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None):
            raise RuntimeError("non-finite gradients")
    model.gradient_checkpointing_disable()
    model.eval()
    return counters["stats"]["unique_graphs"] - graphs


def model_table(seq: int, impl: str) -> list[dict]:
    import torch
    from torch._dynamo.utils import counters
    from transformers import AutoModelForCausalLM

    from trainbox.training import attention, modelfacts
    from trainbox.training.kernels import flexattn

    attention.register(impl)
    base = Path(tempfile.mkdtemp(prefix="flexcheck-"))
    out = []
    for name in MODELS:
        if impl != attention.FLEX and name.startswith("gemma2"):
            continue  # a softcap: only FlexAttention (and eager) apply it
        path = build(base, name)

        def load(impl, dtype):  # eval(): no dropout; gradients still flow
            return AutoModelForCausalLM.from_pretrained(path, attn_implementation=impl, dtype=dtype).to(DEV).eval()

        g = torch.Generator(device=DEV).manual_seed(0)
        rows = [torch.randint(10, 300, (n,), device=DEV, generator=g) for n in (seq, seq * 3 // 4, seq // 2)]
        m = load("eager", torch.float32)
        weights = torch.randn(seq, m.config.vocab_size, device=DEV, generator=g)
        ref = run(m, "single", rows, weights)
        del m
        eager16 = load("eager", torch.bfloat16)
        bound = {k: diffs(run(eager16, k, rows, weights), ref) for k in ("single", "padded")}
        bound["packed"] = bound["single"]
        del eager16
        flex = load(impl, torch.bfloat16)
        torch._dynamo.reset()  # one model per process in training: its own recompile budget
        graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
        t = time.time()
        if impl == attention.FLEX:
            why = flexattn.trial(DEV, flex.config.head_dim, torch.bfloat16 if DEV == "cuda" else torch.float32)
        else:
            why = attention.runtime_usable("varlen", modelfacts.model_facts(str(path)).attention)
        trial_s = time.time() - t
        for kind in ("single", "padded", "packed", "train"):
            t = time.time()
            row = {"model": name, "kind": kind, "trial": why or "ok", "trial_s": trial_s}
            try:
                if kind == "train":
                    late = train_steps(flex, seq)
                    row.update(flex_logit=0.0, flex_grad=0.0, eager_bf16_logit=0.0, eager_bf16_grad=0.0, ok=late == 0,
                               late_graphs=late)
                else:
                    got = diffs(run(flex, kind, rows, weights), ref)
                    b = bound[kind]
                    ok = got[0] <= 2 * b[0] + 0.02 and got[1] <= 2 * b[1] + 0.02
                    row.update(flex_logit=got[0], flex_grad=got[1], eager_bf16_logit=b[0], eager_bf16_grad=b[1],
                               ok=ok)
            except Exception as e:  # noqa: BLE001 - the table reports it, the next rows still run
                row.update(flex_logit=float("nan"), flex_grad=float("nan"), eager_bf16_logit=float("nan"),
                           eager_bf16_grad=float("nan"), ok=False,
                           error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
            row["s"] = time.time() - t  # compiles included
            row["graphs"] = counters["stats"]["unique_graphs"] - graphs
            row["breaks"] = sum(counters["graph_break"].values()) - breaks
            row["ok"] = row["ok"] and row["breaks"] == 0 and not why
            out.append(row)
        del flex
        torch.cuda.empty_cache()
    return out


def sync() -> None:
    import torch

    if DEV == "cuda":
        torch.cuda.synchronize()


def kernel_table() -> list[dict]:
    import torch

    from trainbox.training.kernels import flexattn

    fa = None
    if DEV != "cuda":  # FlexAttention's unfused reference: torch refuses CPU gradients only at its entry check
        from torch.nn.attention import flex_attention as mod

        mod._validate_device, fa = (lambda *x: None), mod.flex_attention
    out = []
    for d in (64, 128, 256):
        # The second: another packed length (a recompile would show in its time). Smoke run: short rows.
        for length in (4096, 3968) if DEV == "cuda" else (512, 384):
            g = torch.Generator(device=DEV).manual_seed(d)
            h, hk = 8, 2
            q = torch.randn(1, h, length, d, device=DEV, generator=g)
            k, v = (torch.randn(1, hk, length, d, device=DEV, generator=g) for _ in range(2))
            sinks = torch.randn(h, device=DEV, generator=g)
            cuts = sorted(torch.randint(1, length, (15,), generator=torch.Generator().manual_seed(d)).tolist())
            pos = torch.cat([torch.arange(b - a) for a, b in zip([0, *cuts], [*cuts, length])]).to(DEV)[None]
            scale, window, cap = d**-0.5, 256, 50.0
            res = {}
            for mode in ("fused", "dense"):
                dt = torch.bfloat16 if mode == "fused" else torch.float32
                qq, kk, vv = (t.to(dt).requires_grad_(True) for t in (q, k, v))
                ss = sinks.clone().requires_grad_(True)
                sync()
                t0 = time.time()
                if mode == "fused":
                    tm = time.time()
                    docs = flexattn.padded_documents(pos, None, 1, length, DEV)
                    flexattn.block_mask(docs, window, length)
                    sync()
                    mask_s = time.time() - tm
                    o, lse = flexattn.fused(qq, kk, vv, docs, scale, window, cap, fn=None if DEV == "cuda" else fa)
                else:
                    docs = flexattn.documents(pos, None, 1, length, DEV)
                    o, lse = flexattn.dense(qq, kk, vv, docs, scale, window, cap)
                o = flexattn.with_sinks(o, lse, ss)
                (o.float() * torch.randn(o.shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(1))
                 ).sum().backward()
                sync()
                res[mode] = {"out": o.detach().float(), "dq": qq.grad.float(), "dk": kk.grad.float(),
                             "dv": vv.grad.float(), "dsinks": ss.grad.float(), "s": time.time() - t0}
                if mode == "fused":
                    res[mode]["mask_s"] = mask_s
            row = {"head_dim": d, "length": length, "first_call_s": res["fused"]["s"],
                   "block_mask_s": res["fused"]["mask_s"]}
            for key in ("out", "dq", "dk", "dv", "dsinks"):
                a, b = res["fused"][key], res["dense"][key]
                row[key] = float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))
            out.append(row)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=512, help="tokens in the longest row")
    ap.add_argument("--impl", default="trainbox_flex", choices=["trainbox_flex", "trainbox_varlen"],
                    help="the kernel under test (default trainbox_flex)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    a = ap.parse_args()
    global DEV
    DEV = a.device

    import torch
    import transformers

    from trainbox.training import attention, modelfacts
    from trainbox.training.kernels import flexattn

    os.environ.pop(flexattn.GPU_ENV, None)  # the default choice, its trial included
    if DEV != "cuda":  # smoke run: the compiled path without inductor (no FlexAttention backward on CPU)
        from torch.nn.attention import flex_attention as fa

        real = flexattn.compiled
        fa._validate_device = lambda *x: None
        flexattn.compiled = lambda backend="aot_eager": real(backend)
        flexattn.uses_fused = lambda q, k, dropout: q.shape[2] == k.shape[2] and not dropout
    cc = torch.cuda.get_device_capability() if DEV == "cuda" else (0, 0)
    print(f"GPU {torch.cuda.get_device_name() if DEV == 'cuda' else 'none (smoke run)'} sm{cc[0]}{cc[1]}, "
          f"torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
    t = time.time()
    name = "flex" if a.impl == attention.FLEX else "varlen"
    why = attention.runtime_usable(name)
    print(f"runtime_usable({name!r}): {why or 'ok'} ({time.time() - t:.1f} s, its compile included)", flush=True)

    models = model_table(a.seq, a.impl)
    print(f"\n1. models vs float32 eager (each row alone); rows of {a.seq}, {a.seq * 3 // 4}, {a.seq // 2} tokens; "
          "grad diff relative to each parameter's largest gradient")
    print(f"{'model':14s} {'rows':7s} | {name + ' bf16 logit':>15s} {'grad':>8s} | {'eager bf16 logit':>16s} "
          f"{'grad':>8s} | {'s':>6s} {'graphs':>6s} {'breaks':>6s} | ok")
    for r in models:
        print(f"{r['model']:14s} {r['kind']:7s} | {r['flex_logit']:15.4f} {r['flex_grad']:8.4f} | "
              f"{r['eager_bf16_logit']:16.4f} {r['eager_bf16_grad']:8.4f} | {r['s']:6.1f} {r['graphs']:6d} "
              f"{r['breaks']:6d} | {'OK' if r['ok'] else 'MISMATCH'}"
              + (f"  trial: {r['trial']}" if r["trial"] != "ok" else "") + (f"  {r['error']}" if "error" in r else "")
              + (f"  {r['late_graphs']} graph(s) in the last 2 steps" if r.get("late_graphs") else ""))
    print("trial (compile included): " + ", ".join(f"{r['model']} {r['trial_s']:.1f} s" for r in models
                                                   if r["kind"] == "single"))
    kernels = kernel_table() if a.impl == attention.FLEX else []
    print("\n2. kernel: bf16 fused vs float32 dense math, one packed row of 16 examples, window 256, softcap 50, "
          "sinks; diffs relative to the largest reference value")
    print(f"{'head_dim':>8s} {'length':>6s} | {'out':>7s} {'dq':>7s} {'dk':>7s} {'dv':>7s} {'dsinks':>7s} | "
          f"{'1st call s':>10s} {'mask s':>7s}")
    for r in kernels:
        print(f"{r['head_dim']:8d} {r['length']:6d} | {r['out']:7.4f} {r['dq']:7.4f} {r['dk']:7.4f} {r['dv']:7.4f} "
              f"{r['dsinks']:7.4f} | {r['first_call_s']:10.2f} {r['block_mask_s']:7.3f}")
    print("\n3. the choice here")
    base = Path(tempfile.mkdtemp(prefix="flexchoice-"))
    lines = {}
    for name in ("gemma2", "gpt-oss", "llama3"):
        needs = modelfacts.model_facts(str(build(base, name))).attention
        for record in ("fa3", "sdpa"):
            c = attention.choose(None, {"attention_backend": record}, needs)
            lines[f"{name}/{record}"] = {"line": c.line(), "packed": c.packed}
            print(f"  {name} ({record} image): {c.line()} -> packing {'on' if c.packed else 'off'}")
    bad = [(r["model"], r["kind"]) for r in models if not r["ok"]]
    bad += [(f"kernel-d{r['head_dim']}", k) for r in kernels for k in ("out", "dq", "dk", "dv", "dsinks")
            if r[k] > 0.05]
    print("RESULT " + json.dumps({"mismatches": bad}))
    if a.json:
        Path(a.json).write_text(json.dumps({"models": models, "kernels": kernels, "choice": lines}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
