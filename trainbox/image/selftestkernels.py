"""selftest's kernel rows, each run in a child process of its own (selftestchecks.child): every attention kernel the
image ships against eager on tiny models with the features it claims, Liger's kernels, bitsandbytes' 4-bit matmul,
the fused master-weight AdamW step. Each returns (status, reason); `fault` (TRAINBOX_SELFTEST_FAULT names the row)
puts an error into the kernel's result, which the row's own comparison must catch.

The attention comparison is tests/gpu/flex_check.py's (which imports `run` and `diffs` from here): logits and every
parameter's gradient of loss = sum(logits * W) for rows fed one by one, as a right-padded batch and, for a kernel
that takes packed rows, as one packed row, against float32 eager one row at a time; within 2x what bf16 eager itself
differs by, + 0.02.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from common import errors
from trainbox.image import tinymodel

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
NO_GPU = "no GPU here (torch sees no CUDA device)"


def run(model, kind, rows, weights):
    """(per-row float32 logits, float32 parameter grads) for rows fed as single / padded / packed."""
    import torch

    model.zero_grad(set_to_none=True)
    lens, dev = [len(r) for r in rows], rows[0].device
    if kind == "single":
        logits = []
        for r in rows:
            out = model(r[None]).logits[0].float()
            (out * weights[: len(r)]).sum().backward()
            logits.append(out.detach())
    else:
        if kind == "padded":
            ids = torch.zeros(len(rows), max(lens), dtype=torch.long, device=dev)
            mask = torch.zeros_like(ids)
            for i, r in enumerate(rows):
                ids[i, : len(r)], mask[i, : len(r)] = r, 1
            out = model(ids, attention_mask=mask).logits.float()
            logits = [out[i, :n] for i, n in enumerate(lens)]
        else:
            pos = torch.cat([torch.arange(n, device=dev) for n in lens])[None]
            out = model(torch.cat(rows)[None], position_ids=pos, use_cache=False).logits[0].float()
            starts = [sum(lens[:i]) for i in range(len(lens))]
            logits = [out[a : a + n] for a, n in zip(starts, lens)]
        sum((x * weights[: len(x)]).sum() for x in logits).backward()
        logits = [x.detach() for x in logits]
    grads = {n: p.grad.detach().float() for n, p in model.named_parameters() if p.grad is not None}
    return logits, grads


def diffs(ours, ref) -> tuple[float, float]:
    """(max |logit diff|, max |grad diff| relative to each parameter's largest gradient)."""
    import torch

    (lo, go), (lr, gr) = ours, ref
    logit = max(float((a - b).abs().max()) for a, b in zip(lo, lr))
    grad = max(float((go.get(n, torch.zeros_like(g)) - g).abs().max() / g.abs().max().clamp_min(1e-12))
               for n, g in gr.items())
    return logit, grad


def _kinds(honours) -> list[str]:
    """The tiny models that have the most of what a kernel claims and nothing it would drop."""
    fits = [k for k, (_, _, has) in tinymodel.KINDS.items() if has <= honours]
    top = [k for k in fits if not any(tinymodel.KINDS[k][2] < tinymodel.KINDS[o][2] for o in fits)]
    return top or ["llama"]


def _off_by(model, factor: float = 1.05) -> None:
    """The planted fault: the first layer's attention output scaled, as a kernel with a wrong softmax would be."""
    attn = model.model.layers[0].self_attn
    attn.register_forward_hook(lambda m, i, o: (o[0] * factor, *o[1:]))


def attention_row(name: str, fault: bool = False) -> tuple[str, str]:
    import torch
    from transformers import AutoModelForCausalLM

    from trainbox.image import imageinfo
    from trainbox.training import attention

    k = attention.KERNELS[name]
    gpu = torch.cuda.is_available()
    info = imageinfo.load()
    claimed = (info or {}).get("attention_backend") == name
    if not gpu and name not in ("sdpa", "flex"):
        return SKIP, f"{NO_GPU}: {k.label} runs on CUDA only"
    head_dim = 128 if gpu else 16   # the images' FA3 build keeps head dim 128 only
    needs = attention.Needs(window=tinymodel.WINDOW if "window" in k.honours else None,
                            softcap=50.0 if "softcap" in k.honours else None, sinks="sinks" in k.honours,
                            head_dim=head_dim)
    if gpu:
        cc = torch.cuda.get_device_capability()
        if k.min_cc and cc < k.min_cc or k.max_cc and cc > k.max_cc:
            return SKIP, f"{k.label} does not run on sm{cc[0]}{cc[1]}"
        why = attention.runtime_usable(name, needs)   # the kernel's own trial, with the features it claims
        if why:
            absent = why.startswith("not installed") or why.startswith("this torch has no")
            return (FAIL if claimed or not absent else SKIP), f"trial: {why}"
    else:
        why = None
    attention.register(k.impl)
    dev, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    kinds = ("single", "padded") + (("packed",) if k.packed else ())
    worst, said = [], []
    with tempfile.TemporaryDirectory(prefix="trainbox-selftest-attn-") as tmp:
        for kind_name in _kinds(k.honours):
            path = tinymodel.write(Path(tmp) / kind_name, kind_name, head_dim)

            def load(impl, dt):  # eval(): no dropout; gradients still flow
                return AutoModelForCausalLM.from_pretrained(path, attn_implementation=impl, dtype=dt).to(dev).eval()

            g = torch.Generator(device=dev).manual_seed(0)
            rows = [torch.randint(10, 300, (n,), device=dev, generator=g) for n in (64, 48, 32)]
            m = load("eager", torch.float32)
            weights = torch.randn(64, m.config.vocab_size, device=dev, generator=g)
            ref = run(m, "single", rows, weights)
            m = load("eager", dtype)
            bound = {kind: diffs(run(m, kind, rows, weights), ref) for kind in ("single", "padded")}
            bound["packed"] = bound["single"]  # eager never packs: its single-row figure
            m = load(k.impl, dtype)
            if fault:
                _off_by(m)
            for kind in kinds:
                got, b = diffs(run(m, kind, rows, weights), ref), bound[kind]
                if not (got[0] <= 2 * b[0] + 0.02 and got[1] <= 2 * b[1] + 0.02):
                    worst.append(f"{kind_name} {kind}: logits off by {got[0]:.3f}, gradients by {got[1]:.3f} "
                                 f"(bound {2 * b[0] + 0.02:.3f} / {2 * b[1] + 0.02:.3f})")
            has = tinymodel.KINDS[kind_name][2]
            said.append(kind_name + (f" ({', '.join(sorted(has))})" if has else ""))
            del m
    if worst:
        return FAIL, "; ".join(worst) + " against float32 eager"
    where = "dense math on CPU" if not gpu and name == "flex" else "bf16" if gpu else "float32"
    return PASS, f"forward+backward = eager ({where}) on {', '.join(said)}: {', '.join(kinds)} rows"


def _close(a, b, tol: float) -> float | None:
    err = float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))
    return None if err <= tol else err


