"""kernels/ckptoffload.py on CPU: the checkpoint function of every checkpointed layer is wrapped (now and when the
Trainer enables checkpointing again), training through it gives the same gradients, and it applies only where it
can (GPU, checkpointing, one process). The copies themselves need a GPU: tests/gpu/lora4bit_check.py."""

import pytest

torch = pytest.importorskip("torch")


def _model(path, checkpointing=True):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if checkpointing:
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.train()
    return m


def _grads(m, ids):
    m.zero_grad()
    m(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def test_layers_wrapped_and_gradients_unchanged(tiny_model):
    from trainbox.training.kernels import ckptoffload

    m = _model(tiny_model)
    layers = [x for x in m.modules() if getattr(x, "gradient_checkpointing", False)]
    assert layers
    ids = torch.randint(0, m.config.vocab_size, (2, 24))
    ref = _grads(m, ids)
    assert ckptoffload.install(m) == len(layers)
    assert all(getattr(x._gradient_checkpointing_func, "_trainbox_offload", False) for x in layers)
    got = _grads(m, ids)
    assert set(got) == set(ref) and all(torch.equal(got[n], ref[n]) for n in ref)
    # the Trainer enables checkpointing again at train(): the fresh checkpoint function is wrapped too, once
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    assert all(getattr(x._gradient_checkpointing_func, "_trainbox_offload", False) for x in layers)
    assert not getattr(layers[0]._gradient_checkpointing_func.__wrapped__, "_trainbox_offload", False)
    got = _grads(m, ids)
    assert all(torch.allclose(got[n], ref[n], atol=1e-6) for n in ref)


def test_choose_applies_only_where_it_can(tiny_model, monkeypatch):
    from trainbox.training.kernels import ckptoffload

    m = _model(tiny_model)
    assert ckptoffload.choose(m, checkpointing=True, on_gpu=False, distributed=False) is None
    assert ckptoffload.choose(m, checkpointing=False, on_gpu=True, distributed=False) is None
    assert ckptoffload.choose(m, checkpointing=True, on_gpu=True, distributed=True) is None
    monkeypatch.setenv(ckptoffload.ENV, "0")
    assert "kept on the GPU" in ckptoffload.choose(m, checkpointing=True, on_gpu=True, distributed=False)
    assert not hasattr(m, "_trainbox_offloader")
    monkeypatch.delenv(ckptoffload.ENV)
    line = ckptoffload.choose(m, checkpointing=True, on_gpu=True, distributed=False)
    assert "offloaded to pinned host memory" in line and hasattr(m, "_trainbox_offloader")


def test_small_and_cpu_tensors_stay_where_they_are():
    from trainbox.training.kernels import ckptoffload

    off = ckptoffload.Offloader()
    t = torch.ones(4)
    assert off.pack(t) is t and off.unpack(t) is t and off.items == []


def test_any_value_of_the_switches_gives_a_line_never_a_traceback(monkeypatch):
    """Fuzzed: whatever TRAINBOX_CKPT_OFFLOAD or TRAINBOX_LORA_FUSED holds, choose() returns a line or None (a typo
    is named and leaves the path on, never raised)."""
    from hypothesis import given, settings, strategies as st

    from trainbox.training.kernels import ckptoffload, lora4bit

    model = torch.nn.Linear(4, 4)  # neither checkpointed layers nor 4-bit LoRA: nothing to apply them to
    calls = {ckptoffload.ENV: lambda: ckptoffload.choose(model, checkpointing=True, on_gpu=True, distributed=False),
             lora4bit.ENV: lambda: lora4bit.choose(model, distributed=False)}

    @settings(max_examples=150, deadline=None)
    @given(st.sampled_from(sorted(calls)), st.text().filter(lambda t: "\x00" not in t))
    def check(env, value):
        monkeypatch.setenv(env, value)
        line = calls[env]()
        v = value.strip().lower()
        if v in ("0", "false", "no", "off"):
            assert line is not None and f"({env}={value})" in line
        elif v in ("", "1", "true", "yes", "on"):
            assert line is None
        else:
            assert line == f"{env}={value!r} is neither 0 nor 1: left on"

    check()


def test_items_are_held_weakly_so_a_graph_freed_without_backward_leaves_nothing():
    """A forward whose graph is dropped (an exception, a skipped step) must not pin its host copies here."""
    import gc
    import weakref

    from trainbox.training.kernels import ckptoffload

    off = ckptoffload.Offloader()
    item = ckptoffload._Item(torch.ones(4), torch.device("cpu"), None, 0)
    off.items.append(weakref.ref(item))
    assert off._live(0) is item
    del item
    gc.collect()
    assert off._live(0) is None
