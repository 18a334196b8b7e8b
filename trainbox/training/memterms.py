"""The memory plan's terms that depend on a choice: each optimizer's states, and the activations a micro-batch keeps
for backward by layer kind (attention block, dense MLP, routed experts, attention score matrices). memplan.estimate
adds them up; the figures are bytes, the activations bf16 (2 bytes a value) unless said.

Optimizer states (optimizer_state_bytes), as transformers' Trainer builds each `--optim` (trainer_optimizer.py):
AdamW and its variants two float32 moments (8 bytes a parameter); bitsandbytes' and torchao's 8-bit ones 2, torchao's
4-bit 1; SGD none unless `--optim_args momentum=...` (then a float32 buffer: 4); Adagrad and Lion one float32 state (4),
RMSprop one plus its momentum and centred average when asked; AdEMAMix three (12, 8-bit: 3); Adafactor (the
Trainer's: no first moment) a factored second moment, one float32 value per row and per column of each matrix and the
whole of each vector (ModelFacts.factored_state: from the parameters' shapes); LOMO none (the update is fused into
backward), AdaLomo Adafactor's factored moment. An optimizer not known here is counted as AdamW (the safe side).

Activations per token and layer (activations):
- the attention block: the norms' inputs and outputs (8 x hidden) and q, k, v, the rotated q and k, the attention
  output (8 x the attention width, heads x head dim, which differs from hidden in e.g. Qwen3 and Gemma): 16 x hidden
  where the widths agree, the figure calibrated on the device (benchmarks/memory_plan.py);
- a dense MLP: 10 x intermediate (gate, up, their activation and product; 5 with Liger's SwiGLU, which recomputes
  the product in backward);
- a MoE layer: each token goes through top-k experts (num_experts_per_tok), each slot keeps its gathered input
  (2 x hidden), the experts' gate/up output (4 x the expert's width), the activation and its product (4 x width) and
  the down projection's output the routing weight multiplies (2 x hidden): 4 x hidden + 8 x width per slot. gpt-oss's
  experts (moe.py: compiled whole, the routing weight folded into the gate) keep the input, the gate/up output and the
  gated product: 2 x hidden + 6 x width. Shared experts (Qwen2-MoE, DeepSeek) are a dense MLP beside them; the router's
  logits (float32, a value per expert) are kept for the balancing loss;
- attention score matrices: the flash kernels (FlashAttention, varlen, Flex) never hold them. Eager computes
  softmax(QK^T) for every head as a rows x heads x L x L matrix per layer, upcast to float32 for the softmax: its
  float32 output and the bf16 probabilities are kept for backward (6 bytes a score) in every layer, or in the one
  recomputed layer under checkpointing, plus one layer's working set (the bf16 logits, the masked logits, the float32
  softmax: 8 bytes a score) and the 4-D mask. SDPA with a padding mask (padded rows: batch > 1) runs a kernel that
  takes the mask as a float bias per layer (2 bytes a score and row, kept for backward). Both expand grouped k and v
  to every head (repeat_kv: 4 x (attention width - k/v width) a token and layer more). L: --max_length (rows are
  padded to the longest, at most that).
"""

from __future__ import annotations

# bytes a parameter of each optimizer's states; the names are transformers' OptimizerNames values
_ADAM = 8
STATE_BYTES = {
    **dict.fromkeys(("adamw_torch", "adamw_torch_fused", "adamw_torch_xla", "adamw_torch_npu_fused",
                     "adamw_anyprecision", "paged_adamw_32bit", "stable_adamw", "schedule_free_adamw",
                     "schedule_free_radam", "galore_adamw", "galore_adamw_layerwise", "apollo_adamw",
                     "apollo_adamw_layerwise"), _ADAM),
    **dict.fromkeys(("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "adamw_torch_8bit", "galore_adamw_8bit",
                     "galore_adamw_8bit_layerwise"), 2),
    "adamw_torch_4bit": 1,
    **dict.fromkeys(("ademamix", "paged_ademamix_32bit"), 12),
    **dict.fromkeys(("ademamix_8bit", "paged_ademamix_8bit"), 3),
    **dict.fromkeys(("lion_32bit", "paged_lion_32bit", "adagrad", "schedule_free_sgd"), 4),
    **dict.fromkeys(("lion_8bit", "paged_lion_8bit", "rmsprop_bnb_8bit"), 1),
    **dict.fromkeys(("rmsprop_bnb", "rmsprop_bnb_32bit"), 4),
    "grokadamw": 12,  # AdamW's moments and the gradients' moving average
    "lomo": 0,
}
FACTORED = ("adafactor", "galore_adafactor", "galore_adafactor_layerwise", "adalomo")


