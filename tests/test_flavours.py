"""Flavours (issue 21 item 1): [flavour.NAME] cells in the matrix, their rules and errors, and the smoke cell's flavour
(the unsloth flavour's shape: the TRL and datasets Unsloth needs, see matrix.toml) built for real FROM the session's
smoke image (every base layer shared, the flavour lock installed)."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import pytest

from builder import engine as eng, render
from builder.errors import UserError
from builder.lock import state
from builder.matrix import load_matrix
from builder.paths import ROOT
from enginefix import BUILD_TIMEOUT, docker, torch_wheelhouse

M = load_matrix(ROOT / "matrix.toml")
SMOKE_FLAVOUR = next(c for c in M.cells if c.flavour == "unsloth-stack" and c.base.tag == "smoke-x86_64")


def build(*args):
    return subprocess.run([sys.executable, str(ROOT / "build.py"), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_pins(path) -> dict[str, str]:
    """name -> version of every entry of a hash-locked file."""
    return {norm(m[1]): m[2] for m in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", path.read_text(), re.M)}


# ------------------------------------------------------------------------------------------------ matrix, CLI
def test_list_shows_the_unsloth_and_verl_flavour_cells():
    p = build("--list")
    assert p.returncode == 0, p.stderr
    tags = [ln.split()[0] for ln in p.stdout.splitlines()]
    for flavour in ("unsloth", "verl"):
        for gpu in ("ampere", "hopper", "blackwell"):
            for arch in ("x86_64", "aarch64"):
                assert f"cu130-{gpu}-{arch}-{flavour}" in tags, (flavour, gpu, arch)
    assert "smoke-x86_64-unsloth-stack" in tags and not any(t.startswith("smoke-aarch64-") for t in tags)
    assert not any(t.startswith("cu129-") and t.endswith(("-unsloth", "-verl")) for t in tags)  # no lock from here
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("cu130-hopper-x86_64-unsloth "))
    assert "trl=1.15.0" in line and "vllm=0.31.0" in line and "transformers=5.17.0" in line
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("cu130-hopper-aarch64-verl "))
    assert "transformers=5.10.4" in line and "trl=1.16.0" in line


def test_selecting_a_flavour_cell_by_name_or_tag():
    assert [c.tag for c in M.select(names=["cu130-hopper-verl"])] == ["cu130-hopper-x86_64-verl",
                                                                      "cu130-hopper-aarch64-verl"]
    assert [c.tag for c in M.select(names=["smoke-unsloth-stack"])] == ["smoke-x86_64-unsloth-stack"]
    c = SMOKE_FLAVOUR
    assert c.name == "smoke-unsloth-stack" and c.base_image == "trainbox:smoke-x86_64"
    assert c.venv == "smoke-x86_64-unsloth-stack" and c.pins["trl"] == "1.15.0" and c.pins["datasets"] == "4.8.5"
    assert c.attention_lock is None and not c.has_compile_stage  # the attention layer comes with the base image


def test_explain_gives_each_flavours_rules_and_reasons():
    p = build("--explain")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    for flavour, rule in (("unsloth", "unsloth-fits"), ("verl", "verl-fits")):
        i = next(i for i, ln in enumerate(lines) if ln.startswith(f"flavour {flavour}: "))
        block = []
        for ln in lines[i + 1:]:
            if not ln.startswith("  rule="):
                break
            block.append(ln)
        assert any(ln.startswith(f"  rule={rule}: fits — ") and M.rules[rule] in ln for ln in block), block
        assert any(ln.startswith("  rule=vllm-transformers: fits — ") for ln in block), block
    assert "pins datasets 4.8.5, trl 1.15.0, unsloth 2026.10.9, unsloth-zoo 2026.10.9" in p.stdout
    assert "pins hydra-core 1.3.8, transferqueue 0.1.11, transformers 5.10.4, verl 0.9.1; builds from a source " \
        "archive (by its locked hash, no wheel published): antlr4-python3-runtime" in p.stdout


def test_flavour_locks_are_fresh_and_hold_the_pins():
    for c in (c for c in M.cells if c.flavour):
        assert state(c) == "fresh", c.tag
        pins = lock_pins(ROOT / c.lock)
        for pkg, version in c.pins.items():
            assert pins[norm(pkg)] == c.requirement(pkg).split("==")[1], (c.tag, pkg)
    verl = lock_pins(ROOT / "locks/cu130-gpu-x86_64-verl.txt")
    assert verl["hydra-core"] == "1.3.8" and verl["ray"] == "2.60.0" and verl["transferqueue"] == "0.1.11"
    assert "xformers" in lock_pins(ROOT / "locks/cu130-gpu-x86_64-unsloth.txt")
    assert "xformers" not in lock_pins(ROOT / "locks/cu130-gpu-aarch64-unsloth.txt")  # unsloth's marker: x86_64


@pytest.mark.network
def test_only_a_flavours_sdists_may_come_from_source_archives():
    """The verl lock takes antlr4-python3-runtime (published as a source archive only) by its one hash; every other
    lock stays wheels-only (uv --no-build), and without `sdists` hydra-core 1.3.8 does not resolve at all."""
    from builder.lock import compile_lock, wheels_only
    verl = next(c for c in M.cells if c.flavour == "verl" and c.arch == "x86_64")
    assert verl.sdists == ("antlr4-python3-runtime",)
    assert wheels_only(verl) == ["--only-binary", ":all:", "--no-binary", "antlr4-python3-runtime"]
    assert all(wheels_only(c) == ["--no-build"] for c in M.cells if c.flavour != "verl")
    entry = re.search(r"^antlr4-python3-runtime==4\.9\.3 \\\n((?:\s+--hash=\S+.*\n)+)",
                      (ROOT / verl.lock).read_text(), re.M)
    assert entry and entry.group(1).count("--hash=sha256:") == 1, "one source archive, one hash"
    with pytest.raises(UserError, match="antlr4-python3-runtime"):
        compile_lock(dataclasses.replace(verl, sdists=()))


def test_committed_flavour_files_are_the_render():
    for c in (c for c in M.cells if c.flavour):
        assert (ROOT / c.dockerfile).read_text() == render.render(c), c.tag
        assert json.loads((ROOT / c.dockerfile.parent / "image.json").read_text()) == render.image_record(c)
    text = render.render(SMOKE_FLAVOUR)
    assert "FROM ${BASE_IMAGE}" in text and "ARG BASE_IMAGE=trainbox:smoke-x86_64" in text
    assert "PIP_CONSTRAINT= UV_CONSTRAINT= /opt/venv/bin/python -m pip install --no-cache-dir --require-hashes" in text
    assert "COPY --chown=1000:1000 images/notebooks/unsloth/ /workspace/notebooks/" in text
    assert 'CMD ["jupyter"]' in text and "python -m trainbox.helpcache" in text


FLAVOUR_ANCHOR = ('packages = { verl = "0.9.1", transformers = "5.10.4", hydra-core = "1.3.8", '
                  'transferqueue = "0.1.11" }')
SDISTS = 'sdists = ["antlr4-python3-runtime"]'


@pytest.mark.parametrize("old, new, needles", [
    ('cells = ["cu130-ampere", "cu130-hopper", "cu130-blackwell"]\npackages = { verl',
     'cells = ["cu130-ampere", "cu130-nope"]\npackages = { verl',
     ["flavour.verl.cells", "unknown base cell 'cu130-nope'"]),
    (FLAVOUR_ANCHOR, FLAVOUR_ANCHOR.replace('"0.9.1"', '">=0.9"'), ["flavour.verl.packages.verl", "one exact version"]),
    (FLAVOUR_ANCHOR, FLAVOUR_ANCHOR.replace('"0.9.1"', '"banana"'), ["flavour.verl.packages.verl", "not a version"]),
    (FLAVOUR_ANCHOR, FLAVOUR_ANCHOR + '\nremove = ["no-such-package"]', ["flavour.verl.remove", "'no-such-package'"]),
    (FLAVOUR_ANCHOR, FLAVOUR_ANCHOR.replace('"5.10.4"', '"5.17.0"'), ["rule 'verl-fits'", "transformers 5.17.0"]),
    (FLAVOUR_ANCHOR, FLAVOUR_ANCHOR.replace('"5.10.4"', '"5.9.0"'), ["rule 'vllm-transformers'", "5.9.0"]),
    ('rules = ["verl-fits"]', 'rules = ["verl-fitz"]', ["flavour.verl.rules", "unknown flavour rule"]),
    (SDISTS, 'sdists = ["antlr4 python3 runtime"]', ["flavour.verl.sdists", "package name"]),
    (SDISTS, 'sdists = "antlr4-python3-runtime"', ["flavour.verl: sdists must be an array"]),
    (SDISTS, 'sdists = [3]', ["flavour.verl.sdists"]),
    ('datasets = "4.8.5" }\nfiles = { "images/notebooks/unsloth"',
     'datasets = "4.8.5" }\nfiles = { "images/notebooks/nope"',
     ["flavour.unsloth-stack.files", "not in the repository"]),
    ('cmd = ["jupyter"]\n\n[flavour.verl]', 'cmd = ["jupyter; rm -rf /"]\n\n[flavour.verl]',
     ["flavour.unsloth-stack.cmd", "one plain word"]),
])
def test_a_bad_flavour_is_one_error_line_exit_2_nothing_written(tmp_path, old, new, needles):
    text = (ROOT / "matrix.toml").read_text()
    assert text.count(old) == 1, old
    bad = tmp_path / "matrix.toml"
    bad.write_text(text.replace(old, new))
    out = tmp_path / "out"
    p = build("--matrix", str(bad), "--dry-run", "--output-dir", str(out))
    assert p.returncode == 2, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr, p.stderr
    for n in needles:
        assert n in p.stderr, p.stderr
    assert not out.exists()


def test_a_flavour_build_adds_its_base_cell_first_unless_given():
    from builder import cli
    cells, bases = cli.with_bases([SMOKE_FLAVOUR], M, {}, "127.0.0.1:5555/x")
    assert [c.tag for c in cells] == ["smoke-x86_64", "smoke-x86_64-unsloth-stack"]
    assert bases == {"trainbox:smoke-x86_64": "127.0.0.1:5555/x:smoke-x86_64"}   # the ref the base build tags
    cells, bases = cli.with_bases([SMOKE_FLAVOUR], M, {"trainbox:smoke-x86_64": "mine:1"}, None)
    assert [c.tag for c in cells] == ["smoke-x86_64-unsloth-stack"] and bases == {"trainbox:smoke-x86_64": "mine:1"}


# ------------------------------------------------------------------------------------------------ a real build
@pytest.fixture(scope="module")
def flavour_build(smoke_build, smoke_image):  # noqa: F811
    """The smoke cell's flavour, built FROM the session's smoke image."""
    c = SMOKE_FLAVOUR
    return eng.build_cell(c, builder=eng.choose_builder("auto"), bases={c.base_image: smoke_image},
                          wheelhouse=torch_wheelhouse(c.requirement("torch")))


def _inspect(ref: str) -> dict:
    return json.loads(docker("image", "inspect", ref).stdout)[0]


@pytest.mark.engine
@pytest.mark.timeout(BUILD_TIMEOUT)
def test_smoke_flavour_shares_every_base_layer_and_installs_its_lock(flavour_build, smoke_image):  # noqa: F811
    base, flav = _inspect(smoke_image), _inspect(flavour_build.refs[0])
    base_layers, layers = base["RootFS"]["Layers"], flav["RootFS"]["Layers"]
    assert layers[:len(base_layers)] == base_layers          # every layer of the base, byte for byte
    assert 0 < len(layers) - len(base_layers) <= 6, len(layers) - len(base_layers)
    cfg = flav["Config"]
    labels = cfg["Labels"]
    assert labels["io.trainbox.flavour"] == "unsloth-stack" and labels["io.trainbox.base_tag"] == "smoke-x86_64"
    assert cfg["Cmd"] == ["jupyter"] and cfg["User"] == "1000:1000"
    probe = ("import importlib.metadata as m, json, glob; "
             "print(json.dumps({'dists': {d.metadata['Name']: d.version for d in m.distributions()}, "
             "'record': json.load(open('/etc/trainbox/image.json')), "
             "'constraints': open('/etc/trainbox/constraints.txt').read().split(), "
             "'notebooks': sorted(glob.glob('/workspace/notebooks/*.ipynb'))}))")
    out = json.loads(docker("run", "--rm", "--entrypoint", "/opt/venv/bin/python", flavour_build.refs[0], "-c",
                            probe).stdout)
    installed = {norm(k): v for k, v in out["dists"].items()}
    want = lock_pins(ROOT / SMOKE_FLAVOUR.lock)
    wrong = {k: (v, installed.get(k)) for k, v in want.items() if installed.get(k) != v}
    assert not wrong, wrong                                   # the flavour lock, entry for entry
    assert installed["trl"] == "1.15.0" and installed["datasets"] == "4.8.5"
    assert set(installed) - set(want) <= {"pip", "setuptools"}, set(installed) - set(want)
    assert out["record"]["versions"]["trl"] == "1.15.0" and out["record"]["flavour"] == "unsloth-stack"
    assert "trl==1.15.0" in out["constraints"] and "datasets==4.8.5" in out["constraints"]
    assert out["notebooks"] == ["/workspace/notebooks/Llama3.1_(8B)-GRPO.ipynb"]
