"""trainbox_flex (trainbox/training/kernels/flexattn.py) against each model's own eager attention in float32: logits and the
gradients of every parameter (q/k/v/o projections, sinks, experts...) on single rows, a right-padded batch and one
packed row (each example of the packed row against the same example alone), for Gemma 2 (window + softcap), gpt-oss
(window + sinks, MoE) and the Llama control, on the tiny zoo models.

Two implementations of the same masks and modifiers run here: the dense math (what CPU training runs) and
FlexAttention itself through its unfused reference (torch.nn.attention.flex_attention without torch.compile: the
same mask_mod/score_mod, the log-sum-exp and flex's own backward formula; torch refuses gradients on CPU only at its
entry check, lifted here). The compiled kernel's forward runs on CPU too (torch compiles it for inference only); the
compiled path's training (Dynamo's capture and FlexAttention's autograd, backend aot_eager) runs here after the choice
trial, as on a GPU; the Triton kernels' backward and bf16 numbers are tests/gpu/flex_check.py's (on a GPU).
"""

import time

import pytest
import torch

from trainbox.training import attention, modelfacts, speed
from trainbox.training.kernels import flexattn
from zoo import WINDOW, make_zoo_model

ARCHS = ["gemma2", "gpt-oss", "llama3"]
LENGTHS = (64, 40, 29)  # every row longer than the zoo's 16-token window


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    base = tmp_path_factory.mktemp("flexzoo")
    attention.register(attention.FLEX)
    return {name: make_zoo_model(base / name, name) for name in ARCHS}


def load(path, impl):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation=impl, dtype=torch.float32).eval()


@pytest.fixture
def unfused_flex(monkeypatch):
    """Route trainbox_flex through FlexAttention's own (unfused) implementation on CPU, gradients included."""
    from torch.nn.attention import flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *a: None)
    monkeypatch.setattr(flexattn, "uses_fused", lambda q, k, dropout: q.shape[2] == k.shape[2])
    monkeypatch.setattr(flexattn, "compiled", lambda: fa.flex_attention)


@pytest.fixture
def aot_eager_flex(monkeypatch):
    """Route trainbox_flex through the compiled path on CPU, compiled with aot_eager (Dynamo's capture and
    FlexAttention's autograd, no inductor: it has no FlexAttention backward on CPU), gradients included; Dynamo's
    caches reset before and after, so this process's other compiles don't count against the recompile limit here."""
    from torch.nn.attention import flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *a: None)  # torch refuses CPU gradients at its entry only
    monkeypatch.setattr(flexattn, "uses_fused", lambda q, k, dropout: q.shape[2] == k.shape[2])
    real = flexattn.compiled
    monkeypatch.setattr(flexattn, "compiled", lambda backend="aot_eager": real(backend))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def rows_and_weights(vocab):
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(10, 300, (n,), generator=g) for n in LENGTHS]
    # A fixed random weight per (position, vocab entry): loss = sum(logits * W) gives every logit a gradient.
    weights = torch.randn(max(LENGTHS), vocab, generator=g)
    return rows, weights