def _optim_args(text: str | None) -> dict[str, str]:
    """`--optim_args "momentum=0.9,nesterov=True"` as the Trainer reads it (key=value, comma-separated)."""
    out = {}
    for part in (text or "").replace(" ", "").split(","):
        key, eq, value = part.partition("=")
        if eq:
            out[key] = value
    return out


def _nonzero(value: str | None) -> bool:
    try:
        return float(value or 0) != 0
    except ValueError:
        return True  # the Trainer will refuse it; counted on the safe side meanwhile


def optimizer_state_bytes(optim: str, params: int, factored_state: int = 0, optim_args: str | None = None) -> int:
    """Bytes of `optim`'s states for `params` parameters (module docstring). `factored_state`: Adafactor's float32
    values for these parameters (ModelFacts.factored_state), `optim_args`: the Trainer's --optim_args."""
    name = str(getattr(optim, "value", optim)).lower()
    extra = _optim_args(optim_args)
    if name in FACTORED:
        return 4 * (factored_state or params)
    if name == "sgd":
        return 4 * params if _nonzero(extra.get("momentum")) else 0
    if name == "rmsprop":
        return 4 * params * (1 + _nonzero(extra.get("momentum")) + (extra.get("centered", "").lower()
                                                                    in ("true", "1", "yes")))
    return STATE_BYTES.get(name, _ADAM) * params


def per_token_layer(f, liger: bool) -> dict[str, int]:
    """Bytes one token keeps for backward in the layers of each kind, summed over the layers: {"attention block",
    "mlp", "experts"} (module docstring)."""
    layers = max(1, f.layers)
    width = f.attn_width or f.hidden
    out = {"attention block": layers * (8 * f.hidden + 8 * width)}
    mlp = (5 if liger else 10) * f.intermediate
    moe = min(layers, getattr(f, "moe_layers", 0) or layers) if f.experts else 0
    out["mlp"] = (layers - moe) * mlp
    if moe:
        k = f.experts_per_token or f.experts  # a config that doesn't say its top-k: every expert (the safe side)
        ew = getattr(f, "expert_intermediate", 0) or f.intermediate
        slot = 2 * f.hidden + 6 * ew if f.model_type == "gpt_oss" and not f.experts_dispatch else 4 * f.hidden + 8 * ew
        shared = 10 * getattr(f, "shared_intermediate", 0)
        out["experts"] = moe * (k * slot + shared + 4 * f.experts)
    return out


def scores(f, attn: str, rows: int, length: int, checkpointing: bool) -> int:
    """Bytes of attention score matrices (eager) or mask biases (SDPA with padding) a micro-batch of `rows` x `length`
    holds at its peak, and the expanded k/v of both (module docstring); 0 for the flash kernels."""
    if attn not in ("eager", "sdpa") or (attn == "sdpa" and rows <= 1):
        return 0
    layers = max(1, f.layers)
    heads = getattr(f, "heads", 0) or max(1, (f.attn_width or f.hidden) // (getattr(f.attention, "head_dim", 0) or 64))
    kept = layers if not checkpointing else 1
    kv = getattr(f, "kv_width", 0) or f.attn_width
    expanded = kept * rows * length * 4 * max(0, (f.attn_width or f.hidden) - kv)
    square = rows * length * length
    if attn == "sdpa":
        return kept * 2 * square + expanded
    return kept * 6 * square * heads + 8 * square * heads + 4 * square + expanded
