"""A padded batch's forward run padding-free: the rows' real tokens packed into one row, the per-token outputs put
back in the padded layout, for trainers that score a padded batch through TRL's fused LM head (DPO).

Why: TRL 1.16's DPOTrainer pads each batch of pairs (its `padding_free` is disabled "after a refactor" and falls back
to padding), so on long-tailed pairs most of the policy's and the reference's forward is padding: 8 rows of a median
447 tokens padded to the batch's longest (up to 2,048). On one H200, Llama-3.2-1B shape, 4 pairs x 2,048, `trainbox
dpo` padded ran at 10,587 real tokens/s against `trl dpo`'s 7,733 (1.37x, MFU 10-11 %; benchmarks/results/
dpo-2026-12-03.txt). TRL's `model(input_ids, attention_mask, labels, fused_lm_head=True)` call is kept; under it the
model sees one packed row with restarting positions and its cumulative lengths (what TRL's padding-free SFT collator
passes), which the attention kernels that take packed rows (attention.packs) keep apart. The fused head then scores
only the real labels as before, and its per-token tensors (log-probs, entropy, ...) are scattered back into the
padded (batch, length - 1) layout, zero at padding as TRL's own head leaves them, so every line of TRL's loss reads
what it read. Only for a kernel that keeps packed examples apart: under SDPA or eager the rows would see each other.
"""

from __future__ import annotations

import types

OWN_LAYOUT = {"position_ids", "inputs_embeds", "shift_labels", "pixel_values", "cu_seq_lens_q"}  # calls left as they are
PER_TOKEN = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")


def pack(input_ids, attention_mask, labels):
    """(ids [1, N], position_ids [1, N], shift_labels [1, N], keep [B, L]) for the real tokens of a padded batch:
    positions restart at 0 in each row, whichever side its padding is on; shift_labels[p] is the label of the next
    token of p's own row (-100 past a row's end), so no label crosses a seam between rows."""
    import torch

    keep = attention_mask.bool()
    b = input_ids.size(0)
    positions = keep.long().cumsum(1) - 1
    nxt = torch.cat([labels[:, 1:], labels.new_full((b, 1), -100)], dim=1)
    nxt = nxt.masked_fill(~torch.cat([keep[:, 1:], keep.new_zeros(b, 1)], dim=1), -100)
    return input_ids[keep][None], positions[keep][None], nxt[keep][None], keep


def unpack(packed, keep):
    """Packed per-token values [1, N] -> the padded [B, L] layout, value at the predicting position (column j scores
    token j + 1), 0 at padding. Differentiable: masked_scatter's backward is masked_select."""
    return packed.new_zeros(keep.shape).masked_scatter(keep, packed[0])


def packed_call(fused, input_ids, attention_mask, labels, kwargs: dict):
    """fused(...) on the real tokens of a padded (batch, length) call as one row; its outputs in the padded layout."""
    import torch

    ids, positions, nxt, keep = pack(input_ids, attention_mask, labels)
    lengths = keep.sum(1, dtype=torch.int32)
    cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    longest = int(lengths.max())  # one host read a forward (the flash path's own)
    out = fused(input_ids=ids, position_ids=positions, shift_labels=nxt, fused_lm_head=True, cu_seq_lens_q=cu,
                cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest, **kwargs)
    for name in PER_TOKEN:
        flat = getattr(out, name, None)
        if flat is not None:
            setattr(out, name, unpack(flat, keep)[:, :-1])  # TRL's (batch, length - 1)
    return out


def install(model) -> None:
    """Wrap the fused-head forward TRL put on `model` (add_fused_lm_head, an attribute of the instance): a padded
    call with fused_lm_head=True runs packed; any other call (generation, a call with positions or embeddings of
    its own) goes through unchanged."""
    fused = model.forward

    def forward(self, *args, **kwargs):
        mask, ids, labels = kwargs.get("attention_mask"), kwargs.get("input_ids"), kwargs.get("labels")
        if (kwargs.get("fused_lm_head") and not args and ids is not None and labels is not None and mask is not None
                and mask.dim() == 2 and ids.dim() == 2 and all(kwargs.get(k) is None for k in OWN_LAYOUT)):
            rest = {k: v for k, v in kwargs.items()
                    if k not in ("fused_lm_head", "input_ids", "attention_mask", "labels") and k not in OWN_LAYOUT}
            return packed_call(fused, ids, mask, labels, rest)
        return fused(*args, **kwargs)

    model.forward = types.MethodType(forward, model)
