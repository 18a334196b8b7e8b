"""dpo on CPU: tiny Llama, synthetic preference pairs in TRL's formats (explicit and implicit prompt, text and chat),
train -> checkpoint on SIGTERM -> resume -> final model, LoRA's adapter, the memory plan counting the reference,
bad input -> one `error:` line and exit 2 before any model loads, and `trl dpo` itself on the same batches, step by
step."""

import ast
import json
import re
import signal

import pytest

from test_sft import FAST, env_for, loss_steps, run, spawn, state


def write_pairs(path, n=16, chat=True, prompt=True):
    rows = []
    for i in range(n):
        good, bad = "<answer>72</answer> " * (1 + i % 3), f"The quick brown fox {i}"
        q = f"How many clips did Natalia sell in April and May, case {i}?"
        if chat:
            row = {"chosen": [{"role": "assistant", "content": good}],
                   "rejected": [{"role": "assistant", "content": bad}]}
            if prompt:
                row["prompt"] = [{"role": "user", "content": q}]
            else:
                row = {k: [{"role": "user", "content": q}] + v for k, v in row.items()}
        else:
            row = {"prompt": q, "chosen": " " + good, "rejected": " " + bad} if prompt else \
                {"chosen": q + " " + good, "rejected": q + " " + bad}
        rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sigterm_checkpoints_and_rerun_resumes_then_saves(tiny_model, tmp_path):
    """A long run preempted after its first logged step saves a checkpoint and exits 0; the same command with
    two more steps resumes from it (one history), trains and saves the final model."""
    from safetensors.torch import load_file

    data = write_pairs(tmp_path / "pairs.jsonl", 32)
    out = tmp_path / "out"
    args = ["--model_name_or_path", str(tiny_model), "--dataset", str(data), "--output_dir", str(out),
            "--save_steps", "1000", "--learning_rate", "1e-3", *FAST]  # fmt: skip
    p = spawn("trainbox.cli.dpo", args + ["--max_steps", "1000"], env_for(tmp_path))
    seen = []
    for line in p.stdout:
        seen.append(line)
        if "'loss'" in line:
            p.send_signal(signal.SIGTERM)
            break
    seen.append(p.stdout.read())
    log = "".join(seen)
    assert p.wait(timeout=120) == 0, log
    assert "dpo: reference: a frozen float32 copy" in log and "dpo preempted (checkpoint saved)" in log
    assert "[trainbox] packing off: SDPA and eager" in log  # CPU's SDPA: the pairs stay padded
    ckpts = sorted(out.glob("checkpoint-*"))
    assert len(ckpts) == 1 and not (out / "model.safetensors").exists(), ckpts
    n = state(ckpts[0])["global_step"]

    r = run("trainbox.cli.dpo", args + ["--max_steps", str(n + 2)], env_for(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"resuming from {ckpts[0]}" in r.stdout and f"steps {n + 2}/{n + 2} (this run 2)" in r.stdout
    assert loss_steps(out / f"checkpoint-{n + 2}")[-3:] == [n, n + 1, n + 2]  # one history, not a restart
    trained, initial = load_file(out / "model.safetensors"), load_file(tiny_model / "model.safetensors")
    assert any(not (trained[k] == initial[k]).all() for k in initial)  # the policy moved
    summary = [x for x in r.stdout.splitlines() if x.startswith("[trainbox] dpo done")]
    assert len(summary) == 1 and "tokens/s" in summary[0]


def test_lora_pairs_without_prompt_column_save_an_adapter(tiny_model, tmp_path):
    """Implicit prompt (TRL takes the shared start of chosen and rejected), text pairs, LoRA: no reference model
    (the adapters off are the reference), the adapter saved."""
    data = write_pairs(tmp_path / "pairs.jsonl", 8, chat=False, prompt=False)
    out = tmp_path / "out"
    r = run("trainbox.cli.dpo", ["--model_name_or_path", str(tiny_model), "--dataset", str(data), "--output_dir",
                                 str(out), "--max_steps", "1", "--use_peft", "true", "--lora_r", "4",
                                 "--attn_implementation", "trainbox_flex", *FAST],
            env_for(tmp_path))  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "reference: the base with the LoRA adapters off" in r.stdout
    assert "[trainbox] packing: each batch of pairs padding-free in the forward" in r.stdout  # through PEFT's wrapper
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()


@pytest.mark.parametrize("chat, prompt", [(True, True), (True, False), (False, True), (False, False)])
def test_every_pair_format_converts_to_trl_rows(tmp_path, chat, prompt):
    from trainbox.training import data, dpolib

    ds = data.load_table(str(write_pairs(tmp_path / "p.jsonl", 4, chat=chat, prompt=prompt)))
    pairs = dpolib.to_pairs(ds, dpolib.PairArguments(dataset="p"), "dataset p")
    assert set(pairs.column_names) == ({"prompt"} if prompt else set()) | {"chosen", "rejected"}
    assert dpolib.is_chat(pairs) == chat and len(pairs) == 4


def test_text_prompt_beside_chat_completions_becomes_a_user_message(tmp_path):
    from datasets import Dataset

    from trainbox.training import dpolib

    ds = Dataset.from_list([{"prompt": "q?", "chosen": [{"role": "assistant", "content": "a"}],
                             "rejected": [{"role": "assistant", "content": "b"}]}])
    row = dpolib.to_pairs(ds, dpolib.PairArguments(dataset="x", system_prompt="be brief"), "x")[0]
    assert row["prompt"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q?"}]


def test_memory_plan_counts_the_reference_only_where_one_is_kept(tiny_model):
    from trainbox.cli import dpo
    from trainbox.training import dpolib, modelfacts, skeleton, speed

    facts = modelfacts.model_facts(str(tiny_model))
    base = ["--model_name_or_path", str(tiny_model), "--output_dir", "/tmp/unused", "--use_cpu", "true"]
    kept = skeleton.Run.of(dpo.RECIPE, dpo.parse(base))
    assert dpolib.memory(kept, facts)["extra"] == 2 * facts.params  # a bf16 copy (one GPU)
    assert dpolib.memory(kept, facts)["tokens"] == 2 * kept.args.per_device_train_batch_size * kept.args.max_length
    for more in (["--use_peft", "true"], ["--precompute_ref_log_probs", "true"]):
        assert dpolib.memory(skeleton.Run.of(dpo.RECIPE, dpo.parse(base + more)), facts)["extra"] == 0, more
    job = speed.job_for(kept.args, facts, 1, **{k: v for k, v in dpolib.memory(kept, facts).items()})
    from trainbox.training import memplan

    terms = memplan.estimate(job, memplan.Settings(checkpointing=False))
    assert terms["reference model"] == 2 * facts.params
    assert len(memplan.ladder(job)) > len(memplan.ladder(speed.job_for(kept.args, facts, 1, tokens=1)))  # splits


@pytest.mark.parametrize("side", ["right", "left"])
def test_packed_forward_gives_the_padded_forwards_per_token_outputs_and_gradients(tiny_model, side):
    """kernels/packedrows.py under TRL's fused head: a padded batch of rows of unequal length run as one packed row
    (through a kernel that keeps packed examples apart) gives the padded call's log-probs, entropy and gradients,
    zero at padding, in the padded layout; the inner forward really saw one row of the real tokens only."""
    import torch
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from trainbox.training import attention
    from trainbox.training.kernels import packedrows

    attention.register(attention.FLEX)
    torch.manual_seed(0)
    lengths = [9, 4, 7, 2]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        cols = slice(0, n) if side == "right" else slice(max(lengths) - n, None)
        ids[i, cols], mask[i, cols] = torch.randint(3, 200, (n,)), 1
    labels = ids.masked_fill((mask == 0) | (mask.cumsum(1) <= 2), -100)  # each row's first 2 tokens: a prompt
    got = {}
    for packed in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32,
                                                     attn_implementation=attention.FLEX)
        add_fused_lm_head(model, outputs=("log_probs", "entropy"))
        seen = []
        inner = model.forward
        model.forward = lambda *a, _f=inner, **k: seen.append(k["input_ids"].shape) or _f(*a, **k)
        if packed:
            packedrows.install(model)
        out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True, use_cache=False)
        out.log_probs.sum().backward()
        got[packed] = (out.log_probs.detach(), out.entropy.detach(), model.lm_head.weight.grad.clone(),
                       model.model.layers[0].self_attn.q_proj.weight.grad.clone(), seen)
    (lp0, ent0, g0, q0, seen0), (lp1, ent1, g1, q1, seen1) = got[False], got[True]
    assert seen0 == [ids.shape] and seen1 == [torch.Size([1, sum(lengths)])]
    assert lp1.shape == lp0.shape == (len(lengths), max(lengths) - 1)
    scored = labels[:, 1:] != -100
    assert (lp1[~scored] == 0).all() and (lp1[scored] != 0).all()
    for a, b in ((lp0, lp1), (ent0, ent1), (g0, g1), (q0, q1)):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_the_packed_forward_is_installed_only_for_a_kernel_that_keeps_packed_examples_apart():
    from trainbox.training import attention

    assert attention.packs(attention.FLEX) and attention.packs(attention.VARLEN)
    assert attention.packs("flash_attention_2") and not attention.packs("sdpa") and not attention.packs("eager")
    for name, k in attention.KERNELS.items():
        assert attention.Choice(name, k.impl, "").packed == k.packed


def test_the_reference_gets_the_policys_liger_layers(monkeypatch):
    """sftlib.apply_liger patches the frozen reference with the policy's Liger layers too (policy and reference, the
    same weights, then score alike at the first step; Liger itself needs a GPU, so its patch is recorded here); a
    trainer without a reference patches the policy alone."""
    from types import SimpleNamespace

    from trainbox.training import sftlib, speed

    seen = []
    monkeypatch.setattr(speed, "apply_liger", lambda model, model_type: seen.append((model, model_type)))
    policy, ref = object(), object()
    sftlib.apply_liger(SimpleNamespace(model=policy, ref_model=ref), "llama")
    assert seen == [(policy, "llama"), (ref, "llama")]
    seen.clear()
    sftlib.apply_liger(SimpleNamespace(model=policy, ref_model=None), "qwen3")
    assert seen == [(policy, "qwen3")]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--dataset", "/no/such/pairs.jsonl"], "dataset path /no/such/pairs.jsonl does not exist"),
        (["--chosen_key", "better"], "missing column(s) better"),
        (["--loss_type", "banana"], "invalid choice: 'banana'"),
        (["--beta", "nan"], "must be a finite number"),
        (["--label_smoothing", "0.7"], "--label_smoothing 0.7: must be from 0 to 0.5 (not included)"),
        (["--load_in_4bit", "true"], "a quantized base trains only through LoRA adapters"),
        (["--precompute_ref_log_probs", "true", "--sync_ref_model", "true"], "exclude each other"),
        (["--resume", "/no/ckpt"], "not a complete checkpoint"),
        (["--system_prompt", "hi", "--dataset", "TEXT"], "plain-text pairs"),
        (["--dataset", "BAD"], "row 2: column chosen is int, expected text or a chat list"),
        (["--model_name_or_path", "NOTEMPLATE"], "has no chat template; chat pairs need one"),
        # launcher mode: checked before torchrun starts the ranks
        (["--nproc-per-node", "2", "--rejected_key", "worse"], "missing column(s) worse"),
    ],
)
def test_bad_input_is_one_error_line_and_exit_2(tiny_model, tmp_path, monkeypatch, capsys, args, needle):
    import shutil

    import transformers

    from trainbox.cli import dpo

    def no_model(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_model)
    data = write_pairs(tmp_path / "pairs.jsonl", 4)
    text = write_pairs(tmp_path / "text.jsonl", 4, chat=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "q", "chosen": "a", "rejected": "b"}) + "\n"
                   + json.dumps({"prompt": "q", "chosen": 3, "rejected": "b"}) + "\n")
    plain = tmp_path / "plain"
    shutil.copytree(tiny_model, plain)
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    for f in plain.glob("chat_template.*"):
        f.unlink()
    swap = {"TEXT": str(text), "BAD": str(bad), "NOTEMPLATE": str(plain)}
    args = [swap.get(a, a) for a in args]
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    base = ["--model_name_or_path", str(tiny_model), "--dataset", str(data), "--output_dir", str(tmp_path / "o")]
    try:
        assert dpo.main(base + FAST + args) == 2
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: ") and needle in err[-1], err
    assert sum(x.startswith("error:") for x in err) == 1 and not any("Traceback" in x for x in err), err
    assert not (tmp_path / "o").exists()


