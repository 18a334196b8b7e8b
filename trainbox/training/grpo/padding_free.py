"""GRPOTrainer whose policy (and reference) forward runs padding-free: no compute on padding tokens.

TRL scores completions on padded rows: prompts left-padded to the longest prompt, completions right-padded to the
longest completion, so every row costs the longest prompt + the longest completion. GRPO's completions vary widely
in length (one stops at 20 tokens, its sibling runs to max_completion_length), so much of that forward and backward is
padding. Here each chunk of rows becomes ONE packed row of only the real tokens, with position_ids restarting at 0 per
sequence (as TRL's padding-free SFT collator does); the attention kernel keeps the sequences apart (varlen kernels
take the boundaries from the positions; on CPU transformers builds a block-diagonal mask from them, which it does
only without a KV cache: TRL's fused LM head forward passes use_cache=False). Log-probs and entropies come back in
TRL's [B, logits_to_keep] layout: 0 at padding, as TRL's fused head gives them (the loss masks them anyway).

Positions differ from TRL's padded path by each row's left padding (it numbers the pad tokens); with rotary
embeddings attention depends on relative positions only, so the numbers agree within float tolerance.

Anything this doesn't cover goes to TRL's own method: vision-language models, multimodal inputs, MoE aux loss, rows whose real tokens are not
one contiguous run, or a batch with no prompt column.
"""

from __future__ import annotations

import torch
from trl import GRPOTrainer
from trl.extras.profiling import profiling_context

from trainbox.training.kernels import packedrows

_MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
               "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def packable(attention_mask: torch.Tensor, logits_to_keep: int) -> bool:
    """Each row's real tokens form one run (left-padded prompt + right-padded completion), and there is a prompt
    column to predict the first completion token from."""
    if attention_mask.size(1) - logits_to_keep < 1:
        return False
    m = attention_mask.bool()
    starts = m[:, :1].int().sum(1) + (m[:, 1:] & ~m[:, :-1]).int().sum(1)  # 0->1 edges per row
    return bool((starts <= 1).all())


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int):
    """(ids [1, N], position_ids [1, N], shift_labels [1, N], keep [B, L]) for rows of real tokens.

    shift_labels[p] is the next token of the same sequence when that is a scored completion token (TRL scores the
    last logits_to_keep columns where attention_mask is 1), else -100: no label ever crosses into the next sequence.
    """
    keep = attention_mask.bool()
    scored = keep.clone()
    scored[:, : input_ids.size(1) - logits_to_keep] = False
    return packedrows.pack(input_ids, attention_mask, input_ids.masked_fill(~scored, -100))


def unpack(packed: torch.Tensor, keep: torch.Tensor, logits_to_keep: int) -> torch.Tensor:
    """Packed per-token values [1, N] (at the predicting position) -> TRL's [B, logits_to_keep] (at the predicted
    token): the value of completion token t sits at column L-K+t-1 of the row. Differentiable; 0 at padding."""
    length = keep.size(1)
    return packedrows.unpack(packed, keep)[:, length - logits_to_keep - 1 : length - 1]


class PaddingFreeGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer with the per-token log-prob forward on packed rows (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Vision-language models number text positions their own way (e.g. Qwen2-VL's 3-D rope): TRL's path only.
        self.padding_free_model = self.model.config.get_text_config() is self.model.config

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        multimodal_given = any(v is not None for v in multimodal.values())  # images, token types
        if not self.padding_free_model or compute_aux_loss or multimodal_given \
                or set(multimodal) - set(_MULTIMODAL) or not packable(attention_mask, logits_to_keep):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **multimodal)
        batch_size = batch_size or input_ids.size(0)  # TRL's chunking (memory peak): one packed row per chunk
        all_logps, all_entropies = [], []
        # Timed under TRL's own name (its method is profiled; this override replaces it on the packed path).
        with profiling_context(self, "_get_per_token_logps_and_entropies"):
            for start in range(0, input_ids.size(0), batch_size):
                ids, pos, labels, keep = pack(input_ids[start:start + batch_size],
                                              attention_mask[start:start + batch_size], logits_to_keep)
                with self.accelerator.autocast():
                    # No attention_mask: the restarting position_ids are what keeps the sequences apart.
                    out = model(input_ids=ids, position_ids=pos, shift_labels=labels, fused_lm_head=True)
                all_logps.append(unpack(out.log_probs, keep, logits_to_keep))
                if compute_entropy:
                    all_entropies.append(unpack(out.entropy, keep, logits_to_keep))
        logps = torch.cat(all_logps, dim=0)
        return logps, torch.cat(all_entropies, dim=0) if compute_entropy else None, None
