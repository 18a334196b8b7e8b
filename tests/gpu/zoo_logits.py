"""The model zoo on a GPU: for every architecture in tests/zoo.py and every attention kernel trainbox may pick, the
logits of single rows, a padded batch and one packed row against `eager` in bf16, and what `attention.choose` picks
(with the reasons it gives for the kernels it passes over).

Usage: python tests/gpu/zoo_logits.py [--seq 256] [--json FILE]

Noise floor: eager in bf16 against eager in float32 on the same weights (what bf16 rounding alone moves). A kernel
"matches" when its max |diff| against bf16 eager is within 2x that floor plus the floor of SDPA (another exact
kernel) on a model without special features. Packed rows are measured only for kernels trainbox packs for
(FlashAttention, torch varlen); SDPA and eager get padded batches (attention.UNPACKED_WHY), but their packed
figure is printed too, in brackets, to show why.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def logits_diffs(path: Path, impl: str, seq: int, ref: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, attn_implementation=impl, dtype=torch.bfloat16).cuda().eval()
    rows, lens = ref["rows"], [len(r) for r in ref["rows"]]
    with torch.no_grad():
        single = max(float((m(r[None]).logits[0].float() - s).abs().max()) for r, s in zip(rows, ref["single"]))
        ids = torch.zeros(len(rows), max(lens), dtype=torch.long, device="cuda")
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = r, 1
        pad = m(ids, attention_mask=mask).logits.float()
        padded = max(float((pad[i, :n] - ref["single"][i]).abs().max()) for i, n in enumerate(lens))
        pos = torch.cat([torch.arange(n, device="cuda") for n in lens])[None]
        out = m(torch.cat(rows)[None], position_ids=pos, use_cache=False).logits[0].float()
        starts = [sum(lens[:i]) for i in range(len(lens))]
        packed = max(float((out[a : a + n] - ref["single"][i]).abs().max()) for i, (a, n) in enumerate(zip(starts, lens)))
    del m
    torch.cuda.empty_cache()
    return {"single": single, "padded": padded, "packed": packed}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=256, help="tokens in the longest row (window is zoo.WINDOW)")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from trainbox.training import attention, modelfacts
    from trainbox.training.kernels import varlenattn
    from zoo import ZOO, make_zoo_model

    cc = torch.cuda.get_device_capability()
    print(f"GPU {torch.cuda.get_device_name()} sm{cc[0]}{cc[1]}, torch {torch.__version__}", flush=True)
    results, base = [], Path(tempfile.mkdtemp(prefix="zoo-"))
    floor_plain = 0.0
    for name in ZOO:
        path = make_zoo_model(base / name, name)
        needs = modelfacts.model_facts(str(path)).attention
        # As the Hopper images decide (their record says fa3); the reasons name every kernel passed over.
        choice = attention.choose(None, {"attention_backend": "fa3"}, needs)
        torch.manual_seed(0)
        rows = [torch.randint(10, 300, (n,), device="cuda") for n in (a.seq, a.seq * 3 // 4, a.seq // 2)]
        ref = {"rows": rows}
        with torch.no_grad():
            for dtype, key in ((torch.bfloat16, "single"), (torch.float32, "fp32")):
                m = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=dtype).cuda().eval()
                ref[key] = [m(r[None]).logits[0].float() for r in rows]
                del m
        floor = max(float((x - y).abs().max()) for x, y in zip(ref["single"], ref["fp32"]))
        row = {"model": name, "needs": needs.describe(needs.features()) or "plain causal", "chosen": choice.impl,
               "line": choice.line(), "floor_bf16_vs_fp32": floor, "kernels": {}}
        for k in ("fa3", "fa4", "fa2", "varlen", "sdpa"):
            kern = attention.KERNELS[k]
            lost = needs.features() - kern.honours
            why = (f"would drop {needs.describe(lost)}" if lost else attention.runtime_usable(k, needs))
            if why:
                row["kernels"][k] = {"not_picked": why}
                continue
            if k == "varlen":
                varlenattn.register()
            row["kernels"][k] = {**logits_diffs(path, kern.impl, a.seq, ref), "packs": kern.packed}
        if not needs.features():
            floor_plain = max(floor_plain, row["kernels"].get("sdpa", {}).get("single", 0.0))
        results.append(row)

    print(f"\nnoise floor: eager bf16 vs fp32 per model (below); SDPA vs eager on plain models {floor_plain:.3f}\n")
    print(f"{'model':15s} {'needs':28s} {'chosen':22s} {'floor':>6s}  kernel: single / padded / packed")
    bad = []
    for r in results:
        cells = []
        for k, v in r["kernels"].items():
            if "not_picked" in v:
                cells.append(f"{k}: not picked ({v['not_picked']})")
                continue
            tol = 2 * r["floor_bf16_vs_fp32"] + floor_plain
            packed = f"{v['packed']:.3f}" if v["packs"] else f"[{v['packed']:.3f}, pads]"
            ok = v["single"] <= tol and v["padded"] <= tol and (not v["packs"] or v["packed"] <= tol)
            cells.append(f"{k}: {v['single']:.3f} / {v['padded']:.3f} / {packed}{'' if ok else ' MISMATCH'}")
            if not ok:
                bad.append((r["model"], k))
        print(f"{r['model']:15s} {r['needs']:28s} {r['chosen']:22s} {r['floor_bf16_vs_fp32']:6.3f}  " + "; ".join(cells))
    for r in results:
        print(f"  {r['model']}: {r['line']}")
    chosen_bad = [(m, k) for m, k in bad if any(r["model"] == m and attention.ALIASES.get(k) == r["chosen"]
                                                for r in results)]
    print("RESULT " + json.dumps({"mismatches": bad, "chosen_mismatches": chosen_bad, "floor_plain": floor_plain}))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 1 if chosen_bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
