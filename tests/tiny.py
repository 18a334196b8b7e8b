"""A tiny Llama and a BPE tokenizer built locally: no hub downloads in tests.

`make_tiny_model(dirpath)` writes a 2-layer random Llama plus a byte-level BPE tokenizer (trained on a few lines,
with a chat template and pad/eos tokens) that `from_pretrained(dirpath)` loads. Also runnable as a script
(`python tests/tiny.py DIR`) so the image tests can make the model on the host and mount it in.
"""

from __future__ import annotations

import sys
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

CORPUS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May? #### 72",
    "<reasoning>48 / 2 = 24 and 48 + 24 = 72</reasoning><answer>72</answer>",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
    "Give three tips for staying healthy. Eat a balanced diet, exercise and sleep well.",
    "The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9 10 11 12",
    "system user assistant instruction input output response question answer",
]
SPECIAL = ["<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]


def make_tokenizer(vocab_size: int = 384):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        bos_token="<|bos|>",
        eos_token="<|end|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(dirpath: str | Path, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dirpath = Path(dirpath)
    dirpath.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(dirpath)
    tokenizer.save_pretrained(dirpath)
    return dirpath


if __name__ == "__main__":
    out = make_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama")
    print(out)
