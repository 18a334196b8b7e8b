"""trainbox_grouped_mm (moe.py) against transformers' own experts on the zoo's MoE models (gpt-oss: biases and an
interleaved gate; Mixtral, Qwen3-MoE: no biases), on the CPU in float32: the same logits and gradients, and the line
`trainbox sft` prints."""

from __future__ import annotations

import copy

import pytest

import zoo
from trainbox.training import modelfacts
from trainbox.training.kernels import moe


def _model(name):
    import torch
    import transformers

    cls, extra, _ = zoo.ZOO[name]
    conf = getattr(transformers, cls)(**{**zoo.COMMON, **extra, "vocab_size": 97})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(conf).float()
    for n, p in model.named_parameters():
        if "bias" in n:  # random-init biases are zeros: make them count
            torch.nn.init.normal_(p, std=0.2)
    return model


@pytest.mark.parametrize("name", ["gpt-oss", "mixtral", "qwen3-moe"])
def test_same_logits_and_gradients_as_transformers_experts(name):
    import torch

    moe.register()
    base = _model(name)
    ids = torch.randint(0, 97, (3, 40), generator=torch.Generator().manual_seed(1))
    got = {}
    for impl in ("eager", moe.NAME):
        m = copy.deepcopy(base)
        m.set_experts_implementation(impl)
        out = m(ids, labels=ids)
        out.loss.backward()
        got[impl] = out.logits.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    ref_logits, ref_grads = got["eager"]
    logits, grads = got[moe.NAME]
    assert torch.allclose(logits, ref_logits, atol=1e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    experts = [n for n in ref_grads if ".experts." in n]
    assert experts and all(ref_grads[n].abs().max() > 0 for n in experts)  # the experts (and biases) were trained
    for n, ref in ref_grads.items():
        assert torch.allclose(grads[n], ref, atol=1e-5 * float(ref.abs().max()) + 1e-7), n


def test_sft_gets_it_for_moe_models_only(tmp_path):
    for name in ("gpt-oss", "llama3"):
        _model(name).save_pretrained(tmp_path / name)
    kwargs, line = moe.choose(modelfacts.model_facts(str(tmp_path / "gpt-oss")))
    assert kwargs == {"experts_implementation": moe.NAME} and line.startswith(f"MoE experts: {moe.NAME}")
    assert moe.choose(modelfacts.model_facts(str(tmp_path / "llama3"))) == ({}, None)
    facts = modelfacts.model_facts(str(tmp_path / "gpt-oss"))
    no = modelfacts.ModelFacts(**{**facts.__dict__, "experts_dispatch": "X does not dispatch its experts"})
    assert moe.choose(no) == ({}, "MoE experts: transformers' own (X does not dispatch its experts)")


def test_float32_weights_under_bf16_autocast_run_the_grouped_gemms_in_bf16(monkeypatch):
    """TRL's GRPO default (float32 weights, bf16 autocast): the grouped GEMMs are no autocast ops and transformers
    casts their input to the weights' dtype, so without our cast they ran in float32 (seen on an H100). Under autocast
    ours gives them bf16 operands, as autocast gives a Linear; gradients still reach the float32 weights, and the
    logits stay within bf16's error of the float32 ones. Without autocast nothing changes (the test above)."""
    import torch
    from transformers.integrations import moe as hf_moe

    moe.register()
    model = _model("gpt-oss")
    model.set_experts_implementation(moe.NAME)
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(ids).logits
    seen = []
    real = hf_moe._grouped_linear

    def spy(x, w, *a, **k):
        seen.append((x.dtype, w.dtype))
        return real(x, w, *a, **k)

    monkeypatch.setattr(hf_moe, "_grouped_linear", spy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, labels=ids)
    out.loss.backward()
    assert seen and set(seen) == {(torch.bfloat16, torch.bfloat16)}, seen
    experts = [p for n, p in model.named_parameters() if ".experts." in n and "proj" in n]
    assert experts and all(p.dtype == torch.float32 and p.grad is not None and p.grad.abs().max() > 0
                           for p in experts)
    assert float((out.logits.detach().float() - ref).abs().max()) < 0.1 * float(ref.abs().max())


def test_gpt_oss_gate_is_transformers_own_and_compiles_into_one_graph_for_every_batch(monkeypatch, capsys):
    """moe.oss_gate computes transformers' GptOssExperts._apply_gate (values and gradients: a transformers upgrade
    that changes theirs fails here), times each row's routing weight when given (and the weights' gradients).
    Compiled as on a GPU (moe.compiled: the rows symbolic, fullgraph; inductor's CPU code here), slot counts that
    change every batch reuse one graph, and the gradients match. The experts use it for gpt-oss only, and a compiler
    failure falls back to the model's own ops with one line; the fallbacks say the weights are still to be
    multiplied."""
    import torch
    from torch._dynamo.utils import counters
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    model = _model("gpt-oss")
    experts = next(m for m in model.modules() if isinstance(m, GptOssExperts))
    alpha, limit = float(experts.alpha), float(experts.limit)
    torch._dynamo.reset()
    counters.clear()
    compiled = moe.compiled()
    for rows in (37, 53, 101):
        gen = torch.Generator().manual_seed(rows)
        x = (torch.randn(rows, 64, generator=gen) * 6).requires_grad_()
        w = torch.rand(rows, generator=gen).requires_grad_()
        grad = torch.randn(rows, 32)
        outs = {}
        for name, fn in (("theirs", lambda t, v: experts._apply_gate(t) * v.unsqueeze(-1)),
                         ("ours", lambda t, v: moe.oss_gate(t, alpha, limit, v)),
                         ("compiled", lambda t, v: compiled(t, alpha, limit, v))):
            y = fn(x, w)
            outs[name] = (y.detach(), *torch.autograd.grad(y, (x, w), grad))
        assert (outs["theirs"][1] == 0).any() and (outs["theirs"][1] != 0).any()  # clamps cut some gradients
        for name in ("ours", "compiled"):
            for got, ref in zip(outs[name], outs["theirs"]):
                assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), name
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # the slot count symbolic from the start
    assert torch.equal(moe.oss_gate(x, alpha, limit), experts._apply_gate(x))  # no weights: transformers' gate

    # In the experts: gpt-oss's compiled gate where compiles() (a GPU), the model's own elsewhere and for others.
    calls = []
    monkeypatch.setattr(moe, "compiles", lambda h: True)
    monkeypatch.setitem(moe._FN, "gate", lambda h, a, lim, v: calls.append((a, lim)) or moe.oss_gate(h, a, lim, v))
    h, w = torch.randn(5, 64), torch.rand(5)
    out, weighted = moe._gate(experts, h, w)
    assert weighted and torch.allclose(out, experts._apply_gate(h) * w[:, None]) and calls == [(alpha, limit)]
    other = _model("mixtral")
    mixtral_experts = next(m for m in other.modules() if hasattr(m, "_apply_gate") and m is not other)
    h2 = torch.randn(5, 2 * other.config.intermediate_size)
    assert moe._gate(mixtral_experts, h2, w)[1] is False and len(calls) == 1

    def out_of_memory(*a):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setitem(moe._FN, "gate", out_of_memory)  # the step's memory, not the compiler: raised as is
    with pytest.raises(torch.OutOfMemoryError):
        moe._gate(experts, h, w)
    assert moe._FN["gate"] is out_of_memory and not capsys.readouterr().err

    def broken(*a):
        raise RuntimeError("inductor: no compiler here\nmore")

    monkeypatch.setitem(moe._FN, "gate", broken)
    for _ in range(2):  # the first call falls back and says so; later ones go straight to the model's own ops
        out, weighted = moe._gate(experts, h, w)
        assert not weighted and torch.equal(out, experts._apply_gate(h)) and moe._FN["gate"] is False
    err = capsys.readouterr().err
    assert err.count("[trainbox] MoE: gpt-oss's gate did not compile (RuntimeError: inductor: no compiler here); "
                     "running it op by op") == 1, err