def liger_row(fault: bool = False) -> tuple[str, str]:
    """RMSNorm and the SwiGLU MLP (the layer kernels the trainers patch in: speed.py; the LM head's loss is TRL's),
    forward and backward against torch's math."""
    import importlib.util

    import torch

    if importlib.util.find_spec("liger_kernel") is None:
        return SKIP, "liger-kernel is not installed"
    if not torch.cuda.is_available():
        return SKIP, f"{NO_GPU}: Liger's kernels are Triton (CUDA)"
    from types import SimpleNamespace

    from liger_kernel.transformers import LigerRMSNorm, LigerSwiGLUMLP

    torch.manual_seed(0)
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    norm = LigerRMSNorm(256, eps=1e-6).cuda()
    with torch.no_grad():
        norm.weight.normal_(1, 0.1)
    mlp = LigerSwiGLUMLP(SimpleNamespace(hidden_size=256, intermediate_size=512, hidden_act="silu")).cuda()
    head = torch.randn(384, 256, device="cuda", requires_grad=True)
    y = torch.randint(0, 384, (64,), device="cuda")

    def ours(x):
        h = mlp(norm(x))
        h = h * 1.05 if fault else h
        return torch.nn.functional.cross_entropy(h @ head.T, y)

    def reference(x):
        n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight
        h = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(n)) * mlp.up_proj(n))
        return torch.nn.functional.cross_entropy(h @ head.T, y)

    out = []
    for fn in (ours, reference):
        x.grad = head.grad = None
        loss = fn(x)
        loss.backward()
        out.append((loss.detach(), x.grad.clone(), head.grad.clone()))
    bad = [(what, e) for what, a, b in zip(("loss", "input grad", "head grad"), *out) if (e := _close(a, b, 1e-3))]
    if bad:
        return FAIL, "; ".join(f"{w} off by {e:.2e} (relative)" for w, e in bad) + " against torch's math"
    return PASS, "RMSNorm + SwiGLU MLP: loss and gradients (input, LM head) = torch's math (relative 1e-3)"


def bnb_row(fault: bool = False) -> tuple[str, str]:
    """bitsandbytes' NF4 matmul (what qlora's Linear4bit runs) against a bf16 matmul with the dequantized weight,
    forward and the input's gradient."""
    import importlib.util

    import torch

    if importlib.util.find_spec("bitsandbytes") is None:
        return SKIP, "bitsandbytes is not installed"
    import bitsandbytes as bnb
    import bitsandbytes.functional as bf

    dev = "cuda" if torch.cuda.is_available() else "cpu"   # bitsandbytes >= 0.45 has CPU kernels too
    torch.manual_seed(0)
    w = torch.randn(512, 256, device=dev, dtype=torch.bfloat16)
    q, state = bf.quantize_4bit(w, quant_type="nf4", compress_statistics=True)
    dq = bf.dequantize_4bit(q, state)
    x = torch.randn(32, 256, device=dev, dtype=torch.bfloat16, requires_grad=True)
    out = bnb.matmul_4bit(x, q.t(), quant_state=state)
    out = out * 1.05 if fault else out
    out.float().sum().backward()
    got = (out.detach(), x.grad.clone())
    x.grad = None
    ref = x @ dq.t()
    ref.float().sum().backward()
    bad = [(what, e) for what, a, b in zip(("output", "input grad"), got, (ref.detach(), x.grad))
           if (e := _close(a, b, 2e-2))]
    qerr = float((dq.float() - w.float()).abs().mean() / w.float().abs().mean())
    if bad or qerr > 0.2:
        return FAIL, "; ".join([f"{w_} off by {e:.2e} (relative)" for w_, e in bad]
                               + ([f"NF4 round trip error {qerr:.2f}"] if qerr > 0.2 else []))
    return PASS, (f"NF4 matmul forward and backward = bf16 matmul of the dequantized weight on {dev} "
                  f"(NF4 error {qerr:.3f})")


