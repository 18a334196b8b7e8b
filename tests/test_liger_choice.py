"""speed.choose_liger: Liger's kernels on where they apply, unless the user set TRL's flag or asked for the Trainer's
own torch.compile (inductor failed on Liger's Triton kernels inside a compiled Llama on an H200, torch 2.11)."""

from __future__ import annotations

from types import SimpleNamespace

from trainbox.training import config, speed

FACTS = speed.ModelFacts(model_type="llama", params=10, embedding_params=2, layers=2, hidden=8, intermediate=16,
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
