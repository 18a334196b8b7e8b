"""dpo's library: the preference pairs (the formats TRL's DPOTrainer reads, checked row by row), the reference model
(a bf16 copy on GPUs, none for LoRA or precomputed log-probs) and what the memory plan counts for it, and TRL's
DPOTrainer with the one callback list. The run's steps are skeleton.py's; cli/dpo.py declares the recipe.

Formats (TRL's preference formats): `prompt` + `chosen` + `rejected` (explicit prompt), or `chosen` + `rejected`
alone (implicit prompt: TRL takes their shared beginning as the prompt); each field plain text or a chat list of
{role, content} messages (the conversational pairs: e.g. `chosen: [{user}, {assistant}]`). A text prompt beside
chat completions becomes a user message, a text completion beside a chat prompt an assistant message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.errors import UsageError
from trainbox.training import adapters, attention, data, sftlib
from trainbox.training.kernels import packedrows

GiB = 2**30


@dataclass
class PairArguments:
    dataset: str | None = field(
        default=None, metadata={"help": "local .parquet/.jsonl/.json/.csv file or directory, or a hub id name[:config]"}
    )
    dataset_split: str = field(default="train", metadata={"help": "split to train on"})
    prompt_key: str = field(default="prompt", metadata={"help": "prompt column (optional: without it TRL takes the "
                                                                "shared beginning of chosen and rejected)"})
    chosen_key: str = field(default="chosen", metadata={"help": "column of the preferred completion"})
    rejected_key: str = field(default="rejected", metadata={"help": "column of the dispreferred completion"})
    system_prompt: str | None = field(default=None, metadata={"help": "system message prepended to every chat prompt"})
    max_samples: int | None = field(default=None, metadata={"help": "use only the first N rows"})
    resume: str = field(
        default="auto", metadata={"help": "auto: last complete checkpoint in output_dir if any; never; or a checkpoint path"}
    )


def _kind(value, name: str) -> str:
    if data._is_chat(value):
        data._chat(value, name)
        if not value:
            raise data.BadRow(f"{name} is an empty list")
        return "chat"
    if isinstance(value, str):
        if not value.strip():
            raise data.BadRow(f"{name} is empty")
        return "text"
    raise data.BadRow(f"{name} is {'missing' if value is None else type(value).__name__}, expected text or a chat "
                      "list of {role, content} messages")


def to_pairs(ds, a: PairArguments, where: str):
    """TRL's preference rows (prompt?, chosen, rejected), all text or all chat (decided by the first row)."""
    data.require_columns(ds, [a.chosen_key, a.rejected_key], where)
    explicit = a.prompt_key in ds.column_names
    if not len(ds):
        raise UsageError(f"{where}: no rows")
    first = ds[0]
    fields = ([a.prompt_key] if explicit else []) + [a.chosen_key, a.rejected_key]
    chat = any(data._is_chat(first[f]) for f in fields)
    if not chat and a.system_prompt:
        raise UsageError(f"--system_prompt: {where} has plain-text pairs (no chat messages to put it before); drop "
                         "it or write the pairs as chat lists")

    def conv(row):
        kinds = {f: _kind(row[f], f"column {f}") for f in fields}
        if not chat and "chat" in kinds.values():
            raise data.BadRow("has chat messages where the first row has plain text; keep one format per dataset")
        out = {}
        if explicit:
            p = row[a.prompt_key]
            out["prompt"] = data._as_prompt(p, a.system_prompt) if chat else p
        for key, name in ((a.chosen_key, "chosen"), (a.rejected_key, "rejected")):
            v = row[key]
            if chat and kinds[key] == "text":
                v = [{"role": "assistant", "content": v}]
            elif chat:
                v = [{"role": m["role"], "content": m["content"]} for m in v]
                if not explicit and a.system_prompt and v[0]["role"] != "system":
                    v = [{"role": "system", "content": a.system_prompt}] + v
            out[name] = v
        return out

    return data.convert(ds, conv, where)


def is_chat(ds) -> bool:
    return len(ds) > 0 and data._is_chat(ds[0]["chosen"])


def prepare_pairs(run, tokenizer, rows: int | None = None):
    """The dataset as TRL's preference rows; a chat dataset needs the tokenizer's chat template."""
    a = run.data
    ds = data.load_table(a.dataset, split=a.dataset_split)
    rows = rows or a.max_samples
    if rows:
        ds = ds.select(range(min(rows, len(ds))))
    pairs = to_pairs(ds, a, f"dataset {a.dataset}")
    if is_chat(pairs) and not sftlib.has_chat_template(tokenizer, run.args):
        raise UsageError(f"the tokenizer in {run.model.model_name_or_path} has no chat template; chat pairs need one "
                         "(use an instruct model or --chat_template_path FILE, or plain-text pairs)")
    return pairs


