"""matrix.toml -> cells: the contract other pieces code against, selection, and validation errors."""
import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

from brokenmatrix import defect_line, write_broken
from builder.errors import UserError
from builder.matrix import Cell, load_matrix
from builder.paths import ROOT


@pytest.fixture(scope="module")
def m():
    return load_matrix(ROOT / "matrix.toml")


def write(tmp_path, text, name="matrix.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def base_text():
    return (ROOT / "matrix.toml").read_text()


def test_every_arch_gpu_pair_has_a_cell(m):
    pairs = {(c.arch, c.gpu) for c in m.cells if c.gpu}
    for arch in ("x86_64", "aarch64"):
        for gpu in ("ampere", "hopper", "blackwell"):
            assert (arch, gpu) in pairs, f"no cell for {arch} + {gpu}"
    assert any(c.tag == "cu129-hopper-aarch64" for c in m.cells)


def test_cell_contract_fields(m):
    for c in m.cells:
        if c.flavour:  # a flavour cell: tests/test_flavours.py
            continue
        assert isinstance(c, Cell)
        assert c.tag == f"{c.name}-{c.arch}"
        assert c.platform == {"x86_64": "linux/amd64", "aarch64": "linux/arm64"}[c.arch]
        assert c.dockerfile == Path("images") / c.tag / "Dockerfile"
        # GPU cells of one CUDA, arch and stack share one venv lock (and so one venv layer); others lock alone.
        venv = f"cu{c.cuda.replace('.', '')}-{c.stack}-{c.arch}" if c.cuda else c.tag
        assert c.venv == venv and c.lock == Path("locks") / f"{venv}.txt"
        assert c.repository == "trainbox"
        assert c.tags[0] == c.tag and all(t.startswith(c.tag + "-") for t in c.version_tags)
        assert c.attention_backend in ("fa3", "fa2", "sdpa")
        assert re.fullmatch(r"3\.\d+", c.python)
        assert all(re.fullmatch(r"[0-9][0-9a-z.]*", v) for v in c.pins.values())
        if c.cuda:
            assert c.gpu and c.min_driver and c.cuda_arch_list and c.base_image.startswith("nvidia/cuda:")
            assert c.cuda in c.base_image and c.torch_variant == "cu" + c.cuda.replace(".", "")
            assert c.python == "3.12" and "ubuntu24.04" in c.base_image
            # The runtime sits on the small CUDA `base` image; compilers only in the devel image of a compile stage.
            assert "-base-" in c.base_image and "-devel-" in c.build_image
            # CUDA minor-version compatibility: any driver of the major family runs the image.
            assert c.min_driver == {"12": "525.60.13", "13": "580.65.06"}[c.cuda.split(".")[0]]
        else:
            assert c.gpu is None and c.min_driver is None and c.cuda_arch_list == ""


def test_cells_are_frozen(m):
    c = m.cells[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.tag = "other"  # type: ignore[misc]


def test_hopper_is_fa3_only_hopper(m):
    for c in m.cells:
        assert (c.attention_backend == "fa3") == (c.gpu == "hopper")
        if c.gpu == "blackwell":
            assert tuple(int(x) for x in c.cuda.split(".")) >= (12, 8)
            assert c.attention_backend == "sdpa"
        if c.gpu == "hopper":
            assert c.cuda_arch_list == "9.0a"


def test_smoke_is_one_name_two_arches_two_profiles(m):
    smoke = {c.arch: c for c in m.cells if c.name == "smoke"}
    assert set(smoke) == {"x86_64", "aarch64"}
    x86, arm = smoke["x86_64"], smoke["aarch64"]
    assert (x86.tag, arm.tag) == ("smoke-x86_64", "smoke-aarch64")
    assert x86.cuda is None and x86.gpu is None and x86.python == "3.11"
    assert x86.pins["torch"] == "2.13.0" and x86.torch_variant == "cpu"
    assert x86.requirement("torch") == "torch==2.13.0+cpu"
    for gpu_only in ("vllm",):
        assert gpu_only not in x86.pins
    assert "torch" not in arm.pins and arm.torch_variant is None
    assert {"jupyterlab", "pyyaml"} <= set(arm.pins)
    assert not any("torch" in t for t in arm.version_tags)


def test_gpu_cells_need_cuda12_variant_builds(m):
    c = next(c for c in m.cells if c.tag == "cu129-hopper-x86_64")
    assert c.requirement("torch") == "torch==2.13.0+cu129"
    assert c.requirement("vllm") == "vllm==0.31.0+cu129"
    assert c.requirement("trl") == "trl==1.16.0"


def test_smoke_pins_agree_with_pyproject_train_extra(m):
    """The host's training stack (pyproject [train]) and the smoke image are the same stack."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    train = pyproject["project"]["optional-dependencies"]["train"]
    smoke = next(c for c in m.cells if c.tag == "smoke-x86_64").pins
    for spec in train:
        name, sep, version = spec.partition("==")
        name = name.strip().lower()
        assert name in smoke, f"pyproject [train] has {name}, the smoke cell doesn't"
        if sep:
            assert smoke[name] == version.strip(), f"{name}: pyproject {version} vs matrix {smoke[name]}"


def test_select(m):
    assert {c.tag for c in m.select(names=["smoke"])} == {"smoke-x86_64", "smoke-aarch64"}
    assert [c.tag for c in m.select(names=["smoke-aarch64"])] == ["smoke-aarch64"]
    aarch = m.select(arch=["aarch64"])
    assert aarch and all(c.arch == "aarch64" for c in aarch)
    both = m.select(arch=["aarch64"], gpu=["hopper"], cuda=["12.9"])
    assert [c.tag for c in both] == ["cu129-hopper-aarch64"]
    assert m.select(cuda=["12.8"]) == []   # a known CUDA version whose cells are all excluded
    with pytest.raises(UserError, match="no cell named 'nope'"):
        m.select(names=["nope"])
    with pytest.raises(UserError, match="--gpu 'volta'"):
        m.select(gpu=["volta"])


def test_exclusions_carry_rule_and_reason(m):
    rules = {(e.arch, e.cuda, e.gpu, e.attention): e for e in m.exclusions}
    e = rules[("x86_64", "12.6", "blackwell", None)]
    assert e.rule == "gpu-min-cuda" and "12.8" in e.reason
    e = rules[(None, None, "ampere", "fa3")]
    assert e.rule == "fa3-hopper-only" and "Hopper" in e.reason
    assert rules[("aarch64", "12.8", "hopper", None)].rule == "torch-variant-exists"
    # nothing excluded is also a cell
    tags = {(c.arch, c.cuda, c.gpu) for c in m.cells}
    assert not any((e.arch, e.cuda, e.gpu) in tags for e in m.exclusions)


@pytest.mark.parametrize("name, needles", [
    ("broken.toml", ["broken.toml", "TOML syntax error"]),
    ("unknown_key.toml", ["unknown_key.toml", "gpu.hopper", "unknown key 'cuda_arch_lst'"]),
    ("unknown_arch.toml", ["expand.arch", "unknown value 'ppc64le'", "x86_64"]),
    ("conflicting_pins.toml", ["stack.gpu", "vllm-pins-torch", "torch==2.14.0"]),
    ("rule_violation.toml", ["cell[1]", "fa3-ampere", "fa3-hopper-only", "Hopper-only"]),
])
def test_broken_matrices(name, needles, tmp_path):
    with pytest.raises(UserError) as err:
        load_matrix(write_broken(name, tmp_path))
    text = str(err.value)
    assert "\n" not in text
    for n in needles:
        assert n in text
    if name == "broken.toml":  # the line of the unclosed array, or where the parser gave up just after it
        line = defect_line(name)
        assert any(f"line {n}," in text or f"line {n})" in text for n in range(line, line + 3)), text


@pytest.mark.parametrize("old, new, needles", [
    ('version = "0.1.0"', 'version = 1', ["naming", "version must be a string"]),
    ('min_cuda = "12.8"', 'min_cuda = "twelve"', ["gpu.blackwell.min_cuda", "not a version"]),
    ('extends = "light"', 'extends = "heavy"', ["stack.train.extends", "unknown stack 'heavy'"]),
    ('[stack.light]\n', '[stack.light]\nextends = "gpu"\n', ["extends itself"]),
    ('trl = "1.16.0"', 'trl = ">=1.16"', ["stack.train.packages.trl", "one exact version"]),
    ('id = "gpu-min-cuda"', 'id = "gpu-max-cuda"', ["rule[1].id", "unknown rule id"]),
    ('tag = "{name}-{arch}"', 'tag = "{name}-{os}"', ["naming.tag", "bad template"]),
    ('tag = "{name}-{arch}"', 'tag = "{name}"', ["two cells have the tag 'cu129-ampere'", "{arch}"]),
    ('schema = 1', 'schema = 2', ["schema 2 is not supported"]),
    ('attention = "sdpa"\nmin_cuda', 'attention = "fa4"\nmin_cuda', ["gpu.blackwell.attention", "'fa4'"]),
    ('trl_vllm_extra = { "1.16.0" = ">=0.22.0,<=0.31.0",', 'trl_vllm_extra = { "1.16.0" = ">=0.22.0,<=0.30.0",',
     ["trl-vllm-extra", "vllm>=0.22.0,<=0.30.0"]),
    # A FlashAttention source at a tag: tags move, and v2.8.3's FA3 is 3.0.0b1, not the pinned 3.0.0.
    ('flash-attention@e2743ab5b3803bb672b16437ba98a3b1d4576c50"', 'flash-attention@v2.8.3"',
     ["attention.fa3.source", "not pinned to a commit", "40-hex commit"]),
    # found by the hypothesis fuzz (test_fuzz_matrix) in a CI rehearsal: a string where a table belongs
    ('prebuilt = { x86_64 = { cu126 = "cu126", cu129 = "cu126", cu130 = "cu130" },', 'prebuilt = { x86_64 = "0",',
     ["attention.fa3.prebuilt.x86_64", "must be a table, got str"]),
    ('probe = ["aarch64"]', 'probe = ["x86_64", "aarch64", "x86_64"]', ["attention.fa3.probe", "duplicate"]),
    # [fabric] goes into apt and ENV lines as it is
    ('packages = ["ibverbs-providers", "ibverbs-utils", "rdmacm-utils"]', 'packages = ["ibverbs-providers", "x; rm"]',
     ["fabric.packages", "not a Debian package name"]),
    ('MELLANOX_VISIBLE_DEVICES = "all"', 'MELLANOX_VISIBLE_DEVICES = "all $HOME"', ["fabric.env", "a plain value"]),
    ('MELLANOX_VISIBLE_DEVICES = "all"', '"MELLANOX-X" = "all"', ["fabric.env name", "environment variable name"]),
    ('env = { MELLANOX_VISIBLE_DEVICES', 'envs = { MELLANOX_VISIBLE_DEVICES', ["fabric", "unknown key 'envs'"]),
])
def test_inconsistent_matrices(tmp_path, old, new, needles):
    text = base_text()
    assert old in text
    with pytest.raises(UserError) as err:
        load_matrix(write(tmp_path, text.replace(old, new, 1)))
    for n in needles:
        assert n in str(err.value)


def test_rule_removed_from_matrix_is_not_applied(tmp_path):
    """Rules are data: dropping [[rule]] gpu-min-cuda makes Blackwell on CUDA 12.6 a cell (still excluded by the
    torch arch list rule, because cu126 wheels carry no sm100 kernels)."""
    text = base_text().replace('[[rule]]\nid = "gpu-min-cuda"', '[[ignored]]\nid = "gpu-min-cuda"')
    with pytest.raises(UserError, match="unknown key 'ignored'"):
        load_matrix(write(tmp_path, text))
    text = re.sub(r'\[\[rule\]\]\nid = "gpu-min-cuda"\nreason = "[^"]*"\n', "", base_text())
    m = load_matrix(write(tmp_path, text))
    e = next(e for e in m.exclusions if (e.arch, e.cuda, e.gpu) == ("x86_64", "12.6", "blackwell"))
    assert e.rule == "torch-arch-list" and "sm 10.0, 12.0" in e.reason


def test_unreadable_and_missing_files(tmp_path):
    with pytest.raises(UserError, match="cannot read the matrix"):
        load_matrix(tmp_path / "missing.toml")
    p = tmp_path / "bin.toml"
    p.write_bytes(b"schema = 1\n\xff\xfe")
    with pytest.raises(UserError, match="not UTF-8"):
        load_matrix(p)