@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_gate_inside_the_experts_trains_as_transformers_does(monkeypatch, checkpointing):
    """The gpt-oss model with trainbox_grouped_mm and the compiled gate (forced on here: inductor's CPU code), with and
    without gradient checkpointing (the memory plan's rung that recomputes layers in backward): the logits and
    gradients of transformers' own experts."""
    import torch

    moe.register()
    base = _model("gpt-oss")
    ids = torch.randint(0, 97, (3, 40), generator=torch.Generator().manual_seed(1))
    got = {}
    for impl in ("eager", moe.NAME):
        m = copy.deepcopy(base)
        m.set_experts_implementation(impl)
        if checkpointing:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            m.train()
        calls = []
        with monkeypatch.context() as p:
            p.setattr(moe, "compiles", lambda h: calls.append(h.shape) or True)
            out = m(ids, labels=ids)
            out.loss.backward()
        if impl == moe.NAME:  # it ran, compiled (not fallen back)
            assert calls and moe._FN.get("gate") not in (None, False)
        else:
            assert not calls
        got[impl] = out.logits.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    moe._FN.pop("gate", None)
    ref_logits, ref_grads = got["eager"]
    logits, grads = got[moe.NAME]
    assert torch.allclose(logits, ref_logits, atol=1e-5, rtol=1e-5)
    for n, ref in ref_grads.items():
        assert torch.allclose(grads[n], ref, atol=1e-5 * float(ref.abs().max()) + 1e-7), n


