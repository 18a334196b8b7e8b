"""Sampling completions from a causal LM through a static KV cache and one compiled decode step: GRPO's rollouts for
dense models without vLLM (grpo/rollouts.py decides; vLLM may be absent, as on cu126 images, or slower). Under
adapters (lora, qlora) the copy holds the base weights with the adapter merged in (source_weights), re-merged after
each step: transformers' generate over a 4-bit base dequantizes every weight at every token (an 8B Llama on an H200:
77-81 ms a decode step of 6 rows, benchmarks/results/grpo_notebook-2026-12-02.txt).

transformers' `generate` with its dynamic cache is CPU-bound on small models (a 1.2B Llama on an H100: 16-33 ms a
decode step for 16 rows, 4-8 s a GRPO rollout of 256 tokens, TRL's no-vLLM path), and its own static-cache
auto-compile still rebuilds shapes every step (5 ms). Here a bfloat16 copy of the policy decodes into a static cache
whose shapes never change (rows and length fixed per run; full-length layers for sliding windows too), so ONE compiled
step (the forward on one token per row, the sampling from uniforms drawn outside it, the end-of-sequence bookkeeping)
is captured as a CUDA graph and replayed for every token. Sibling projections (q/k/v, gate/up) run as one GEMM each.
On an H100 (benchmarks/decode_probe.py): 1.93 ms a step, 1.63 of them GPU time, 0.50 s a rollout of 16 x 256 tokens,
where colocated vLLM's CPU-bound loop took 0.56-0.95 s. Keys and values are read per KV head group
(`decode_attention`): SDPA with a mask would copy the whole cache once per group every step.

Sampling is plain softmax(logits / temperature) (Gumbel-max, an exact draw); anything else (top-p/k, min-p,
repetition penalty) is left to vLLM or transformers' generate by the caller. The prefill runs uncompiled (its width
changes every batch); on CPU nothing is compiled (tests).
"""

from __future__ import annotations

import copy
import sys

import torch

from common import errors

IMPL = "trainbox_decode"
STEP = 512  # prompt budgets grow in these steps: each growth compiles the step anew (30-60 s on an H200)
SCORE_BYTES = 2**29  # float32 attention scores of one pass where the kernel is ours (softcap, sinks): 512 MiB


