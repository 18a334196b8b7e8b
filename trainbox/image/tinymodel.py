"""Tiny random models and a BPE tokenizer built on the spot (no download), and synthetic data in the real formats:
what `trainbox selftest` trains and checks kernels on.

A model kind names the attention features it has: `llama` (plain causal), `mistral` (a sliding window), `gemma2` (a
sliding window and an attention-logit softcap), `gpt-oss` (a sliding window and learned sinks, MoE). Each is the architecture's own
transformers config with its features switched on and small (a window shorter than the rows the checks feed, so a
kernel that drops it gives other logits). `head_dim` is a parameter: the images' FA3 build keeps head dim 128 only.
"""

from __future__ import annotations

import json
from pathlib import Path

WINDOW = 16  # tokens: shorter than the checks' rows
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May? #### 72",
    "<reasoning>48 / 2 = 24 and 48 + 24 = 72</reasoning><answer>72</answer>",
    "What is 3 plus 3? It is 6. Add 2 and 2. The sum is 4. 0 1 2 3 4 5 6 7 8 9 10 11 12",
    "system user assistant instruction input output response question answer",
]
SPECIAL = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
# kind: (transformers config class, its features' arguments, the features)
KINDS = {
    "llama": ("LlamaConfig", {}, frozenset()),
    "mistral": ("MistralConfig", dict(sliding_window=WINDOW), frozenset({"window"})),
    "gemma2": ("Gemma2Config", dict(sliding_window=WINDOW, attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
               frozenset({"window", "softcap"})),
    "gpt-oss": ("GptOssConfig", dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
                                     layer_types=["sliding_attention", "full_attention"]),
                frozenset({"window", "sinks"})),
}


def tokenizer(vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|end|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def kind_for(features) -> str:
    """The smallest kind that has every one of `features` (window, softcap, sinks); softcap and sinks together
    exist in no architecture: the caller checks the two kinds."""
    for kind, (_, _, has) in KINDS.items():
        if set(features) <= has:
            return kind
    raise ValueError(f"no tiny model has all of {sorted(features)}")


def config(kind: str, tok, head_dim: int = 16):
    import transformers

    cls, extra, _ = KINDS[kind]
    heads = 4 if head_dim <= 32 else 2
    kw = dict(hidden_size=heads * head_dim, intermediate_size=128, num_hidden_layers=2, num_attention_heads=heads,
              num_key_value_heads=max(1, heads // 2), head_dim=head_dim, max_position_embeddings=512,
              tie_word_embeddings=False, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **extra)
    if kind == "gemma2":
        kw["query_pre_attn_scalar"] = head_dim
    return getattr(transformers, cls)(**kw)


def write(path: Path, kind: str = "llama", head_dim: int = 16, seed: int = 0) -> Path:
    """A random float32 model of `kind` and its tokenizer in `path` (from_pretrained loads it)."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(kind, tok, head_dim), dtype=torch.float32)
    with torch.no_grad():  # sinks start at 0 (a no-op): random ones make them matter
        for n, p in model.named_parameters():
            if n.endswith("sinks"):
                p.normal_(0, 1)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chat_data(path: Path, n: int = 16) -> Path:
    """Conversations (`messages`), the format sft reads."""
    return _jsonl(path, [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                                       {"role": "assistant", "content": f"It is {2 * i}."}]} for i in range(n)])


def dolly_data(path: Path, n: int = 16) -> Path:
    """databricks-dolly-15k's columns (instruction/context/response/category), the format qlora's docs use."""
    return _jsonl(path, [{"instruction": f"Add {i} and {i}.", "context": "", "response": f"The sum is {2 * i}.",
                          "category": "open_qa"} for i in range(n)])


def gsm8k_data(path: Path, n: int = 8) -> Path:
    """GSM8K's columns (question, answer ending in `#### N`), grpo's `--preset gsm8k`."""
    rows = []
    for a in range(2, 2 + n):
        b, total = a + 3, 2 * a + 3
        rows.append({"question": f"Natalia sold {a} clips in April and {b} in May. How many in all?",
                     "answer": f"She sold {a} + {b} = <<{a}+{b}={total}>>{total}.\n#### {total}"})
    return _jsonl(path, rows)
