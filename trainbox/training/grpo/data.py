"""GRPO's prompts and rewards: the reward functions named (the gsm8k preset's set by default), the dataset (the preset's
prompt format, the columns each reward function reads), prompts longer than max_prompt_tokens dropped.
"""

from __future__ import annotations

from common.errors import UsageError
from trainbox.training import data
from trainbox.training.grpo import rewards
from trainbox.training.grpo.options import GSM8K_HUB


def reward_refs(script) -> list[str]:
    refs = [r.strip() for item in (script.reward_funcs or []) for r in str(item).split(",") if r.strip()]
    if not refs:
        if script.preset == "gsm8k":
            return list(rewards.GSM8K)
        raise UsageError(
            "no reward functions: give --reward_funcs (e.g. rewards:correctness,rewards:xmlcount or my_mod:fn), "
            "or --preset gsm8k for the notebook's set"
        )
    return refs


def prepare_dataset(script, refs, funcs):
    if not script.dataset:
        if script.preset != "gsm8k":
            raise UsageError("no training data: give --dataset (a .parquet/.jsonl file or directory, or a hub id)")
        script.dataset = GSM8K_HUB
    where = f"dataset {script.dataset}"
    ds = data.load_table(script.dataset, split=script.dataset_split)
    if script.preset == "gsm8k":
        # gsm8k question/answer (answer after ####) or verl's gsm8k parquet -> prompt with the notebook's system
        # prompt + answer column for rewards:correctness.
        ds = data.to_prompt_answer(ds, where=f"{where} (--preset gsm8k)", system_prompt=rewards.SYSTEM_PROMPT)
    data.require_columns(ds, ["prompt"], f"{where} (GRPO needs a prompt per row)")
    for ref, func in zip(refs, funcs):
        need = rewards.required_columns(func)
        if need:
            data.require_columns(ds, need, f"{where} (reward function {ref})")
    if len(ds) == 0:
        raise UsageError(f"{where} split {script.dataset_split} has no rows")
    return ds


def drop_long_prompts(ds, model_ref: str, limit: int, revision=None):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_ref, revision=revision)

    def n_tokens(row):
        p = row["prompt"]
        if isinstance(p, list):
            return len(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False))
        return len(tok(p)["input_ids"])

    before = len(ds)
    ds = ds.filter(lambda row: n_tokens(row) <= limit)
    print(f"[trainbox] grpo: max_prompt_tokens {limit}: dropped {before - len(ds)} of {before} prompts", flush=True)
    if len(ds) == 0:
        raise UsageError(f"every prompt is longer than max_prompt_tokens={limit}; raise it or shorten the prompts")
    return ds