def test_balancing_loss_is_mixtrals_without_a_sync(monkeypatch):
    """register() puts moe.balancing_loss where TRL's fused LM head imports Mixtral's load_balancing_loss_func: the
    same loss and router gradients, counted without torch.bincount (whose output size is read back to the host)."""
    import torch
    from transformers.models.mixtral import modeling_mixtral

    moe.register()
    assert modeling_mixtral.load_balancing_loss_func is moe.balancing_loss
    original = moe._FN["balancing"]
    assert original is not moe.balancing_loss and original.__module__ == modeling_mixtral.__name__
    torch.manual_seed(0)
    for experts, k in ((8, 2), (4, 1), (16, 4)):
        logits = tuple(torch.randn(37, experts, requires_grad=True) for _ in range(3))
        theirs = original(logits, experts, k, None)
        with monkeypatch.context() as m:
            m.setattr(torch, "bincount", lambda *a, **kw: pytest.fail("bincount syncs"))
            ours = moe.balancing_loss(logits, experts, k, None)
        assert torch.allclose(ours, theirs, atol=1e-6)
        for a, b in zip(torch.autograd.grad(ours, logits), torch.autograd.grad(theirs, logits)):
            assert torch.allclose(a, b, atol=1e-7)
        mask = torch.ones(1, 37)
        mask[0, 30:] = 0  # masked rows: transformers' own (it counts with scatter_add already)
        assert torch.allclose(moe.balancing_loss(logits, experts, k, mask), original(logits, experts, k, mask))
    assert moe.balancing_loss(None, 8, 2, None) == 0


