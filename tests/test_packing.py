"""Packed (padding-free) batches give each example exactly the logits and loss it gets alone: no example attends to
another. On CPU this is transformers' block-diagonal mask from position_ids (what `sft` packs with here); the varlen
kernel's own check runs on a GPU (benchmarks/train_throughput.py --check)."""

import pytest
import torch

from trainbox.training import attention
from trainbox.training.kernels import varlenattn


@pytest.fixture(scope="module")
def model_and_examples(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    texts = ["How many clips did Natalia sell altogether in April and May? #### 72",
             "Eat a balanced diet.",
             "The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9"]  # fmt: skip
    examples = [tok(t)["input_ids"] for t in texts]
    assert len({len(e) for e in examples}) == 3  # different lengths, so any leak would shift the numbers
    return tiny_model, examples


def load(path, impl):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=impl).eval()


def packed_batch(examples):
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    collate = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    return collate([{"input_ids": e} for e in examples])


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_logits_and_loss_match_each_example_alone(model_and_examples, impl):
    path, examples = model_and_examples
    model = load(path, impl)
    batch = packed_batch(examples)
    assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch  # one row, no padding
    with torch.no_grad():
        # use_cache=False as TRL's SFTTrainer passes it in training: with a cache transformers skips the packed mask.
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                       use_cache=False)
        start, losses, counts = 0, [], []
        for ex in examples:
            ids = torch.tensor([ex])
            alone = model(input_ids=ids, labels=ids)
            got = packed.logits[0, start:start + len(ex)]
            torch.testing.assert_close(got, alone.logits[0], rtol=1e-4, atol=1e-4)
            losses.append(alone.loss * (len(ex) - 1))
            counts.append(len(ex) - 1)
            start += len(ex)
    # The packed loss is the token mean over all examples (the collator masks each example's first label).
    torch.testing.assert_close(packed.loss, sum(losses) / sum(counts), rtol=1e-4, atol=1e-5)


def test_packing_without_position_ids_would_leak(model_and_examples):
    """The check above can fail: the same packed row without its position ids attends across examples."""
    path, examples = model_and_examples
    model = load(path, "sdpa")
    batch = packed_batch(examples)
    with torch.no_grad():
        leaky = model(input_ids=batch["input_ids"], use_cache=False).logits[0]
        second = model(input_ids=torch.tensor([examples[1]])).logits[0]
    n0 = len(examples[0])
    assert not torch.allclose(leaky[n0:n0 + len(examples[1])], second, atol=1e-3)


def test_varlen_adapter_unpacked_paths_match_sdpa(model_and_examples):
    """trainbox_varlen without packing (one row; a padded batch, as in evaluation) is plain SDPA: same logits."""
    path, examples = model_and_examples
    varlenattn.register()
    ours, ref = load(path, attention.VARLEN), load(path, "sdpa")
    ids = torch.tensor([examples[0]])
    n = max(len(e) for e in examples)
    padded = torch.tensor([e + [0] * (n - len(e)) for e in examples])
    mask = torch.tensor([[1] * len(e) + [0] * (n - len(e)) for e in examples])
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
        a = ours(input_ids=padded, attention_mask=mask).logits
        b = ref(input_ids=padded, attention_mask=mask).logits
    keep = mask.bool()
    torch.testing.assert_close(a[keep], b[keep], rtol=1e-4, atol=1e-4)
