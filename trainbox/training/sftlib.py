"""The SFT-style trainers' library (sft, qlora; dpo shares its checks, tokenizer and tuning): dataset options and
rows, tokenizer, checks before launch, speed tuning, TRL's SFTTrainer with the one callback list. The run's steps
are skeleton.py's; the commands (sft.py, qlora.py) only declare their recipes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.errors import UsageError
from trainbox.run import outputs, preemption, ranks, resume, throughput
from trainbox.training import attention, callbacks, config as cfg, data, modelfacts, modelfiles, speed
from trainbox.training.kernels import ckptoffload, leanmlp, lora4bit, losshead, sftloss


@dataclass
class DataArguments:
    dataset: str | None = field(
        default=None, metadata={"help": "local .parquet/.jsonl/.json/.csv file or directory, or a hub id name[:config]"}
    )
    dataset_split: str = field(default="train", metadata={"help": "split to train on"})
    dataset_format: str = field(default="auto", metadata={"help": f"one of {', '.join(data.FORMATS)}"})
    prompt_key: str | None = field(default=None, metadata={"help": "prompt column; dotted for dicts (extra_info.question)"})
    response_key: str | None = field(default=None, metadata={"help": "response column; dotted (extra_info.answer)"})
    messages_key: str = field(default="messages", metadata={"help": "column with chat messages"})
    system_prompt: str | None = field(default=None, metadata={"help": "system message prepended to every example"})
    max_samples: int | None = field(default=None, metadata={"help": "use only the first N rows"})
    resume: str = field(
        default="auto", metadata={"help": "auto: last complete checkpoint in output_dir if any; never; or a checkpoint path"}
    )


def load_tokenizer(model_path: str, training_args, chat: bool = True):
    """The model's tokenizer with a pad token; `chat`: it must have a chat template (conversational rows)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    if chat and not has_chat_template(tok, training_args):
        raise UsageError(
            f"the tokenizer in {model_path} has no chat template; conversational data needs one "
            "(use an instruct model or --chat_template_path FILE)"
        )
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def has_chat_template(tokenizer, training_args) -> bool:
    return tokenizer.chat_template is not None or getattr(training_args, "chat_template_path", None) is not None


def prepare_dataset(data_args: DataArguments, training_args, rows: int | None = None):
    """The dataset as SFT rows; `rows` (or --max_samples) keeps only the first ones."""
    ds = data.load_table(data_args.dataset, split=data_args.dataset_split)
    rows = rows or data_args.max_samples
    if rows:
        ds = ds.select(range(min(rows, len(ds))))
    return data.to_sft(
        ds,
        fmt=data_args.dataset_format,
        prompt_key=data_args.prompt_key,
        response_key=data_args.response_key,
        messages_key=data_args.messages_key,
        system_prompt=data_args.system_prompt,
        where=f"dataset {data_args.dataset}",
    )


FSDP2_GPU = {
    "fsdp": "full_shard auto_wrap",
    "fsdp_config": {
        "version": 2,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "reshard_after_forward": True,
        # Sharded checkpoints: every rank writes its shard to the shared output dir; fast and resumable.
        "state_dict_type": "SHARDED_STATE_DICT",
    },
}


def validate(data_args, model_args, training_args):
    """Checks that need neither the model nor the data: model path, report_to, dataset given, resume target."""
    if training_args.resume_from_checkpoint:
        # TrainingArguments' own option means the same as our --resume PATH.
        data_args.resume = training_args.resume_from_checkpoint
    cfg.check_model_path(model_args.model_name_or_path)
    modelfiles.check_weights(model_args.model_name_or_path)
    cfg.check_report_to(training_args.report_to)
    if not data_args.dataset:
        raise UsageError("no dataset given: pass --dataset PATH (.parquet/.jsonl/.json/.csv file or directory) or a hub id")
    if data_args.resume not in ("auto", "never"):
        resume.resolve_resume(data_args.resume, training_args.output_dir)


def shards(training_args) -> int:
    """Ranks the weights and optimizer states are sharded over (FSDP on GPUs), 1 otherwise."""
    import torch

    if training_args.fsdp and torch.cuda.is_available() and not training_args.use_cpu:
        return ranks.world_size()
    return 1