def decode_attention(module, query, key, value, attention_mask, scaling=None, softcap=None, s_aux=None, dropout=0.0,
                     **kwargs):
    """transformers attention for the decoder copy: query heads of a KV group ride as rows of one matmul against the
    group's keys (no repeat_kv copy), with the model's logit softcap (Gemma 2) and learned sinks (gpt-oss) applied as
    eager attention does. Any query length; memory is rows x heads x queries x keys in float32, which the prefill of
    a GRPO batch affords (longest prompt squared)."""
    b, h, q, d = query.shape
    g = key.shape[1]
    scale = scaling if scaling is not None else d ** -0.5
    if attention_mask is not None:
        attention_mask = attention_mask[..., : key.shape[2]]
    if q > 1 and not softcap and s_aux is None:  # a plain prefill: SDPA's memory-efficient kernel, GQA native
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               scale=scale, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    chunk = max(1, SCORE_BYTES // (4 * b * h * key.shape[2]))  # queries per pass
    if q > chunk:
        parts = [decode_attention(module, query[:, :, i : i + chunk], key, value,
                                  None if attention_mask is None else attention_mask[:, :, i : i + chunk],
                                  scaling=scale, softcap=softcap, s_aux=s_aux)[0] for i in range(0, q, chunk)]
        return torch.cat(parts, 1), None
    scores = torch.matmul(query.reshape(b, g, (h // g) * q, d), key.transpose(-1, -2)).float() * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(b, g, h // g, q, -1)
    if attention_mask is not None:  # (b, 1, q, keys): bool (True = may look) or additive
        mask = attention_mask[:, :, None]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if s_aux is not None:  # one learned sink logit per head: it takes probability mass, contributes no value
        sink = s_aux.float().view(1, g, h // g, 1, 1).expand(b, g, h // g, q, 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    probs = probs.nan_to_num(0.0)  # a fully masked row (a left-pad query) gets zeros, not NaN
    out = torch.matmul(probs.to(value.dtype).view(b, g, (h // g) * q, -1), value)
    return out.view(b, h, q, d).transpose(1, 2).contiguous(), None


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IMPL, decode_attention)
    AttentionMaskInterface.register(IMPL, sdpa_mask)  # boolean (b, 1, q, keys), causal + window + padding


class _Fused(torch.nn.Module):
    """One matmul for sibling projections of the same input (q/k/v, gate/up): decode is bound by weight reads and
    kernel count at a few rows, and one wide GEMM beats three narrow ones. The sibling called first computes all
    and keeps the slices for the others (matched by input identity, so any call order or input is still right)."""

    def __init__(self, linears):
        super().__init__()
        first = linears[0]
        self.splits = [lin.out_features for lin in linears]
        self.weight = torch.nn.Parameter(torch.empty(sum(self.splits), first.in_features, dtype=first.weight.dtype,
                                                     device=first.weight.device), requires_grad=False)
        has_bias = [lin.bias is not None for lin in linears]
        self.bias = None
        if any(has_bias):  # a sibling without bias gets zeros (a slice nothing syncs into)
            self.bias = torch.nn.Parameter(torch.zeros(sum(self.splits), dtype=first.weight.dtype,
                                                       device=first.weight.device), requires_grad=False)
        self.memo: list = []  # [input, parts, calls left]: a list Dynamo traces through, emptied once all are served

    def part(self, x, i):
        if not self.memo or self.memo[0] is not x:
            self.memo.clear()
            out = torch.nn.functional.linear(x, self.weight, self.bias)
            self.memo.extend([x, out.split(self.splits, -1), len(self.splits)])
        parts = self.memo[1]
        self.memo[2] -= 1
        if self.memo[2] == 0:
            self.memo.clear()
        return parts[i]


class _Part(torch.nn.Module):
    def __init__(self, fused, i):
        super().__init__()
        self.fused, self.i = [fused], i  # a list: not a submodule (the parent holds the fused weight once)

    def forward(self, x):
        return self.fused[0].part(x, self.i)


SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def fuse_projections(model) -> dict[str, torch.Tensor]:
    """Replace sibling nn.Linear projections (SIBLINGS) by slices of one fused matmul, in place; return where each
    original parameter name now lives (a view into the fused weight) for copying weights in."""
    targets = dict(model.named_parameters())
    for mod_name, module in list(model.named_modules()):
        for names in SIBLINGS:
            linears = [getattr(module, n, None) for n in names]
            if not all(type(lin) is torch.nn.Linear for lin in linears) or \
                    len({(lin.in_features, lin.weight.dtype) for lin in linears}) != 1:
                continue
            fused = _Fused(linears)
            setattr(module, "_fused_" + names[0], fused)
            start = 0
            for i, (n, lin) in enumerate(zip(names, linears)):
                prefix = f"{mod_name}.{n}." if mod_name else f"{n}."
                targets[prefix + "weight"] = fused.weight[start : start + lin.out_features]
                if lin.bias is not None:
                    targets[prefix + "bias"] = fused.bias[start : start + lin.out_features]
                start += lin.out_features
                setattr(module, n, _Part(fused, i))
    return targets


def source_weights(policy) -> tuple[dict, dict]:
    """(parameters, buffers) of `policy` under a plain model's names, as callables giving the tensor to copy in: a
    plain model's own; a PEFT model's (lora, qlora) base weights with each active LoRA adapter merged in (the 4-bit
    ones dequantized first: PEFT's own dequantize_bnb_weight and get_delta_weight, as its merge does), one matrix at a
    time, so the decoder samples from the policy as it trains without a merged copy of the model."""
    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    params = {n: (lambda p=p: p) for n, p in base.named_parameters()}
    buffers = {n: (lambda b=b: b) for n, b in base.named_buffers()}
    try:  # (PEFT injects its layers into the model itself: a base model taken from a PEFT one has them too)
        from peft.tuners.lora import LoraLayer
        from peft.utils.integrations import dequantize_bnb_weight
    except ImportError:
        return params, buffers

    for name, module in base.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        adapters = [a for a in module.active_adapters if a in module.lora_A]
        if getattr(module, "lora_variant", None) and any(a in module.lora_variant for a in adapters):
            raise StepNotCompiled(f"{name}: a LoRA variant (DoRA) the decoder does not merge")
        layer = module.get_base_layer()
        for n in [k for k in params if k.startswith(name + ".")]:
            del params[n]  # the layer's base_layer / lora_A / lora_B: replaced by the merged weight below

        def merged(module=module, layer=layer, adapters=adapters):
            w = layer.weight
            if getattr(getattr(w, "quant_state", None), "packing_format_for_cpu", False):
                # bitsandbytes' CPU inference layout (AVX512-BF16, made at an eval forward): back to the standard
                # one, as bitsandbytes itself does before saving or moving the weight
                from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

                w.data, w.quant_state = _convert_weight_packed_for_cpu_inverse(w.data, w.quant_state)
            w = dequantize_bnb_weight(w, state=w.quant_state) if getattr(w, "quant_state", None) is not None else w
            w = w.to(torch.float32, copy=True)  # summed in float32, rounded once by the copy into the decoder
            if not module.merged and not module.disable_adapters:
                for a in adapters:
                    w += module.get_delta_weight(a).float()
            return w

        params[name + ".weight"] = merged
        if layer.bias is not None:
            params[name + ".bias"] = lambda layer=layer: layer.bias
    return params, buffers


class StepNotCompiled(RuntimeError):
    """The decode step failed to compile or capture (seen on an H100: Mixtral's and Qwen3-MoE's expert loops copy
    from the host inside the graph); raised where the caller would rather use another engine than decode uncompiled."""


def memory_bytes(params: int, layers: int, attn_width: int, rows: int, prompt_tokens: int, max_new: int) -> int:
    """What the decoder adds on the GPU: its bfloat16 weights and its static cache, keys and values of every layer
    counted at the full attention width (grouped-query models need less: the estimate errs on the safe side)."""
    return 2 * params + rows * (_round_up(prompt_tokens) + max_new) * layers * 2 * attn_width * 2


def _round_up(n: int) -> int:
    return -(-n // STEP) * STEP


def split_argmax(x, width: int = 1024):
    """argmax over the last dim in two passes (each chunk's max, then the best chunk): a row-per-block argmax over a
    128k vocabulary keeps 16 of an H100's 132 SMs busy (60 us of a 1.8 ms step, decode_probe.py)."""
    rows, n = x.shape
    pad = -n % width
    chunks = torch.nn.functional.pad(x, (0, pad), value=float("-inf")).view(rows, -1, width)
    best, where = chunks.max(-1)
    chunk = best.argmax(-1, keepdim=True)
    return (chunk * width + where.gather(-1, chunk)).squeeze(-1)


def static_cache(config, length: int):
    """A static cache of `length` slots in every attention layer, sliding-window ones included: transformers'
    sliding-window layer keeps its fill as a Python int, which a compiled step guards on and so recompiles every
    token (seen on an H100: Mistral, Qwen2, Gemma 2/3, Phi-3 fell back to eager, 5-9 ms a step). A full-length layer
    holds the same keys at their positions; the sliding-window mask (from the config, per layer) hides the rest."""
    from transformers.cache_utils import Cache, StaticCache, StaticLayer, get_layer_types_and_kwargs

    types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    if not set(types) <= {"full_attention", "sliding_attention"}:  # chunked, linear or compressed layers: theirs
        return StaticCache(config=config, max_cache_len=length)
    return Cache(layers=[StaticLayer(max_cache_len=length) for _ in types])


class StaticDecoder:
    """A bfloat16 decoder copy of `policy` (same architecture and weights), its static cache, and the decode step.

    generate(prompts) samples one completion per prompt (token id lists, no padding), each up to `max_new` tokens,
    ending at the first of `eos_ids` (kept, as TRL keeps it). sync(policy) copies the policy's current weights in.
    """

    def __init__(self, policy, max_new: int, pad_id: int, eos_ids, temperature: float = 1.0,
                 compile: bool | None = None, dtype=torch.bfloat16, uncompiled_fallback: bool = True,
                 fuse: bool = True):
        from transformers import AutoModelForCausalLM

        register()
        self.device = next(policy.parameters()).device
        conf = copy.deepcopy(policy.config)
        if hasattr(conf, "quantization_config"):  # a 4-bit policy (qlora): the decoder holds merged bf16 weights
            del conf.quantization_config
        conf._attn_implementation = IMPL  # (the policy's own kernel may be a training-only varlen/flex one)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(conf, dtype=dtype)
        self.model = model.to_empty(device=self.device).eval().requires_grad_(False)
        self.model.tie_weights()  # once, before any graph is captured: sync() then copies into fixed addresses
        self.targets = fuse_projections(self.model) if fuse else dict(self.model.named_parameters())
        self.max_new, self.pad_id, self.temperature = max_new, pad_id, float(temperature)
        self.eos = torch.tensor(sorted(set(eos_ids)) or [-1], device=self.device)
        self.compile = self.device.type == "cuda" if compile is None else compile
        self.uncompiled_fallback = uncompiled_fallback  # else a failed compile raises StepNotCompiled
        self.rows = self.length = 0
        self.cache = self.mask = self.step = None
        self.sync(policy)

    def sync(self, policy) -> None:
        """Copy the policy's weights (and buffers such as rotary frequencies) into the decoder, in place, so a
        captured graph keeps reading the same addresses."""
        with torch.no_grad():
            params, buffers = source_weights(policy)
            for name, p in self.targets.items():
                p.copy_(params[name]())
            for name, b in self.model.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name]())

    def _fit(self, rows: int, prompt: int) -> None:
        """Cache and step for at least `rows` rows and `prompt` prompt tokens (grown in STEP-sized lengths)."""
        length = _round_up(prompt) + self.max_new
        if rows <= self.rows and length <= self.length:
            return
        self.rows, self.length = max(rows, self.rows), max(length, self.length)
        self.cache = static_cache(self.model.config, self.length)
        self.mask = torch.zeros(self.rows, self.length, dtype=torch.long, device=self.device)
        self.step = torch.compile(self._step, mode="reduce-overhead", fullgraph=True) if self.compile else self._step

    def _sample(self, logits, uniform):
        logits = logits.float() / self.temperature
        noise = -torch.log(-torch.log(uniform))  # Gumbel: argmax(l + g) ~ softmax(l)
        return split_argmax(logits + noise)

    def _step(self, token, done, position, slot, mask, uniform):
        logits = self.model(input_ids=token[:, None], position_ids=position, attention_mask=mask,
                            past_key_values=self.cache, cache_position=slot, use_cache=True).logits[:, -1]
        nxt = torch.where(done, self.pad_id, self._sample(logits, uniform))
        return nxt, done | torch.isin(nxt, self.eos)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], check_every: int = 32) -> list[list[int]]:
        n = len(prompts)
        width = max(map(len, prompts))
        self._fit(n, width)
        rows = prompts + [prompts[0]] * (self.rows - n)  # fixed row count: the graph's shape
        ids = torch.tensor([[self.pad_id] * (width - len(r)) + list(r) for r in rows], device=self.device)
        real = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=self.device)
        self.cache.reset()
        mask = self.mask
        mask.zero_()
        mask[:, :width] = real
        mask[:, width:] = 1  # not yet written slots are hidden by causality (cache_position), not by the mask
        position = (real.cumsum(-1) - 1).clamp_(min=0)
        logits = self.model(input_ids=ids, position_ids=position, attention_mask=real, past_key_values=self.cache,
                            cache_position=torch.arange(width, device=self.device), use_cache=True).logits[:, -1]
        token = self._sample(logits, torch.rand_like(logits, dtype=torch.float32))
        # Each step's uniforms are drawn outside the graph and passed in: fresh by construction, whatever the
        # captured graph's own RNG would do on replay (not verified on a GPU); ~10 us a step.
        shape, like = (self.rows, logits.shape[-1]), dict(device=self.device, dtype=torch.float32)
        done = torch.isin(token, self.eos)
        done[n:] = True  # filler rows: finished from the start, so they never hold the loop open
        out = [token]
        position = position[:, -1:] + 1
        slots = torch.arange(width, width + self.max_new, device=self.device)  # made up front: no host copy a step
        for i in range(self.max_new - 1):
            if i % check_every == 0 and bool(done.all()):
                break
            args = (out[-1], done, position + i, slots[i : i + 1], mask, torch.rand(shape, **like))
            try:
                token, done = self.step(*args)
            except Exception as error:  # noqa: BLE001 - the eager step below re-raises anything real
                if self.step == self._step:
                    raise
                why = errors.brief(error)
                if not self.uncompiled_fallback:
                    raise StepNotCompiled(why) from error
                print(f"[trainbox] grpo: the decode step did not compile ({why}); decoding uncompiled",
                      file=sys.stderr, flush=True)
                self.step = self._step
                self.compile = False
                token, done = self.step(*args)
            token, done = token.clone(), done.clone()  # a graph's outputs are overwritten by its next replay
            out.append(token)
        tokens = torch.stack(out, 1)[:n].tolist()
        completions = []
        eos = set(self.eos.tolist())
        for row in tokens:
            end = next((j for j, t in enumerate(row) if t in eos), len(row) - 1)
            completions.append(row[: end + 1])
        return completions
