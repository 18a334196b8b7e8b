"""Where GRPO's completions come from: without vLLM our static-cache decoder (static_decode.py) or transformers'
generate; vLLM colocated with the trainers (its share of the GPU, sleep mode), or a vLLM server: one given by the
user, or ours beside the trainers (the last node of the srun step or the last GPUs of this one: roles from
vllm_server.py, the trainers' launcher that waits for its health).
"""

from __future__ import annotations

import importlib.util
import os

from common import launch
from common.errors import UsageError
from trainbox.training import config, memplan, modelfacts, speed
from trainbox.training.grpo import vllm_server


def resolve_rollouts(args, ours: str | None = None, script=None, mode: str = "full", model_args=None) -> str:
    """Pick the rollout engine (unless use_vllm was set): our static decoder where it applies and is the faster one
    (static_over_vllm), else vLLM when it's installed and a GPU is there, else transformers' generate; sets
    args.use_vllm and script.static_decode, returns the line to report."""
    has_vllm = importlib.util.find_spec("vllm") is not None
    if "use_vllm" in config.explicit(args):
        if args.use_vllm and not has_vllm:
            raise UsageError(
                "use_vllm=true but vllm is not installed here; drop use_vllm to generate with transformers"
            )
        why = "use_vllm set"
    else:
        import torch

        args.use_vllm = has_vllm and torch.cuda.is_available()
        why = "auto: " + ("vllm installed, GPU present" if args.use_vllm
                          else "vllm not installed" if not has_vllm else "no GPU")
        if args.use_vllm and script is not None and script.static_decode is not False:
            instead = (static_over_vllm(args, mode, model_args, script.max_prompt_tokens)
                       if not script.static_decode else None)
            if instead is None:
                args.use_vllm = False
                why = ("static_decode set" if script.static_decode else
                       "auto: vllm installed, but faster on a dense text model at full fine-tuning; --use_vllm "
                       "true for vLLM")
            else:
                why += f"; static decode off: {instead}"
    if not args.use_vllm:
        return f"rollouts: {choose_static_decode(script, args, mode, model_args)} ({why})"
    if script is not None and script.static_decode:
        raise UsageError("static_decode=true stands in for transformers' generate, but vLLM generates here "
                         f"({why}); drop static_decode, or set --use_vllm false to use it")
    explicit = config.explicit(args)
    if "vllm_mode" not in explicit:
        args.vllm_mode = "colocate"  # said, not inherited: TRL's default could change under us
    if args.vllm_mode == "server":
        where = args.vllm_server_base_url or f"{args.vllm_server_host}:{args.vllm_server_port}"
        return f"rollouts: vLLM server at {where} ({why}; {ours or 'start it with `trl vllm-serve --model MODEL`'})"
    if "vllm_enable_sleep_mode" in explicit:
        sleep = f"sleep mode {'on' if args.vllm_enable_sleep_mode else 'off'} (set by you)"
    else:
        # Colocated vLLM frees its weights and KV cache while the policy trains, for the memory's sake; the memory
        # plan turns it off where training fits beside vLLM's share anyway (grpo_trainer.choose_sleep_mode).
        args.vllm_enable_sleep_mode = True
        sleep = "sleep mode by the memory plan"
    sized = ""
    if "vllm_gpu_memory_utilization" not in explicit:
        import torch

        try:
            total = torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else None
        except (RuntimeError, AssertionError):  # no usable CUDA after all: keep TRL's share
            total = None
        if total:
            args.vllm_gpu_memory_utilization, sized = rollout_memory_share(total)
    detok = skip_detokenizing(args)
    return (f"rollouts: vLLM colocate, {sleep}, "
            f"gpu_memory_utilization {args.vllm_gpu_memory_utilization:.2f}{sized}{detok} ({why})")