def run(model, kind, rows, weights):
    """(per-row logits, parameter gradients) for `rows` fed as `kind`: single (each row alone: eager's reference
    when summed), padded (one right-padded batch) or packed (one row, position_ids restarting per example)."""
    model.zero_grad()
    lens = [len(r) for r in rows]
    if kind == "single":
        logits = []
        for r in rows:
            out = model(r[None]).logits[0]
            (out * weights[: len(r)]).sum().backward()
            logits.append(out.detach())
    elif kind == "padded":
        ids = torch.zeros(len(rows), max(lens), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = r, 1
        out = model(ids, attention_mask=mask).logits
        logits = [out[i, :n] for i, n in enumerate(lens)]
        sum((x * weights[: len(x)]).sum() for x in logits).backward()
        logits = [x.detach() for x in logits]
    else:
        pos = torch.cat([torch.arange(n) for n in lens])[None]
        out = model(torch.cat(rows)[None], position_ids=pos, use_cache=False).logits[0]
        starts = [sum(lens[:i]) for i in range(len(lens))]
        logits = [out[a : a + n] for a, n in zip(starts, lens)]
        sum((x * weights[: len(x)]).sum() for x in logits).backward()
        logits = [x.detach() for x in logits]
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits, grads


def worst(ours, ref):
    (lo, go), (lr, gr) = ours, ref
    logit = max(float((a - b).abs().max()) for a, b in zip(lo, lr))
    # Relative to each gradient's own scale (embeddings and experts differ by orders of magnitude); a parameter
    # that got no gradient (sinks not applied) counts as a zero one.
    grad = max(float((go.get(n, torch.zeros_like(g)) - g).abs().max() / g.abs().max().clamp_min(1e-12))
               for n, g in gr.items())
    return logit, grad


@pytest.fixture(scope="module")
def eager_refs(zoo):
    out = {}
    for name, path in zoo.items():
        model = load(path, "eager")
        rows, weights = rows_and_weights(model.config.vocab_size)
        out[name] = (rows, weights, run(model, "single", rows, weights))
    return out


@pytest.mark.parametrize("kind", ["single", "padded", "packed"])
@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("impl", ["dense", "flex"])
def test_logits_and_grads_match_float32_eager(zoo, eager_refs, request, name, kind, impl):
    if impl == "flex":
        request.getfixturevalue("unfused_flex")
    rows, weights, ref = eager_refs[name]
    logit, grad = worst(run(load(zoo[name], attention.FLEX), kind, rows, weights), ref)
    assert logit < 1e-4 and grad < 1e-4, (logit, grad)


def test_the_comparison_catches_a_leak_an_off_by_one_window_and_dropped_sinks(zoo, eager_refs, monkeypatch):
    """What the test above would see if the masks were wrong: examples attending to each other in the packed row,
    the window one token wider than transformers' (kv > q - window), sinks not applied."""
    rows, weights, ref = eager_refs["gpt-oss"]
    model = load(zoo["gpt-oss"], attention.FLEX)
    docs = flexattn.documents
    monkeypatch.setattr(flexattn, "documents", lambda p, m, b, n, d: docs(None, m, b, n, d))
    assert worst(run(model, "packed", rows, weights), ref)[0] > 1e-2
    monkeypatch.undo()
    dense = flexattn.dense
    monkeypatch.setattr(flexattn, "dense", lambda q, k, v, d, s, w, *a: dense(q, k, v, d, s, w and w + 1, *a))
    assert worst(run(model, "single", rows, weights), ref)[0] > 1e-3
    monkeypatch.undo()
    monkeypatch.setattr(flexattn, "with_sinks", lambda out, lse, sinks: out)
    assert worst(run(model, "single", rows, weights), ref)[0] > 1e-2


def test_compiled_kernel_forward_on_cpu_compiles_once_per_shape_family(zoo, eager_refs, capsys):
    """The compiled FlexAttention kernel (inductor's CPU code; inference only, no log-sum-exp, so not gpt-oss) on
    Gemma 2's packed row: window, softcap and example boundaries in the fused kernel give eager's logits. Packed
    rows of other lengths (other 128-token buckets, other examples) and both layer types (windowed, full) then
    reuse what was compiled: at most two graphs (the first shape, then the dynamic one)."""
    from torch._dynamo.utils import counters

    rows, weights, ref = eager_refs["gemma2"]
    model = load(zoo["gemma2"], attention.FLEX)
    real = flexattn.uses_fused
    flexattn.uses_fused = lambda q, k, dropout: q.shape[2] == k.shape[2]
    graphs = counters["stats"]["unique_graphs"]
    try:
        lens = [len(r) for r in rows]
        pos = torch.cat([torch.arange(n) for n in lens])[None]
        t = time.time()
        with torch.no_grad():
            out = model(torch.cat(rows)[None], position_ids=pos, use_cache=False).logits[0]
            took = time.time() - t
            for n in ((100, 100, 100), (300, 250), (50,) * 9):  # 384, 640, 512 tokens
                model(torch.randint(10, 300, (1, sum(n))), position_ids=torch.cat([torch.arange(k) for k in n])[None],
                      use_cache=False)
        compiled = counters["stats"]["unique_graphs"] - graphs
    finally:
        flexattn.uses_fused = real
    starts = [sum(lens[:i]) for i in range(len(lens))]
    diff = max(float((out[a : a + n] - r).abs().max()) for a, n, r in zip(starts, lens, ref[0]))
    with capsys.disabled():
        print(f"\n[flex] compiled CPU forward (first call, compile included): {took:.1f} s; max |logit diff| "
              f"{diff:.2e}; {compiled} graph(s) for 4 packed lengths x 2 layer types")
    assert diff < 1e-4
    assert compiled <= 2


@pytest.mark.parametrize("name", ["gemma2", "gpt-oss"])
def test_compiled_path_trains_after_the_choice_trial_and_reuses_its_graphs(zoo, eager_refs, aot_eager_flex, capsys,
                                                                           name):
    """The GPU failure's sequence, on CPU: the choice trial (flexattn.trial: softcap 20, window 48, sinks) compiles
    flex_attention first, then the model (Gemma 2: softcap 50, window 16; gpt-oss: no softcap, sinks) trains through
    the same compiled function, fullgraph: packed rows forward and backward (backend aot_eager: Dynamo's capture and
    FlexAttention's autograd as on a GPU, without inductor, which has no FlexAttention backward on CPU) give float32
    eager's logits and gradients; packed rows of other lengths and a no-grad forward reuse the graphs. While the
    softcap was a captured Python float, the model's first call broke the graph on the trial's value and its backward
    failed in FlexAttention's unfused operator (on an H100: "all unwrapped values must be FakeTensor, int, or SymInt")."""
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    t = time.time()
    assert flexattn.trial("cpu", 16) is None
    trial_s = time.time() - t
    rows, weights, ref = eager_refs[name]
    model = load(zoo[name], attention.FLEX)
    t = time.time()
    logit, grad = worst(run(model, "packed", rows, weights), ref)
    first_s = time.time() - t
    t = time.time()
    for n in ((100, 100, 100), (300, 250), (50,) * 9):  # 384, 640, 512 tokens: other 128-token buckets
        pos = torch.cat([torch.arange(k) for k in n])[None]
        ids = torch.randint(10, 300, (1, sum(n)))
        model(ids, position_ids=pos, use_cache=False).logits.square().mean().backward()
        with torch.no_grad():  # evaluation, and checkpointing's first forward
            model(ids, position_ids=pos, use_cache=False)
    rest_s = time.time() - t
    compiled = counters["stats"]["unique_graphs"] - graphs
    with capsys.disabled():
        print(f"\n[flex] {name}: compiled path (aot_eager) trial {trial_s:.1f} s, first packed step {first_s:.1f} s, "
              f"3 more steps + 3 no-grad forwards {rest_s:.1f} s; {compiled} graph(s); max |logit diff| {logit:.1e}, "
              f"grad {grad:.1e}")
    assert logit < 1e-4 and grad < 1e-4, (logit, grad)
    # trial; model (its modifiers differ from the trial's): first shape, then the symbolic length, each with and
    # without grad; gpt-oss's sinks (sinks_to_layout, inductor) one more. A per-batch (per-length, per-layer)
    # recompile would exceed it.
    assert compiled <= 5 + (name == "gpt-oss")


@pytest.mark.parametrize("name", ["gemma2", "gpt-oss"])
def test_inside_the_users_torch_compile_the_fused_path_runs_behind_a_graph_break(zoo, eager_refs, aot_eager_flex,
                                                                                 monkeypatch, name):
    """--torch_compile: the Trainer compiles the whole model. Traced into that graph, the fused path's block mask
    (a symbolic block count) failed inductor's codegen on an H200 (CantSplit, gpt-oss). It runs behind a graph break
    instead, exactly as outside a compile: the model compiled whole (aot_eager here) trains on packed rows of several
    lengths with float32 eager's logits and gradients, and no document ids are built inside the trace."""
    traced = []
    docs = flexattn.padded_documents
    monkeypatch.setattr(flexattn, "padded_documents",
                        lambda *a: traced.append(torch.compiler.is_compiling()) or docs(*a))
    rows, weights, ref = eager_refs[name]
    model = load(zoo[name], attention.FLEX)
    model.compile(backend="aot_eager")
    logit, grad = worst(run(model, "packed", rows, weights), ref)
    for n in ((100, 100, 100), (300, 250)):  # other lengths: the user's graph goes dynamic
        pos = torch.cat([torch.arange(k) for k in n])[None]
        model(torch.randint(10, 300, (1, sum(n))), position_ids=pos, use_cache=False).logits.mean().backward()
    assert logit < 1e-4 and grad < 1e-4, (logit, grad)
    assert traced and not any(traced), f"{sum(traced)} of {len(traced)} block masks were built inside the trace"


@pytest.mark.parametrize("name", ["gemma2", "gpt-oss"])
def test_generation_with_a_cache_and_left_padding_matches_eager(zoo, name):
    """Decoding (queries fewer than keys: the dense path) from a left-padded batch: eager's tokens and scores."""
    ids = torch.tensor([[0, 0, 0, *range(20, 40)], [*range(50, 73)]])
    mask = torch.tensor([[0, 0, 0, *[1] * 20], [1] * 23])
    got = {}
    for impl in ("eager", attention.FLEX):
        model = load(zoo[name], impl)
        model.generation_config.pad_token_id = 0
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
        got[impl] = (out.sequences, torch.stack(out.scores))
    assert torch.equal(got["eager"][0], got[attention.FLEX][0])
    assert float((got["eager"][1] - got[attention.FLEX][1]).abs().max()) < 1e-4


@pytest.mark.parametrize("name,kernel", [("gemma2", attention.FLEX), ("gpt-oss", attention.VARLEN)])
def test_choice_names_a_fused_kernel_and_packs(zoo, name, kernel):
    """Where no FlashAttention honours the model (sm90 without FA3 for Gemma 2's softcap; FA3 and FA2 for gpt-oss's
    sinks) the choice is a fused kernel and training packs: FlexAttention for the softcap, torch's varlen FlashAttention
    for the sinks (varlen_sinks.py), FlexAttention where that can't run; where neither can, eager with the reason; on
    CPU FlexAttention's dense math."""
    needs = modelfacts.model_facts(str(zoo[name])).attention
    hopper = {"attention_backend": "fa3"}
    c = attention.decide(hopper, (9, 0), lambda n: None if n in ("varlen", "flex") else "not installed", model=needs)
    assert c.impl == kernel and c.packed
    flex = attention.decide(hopper, (9, 0), lambda n: None if n == "flex" else "not installed", model=needs)
    assert flex.impl == attention.FLEX and flex.packed
    if kernel == attention.VARLEN:
        assert c.line().startswith("attention: PyTorch varlen flash attention (trainbox_varlen): the first that runs "
                                   "here and honours this model's attention")
        assert "compile" not in c.line()
        assert "PyTorch varlen flash attention: not installed" in flex.line()
        c = flex
    else:
        assert c.line().startswith("attention: PyTorch FlexAttention (trainbox_flex): the first that runs here and "
                                   "honours this model's attention")
        assert "PyTorch varlen flash attention: would drop" in c.line()
    assert c.line().endswith("its kernels compile during the first steps (kept under TORCHINDUCTOR_CACHE_DIR for "
                             "later runs)")  # a cold compile is minutes: the long first step is announced
    cpu = attention.decide(hopper, None, lambda n: None, model=needs)
    assert cpu.impl == attention.FLEX and "compile" not in cpu.line()  # CPU: dense math, nothing compiled
    args = type("Args", (), {"packing_strategy": "bfd"})()
    from trainbox.training import config as cfg

    orig = cfg.explicit
    cfg.explicit = lambda a: set()
    try:
        assert speed.choose_packing(args, c.packed).startswith("packing on (bfd")
    finally:
        cfg.explicit = orig
    down = attention.decide(hopper, (9, 0), lambda n: "test op failed (boom)" if n == "flex" else "not installed",
                            model=needs)  # (varlen "not installed")
    assert down.impl == "eager" and not down.packed and "PyTorch FlexAttention: test op failed (boom)" in down.line()
    cpu = attention.decide(None, None, lambda n: None, model=needs)
    assert cpu.impl == attention.FLEX and cpu.packed and cpu.reason == attention.CPU_FLEX


def test_plain_models_keep_their_kernels():
    """The Llama control: varlen on a GPU that has it, SDPA on CPU; FlexAttention only where neither packs."""
    hopper = {"attention_backend": "fa3"}
    assert attention.decide(hopper, (9, 0), lambda n: None if n in ("varlen", "flex") else "x").impl == attention.VARLEN
    assert attention.decide(hopper, (9, 0), lambda n: None if n == "flex" else "x").impl == attention.FLEX
    assert attention.decide(None, None, lambda n: None).impl == "sdpa"
    windowed = attention.Needs(window=WINDOW)
    assert attention.decide(hopper, (9, 0), lambda n: None, model=windowed).impl == "flash_attention_3"


def test_a_torch_without_a_per_function_budget_gets_the_global_limit_raised_never_lowered(monkeypatch):
    """torch 2.11 (the H100's) has no recompile_limit argument to torch.compile: there flex_check's kernel table hit
    the global limit of 8 under fullgraph (an error). compiled() raises the global limit to RECOMPILE_LIMIT instead,
    and leaves a larger one a user set."""
    import torch._dynamo.config as dyn

    calls = []

    def old_compile(model, backend="inductor", fullgraph=False):  # torch 2.11's shape: no recompile_limit
        calls.append((backend, fullgraph))
        return model

    monkeypatch.setattr(torch, "compile", old_compile)
    # Set and restored by hand: monkeypatch's undo leaves torch's config module without the key, which broke every
    # later FlexAttention call in the process (its eager entry reads recompile_limit).
    saved = dyn.recompile_limit
    try:
        for before, after in ((8, flexattn.RECOMPILE_LIMIT),
                              (4 * flexattn.RECOMPILE_LIMIT, 4 * flexattn.RECOMPILE_LIMIT)):
            monkeypatch.setattr(flexattn, "_compiled", {})
            dyn.recompile_limit = before
            assert flexattn.compiled("aot_eager") is flexattn.flex_fn()
            assert dyn.recompile_limit == after
    finally:
        dyn.recompile_limit = saved
    assert calls == [("aot_eager", True)] * 2


def test_the_gpu_default_has_an_off_switch(monkeypatch):
    """On by default on a GPU (tests/gpu/flex_check.py passed on an H100); TRAINBOX_FLEX_GPU=0 turns it off, and
    says so in the choice line's reason."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for off in ("0", "false", "OFF", " no "):
        monkeypatch.setenv(flexattn.GPU_ENV, off)
        assert flexattn.usable(64) == f"{flexattn.GPU_ENV}={off} turns it off"
    for garbage in ("2", "maybe", "é\x00"):  # a typo never turns the kernel on silently, nor raises
        monkeypatch.setenv(flexattn.GPU_ENV, garbage.replace("\x00", ""))
        assert "is neither 0 nor 1: left off" in flexattn.usable(64)
    monkeypatch.setattr(flexattn, "trial", lambda device, head_dim, dtype: f"trial on {device} at {head_dim}")
    import torch.utils._triton as tt

    monkeypatch.setattr(tt, "has_triton", lambda: True)
    for on in ("1", "true", ""):
        monkeypatch.setenv(flexattn.GPU_ENV, on)
        assert flexattn.usable(128) == "trial on cuda at 128"
    monkeypatch.delenv(flexattn.GPU_ENV)
    assert flexattn.usable(128) == "trial on cuda at 128"


def test_a_named_flex_kernel_is_warmed_up_by_its_trial(monkeypatch):
    """--attn_implementation trainbox_flex on a GPU: no choice, but trial() runs first as a warm-up (its compile is what
    makes the first batch's graph symbolic in every size: without it two later batches compiled again inside
    training on an H200), and a failed check is a WARNING in the line, never another kernel. Any other named kernel,
    or no GPU: no trial."""
    calls = []

    def trial(device, head_dim, dtype):
        calls.append((device, head_dim, dtype))

    monkeypatch.setattr(flexattn, "trial", trial)
    monkeypatch.setattr(attention, "register", lambda impl: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    info = {"attention_backend": "fa3"}
    c = attention.choose("trainbox_flex", info, attention.Needs(softcap=50.0, head_dim=256))
    assert (c.impl, c.reason, calls) == (flexattn.FLEX, "set by --attn_implementation", [("cuda", 256, torch.bfloat16)])
    attention.choose("sdpa", info, attention.Needs(head_dim=256))
    assert len(calls) == 1
    monkeypatch.setattr(flexattn, "trial", lambda *a: "test op failed (Boom)")
    c = attention.choose("trainbox_flex", info, attention.Needs())
    assert c.impl == flexattn.FLEX and c.reason.endswith("; WARNING: its check failed here: test op failed (Boom)")
    monkeypatch.setattr(flexattn, "trial", trial)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert attention.choose("trainbox_flex", info, attention.Needs()).impl == flexattn.FLEX and len(calls) == 1


def test_kernel_options_only_where_measured(monkeypatch):
    """Block sizes (flexattn.KERNEL_OPTIONS) for head sizes above 128 and up to 64 on sm90 only; inductor's default
    elsewhere."""
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda", 0)
    assert flexattn.kernel_options(256, cuda)["BLOCK_M1"] == 32
    assert flexattn.kernel_options(64, cuda)["BLOCK_N"] == 128 and flexattn.kernel_options(32, cuda)["BLOCK_M"] == 64
    assert flexattn.kernel_options(128, cuda) is None and flexattn.kernel_options(96, cuda) is None
    assert flexattn.kernel_options(256, torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert flexattn.kernel_options(256, cuda) is None


def test_the_kernel_runs_in_autocasts_dtype_when_rope_left_q_and_k_in_float32():
    """Float32 weights under bf16 autocast (TRL's GRPO default): RoPE's float32 cos/sin leave q and k in float32 and v
    in bf16. The kernel gets all three in autocast's dtype (it ran in float32 before: a Gemma-2 GRPO step 2.2x slower
    on an H100); without autocast (float32 training) it keeps float32, and autocast is off inside the call."""
    q, k = torch.randn(1, 4, 40, 16), torch.randn(1, 2, 40, 16)
    v = torch.randn(1, 2, 40, 16, dtype=torch.bfloat16)
    docs = flexattn.padded_documents(None, None, 1, 40, q.device)
    seen = []

    def kernel(query, key, value, **kw):
        seen.append((query.dtype, key.dtype, value.dtype, torch.is_autocast_enabled("cpu")))
        return torch.zeros_like(query)  # the dtypes it was given are the point here, not its numbers

    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = flexattn.fused(q, k, v, docs, 0.25, None, 50.0, fn=kernel, lse=False)
    assert seen == [(torch.bfloat16,) * 3 + (False,)] and out.dtype == torch.bfloat16
    seen.clear()
    out, _ = flexattn.fused(q, k, v.float(), docs, 0.25, None, 50.0, fn=kernel, lse=False)
    assert seen == [(torch.float32,) * 3 + (False,)] and out.dtype == torch.float32


def test_block_tiles_are_create_block_masks_without_the_dense_mask():
    """flexattn.tiles reads the block mask off each block's document ids and positions; torch's create_block_mask
    evaluates mask_mod at every (query, key) pair. Over packed rows (short and long examples), right- and left-padded
    batches and one-example rows, with windows around the block size: the same tiles visited, and the same of them
    visited without the mask (full), and block_mask's BlockMask says the same."""
    import random

    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    for seed in range(60):
        r = random.Random(seed)
        batch, length = r.choice([1, 2, 3]), r.randint(1, 1100)
        positions = [p for _ in range(length) for p in range(r.randint(1, 300))][:length]
        position_ids = torch.tensor(positions)[None].expand(batch, length) if seed % 3 else None
        mask = None
        if seed % 4 == 0:
            mask = torch.ones(batch, length, dtype=torch.long)
            for row in range(batch):
                cut = r.randint(0, length - 1)
                (mask[row, :cut] if seed % 8 else mask[row, length - cut:]).zero_()
        flexattn._docs_cache.clear()
        docs = flexattn.padded_documents(position_ids, mask, batch, length, "cpu")
        window = r.choice([None, 1, 100, 127, 128, 129, 256, 1024])
        n = docs.shape[1]
        ref = create_block_mask(flexattn.mask_mod(docs, torch.tensor(window or flexattn.NO_WINDOW)), batch, None, n,
                                n, device="cpu")
        partial, full = flexattn.tiles(docs, window)
        blocks = n // flexattn.BLOCK
        ref_full = torch.zeros(batch, 1, blocks, blocks, dtype=torch.bool)
        for b in range(batch):
            for q in range(blocks):
                ref_full[b, 0, q, ref.full_kv_indices[b, 0, q, :ref.full_kv_num_blocks[b, 0, q]]] = True
        case = (seed, batch, length, window)
        assert torch.equal(full, ref_full), case
        assert torch.equal(partial | full, ref.to_dense().bool()) and not (partial & full).any(), case
        flexattn._masks.clear()
        bm = flexattn.block_mask(docs, window)
        assert torch.equal(bm.to_dense().bool(), partial | full), case
        # the backward's lists (per key block), made from the tiles: what torch derives from the forward's lists
        ref = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                                       BLOCK_SIZE=flexattn.BLOCK, seq_lengths=bm.seq_lengths)
        lists = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
                 "full_q_num_blocks", "full_q_indices")
        assert all(getattr(bm, name).is_contiguous() for name in lists), case  # the kernels read them so
        for name in ("q_num_blocks", "full_q_num_blocks"):
            assert torch.equal(getattr(bm, name), getattr(ref, name)), (case, name)
        for name, count in (("q_indices", "q_num_blocks"), ("full_q_indices", "full_q_num_blocks")):
            for b in range(batch):
                for kv in range(blocks):
                    k = int(getattr(ref, count)[b, 0, kv])
                    assert torch.equal(getattr(bm, name)[b, 0, kv, :k], getattr(ref, name)[b, 0, kv, :k]), (case, name)
    flexattn._masks.clear()
    flexattn._docs_cache.clear()


