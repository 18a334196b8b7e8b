"""speed.choose_liger: Liger's kernels on where they apply, unless the user set TRL's flag or asked for the Trainer's
own torch.compile (inductor failed on Liger's Triton kernels inside a compiled Llama on an H200, torch 2.11)."""

from __future__ import annotations

from types import SimpleNamespace

from trainbox.training import config, modelfacts, speed

FACTS = modelfacts.ModelFacts(model_type="llama", params=10, embedding_params=2, layers=2, hidden=8, intermediate=16,
                         attn_width=8)


def _args(**set_by_user):
    args = SimpleNamespace(**{"torch_compile": False, "use_liger_kernel": False, **set_by_user})
    config.set_explicit(args, set_by_user)
    return args


def test_torch_compile_turns_liger_off_unless_the_user_set_it(monkeypatch):
    monkeypatch.setattr(speed, "liger_reason", lambda model_type: None)  # as on a GPU with liger-kernel installed
    args = _args()
    assert speed.choose_liger(args, FACTS) == "Liger kernels on (RMSNorm, RoPE, SwiGLU)" and args.trainbox_liger
    args = _args(torch_compile=True)
    line = speed.choose_liger(args, FACTS)
    assert line.startswith("Liger kernels off: --torch_compile") and args.trainbox_liger is False
    args = _args(torch_compile=True, use_liger_kernel=True)  # TRL's own flag: the user's choice stands
    assert speed.choose_liger(args, FACTS) == "Liger kernels on (set by you)" and args.trainbox_liger is False


def test_without_liger_the_reason_is_kept(monkeypatch):
    monkeypatch.setattr(speed, "liger_reason", lambda model_type: "liger-kernel not installed")
    args = _args(torch_compile=True)
    assert speed.choose_liger(args, FACTS) == "Liger kernels off: liger-kernel not installed"


def test_liger_s_fused_moe_is_undone_on_experts_and_under_peft_s_wrapper():
    """Liger's SwiGLU patch binds its fused MoE forward to each experts module (Mixtral, Qwen3-MoE), and under PEFT's
    LoRA on the experts (qlora) to the ParamWrapper standing there, where it failed on a GPU ('ParamWrapper' object has
    no attribute 'hidden_dim'). unpatch_experts removes exactly those bindings (bound the way Liger binds, with a
    stand-in: Liger's kernels need a GPU), and the model's own experts (transformers' interface) run again."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    def fused(self, hidden_states, top_k_index, top_k_weights):  # Liger's forward reads attributes the wrapper lacks
        return hidden_states.view(-1, self.hidden_dim)

    assert speed.unpatch_experts(torch.nn.Linear(2, 2)) == 0  # Liger's own forward by default; none without Liger
    conf = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=100)
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (1, 12))
    for peft in (False, True):
        model = transformers.AutoModelForCausalLM.from_config(conf)
        want = model(ids).logits
        if peft:
            model = get_peft_model(model, LoraConfig(target_modules="all-linear", lora_dropout=0.0, r=4))
        base = model.get_base_model() if peft else model
        layers = base.model.layers
        assert type(layers[0].mlp.experts).__name__ == ("ParamWrapper" if peft else "MixtralExperts")
        for layer in layers:  # as Liger's _patch_swiglu_module binds it
            layer.mlp.experts.__dict__["forward"] = fused.__get__(layer.mlp.experts, type(layer.mlp.experts))
            layer.mlp.experts.__dict__["_get_name"] = lambda: "LigerExperts"
        layers[0].self_attn.__dict__["forward"] = layers[0].self_attn.forward  # not Liger's: left alone
        if peft:
            try:
                model(ids)
                raise AssertionError("the stand-in should fail on the wrapper, as Liger's did")
            except AttributeError as e:
                assert "hidden_dim" in str(e)
        assert speed.unpatch_experts(base, fused) == 2
        assert all("forward" not in layer.mlp.experts.__dict__ for layer in layers)
        assert "forward" in layers[0].self_attn.__dict__
        assert torch.allclose(model(ids).logits, want, atol=1e-5)  # LoRA's B starts at zero: the same logits
