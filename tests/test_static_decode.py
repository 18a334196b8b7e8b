"""static_decode.py, the no-vLLM GRPO rollout engine, on CPU for every zoo architecture: what it decodes greedily
is what a plain full forward of the policy predicts (cache, positions, left padding, windows, softcaps, sinks,
experts), it stops rows at their end token, grows its cache for longer prompts and more rows, and its sampling
draws from softmax(logits / temperature)."""

from __future__ import annotations

import math

import pytest
import torch

from tiny import make_tokenizer
from trainbox.training.grpo import static_decode
from zoo import ZOO, make_config

GREEDY = 1e-6  # a temperature at which the Gumbel draw is the argmax (random logits: no near-ties)


def policy(name: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    tok = make_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(name, tok), dtype=torch.float32)
    return model.eval(), tok


def prompts(tok, lengths=(5, 13, 22)):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(5, len(tok), (n,), generator=g).tolist() for n in lengths]


def assert_greedy(model, prompt_rows, completions):
    """Each completion token is the full forward's argmax after the row's own unpadded prefix."""
    for prompt, completion in zip(prompt_rows, completions, strict=True):
        ids = torch.tensor([prompt + completion])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        top2 = logits.topk(2, -1)
        for j, token in enumerate(completion):
            gap = (top2.values[j, 0] - top2.values[j, 1]).item()
            assert token == top2.indices[j, 0].item() or gap < 1e-4, (j, token, top2)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_greedy_decode_matches_full_forward(name):
    model, tok = policy(name)
    dec = static_decode.StaticDecoder(model, max_new=14, pad_id=tok.pad_token_id, eos_ids=[], temperature=GREEDY,
                                      dtype=torch.float32)
    rows = prompts(tok)
    out = dec.generate(rows)
    assert [len(c) for c in out] == [14, 14, 14]  # no end token: every row runs to max_new
    assert_greedy(model, rows, out)


def test_rows_stop_at_their_end_token_which_is_kept():
    model, tok = policy("llama3")
    rows = prompts(tok)
    dec = static_decode.StaticDecoder(model, max_new=12, pad_id=tok.pad_token_id, eos_ids=[], temperature=GREEDY,
                                      dtype=torch.float32)
    free = dec.generate(rows)
    stop = free[0][3]
    dec = static_decode.StaticDecoder(model, max_new=12, pad_id=tok.pad_token_id, eos_ids=[stop],
                                      temperature=GREEDY, dtype=torch.float32)
    out = dec.generate(rows)
    for before, after in zip(free, out, strict=True):
        end = before.index(stop) + 1 if stop in before else len(before)
        assert after == before[:end]
    assert len(out[0]) <= 4 and out[0][-1] == stop


def test_cache_grows_for_longer_prompts_and_more_rows_and_weights_sync(monkeypatch):
    monkeypatch.setattr(static_decode, "STEP", 8)
    monkeypatch.setattr(static_decode, "SCORE_BYTES", 4 * 2 * 4 * 16 * 3)  # prefill of the sink model in chunks
    model, tok = policy("gpt-oss")
    dec = static_decode.StaticDecoder(model, max_new=6, pad_id=tok.pad_token_id, eos_ids=[], temperature=GREEDY,
                                      dtype=torch.float32)
    short = prompts(tok, (3, 6))
    assert_greedy(model, short, dec.generate(short))
    first = (dec.rows, dec.length)
    long = prompts(tok, (4, 30, 9, 17))
    out = dec.generate(long)
    assert (dec.rows, dec.length) == (4, 32 + 6) and first == (2, 8 + 6)
    assert_greedy(model, long, out)
    with torch.no_grad():  # the policy trains on: sync() carries its new weights into the decoder
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    dec.sync(model)
    assert_greedy(model, long, dec.generate(long))


def test_fused_projections_trace_into_one_graph_decode_alike_and_sync():
    """q/k/v and gate/up become one GEMM each (slices of a fused weight the policy's weights are copied into);
    Dynamo traces the sibling hand-off without a graph break, and the result is the unfused decoder's."""
    model, tok = policy("llama3")
    rows = prompts(tok)
    kwargs = dict(max_new=10, pad_id=tok.pad_token_id, eos_ids=[], temperature=GREEDY, dtype=torch.float32)
    plain = static_decode.StaticDecoder(model, fuse=False, **kwargs)
    dec = static_decode.StaticDecoder(model, **kwargs)
    fused = [m for m in dec.model.modules() if isinstance(m, static_decode._Fused)]
    assert [m.splits for m in fused[:2]] == [[64, 32, 32], [128, 128]]
    assert len(fused) == 2 * model.config.num_hidden_layers
    assert not any(isinstance(m, torch.nn.Linear) and m.out_features in (32, 128) for m in dec.model.modules())
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    dec._fit(len(rows), max(map(len, rows)))
    dec.step = torch.compile(dec._step, backend=backend, fullgraph=True)  # a graph break would raise
    assert dec.generate(rows) == plain.generate(rows)
    assert len(graphs) == 1
    assert all(not m.memo for m in fused)  # nothing held between calls
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    dec.sync(model)
    assert_greedy(model, rows, dec.generate(rows))