def static_decode_blockers(args, mode: str) -> list[str]:
    """What keeps static_decode.py from standing in for transformers' generate: it samples plainly from
    softmax(logits / temperature), with the whole model on each GPU. (lora and qlora: it holds the base weights
    with the adapter merged in, dequantized from 4 bits for qlora, re-merged after each step.)"""
    out = []
    plain = dict(top_p=(None, 1.0), top_k=(None, 0), min_p=(None, 0.0), repetition_penalty=(None, 1.0))
    out += [f"{name}={getattr(args, name)}" for name, ok in plain.items() if getattr(args, name, None) not in ok]
    for name in ("generation_kwargs", "cache_implementation", "fsdp", "deepspeed",
                 "use_transformers_continuous_batching"):
        if getattr(args, name, None):
            out.append(f"{name} set")
    return out


# A full fine-tuning run keeps the decoder's copy beside the policy's training state (memplan.resident: float32
# weights, gradients and AdamW's two moments are 16 bytes a parameter, an 8-bit optimizer's 10; a KL reference model
# 4 more); colocated vLLM hands its memory back while the policy trains (sleep mode). Past this share of the GPU,
# vLLM is the one that fits.
STATIC_FITS = 0.8


def static_over_vllm(args, mode: str, model_args, max_prompt_tokens: int | None = None) -> str | None:
    """None where our static decoder should generate although vLLM is installed, else why not.

    Measured on one H100 (Llama-3.2-1B shape, 16 x 256-token rollouts, benchmarks/results/grpo_static-2026-11-27.txt):
    the decoder is GPU-bound at ~1.9 ms a token where colocated vLLM's loop is CPU-bound at 2.2-3.8 ms, and it
    holds 2 bytes a parameter instead of vLLM's share of the GPU. Left to vLLM: what the decoder can't do or hand
    over (static_decode_blockers; vLLM options given; a vision-language model), MoE models (their expert loops do
    not capture into a CUDA graph: the decoder would hand over to transformers' generate), and a policy whose
    training state and decoder copy together pass STATIC_FITS of the GPU (the smallest GPU of the job: every rank
    must pick the same engine, or colocated vLLM's collectives wait forever for a rank that decodes statically)."""
    blockers = static_decode_blockers(args, mode)
    if blockers:
        return blockers[0]
    given = sorted(k for k in config.explicit(args) if k.startswith("vllm_"))
    if given:
        return f"vLLM options set ({', '.join(given)})"
    if mode != "full":
        return f"mode {mode}: vLLM where it is installed (the decoder's lead over it was measured at full fine-tuning)"
    return decoder_unfit(args, mode, model_args, max_prompt_tokens)


def decoder_unfit(args, mode: str, model_args, max_prompt_tokens: int | None = None) -> str | None:
    """None where the decoder suits this model and fits beside the policy's training state on the job's smallest
    GPU (STATIC_FITS), else why not."""
    if model_args is None:
        return "no model to judge"
    import torch
    from transformers import AutoConfig

    conf = AutoConfig.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision)
    if conf.get_text_config() is not conf:
        return "a vision-language model"
    facts = modelfacts.model_facts(model_args.model_name_or_path, model_args.model_revision)
    if facts.experts:
        return "MoE experts (their loops do not capture into a CUDA graph)"
    try:
        local = torch.cuda.mem_get_info()[1]
    except (RuntimeError, AssertionError):  # no usable CUDA after all
        local = None
    need = training_state_bytes(args, facts, mode) + decoder_bytes(args, facts, max_prompt_tokens)

    def decide(total, seen):
        if total is None:
            return "no GPU memory reading"
        if need <= STATIC_FITS * total:
            return None
        of = f"the smallest GPU's {total / 2**30:.0f} GiB (of {seen[2]} ranks)" if seen[2] > 1 else \
            f"the GPU's {total / 2**30:.0f} GiB"
        return (f"the policy's training state and a decoder copy ({need / 2**30:.0f} GiB) pass {STATIC_FITS:.0%} of "
                f"{of}; vLLM sleeps while the policy trains")

    # The job's process group is up here (TRL's config starts it): rank 0 judges the smallest GPU for every rank.
    return memplan.agree(local, decide)


def reference_bytes(args, facts) -> int:
    """TRL's reference model, loaded like the policy (float32 here) only when the KL term is on (beta > 0)."""
    return 4 * facts.params if args.beta else 0


