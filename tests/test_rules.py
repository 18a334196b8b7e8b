"""The rules one by one, on the real matrix data and on small hand-made contexts."""
import tomllib

import pytest

from builder import rules
from builder.errors import UserError
from builder.matrix import load_matrix
from builder.paths import ROOT


@pytest.fixture(scope="module")
def ctx():
    data = tomllib.loads((ROOT / "matrix.toml").read_text())
    m = load_matrix(ROOT / "matrix.toml")
    stacks = {"gpu": dict(next(c for c in m.cells if c.gpu).pins)}
    return rules.Context(data=data, stacks=stacks, facts=data["facts"], rules=m.rules)


def test_every_check_has_a_reason_in_the_matrix(ctx):
    # every registered check, plus the facts rules (no code: [[rule]] facts = "TABLE")
    assert set(ctx.rules) == set(rules.CHECKS) | set(rules.facts_rules(ctx.data))
    # each facts rule (whatever the matrix holds) reads a [facts] table that exists and is in the reported rules
    facts = rules.facts_rules(ctx.data)
    assert facts and all(r["facts"] in ctx.facts and rid in ctx.rules for rid, r in facts.items()), facts
    assert all(len(reason) > 30 for reason in ctx.rules.values())


@pytest.mark.parametrize("sm, arch_list, covered", [
    ("8.6", "8.0;9.0", True),          # sm80 cubins run on sm86
    ("8.0", "8.6", False),             # but not the other way round
    ("9.0", "9.0a", True),
    ("10.0", "5.0;6.0;7.0;7.5;8.0;8.6;9.0", False),
    ("12.0", "7.5;8.0;8.6;9.0;10.0;12.0", True),
    ("12.0", "10.0", False),           # no cross-major compatibility
    ("9.0", "", False),
])
def test_sm_covered(sm, arch_list, covered):
    assert rules.sm_covered(sm, arch_list) is covered


@pytest.mark.parametrize("version, spec, ok", [
    ("0.31.0", ">=0.22.0,<=0.31.0", True),
    ("0.33.0", ">=0.22.0,<=0.31.0", False),
    ("0.22", ">=0.22.0", True),
    ("5.17.0", ">=5.10.4,<5.18", True),
    ("5.18.0", ">=5.10.4,<5.18", False),
    ("2.13.0", "==2.13.0", True),
    ("2.13.0", "!=2.13.0", False),
    # PEP 440 ordering: a release candidate or dev release comes before its release (the hand-made check said >=)
    ("1.16.0rc1", ">=1.16.0", False),
    ("0.31.0.dev0", ">=0.31.0", False),
    ("0.31.0.dev0", "<=0.31.0,>=0.22.0", True),   # pinned to a pre-release, it may match (as pip/uv resolve it)
    ("1.16.0.post1", ">=1.16.0", True),
    ("2.13.0+cu129", "==2.13.0", True),           # local versions match the public one
    ("1.2.5", "~=1.2", True),                     # compatible release, once refused
    ("2.0", "~=1.2", False),
    ("4.0.2", ">=3.4.1,!=4.0.*", False),
])
def test_satisfies(version, spec, ok):
    assert rules.satisfies(version, spec, "here") is ok


@pytest.mark.parametrize("spec", ["~=1", ">=banana", "1.0", ">=1.0;", "=>1.0"])
def test_satisfies_rejects_unreadable_ranges(spec):
    with pytest.raises(UserError, match=r"facts\.x: cannot read the version range .* \(write PEP 440 clauses"):
        rules.satisfies("1.0", spec, "facts.x")


def test_satisfies_rejects_a_version_that_is_no_version():
    with pytest.raises(UserError, match=r"facts\.x: 'banana' is not a version"):
        rules.satisfies("banana", ">=1.0", "facts.x")


def test_variant_for_cuda(ctx):
    assert rules.variant_for_cuda(ctx, "12.9") == "cu129"
    assert rules.variant_for_cuda(ctx, "12.6") == "cu126"
    assert rules.variant_for_cuda(ctx, "12.8") is None


def cell(ctx, **kw):
    args = dict(arch="x86_64", cuda="12.9", gpu="hopper", attention="fa3", variant="cu129")
    args.update(kw)
    return rules.check_cell(ctx, **args)


def test_valid_combinations_pass(ctx):
    assert cell(ctx) is None
    assert cell(ctx, arch="aarch64") is None
    assert cell(ctx, gpu="blackwell", attention="sdpa") is None
    assert cell(ctx, gpu="ampere", attention="fa2", cuda="12.6", variant="cu126", arch="aarch64") is None
    assert cell(ctx, cuda=None, gpu=None, attention="sdpa", variant="cpu") is None


