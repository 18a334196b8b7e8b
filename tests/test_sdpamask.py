"""kernels/sdpamask.py: SDPA's fully masked query rows opened (on CUDA their gradients were NaN: the device's
selftest attention-sdpa row). CPU's SDPA already gives such rows zeros, so here: the wrapper changes nothing else,
opens exactly the empty rows, and is what transformers runs under "sdpa" once the trainers pick SDPA."""

import torch
from transformers import AttentionInterface, AutoModelForCausalLM

from trainbox.image import tinymodel
from trainbox.training import attention
from trainbox.training.kernels import sdpamask


def test_only_rows_that_allow_no_key_are_opened():
    mask = torch.tril(torch.ones(5, 5, dtype=torch.bool))[None, None].repeat(2, 3, 1, 1)
    mask[1, :, 3:] = False  # two rows of the second batch see nothing
    got = sdpamask.open_empty_rows(mask)
    assert got[1, :, 3:].all()
    untouched = torch.ones_like(mask)
    untouched[1, :, 3:] = False
    assert torch.equal(got[untouched], mask[untouched])
    assert sdpamask.open_empty_rows(None) is None
    additive = torch.zeros(1, 1, 2, 2)
    assert sdpamask.open_empty_rows(additive) is additive


def test_registered_under_sdpa_once_and_same_logits_on_a_padded_batch(tmp_path):
    path = tinymodel.write(tmp_path / "m", "mistral", head_dim=16)  # a window of 16: the padded rows see nothing
    attention.register("sdpa")
    attention.register("sdpa")  # twice: still one wrapper over transformers' own function
    assert AttentionInterface._global_mapping["sdpa"] is sdpamask.sdpa_forward
    assert sdpamask._original["fn"] is not sdpamask.sdpa_forward
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32).eval()
    ids = torch.randint(10, 300, (2, 48))
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    with torch.no_grad():
        ours = model(ids, attention_mask=mask).logits
        AttentionInterface._global_mapping["sdpa"] = sdpamask._original["fn"]
        try:
            theirs = model(ids, attention_mask=mask).logits
        finally:
            attention.register("sdpa")
    assert torch.allclose(ours[0], theirs[0], atol=1e-5) and torch.allclose(ours[1, :20], theirs[1, :20], atol=1e-5)