# The policy's weights a parameter under adapters, whatever the batch: qlora's nf4 base is ~0.56 bytes with its
# double-quantized scales (embeddings and head stay bf16: an 8B Llama's 5.7 GB is 0.7), lora's base bf16 or float32;
# the adapters and their optimizer states add ~1-2 %, and TRL's KL reference is the same base with adapters off.
ADAPTER_BASE_BYTES = {"qlora": 1.0, "lora": 4.0}


def training_state_bytes(args, facts, mode: str = "full") -> int:
    """The policy's state on each GPU whatever the batch: at full fine-tuning weights, gradients, optimizer states
    and the reference model, the memory plan's own figures (memplan.resident); under adapters the base weights."""
    if mode in ADAPTER_BASE_BYTES:
        return int(ADAPTER_BASE_BYTES[mode] * facts.params * 1.05)
    return memplan.resident(speed.job_for(args, facts, shards=1, tokens=1, extra=reference_bytes(args, facts)))


def decoder_bytes(args, facts, max_prompt_tokens: int | None = None) -> int:
    """The static decoder's GPU memory for this run (static_decode.memory_bytes): one cache row per completion of a
    generation batch, prompts up to max_prompt_tokens (512 when unknown)."""
    from trainbox.training.grpo.static_decode import memory_bytes

    rows = args.per_device_train_batch_size * (args.steps_per_generation or 1)
    return memory_bytes(facts.params, facts.layers, facts.attn_width, rows, max_prompt_tokens or 512,
                        args.max_completion_length)


def choose_static_decode(script, args, mode: str, model_args=None) -> str:
    """Set script.static_decode (auto: on with a GPU where nothing blocks it and, under adapters, where its bf16 copy
    fits beside the policy: a qlora user's small GPU keeps transformers' generate); return how completions are
    made."""
    if script is None:
        return "transformers generate"
    blockers = static_decode_blockers(args, mode)
    note = ""
    if script.static_decode is None:
        import torch

        gpu = torch.cuda.is_available()
        if not blockers and gpu and mode != "full":
            unfit = decoder_unfit(args, mode, model_args, script.max_prompt_tokens)
            blockers = [unfit] if unfit else []
        script.static_decode = not blockers and gpu
        note = f"; static decode off: {blockers[0]}" if blockers else ""
    elif script.static_decode and blockers:
        raise UsageError(
            f"static_decode=true but {'; '.join(blockers)}: the static decoder copies the full model and samples "
            "from softmax(logits / temperature) only; drop static_decode to generate with transformers"
        )
    if script.static_decode:
        merged = ", its adapter merged in each step" if mode != "full" else ""
        return f"static-cache decode (a bfloat16 copy of the policy{merged}, one CUDA-graphed step a token)"
    return f"transformers generate{note}"


def skip_detokenizing(args) -> str:
    """Colocated vLLM without its incremental detokenization: TRL reads only the token ids (and logprobs) and
    decodes the completions itself, so vLLM's per-step text is thrown away; in the decode loop it is CPU work on the
    critical path (generation there is CPU-bound: the GPU is busy ~30-60 % of a 1B model's rollout). Kept where text
    is needed (stop strings), structured outputs, or where generation_kwargs names detokenize. Returns the note."""
    kwargs = dict(args.generation_kwargs or {})
    if "detokenize" in kwargs:
        return ""
    if kwargs.get("stop") or "structured_outputs" in kwargs or args.vllm_structured_outputs_regex:
        return ", detokenizing (stop strings / structured outputs)"
    args.generation_kwargs = {**kwargs, "detokenize": False}
    return ", no detokenizing (TRL decodes the ids)"


def explain_engine_failure(args, error: BaseException) -> None:
    """An error raised inside vLLM where vLLM was our choice (installed, a GPU there), not the user's: a note on the
    error says how to do without it. A vLLM install may lack a model's kernels (seen: gpt-oss's MoE ops missing from
    a vLLM whose MoE extension was left out), where transformers' generate would run; without the note the traceback
    names only vLLM's internals."""
    import traceback

    if not args.use_vllm or "use_vllm" in config.explicit(args):
        return
    if any("/vllm/" in frame.filename.replace("\\", "/") for frame in traceback.extract_tb(error.__traceback__)):
        error.add_note("[trainbox] grpo: vLLM generates here because it is installed (the rollouts line above), and "
                       "it failed inside vLLM; `--use_vllm false` generates with transformers instead")


