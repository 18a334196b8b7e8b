"""The model zoo: the architectures people fine-tune, each as a tiny random-init model built locally (no downloads).

Every entry is the architecture's own transformers config class with its defining features switched on and small:
sliding windows short enough to cut into 64-token rows, Gemma's softcaps, gpt-oss's sinks and experts. They share the
BPE tokenizer of tiny.py. Also a script (`python tests/zoo.py DIR [NAME ...]`) so the GPU checks can build the same
models on the device.
"""

from __future__ import annotations

import sys
from pathlib import Path

WINDOW = 16  # tokens: shorter than the test rows, so a dropped window changes the logits

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)

# name: (config class, its arguments beyond COMMON, what the attention kernel must honour)
ZOO = {
    "llama3": ("LlamaConfig", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 128}),
               ""),
    "qwen2.5": ("Qwen2Config", dict(), ""),
    "qwen3": ("Qwen3Config", dict(head_dim=16), ""),
    "qwen3-moe": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         decoder_sparse_step=1), ""),
    "mixtral": ("MixtralConfig", dict(**MOE), ""),
    "mistral-window": ("MistralConfig", dict(sliding_window=WINDOW), "window"),
    "qwen2-window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0),
                     "window"),
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=WINDOW, attn_logit_softcapping=50.0,
                                    final_logit_softcapping=30.0, query_pre_attn_scalar=16), "window softcap"),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                                        layer_types=["sliding_attention", "full_attention"]), "window"),
    "phi3": ("Phi3Config", dict(sliding_window=WINDOW), "window"),
    "gpt-oss": ("GptOssConfig", dict(head_dim=16, sliding_window=WINDOW, **MOE, max_position_embeddings=131072,
                                     layer_types=["sliding_attention", "full_attention"]), "window sinks"),
}


def make_config(name: str, tokenizer):
    import transformers

    cls_name, extra, _ = ZOO[name]
    kwargs = {**COMMON, **extra}
    return getattr(transformers, cls_name)(
        vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, **kwargs)


def make_zoo_model(dirpath: str | Path, name: str, seed: int = 0) -> Path:
    """Write zoo model `name` (random init, float32) and the tiny tokenizer to dirpath; from_pretrained loads it."""
    import torch
    from transformers import AutoModelForCausalLM

    from tiny import make_tokenizer

    dirpath = Path(dirpath)
    dirpath.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(name, tokenizer), dtype=torch.float32)
    with torch.no_grad():  # random-init sinks are zeros in some versions: make them matter
        for n, p in model.named_parameters():
            if n.endswith("sinks"):
                p.normal_(0, 1)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(dirpath)
    tokenizer.save_pretrained(dirpath)
    return dirpath


def expected_features(name: str) -> frozenset[str]:
    return frozenset(ZOO[name][2].split())


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "zoo")
    for n in sys.argv[2:] or list(ZOO):
        print(make_zoo_model(out / n, n))