def test_sinks_compile_into_the_models_layout_once_for_every_length(monkeypatch, capsys):
    """On GPUs the sinks and the models' (batch, seq, heads, dim) layout run compiled (flexattn.sinks_to_layout;
    inductor's CPU code here): with_sinks's values and the gradients of the output, log-sum-exp and sinks, one graph
    for every sequence length; a compiler failure falls back to the same ops with one line."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(flexattn, "_sinks", {})
    for s in (40, 77, 130):
        g = torch.Generator().manual_seed(s)
        out = torch.randn(1, 4, s, 8, generator=g).to(torch.bfloat16).requires_grad_()
        lse = torch.randn(1, 4, s, generator=g, requires_grad=True)
        sinks = torch.randn(4, generator=g, requires_grad=True)
        grad = torch.randn(1, s, 4, 8, generator=g).to(torch.bfloat16)
        ref = flexattn.with_sinks(out, lse, sinks).transpose(1, 2).contiguous()
        got = flexattn.sinks_to_layout(out, lse, sinks)
        assert got.shape == (1, s, 4, 8) and got.is_contiguous() and torch.equal(got, ref)
        for a, b in zip(torch.autograd.grad(got, (out, lse, sinks), grad),
                        torch.autograd.grad(ref, (out, lse, sinks), grad)):
            assert torch.allclose(a.float(), b.float(), atol=1e-5, rtol=1e-3)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])

    def broken(*a):
        raise RuntimeError("inductor: no kernel for this")

    monkeypatch.setattr(flexattn._sinks["fn"], "compiled", broken)
    assert torch.equal(flexattn.sinks_to_layout(out, lse, sinks), ref)
    assert flexattn.sinks_to_layout(out, lse, sinks).shape == ref.shape and flexattn._sinks["fn"].compiled is False
    err = capsys.readouterr().err
    assert err.count("sinks did not compile (RuntimeError: inductor") == 1, err
    torch._dynamo.reset()
