"""A model's facts for the planners (speed defaults, the memory plan, throughput's FLOPs): parameter count and
shape, attention needs (windows, softcaps, sinks), MoE experts, read from the config on the meta device (no weights).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from common.errors import UsageError
from trainbox.training import attention
from trainbox.training.kernels import moe


def _factored(shape) -> int:
    """Adafactor's second-moment values for a parameter of `shape` (transformers' Adafactor: a row and a column
    average over the last two dims of a matrix or a stack of them, a vector's own)."""
    if len(shape) < 2:
        return int(shape.numel())
    lead = 1
    for d in shape[:-2]:
        lead *= int(d)
    return lead * (int(shape[-2]) + int(shape[-1]))


def _experts_shape(named, experts: int, hidden: int, width: int) -> dict:
    """MoE layers, one routed expert's width and the shared experts' width. `width`: the config's (intermediate_size
    in Mixtral and gpt-oss, moe_intermediate_size in Qwen3-MoE and DeepSeek); without one, read from the parameters
    (a gated expert is three hidden x width matrices, whether fused as gate_up or not), as the shared experts' is."""
    if not experts:
        return {}
    import re

    def layer_of(name):
        m = re.search(r"\.(\d+)\.", name)
        return m.group(1) if m else name

    routed = [(n, p.numel()) for n, p in named if ".experts." in n]
    shared = [(n, p.numel()) for n, p in named if ".shared_expert" in n and "shared_expert_gate" not in n]
    layers = len({layer_of(n) for n, _ in routed}) or 1
    per_expert = sum(c for _, c in routed) / (layers * experts)
    return dict(moe_layers=layers, expert_intermediate=int(width or round(per_expert / (3 * hidden))),
                shared_intermediate=int(round(sum(c for _, c in shared) / (layers * 3 * hidden))))


@dataclass(frozen=True)
class ModelFacts:
    model_type: str
    params: int
    embedding_params: int  # input embedding (a lookup, not a matmul) when the LM head is a separate matrix
    layers: int
    hidden: int
    intermediate: int
    attn_width: int  # heads x head dim: the width of QK^T and AV
    attention: attention.Needs = None  # windows, softcaps, sinks: what the attention kernel must honour
    experts: int = 0  # routed experts per MoE layer (0: dense)
    experts_per_token: int = 0  # MoE: routed experts each token goes through (top-k)
    expert_params: int = 0  # MoE: the routed experts' parameters, all layers (a token uses top-k / experts of them)
    windowed_layers: int = 0  # layers whose attention is limited to attention.window keys
    vocab: int = 0  # rows of the LM head (the loss head's width)
    experts_dispatch: str | None = None  # MoE: why moe.NAME can't be used (None: it can), moe.applies
    heads: int = 0  # attention heads (0: attn_width / the head dim)
    kv_width: int = 0  # key/value heads x head dim (0: attn_width, no grouped k/v)
    moe_layers: int = 0  # layers with routed experts (0 with experts: every layer)
    expert_intermediate: int = 0  # MoE: one routed expert's intermediate width (0: intermediate)
    shared_intermediate: int = 0  # MoE: the shared experts' intermediate width beside the routed ones, per layer
    factored_state: int = 0  # Adafactor's second moment: rows + columns of each matrix, each vector whole (values)

    @property
    def matmul_params(self) -> int:
        return self.params - self.embedding_params

    @property
    def active_matmul_params(self) -> int:
        """The matmul parameters one token goes through: an MoE layer's token uses top-k of its routed experts."""
        if not (self.experts and self.expert_params and self.experts_per_token):
            return self.matmul_params  # dense, or a config that doesn't say its top-k: every expert counted
        idle = self.expert_params * (self.experts - self.experts_per_token) // self.experts
        return self.matmul_params - idle


@functools.lru_cache(maxsize=8)
def model_facts(model_path: str, revision: str | None = None) -> ModelFacts:
    """Parameter count and shape, from the config alone (the model is built on the meta device: no weights read).
    Kept per path and revision (ModelFacts is frozen): grpo reads it while choosing its rollout engine and again for
    its memory plan."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:  # (modelcheck.py checked config.json before: this is for what only building the model finds)
        conf = AutoConfig.from_pretrained(model_path, revision=revision)
        text = conf.get_text_config()
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(conf)
    except (ValueError, TypeError, KeyError, AttributeError, OSError, ArithmeticError, RuntimeError) as e:
        first = " ".join(str(e).split())[:300] or type(e).__name__
        raise UsageError(f"model {model_path}: its config.json describes no causal LM transformers can build "
                         f"({type(e).__name__}: {first})") from None
    params = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings()
    out = model.get_output_embeddings()
    tied = out is not None and out.weight is emb.weight
    heads = getattr(text, "num_attention_heads", 0)
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else 0)
    experts = int(getattr(text, "num_local_experts", 0) or getattr(text, "num_experts", 0) or 0)
    needs = attention.needs(conf, model)
    types = getattr(text, "layer_types", None)
    layers = getattr(text, "num_hidden_layers", 0)
    windowed = 0 if not needs.window else layers if types is None else sum(t == "sliding_attention" for t in types)
    named = list(model.named_parameters())
    moe_shape = _experts_shape(named, experts, text.hidden_size,
                               getattr(text, "moe_intermediate_size", None) or getattr(text, "intermediate_size", 0))
    return ModelFacts(
        model_type=conf.model_type,
        params=params,
        embedding_params=0 if tied else emb.weight.numel(),
        layers=layers,
        hidden=text.hidden_size,
        intermediate=getattr(text, "intermediate_size", 4 * text.hidden_size) or 4 * text.hidden_size,
        attn_width=heads * head_dim,
        attention=needs,
        experts=experts,
        # routed experts live under `.experts.` in every transformers MoE layout (fused tensors or a ModuleList);
        # shared experts and the router do not
        experts_per_token=int(getattr(text, "num_experts_per_tok", 0) or 0) if experts else 0,
        expert_params=sum(p.numel() for n, p in model.named_parameters() if ".experts." in n) if experts else 0,
        windowed_layers=windowed,
        vocab=int(getattr(text, "vocab_size", 0) or 0),
        experts_dispatch=moe.applies(type(model)) if experts else None,
        heads=int(heads or 0),
        kv_width=int(getattr(text, "num_key_value_heads", None) or heads or 0) * int(head_dim or 0),
        factored_state=sum(_factored(p.shape) for _, p in named),
        **moe_shape,
    )