def tune(model_args, training_args, shards: int, image: dict | None, checkpointing: bool = True,
         packing=None, memory=None):
    """Attention kernel and speed defaults (speed.py) for this model and GPU, printed once; returns (choice, facts).
    image: the image record (attention.choose); packing: None (decided), else the trainer's line or f(choice) -> it;
    memory: facts -> the memory plan's tokens/extra."""
    requested = model_args.attn_implementation if "attn_implementation" in cfg.explicit(model_args) else None
    facts = modelfacts.model_facts(model_args.model_name_or_path, model_args.model_revision)
    choice = attention.choose(requested, image, model=facts.attention)
    lines = speed.apply(training_args, model_args, choice, facts, shards=shards, checkpointing=checkpointing,
                        packing=packing, **(memory(facts) if memory else {}))
    if outputs.is_main_process():
        for line in lines:
            print(f"[trainbox] {line}", flush=True)
    return choice, facts


def build_trainer(model, training_args, train_ds, tokenizer, **extra):
    """TRL's SFTTrainer with the one callback list (callbacks.py); `extra`: peft_config, optimizer, callbacks."""
    from trl import SFTTrainer

    # TRL tokenizes and packs inside the constructor, on every rank at once, into one datasets cache (shared by
    # the nodes of a job on shared storage): the first process fills it, the others then read it.
    with training_args.main_process_first(local=False, desc="tokenize and pack"):
        extra.setdefault("callbacks", callbacks.standard())
        return SFTTrainer(model=model, args=training_args, train_dataset=train_ds, processing_class=tokenizer, **extra)


def finish_tuning(trainer, facts, qlora: bool = False, loss_head: bool = True) -> None:
    """After the trainer is built: FSDP2 policies on accelerate's plugin, FLOPs per token for the summary's MFU.
    qlora: checkpointing stays the model's own (PEFT prepared the 4-bit model for it), and memory comes first.
    loss_head: SFT's loss (sftloss, losshead) in TRL's place; False keeps the trainer's own (DPO's fused LM head)."""
    line = speed.tune_fsdp(trainer, activation_checkpointing=not qlora and bool(trainer.args.gradient_checkpointing),
                           memory_first=qlora)
    if line and outputs.is_main_process():
        print(f"[trainbox] {line}", flush=True)
    if getattr(trainer.args, "trainbox_liger", False):
        apply_liger(trainer, facts.model_type)
        line = leanmlp.choose(trainer.model, checkpointing=bool(trainer.args.gradient_checkpointing))
        if line and outputs.is_main_process():
            print(f"[trainbox] {line}", flush=True)
    on_gpu = trainer.args.device.type == "cuda"
    lines = [lora4bit.choose(trainer.model, distributed=ranks.distributed())]
    if qlora:  # the 4-bit base's memory is mostly the checkpointed inputs: they go to the host (Unsloth does too)
        lines.append(ckptoffload.choose(trainer.model, checkpointing=bool(trainer.args.gradient_checkpointing),
                                        on_gpu=on_gpu, distributed=ranks.distributed()))
    for line in lines:
        if line and outputs.is_main_process():
            print(f"[trainbox] {line}", flush=True)
    if loss_head:
        sftloss.install(trainer)  # before losshead, which runs the loss it finds inside its uniform() marker
        line = losshead.install(trainer, on_gpu=on_gpu)
        if line and outputs.is_main_process():
            print(f"[trainbox] {line}", flush=True)
    cb = preemption.find_callback(trainer, throughput.Throughput)
    if cb:
        cb.count = throughput.TokenCount.install(trainer, on_gpu=on_gpu)
        # A trainer that runs a frozen reference forward beside the policy's (DPO) says so: a forward is a third of
        # a forward + backward, so 8/6 of the policy's FLOPs per token.
        ref = getattr(trainer, "trainbox_reference_forward", False)
        cb.flops_per_token = throughput.flops_per_token(facts, throughput.example_lengths(trainer.train_dataset))
        cb.flops_per_token *= (8.0 / 6.0) if ref else 1.0


def apply_liger(trainer, model_type: str) -> None:
    """Liger's layer kernels on the policy and on a frozen reference beside it (DPO's): the reference scores with the
    policy's kernels, or the two disagree before any step (on one H200, Liger on the policy only: DPO's first loss
    0.6842 where trl dpo's is ln 2 = 0.6931, policy and reference being the same weights)."""
    speed.apply_liger(trainer.model, model_type)
    if getattr(trainer, "ref_model", None) is not None:
        speed.apply_liger(trainer.ref_model, model_type)


def check_before_launch(data_args, model_args, training_args) -> None:
    """In the launcher, before torchrun: the tokenizer's chat template and the dataset's columns (on a few rows),
    so a bad config is one `error:` line and exit 2 here, not a failure in every rank."""
    validate(data_args, model_args, training_args)
    load_tokenizer(model_args.model_name_or_path, training_args)
    prepare_dataset(data_args, training_args, rows=8)