def test_gpt_oss_experts_in_bf16_compile_whole_into_one_graph(monkeypatch, capsys):
    """bf16 gpt-oss (as trainbox sft loads it) runs its experts on a GPU as one compiled graph (forced here: inductor's
    CPU code): one graph for every layer and token count, under the Trainer's bf16 autocast too, with logits and
    gradients as close to float32 as transformers' own bf16 experts. Float32 weights under autocast stay op by op;
    the same under activation checkpointing; a compiler failure falls back to the ops with one line; the user's own
    torch.compile of the model traces them."""
    import torch
    from torch._dynamo.utils import counters

    moe.register()
    base = _model("gpt-oss")
    monkeypatch.setattr(moe, "compiles", lambda h: True)

    def run(impl, dtype, ids, autocast=True):
        m = copy.deepcopy(base).to(dtype)
        m.set_experts_implementation(impl)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = m(ids, labels=ids)
        out.loss.backward()
        return out.logits.detach().float(), {n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None}

    def off(got, ref):  # (max |logit diff|, the worst parameter's max |grad diff| over its largest gradient)
        return (float((got[0] - ref[0]).abs().max()),
                max(float((got[1][n] - ref[1][n]).abs().max() / ref[1][n].abs().max()) for n in ref[1]))

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.delitem(moe._FN, "experts", raising=False)
    for length in (57, 33):
        ids = torch.randint(0, 97, (3, length), generator=torch.Generator().manual_seed(length))
        ref = run("eager", torch.float32, ids, autocast=False)
        ours, theirs = off(run(moe.NAME, torch.bfloat16, ids), ref), off(run("eager", torch.bfloat16, ids), ref)
        assert ours[0] <= 2 * theirs[0] + 1e-3 and ours[1] <= 2 * theirs[1] + 0.02, (ours, theirs)
    assert callable(moe._FN["experts"]) and counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])

    # Under activation checkpointing (the memory plan's rung): the recomputation's early stop passes through the
    # compiled call (caught as a compiler failure it broke the checkpoint's state): the same logits and gradients.
    got = {}
    for checkpointing in (False, True):
        m = copy.deepcopy(base).to(torch.bfloat16)
        m.set_experts_implementation(moe.NAME)
        if checkpointing:
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.train()
        out = m(ids, labels=ids)
        out.loss.backward()
        got[checkpointing] = out.logits.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    assert torch.equal(got[True][0], got[False][0]) and callable(moe._FN["experts"])
    assert all(torch.equal(g, got[False][1][n]) for n, g in got[True][1].items())

    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(3))
    compiled = moe._FN["experts"]
    monkeypatch.setitem(moe._FN, "experts", lambda *a: pytest.fail("float32 weights are not compiled whole"))
    fp32 = run(moe.NAME, torch.float32, ids)  # under bf16 autocast: op by op, the gate compiled alone
    assert off(fp32, run("eager", torch.float32, ids))[0] < 0.1

    def broken(*a):
        raise RuntimeError("inductor: no kernel for this")

    monkeypatch.setitem(moe._FN, "experts", broken)
    ref = run("eager", torch.float32, ids, autocast=False)
    assert off(run(moe.NAME, torch.bfloat16, ids), ref)[0] < 0.1
    err = capsys.readouterr().err
    assert moe._FN["experts"] is False and err.count("experts did not compile (RuntimeError: inductor") == 1, err

    # Inside the user's own torch.compile (the Trainer's --torch_compile): no compile of ours, the same values.
    monkeypatch.setitem(moe._FN, "experts", compiled)
    monkeypatch.setattr(moe, "_compiled_experts", lambda *a: pytest.fail("compiled inside the user's compile"))
    m = copy.deepcopy(base).to(torch.bfloat16)
    m.set_experts_implementation(moe.NAME)
    experts = next(x for x in m.modules() if hasattr(x, "_apply_gate") and x is not m)
    h = torch.randn(29, base.config.hidden_size, dtype=torch.bfloat16)
    top = torch.randint(0, experts.num_experts, (29, 2), generator=torch.Generator().manual_seed(4))
    w = torch.rand(29, 2, dtype=torch.bfloat16)
    torch._dynamo.reset()
    user = torch.compile(lambda *a: experts(*a), fullgraph=True)(h, top, w)
    monkeypatch.setattr(moe, "compiles", lambda h: False)  # op by op, the model's own gate
    assert torch.allclose(user.float(), experts(h, top, w).float(), atol=0.05, rtol=0.02)
    torch._dynamo.reset()


def test_only_compiler_failures_fall_back():
    """The compiled paths' fallback (compilefail) lets the step's own exceptions through: out of memory, and
    activation checkpointing's early stop of a recomputation."""
    import torch
    from torch.utils import checkpoint

    from trainbox.training.kernels import compilefail

    assert compilefail.is_compiler_failure(RuntimeError("inductor: no kernel for this"))
    assert not compilefail.is_compiler_failure(torch.OutOfMemoryError("CUDA out of memory"))
    assert not compilefail.is_compiler_failure(checkpoint._StopRecomputationError())