@pytest.mark.parametrize("kw, rule, detail", [
    (dict(gpu="ampere"), "fa3-hopper-only", "fa3 on ampere"),
    (dict(gpu="blackwell"), "fa3-hopper-only", "fa3 on blackwell"),
    (dict(gpu="blackwell", attention="fa2"), "attention-supported", "not blackwell"),
    (dict(gpu="blackwell", attention="sdpa", cuda="12.6", variant="cu126"), "gpu-min-cuda", "CUDA >= 12.8"),
    (dict(cuda="12.8", variant=None), "torch-variant-exists", "CUDA 12.8"),
    (dict(cuda="12.6", variant="cu129"), "torch-variant-exists", "built for CUDA 12.9, not 12.6"),
    (dict(cuda="12.9", variant="cpu"), "torch-variant-exists", "CPU"),
    (dict(cuda=None, gpu="hopper"), "cuda-needs-gpu", "cuda=None gpu=hopper"),
    (dict(cuda=None, gpu=None, variant="cpu", attention="fa2"), "attention-supported", "needs a GPU"),
    (dict(cuda=None, gpu=None, variant="cpu"), "fa3-hopper-only", "CPU-only"),
])
def test_violations_name_rule_and_values(ctx, kw, rule, detail):
    hit = cell(ctx, **kw)
    assert hit is not None and hit[0] == rule and detail in hit[1], hit


def test_torch_arch_list_rule(ctx):
    """cu126 on aarch64 is built for sm80/sm90 only: Blackwell there has no kernels even if CUDA were new enough."""
    only = rules.Context(data=ctx.data, stacks=ctx.stacks, facts=ctx.facts,
                         rules={"torch-arch-list": ctx.rules["torch-arch-list"]})
    hit = rules.check_cell(only, arch="aarch64", cuda="12.6", gpu="blackwell", attention="sdpa", variant="cu126")
    assert hit[0] == "torch-arch-list" and "10.0, 12.0" in hit[1]
    assert rules.check_cell(only, arch="aarch64", cuda="12.6", gpu="ampere", attention="fa2",
                            variant="cu126") is None


def test_disabled_rules_do_not_apply(ctx):
    none = rules.Context(data=ctx.data, stacks=ctx.stacks, facts=ctx.facts, rules={})
    assert rules.check_cell(none, arch="x86_64", cuda="12.9", gpu="ampere", attention="fa3", variant="cu129") is None


@pytest.mark.parametrize("change, rule, detail", [
    ({"torch": "2.14.0"}, "vllm-pins-torch", "pins torch==2.13.0"),
    ({"vllm": "0.30.0"}, "vllm-pins-torch", "no recorded torch pin"),
    ({"vllm": "0.33.0", "torch": "2.14.0"}, "trl-vllm-extra", "vllm>=0.22.0,<=0.31.0"),
    ({"transformers": "5.18.0"}, "vllm-transformers", "transformers>=5.10.4,<5.18"),
    ({"trl": "9.9.9"}, "trl-vllm-extra", "no recorded vllm range"),
])
def test_stack_consistency(ctx, change, rule, detail):
    pins = dict(ctx.stacks["gpu"], **change)
    hit = rules.check_stack(ctx, pins)
    assert hit is not None and hit[0] == rule and detail in hit[1], hit


def test_real_gpu_stack_is_consistent(ctx):
    assert rules.check_stack(ctx, ctx.stacks["gpu"]) is None
    assert rules.check_stack(ctx, {"torch": "2.13.0"}) is None   # no vLLM, nothing to check


@pytest.mark.parametrize("change, rule, detail", [
    ({"verl": "0.9.1", "transformers": "5.10.4"}, "verl-fits", None),
    ({"verl": "0.9.1"}, "verl-fits", "transformers 5.17.0 is outside verl's transformers>=5.5.3,<5.11,!=5.6.0"),
    ({"verl": "0.9.0", "transformers": "5.10.4"}, "verl-fits", "verl is pinned 0.9.0, its facts are for 0.9.1"),
    ({"transformers": "5.10.4"}, "verl-fits", "verl is pinned nowhere"),
    ({"unsloth": "2026.10.9", "trl": "1.15.0", "datasets": "4.8.5"}, "unsloth-fits", None),
    ({"unsloth": "2026.10.9", "datasets": "4.8.5"}, "unsloth-fits", "trl 1.16.0 is outside unsloth's trl"),
    ({"unsloth": "2026.10.9", "trl": "1.15.0", "datasets": "4.4.1"}, "unsloth-fits", "datasets 4.4.1 is outside"),
])
def test_flavour_rules_check_pins_against_the_packages_metadata(ctx, change, rule, detail):
    """A flavour rule ([flavour.NAME] rules) holds the flavour's pins to [facts] PACKAGE: its own version, then each
    Requires-Dist range the stack pins."""
    hit = rules.check_flavour(ctx, rule, dict(ctx.stacks["gpu"], **change))
    if detail is None:
        assert hit is None, hit
    else:
        assert hit is not None and hit[0] == rule and detail in hit[1], hit


def test_a_flavour_rule_without_its_facts_is_a_finding(ctx):
    bare = rules.Context(data=ctx.data, stacks=ctx.stacks, facts={}, rules=ctx.rules)
    assert rules.check_flavour(bare, "verl-fits", {"verl": "0.9.1"}) == ("verl-fits", "no [facts] verl table to check "
                                                                         "the pins against")