def check(run) -> None:
    """DPO's own checks (before any model loads)."""
    m, args = run.model, run.args
    if (m.load_in_4bit or m.load_in_8bit) and not m.use_peft:
        raise UsageError("--load_in_4bit/--load_in_8bit: a quantized base trains only through LoRA adapters; add "
                         "--use_peft true or drop them")
    if args.precompute_ref_log_probs and args.sync_ref_model:
        raise UsageError("--precompute_ref_log_probs and --sync_ref_model exclude each other (a synced reference "
                         "changes during training; precomputed log-probs would be stale); pick one")
    if m.use_peft and args.sync_ref_model:
        raise UsageError("--sync_ref_model needs a reference model of its own, which LoRA (--use_peft) doesn't keep; "
                         "drop one of them")


def reference(run) -> str:
    """Where the reference log-probs come from: "adapters off" (LoRA), "precomputed" or "model" (a frozen copy)."""
    if run.model.use_peft:
        return "adapters off"
    if run.args.precompute_ref_log_probs:
        return "precomputed"
    return "model"


def reference_dtype(args):
    """A frozen reference only scores (no gradients, no optimizer): bf16 on a GPU, the policy's float32 on a CPU."""
    import torch

    return torch.bfloat16 if torch.cuda.is_available() and not args.use_cpu else torch.float32


def reference_bytes(run, facts, shards: int) -> int:
    """GPU bytes the reference holds during training (FSDP2 shards it like the policy)."""
    if reference(run) != "model":
        return 0
    return 2 * facts.params // max(1, shards)


def memory(run, facts) -> dict:
    """The memory plan's view of a DPO micro-batch: chosen and rejected rows (2 x batch x max_length tokens, still
    halved by the ladder), and the reference beside the policy."""
    args = run.args
    shards = sftlib.shards(args)
    return {"tokens": 2 * int(args.per_device_train_batch_size) * int(args.max_length or 1024),
            "extra": reference_bytes(run, facts, shards), "split": True}


def reference_line(run, facts) -> str:
    how = reference(run)
    if how == "adapters off":
        return "reference: the base with the LoRA adapters off (no second model in memory)"
    if how == "precomputed":
        return "reference: log-probs computed once before training (--precompute_ref_log_probs; no second model)"
    if str(reference_dtype(run.args)) == "torch.float32":
        return "reference: a frozen float32 copy of the model (CPU)"
    size = reference_bytes(run, facts, sftlib.shards(run.args)) / GiB
    return f"reference: a frozen bfloat16 copy, {size:.1f} GiB per GPU, counted by the memory plan"


def build_trainer(run, model, ds, tokenizer, callbacks):
    """TRL's DPOTrainer (it tokenizes in its constructor: the first process fills the datasets cache, the others
    read it) with our reference model where one is kept."""
    from transformers import AutoModelForCausalLM
    from trl import DPOTrainer

    args = run.args
    ref = None
    if reference(run) == "model":
        ref = AutoModelForCausalLM.from_pretrained(run.model.model_name_or_path, dtype=reference_dtype(args),
                                                   attn_implementation=model.config._attn_implementation,
                                                   revision=run.model.model_revision)
        ref.eval().requires_grad_(False)
    with args.main_process_first(local=False, desc="tokenize"):
        trainer = DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=ds, processing_class=tokenizer,
                             callbacks=callbacks, peft_config=adapters.peft_config(run.model))
    trainer.trainbox_reference_forward = reference(run) != "precomputed"  # a reference forward each step: MFU
    if attention.packs(model.config._attn_implementation):
        policy = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
        for m in (policy, trainer.ref_model):  # where TRL put its fused head (add_fused_lm_head)
            if m is not None:
                packedrows.install(m)
    return trainer


def packing_line(choice) -> str:
    """What the run prints for packing: TRL pads each batch of pairs; the forward packs them where the kernel can."""
    if choice.packed:
        return ("packing: each batch of pairs padding-free in the forward (policy and reference: the real tokens in "
                "one row, kept apart by the attention kernel; kernels/packedrows.py)")
    return f"packing off: {attention.UNPACKED_WHY}; batches of pairs are padded"