def test_every_steps_loss_is_trl_dpos_on_the_same_batches(tiny_model, tmp_path):
    """`trainbox dpo` and `trl dpo` from the same model, pairs, seed and options, float32 on the CPU: the loss of
    every step agrees within 0.2 % (the logs' 4 digits; measured 0.08 % at most over 10 steps). What the device's
    run can't separate from bf16's rounding (benchmarks/train_throughput.py dpo), this pins: the same update."""
    (tmp_path / "ds").mkdir()
    data = write_pairs(tmp_path / "ds" / "train.jsonl", n=24)
    common = ["--model_name_or_path", str(tiny_model), "--max_steps", "6", "--per_device_train_batch_size", "4",
              "--logging_steps", "1", "--learning_rate", "5e-5", "--seed", "0", "--report_to", "none",
              "--save_strategy", "no", "--max_length", "128", "--disable_tqdm", "true"]
    env = env_for(tmp_path, CUDA_VISIBLE_DEVICES="")
    losses = {}
    for who, module, args in (
            ("trl", "trl.cli.main", ["dpo", "--dataset_name", str(data.parent), "--use_cpu", "true", "--bf16",
                                     "false", "--output_dir", str(tmp_path / "o-trl")]),
            ("ours", "trainbox", ["dpo", "--dataset", str(data), "--resume", "never",
                                  "--output_dir", str(tmp_path / "o-ours")])):
        r = run(module, args + common, env)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        losses[who] = [float(ast.literal_eval(line)["loss"])
                       for line in re.findall(r"^\{'loss'.*\}$", r.stdout + r.stderr, re.M)]
    assert len(losses["trl"]) == len(losses["ours"]) == 6
    assert losses["trl"][0] == pytest.approx(0.6931, abs=1e-4)  # the policy is its reference: ln 2
    assert losses["trl"][-1] < losses["trl"][0] - 0.02  # it learns, so a different update would show
    for step, (theirs, ours) in enumerate(zip(losses["trl"], losses["ours"]), 1):
        assert ours == pytest.approx(theirs, rel=2e-3), (step, losses)