def optimizer_row(fault: bool = False) -> tuple[str, str]:
    """masterstep's one-pass AdamW (bf16 gradients in, float32 master and bf16 weight out) against torch's fused
    AdamW on float32 gradients, two steps with a clipping scale."""
    import torch

    if not torch.cuda.is_available():
        return SKIP, f"{NO_GPU}: the fused master-weight step is a Triton kernel (CPU runs torch's AdamW)"
    from trainbox.training.kernels import masterstep

    torch.manual_seed(0)
    shapes = [(4096,), (256, 96), (7,)]
    masters = [torch.randn(s, device="cuda") for s in shapes]
    refs = [m.clone() for m in masters]
    weights = [m.bfloat16() for m in masters]
    opts = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    inner, ref = torch.optim.AdamW(masters, **opts), torch.optim.AdamW(refs, **opts)
    if not masterstep.usable(inner):
        return FAIL, "masterstep refuses torch's fused AdamW (the Trainer's adamw_torch_fused)"
    scale = torch.tensor(0.5, device="cuda")
    for _ in range(2):
        grads = [torch.randn(s, device="cuda").bfloat16() for s in shapes]
        given = [-grads[0], *grads[1:]] if fault else grads   # the fault: one gradient's sign lost
        if not masterstep.step(inner, inner.param_groups[0], weights, given, masters, scale):
            return FAIL, f"its kernel did not run ({masterstep._OFF[-1] if masterstep._OFF else 'no reason'})"
        for r, g in zip(refs, grads):
            r.grad = g.float() * scale
        ref.step()
    err = max(float((m - r).abs().max()) for m, r in zip(masters, refs))
    werr = max(float((w.float() - m.bfloat16().float()).abs().max()) for w, m in zip(weights, masters))
    if err > 1e-5 or werr > 0:
        return FAIL, f"master weights off by {err:.2e} from torch's fused AdamW, bf16 copy off by {werr:.2e}"
    return PASS, f"2 steps = torch's fused AdamW (max diff {err:.1e}), bf16 weights = the masters rounded"


ROWS = {"liger": liger_row, "bitsandbytes-4bit": bnb_row, "fused-optimizer": optimizer_row}


def check(row: str, fault: bool) -> tuple[str, str]:
    try:
        if row.startswith("attention-"):
            return attention_row(row.removeprefix("attention-"), fault)
        return ROWS[row](fault)
    except Exception as e:  # noqa: BLE001 - the row fails with the reason, the others still run
        return FAIL, errors.brief(e)


def vllm_row(fault: bool = False) -> tuple[str, str]:
    """vLLM's engine (the one grpo's colocated rollouts start) on a tiny model: starts, generates greedily."""
    import importlib.util

    import torch

    if importlib.util.find_spec("vllm") is None:
        return SKIP, "vllm is not installed"
    if not torch.cuda.is_available():
        return SKIP, f"{NO_GPU}: vLLM needs one"
    import importlib.metadata

    from vllm import LLM, SamplingParams

    with tempfile.TemporaryDirectory(prefix="trainbox-selftest-vllm-") as tmp:
        path = tinymodel.write(Path(tmp) / "model", "llama", head_dim=64)
        llm = LLM(model=str(path), dtype="bfloat16", enforce_eager=True, gpu_memory_utilization=0.15,
                  max_model_len=256, seed=0)
        out = llm.generate(["Natalia sold clips"], SamplingParams(max_tokens=8 if not fault else 0, temperature=0))
        ids = out[0].outputs[0].token_ids
    if len(ids) != 8:
        return FAIL, f"asked for 8 tokens, got {len(ids)}"
    return PASS, f"engine started (vllm {importlib.metadata.version('vllm')}) and generated 8 tokens greedily"


ROWS["vllm-engine"] = vllm_row


def main(argv: list[str]) -> int:
    """Child: `python -m trainbox.image.selftestkernels ROW [--fault]`; prints one `SELFTEST-ROW {json}` line."""
    import json
    import time

    t0 = time.monotonic()
    status, reason = check(argv[0], "--fault" in argv[1:])
    print("SELFTEST-ROW " + json.dumps({"row": argv[0], "status": status, "reason": reason,
                                        "seconds": round(time.monotonic() - t0, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