@pytest.mark.parametrize("name", sorted(n for n in ZOO if "window" in ZOO[n][2]))
def test_windowed_models_compile_one_step_for_every_token(name, monkeypatch):
    """transformers' sliding-window cache layer guards a compiled step on a Python int that changes every token;
    the decoder's cache (static_cache) keeps one graph for the whole rollout."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model, tok = policy(name)
    rows = prompts(tok)
    dec = static_decode.StaticDecoder(model, max_new=12, pad_id=tok.pad_token_id, eos_ids=[], temperature=GREEDY,
                                      dtype=torch.float32)
    dec._fit(len(rows), max(map(len, rows)))
    dec.step = torch.compile(dec._step, backend=backend, fullgraph=True)
    assert_greedy(model, rows, dec.generate(rows))
    assert len(graphs) == 1


def test_split_argmax_is_argmax():
    g = torch.Generator().manual_seed(0)
    for n in (3, 1024, 1025, 5000):
        x = torch.randn(4, n, generator=g)
        x[1, -1] = 50.0  # the maximum in the padded last chunk
        assert torch.equal(static_decode.split_argmax(x, width=1024), x.argmax(-1))


def test_sampling_draws_from_the_softmax():
    model, tok = policy("qwen2.5")
    temperature = 0.7
    prompt = prompts(tok, (7,))[0]
    dec = static_decode.StaticDecoder(model, max_new=1, pad_id=tok.pad_token_id, eos_ids=[],
                                      temperature=temperature, dtype=torch.float32)
    n = 3000
    torch.manual_seed(0)
    first = torch.tensor([c[0] for c in dec.generate([prompt] * n)])
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1] / temperature, -1)
    assert len(set(first.tolist())) > 1  # not a constant: the rows draw independently
    for token in probs.topk(3).indices.tolist():  # the likeliest tokens, each within 4.5 standard errors
        p = probs[token].item()
        seen = (first == token).float().mean().item()
        assert abs(seen - p) < 4.5 * math.sqrt(p * (1 - p) / n) + 1e-3, (token, seen, p)


def test_a_step_that_does_not_compile_decodes_uncompiled_or_raises(monkeypatch, capsys):
    """Compile failures (a host copy inside CUDA graph capture: Mixtral, Qwen3-MoE on an H100) either fall back to
    the uncompiled step, said on stderr, with the same tokens, or raise StepNotCompiled for a caller with another
    engine."""

    def broken(fn, **kw):
        def step(*a):
            raise RuntimeError("Cannot copy between CPU and CUDA tensors during CUDA graph capture\nmore")
        return step

    model, tok = policy("mixtral")
    rows = prompts(tok)
    plain = static_decode.StaticDecoder(model, max_new=6, pad_id=tok.pad_token_id, eos_ids=[], temperature=GREEDY,
                                        dtype=torch.float32).generate(rows)
    monkeypatch.setattr(torch, "compile", broken)
    kw = dict(max_new=6, pad_id=tok.pad_token_id, eos_ids=[], temperature=GREEDY, dtype=torch.float32, compile=True)
    dec = static_decode.StaticDecoder(model, **kw)
    assert dec.generate(rows) == plain and dec.compile is False
    assert ("the decode step did not compile (RuntimeError: Cannot copy between CPU and CUDA tensors during CUDA "
            "graph capture); decoding uncompiled") in capsys.readouterr().err
    strict = static_decode.StaticDecoder(model, **kw, uncompiled_fallback=False)
    with pytest.raises(static_decode.StepNotCompiled, match="RuntimeError: Cannot copy between CPU and CUDA"):
        strict.generate(rows)


def _adapted(model, seed: int = 3):
    """A PEFT LoRA policy over `model` with B off zero (as after some training), so the merge is exercised."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return peft.eval()


def test_a_lora_policy_decodes_with_its_adapter_merged_and_syncs_it():
    """grpo --mode lora: the decoder's weights are the base plus each adapter's delta, so its greedy decode is what
    the PEFT policy's own forward predicts; after the adapter moves, sync() takes the new delta."""
    model, tok = policy("llama3")
    peft = _adapted(model)
    dec = static_decode.StaticDecoder(peft, max_new=10, pad_id=tok.pad_token_id, eos_ids=[], temperature=GREEDY,
                                      dtype=torch.float32)
    rows = prompts(tok)
    assert_greedy(peft, rows, dec.generate(rows))
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.mul_(-3)
    dec.sync(peft)
    assert_greedy(peft, rows, dec.generate(rows))
    with peft.disable_adapter():  # the base alone decodes otherwise: the adapter really is in the weights
        base_out = static_decode.StaticDecoder(model, max_new=10, pad_id=tok.pad_token_id, eos_ids=[],
                                               temperature=GREEDY, dtype=torch.float32).generate(rows)
    assert base_out != dec.generate(rows)


def test_a_4bit_lora_policy_is_dequantized_and_merged(tmp_path):
    """grpo --mode qlora: the decoder holds the 4-bit base weights dequantized (bitsandbytes' CPU backend) plus the
    adapters' deltas: each merged weight is what the PEFT layer computes with, and the decoder's greedy decode is
    what a float32 model with those weights predicts."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    model, tok = policy("llama3")
    model.save_pretrained(tmp_path / "m")
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.bfloat16)
    q = AutoModelForCausalLM.from_pretrained(tmp_path / "m", quantization_config=quant, dtype=torch.bfloat16,
                                             device_map={"": "cpu"})
    peft = _adapted(q)
    weights, _ = static_decode.source_weights(peft)
    layer = peft.get_base_model().model.layers[0].mlp.down_proj
    x = torch.randn(5, layer.in_features)
    with torch.no_grad():
        want = layer(x.bfloat16()).float()
    got = x @ weights["model.layers.0.mlp.down_proj.weight"]().t()
    assert (got - want).abs().max() < 2e-2 * want.abs().max()  # bf16 compute against float32
    dec = static_decode.StaticDecoder(peft, max_new=8, pad_id=tok.pad_token_id, eos_ids=[], temperature=GREEDY,
                                      dtype=torch.float32)
    assert not hasattr(dec.model.config, "quantization_config")
    ref = model  # the float32 original, given the merged weights
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(weights[name]())
    rows = prompts(tok)
    assert_greedy(ref, rows, dec.generate(rows))