# vLLM's colocated share of the GPU: enough KV cache for a generation batch of long completions, the rest for
# training. 24 GiB holds a 7-8B model's bf16 weights plus a few GB of KV cache; past that more cache buys little.
ROLLOUT_BYTES = 24 * 2**30


def rollout_memory_share(total_bytes: int) -> tuple[float, str]:
    """gpu_memory_utilization for colocated vLLM on a GPU of `total_bytes`, and how it was sized."""
    share = min(0.5, max(0.15, ROLLOUT_BYTES / total_bytes))
    return round(share, 2), f" (sized: {share * total_bytes / 2**30:.0f} GiB of {total_bytes / 2**30:.0f} GiB)"


def arrange_server(script, raw, launch_args, env):
    """vllm_server.Roles when a server beside the trainers was asked for (not in torchrun's ranks), else None.

    Trainers: TRL's server options are set here (validation sees them) and appended to the ranks' argv."""
    if not (script.vllm_server_nodes or script.vllm_server_gpus) or env.get("TORCHELASTIC_RUN_ID"):
        return None
    if script.vllm_server_nodes and script.vllm_server_gpus:
        raise UsageError("--vllm_server_nodes and --vllm_server_gpus exclude each other: a node of its own, or "
                         "GPUs of this node")
    explicit = config.explicit(raw)
    if "vllm_mode" in explicit and raw.vllm_mode != "server" or "use_vllm" in explicit and not raw.use_vllm:
        raise UsageError("--vllm_server_nodes/--vllm_server_gpus run the trainers with vllm_mode server; drop "
                         "use_vllm/vllm_mode")
    if raw.vllm_server_base_url:
        raise UsageError("--vllm_server_base_url points at a server you run; drop it, or drop "
                         "--vllm_server_nodes/--vllm_server_gpus")
    ports = dict(http_port=raw.vllm_server_port, group_port=raw.vllm_group_port)
    if script.vllm_server_nodes:
        roles = vllm_server.slurm_roles(env, script.vllm_server_nodes, launch.local_procs(env), **ports)
    else:
        if any(getattr(launch_args, f, None) not in (None, 0) for f in ("nnodes", "node_rank", "master_addr")):
            raise UsageError("--vllm_server_gpus splits one node; drop --nnodes/--node-rank/--master-addr")
        roles = vllm_server.local_roles(vllm_server.visible_gpus(env), script.vllm_server_gpus, **ports)
        if launch_args.nproc_per_node is None:
            launch_args.nproc_per_node = len(roles.trainer_gpus)
    if roles.role == "trainer":
        raw.use_vllm, raw.vllm_mode, raw.vllm_server_host = True, "server", roles.server_host
        config.set_explicit(raw, explicit | {"use_vllm", "vllm_mode", "vllm_server_host"})
    return roles


def run_beside_server(script, roles, model_args, plan, argv) -> int:
    """Trainer launcher: (start the one-node server,) wait for its health, run torchrun, stop the server."""
    proc = None
    if roles.server_gpus is not None:  # one node: the server is our child, on its GPUs
        cmd = vllm_server.serve_command(model_args.model_name_or_path, roles, script.vllm_serve_args)
        print(f"[trainbox] vllm server on GPU(s) {','.join(roles.server_gpus)}: {' '.join(cmd)}", flush=True)
        proc = vllm_server.subprocess.Popen(
            cmd, env={**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(roles.server_gpus)}, start_new_session=True)
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(roles.trainer_gpus)
    watch = vllm_server.Watch(roles, script.vllm_server_wait, proc)
    try:
        took = vllm_server.wait_healthy(roles.server_host, roles.http_port, script.vllm_server_wait, watch.gone)
        print(f"[trainbox] vllm server at {roles.server_host}:{roles.http_port} healthy after {took:.0f} s; "
              f"weight-sync group port {roles.group_port}", flush=True)
        watch.start()
        rc = launch.run_torchrun(plan, "trainbox.cli.grpo", argv)
        return 1 if watch.failed else rc
    finally:
        watch.close()
