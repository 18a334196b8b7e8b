"""build.py end to end (subprocess, as a user runs it) and the CLI's wiring to the engine (in-process)."""
import subprocess
import sys
import types
from pathlib import Path

import pytest

from brokenmatrix import write_broken
from builder import cli
from builder.matrix import load_matrix
from builder.paths import ROOT

M = load_matrix(ROOT / "matrix.toml")


def build(*args, cwd=ROOT):
    return subprocess.run([sys.executable, str(ROOT / "build.py"), *args], capture_output=True, text=True, cwd=cwd)


def test_list_shows_every_valid_cell_and_every_arch_gpu_pair():
    p = build("--list")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert len(lines) == len(M.cells)
    for c in M.cells:
        line = next(ln for ln in lines if ln.split()[0] == c.tag)
        assert c.arch in line and f"cuda={c.cuda or '-'}" in line and f"torch={c.pins['torch']}" in line \
            if "torch" in c.pins else c.arch in line
    for arch in ("x86_64", "aarch64"):
        for gpu in ("ampere", "hopper", "blackwell"):
            assert any(f" {arch} " in ln and f"gpu={gpu}" in ln for ln in lines), (arch, gpu)
    assert any(ln.startswith("cu129-hopper-aarch64 ") and "vllm=0.31.0" in ln for ln in lines)


def test_explain_lists_exclusions_with_reasons():
    p = build("--explain")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    fa3 = [ln for ln in out.splitlines() if "attention=fa3" in ln]
    assert any("gpu=ampere" in ln for ln in fa3) and any("gpu=blackwell" in ln for ln in fa3)
    assert all("rule=fa3-hopper-only" in ln and "Hopper-only" in ln for ln in fa3)
    bw = [ln for ln in out.splitlines() if "gpu=blackwell" in ln and "cuda=12.6" in ln]
    assert len(bw) == 2 and all("rule=gpu-min-cuda" in ln and "CUDA >= 12.8" in ln for ln in bw)
    assert "rule=torch-variant-exists" in out and "no cu128 wheels" in out
    assert f"{len(M.exclusions)} excluded combinations" in out
    assert "driver: CUDA 12.6, 12.8, 12.9 images run on any driver >= 525.60.13 (CUDA minor-version" in out
    assert "driver: CUDA 13.0 images run on any driver >= 580.65.06" in out


def test_dry_run_aarch64_writes_only_those_and_prints_a_plan(tmp_path):
    p = build("--arch", "aarch64", "--dry-run", "--output-dir", str(tmp_path))
    assert p.returncode == 0, p.stderr
    written = sorted(str(f.relative_to(tmp_path)) for f in tmp_path.rglob("Dockerfile"))
    expected = sorted(str(c.dockerfile) for c in M.cells if c.arch == "aarch64")
    assert written == expected
    out = p.stdout
    assert out.startswith(f"build plan: {len(expected)} image(s)")
    for c in M.cells:
        assert (f". {c.tag} (linux/arm64, emulated (QEMU))" in out) == (c.arch == "aarch64")
    assert "base: nvidia/cuda:12.9.1-base-ubuntu24.04" in out
    # under emulation the venv stage runs on the base's twin for this host (host-base), natively
    assert "build args: VENV_BASE=host-base HOST_BASE_IMAGE=nvidia/cuda:12.9.1-base-ubuntu24.04@sha256:" in out
    assert " TORCH_INDEX_URL=https://download.pytorch.org/whl/cu129 " \
           "VLLM_INDEX_URL=https://wheels.vllm.ai/0.31.0/cu129 " in out
    assert "lock: locks/cu129-gpu-aarch64.txt (missing: locked automatically before the build (uv pip compile " \
           "for aarch64-manylinux_2_35, python 3.12))" in out
    assert "lock: locks/smoke-aarch64.txt (fresh, used as is)" in out
    assert "tags: trainbox:cu129-hopper-aarch64 trainbox:cu129-hopper-aarch64-v0.1.0" in out
    # No step compiles under emulation: where no prebuilt aarch64 wheel exists the plan refuses, naming the way out.
    compiled = [ln for ln in out.splitlines() if "compiled from source" in ln]
    assert compiled and all("REFUSED here under emulation" in ln for ln in compiled)
    assert "torch: prebuilt wheel torch==2.13.0+cu129 from index torch" in out
    assert "vllm: prebuilt wheel vllm==0.31.0 from the default index" in out   # cu130: the default build
    for f in written:   # identical to the committed files
        assert (tmp_path / f).read_bytes() == (ROOT / f).read_bytes()


def test_dry_run_with_base_substitution(tmp_path):
    cfg = tmp_path / "bases.toml"
    cfg.write_text('[bases]\n"nvidia/cuda:12.9.1-base-ubuntu24.04" = "local/cuda:test"\n'
                   '[index]\nvllm = "https://user:secret@mirror.example/vllm/{vllm}/{variant}"\n')
    p = build("smoke", "cu129-hopper", "--arch", "x86_64", "--dry-run", "--output-dir", str(tmp_path / "out"),
              "--base", "debian:bookworm=127.0.0.1:5000/trainbox/base:bookworm", "--config", str(cfg))
    assert p.returncode == 0, p.stderr
    assert "base: 127.0.0.1:5000/trainbox/base:bookworm (substituted for debian:bookworm)" in p.stdout
    assert "build args: BASE_IMAGE=127.0.0.1:5000/trainbox/base:bookworm VCS_REF=" in p.stdout
    assert "torch: prebuilt wheel torch==2.13.0+cpu from the wheelhouse (or TORCH_INDEX_URL's cpu variant)" in p.stdout
    assert "base: local/cuda:test (substituted for nvidia/cuda:12.9.1-base-ubuntu24.04)" in p.stdout
    # the config's [index] replaces the matrix default; credentials never printed
    assert "index vllm: https://***@mirror.example/vllm/0.31.0/cu129" in p.stdout and "secret" not in p.stdout
    # the rendered file is unchanged by the substitution
    rendered = (tmp_path / "out/images/smoke-x86_64/Dockerfile").read_bytes()
    assert rendered == (ROOT / "images/smoke-x86_64/Dockerfile").read_bytes()


@pytest.mark.parametrize("name", ["broken.toml", "unknown_key.toml", "unknown_arch.toml", "conflicting_pins.toml",
                                  "rule_violation.toml"])
@pytest.mark.parametrize("mode", [["--list"], ["--dry-run"], ["--explain"]])
def test_bad_matrix_exit_2_one_line_nothing_written(tmp_path, name, mode):
    matrix = write_broken(name, tmp_path / "in")
    out = tmp_path / "out"
    p = build("--matrix", str(matrix), *mode, "--output-dir", str(out))
    assert p.returncode == 2
    assert p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and name in lines[0]
    assert "Traceback" not in p.stderr
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("args, needle", [
    (["--arch", "ppc64le", "--list"], "--arch 'ppc64le' is not in the matrix"),
    (["nope", "--list"], "no cell named 'nope'"),
    (["--cuda", "12.8", "--list"], "--cuda 12.8 matches no cell: excluded by rule "),
    (["smoke", "--cuda", "13.0", "--list"], "the selection matches no cell"),   # no rule: the filters exclude it
    (["--base", "justone", "--dry-run"], "expected OLD=NEW"),
    (["--matrix", "/nonexistent/m.toml", "--list"], "cannot read the matrix"),
])
def test_bad_arguments_exit_2(tmp_path, args, needle):
    p = build(*args, "--output-dir", str(tmp_path))
    assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_bad_config_exit_2(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text("[bases]\nx = 1\n")
    p = build("--config", str(cfg), "--list")
    assert p.returncode == 2 and "[bases] must map image names" in p.stderr


def test_help_lists_every_contract_flag():
    out = build("--help").stdout
    for flag in ("--cell", "--arch", "--cuda", "--gpu", "--list", "--explain", "--dry-run", "--lock", "--matrix",
                 "--base", "--quiet", "--push", "--registry", "--wheelhouse", "--builder", "--no-cache", "--report",
                 "--secret", "--sqsh", "--sqsh-compression", "--use-enroot"):
        assert flag in out, flag


def _fake_engine(monkeypatch, module):
    """Stand in for builder.pipeline (the build run) whether or not another test imported the real one already:
    `from builder import pipeline` reads the package attribute first, sys.modules second."""
    import builder

    monkeypatch.setitem(sys.modules, "builder.pipeline", module)
    if module is None:
        monkeypatch.delattr(builder, "pipeline", raising=False)
    else:
        monkeypatch.setattr(builder, "pipeline", module, raising=False)


def test_build_mode_renders_then_calls_the_engine_with_typed_options(tmp_path, monkeypatch):
    from builder import docker
    from builder.options import BuildOptions
    seen = {}
    # --builder buildkit is resolved before anything renders (options.check_buildable): this host's CLIs stand aside.
    monkeypatch.setattr(docker, "choose_builder", lambda requested: docker.Builder(requested, "/usr/bin/docker"))

    def build_cells(cells, opts):
        seen["tags"] = [c.tag for c in cells]
        seen["opts"] = opts
        seen["exists"] = all((tmp_path / c.dockerfile).is_file() for c in cells)
        return 7
    _fake_engine(monkeypatch, types.SimpleNamespace(build_cells=build_cells))
    secret = tmp_path / "token"
    secret.write_text("x")
    cfg = tmp_path / "c.toml"
    cfg.write_text('[bases]\n"nvidia/cuda:12.9.1-base-ubuntu24.04" = "local/cuda:1"\n')
    rc = cli.main(["smoke", "--output-dir", str(tmp_path), "--base", "debian:bookworm=local/b:1", "--push",
                   "--registry", "127.0.0.1:5555/t", "--builder", "buildkit", "--secret", f"id=a,src={secret}", "--sqsh",
                   "--config", str(cfg), "--build-arg", "MAX_JOBS=3"])
    assert rc == 7
    assert seen["tags"] == ["smoke-x86_64", "smoke-aarch64"] and seen["exists"]
    o = seen["opts"]
    assert isinstance(o, BuildOptions)
    # --base and the config's [bases] parsed once into one mapping; nothing turned back into OLD=NEW strings
    assert dict(o.bases) == {"debian:bookworm": "local/b:1", "nvidia/cuda:12.9.1-base-ubuntu24.04": "local/cuda:1"}
    assert o.push and o.registry == "127.0.0.1:5555/t" and o.output_dir == tmp_path
    assert o.builder == "buildkit" and o.secrets == (f"id=a,src={secret}",) and o.sqsh == "out"
    assert dict(o.build_args) == {"MAX_JOBS": "3"}


def test_build_mode_without_engine_exits_1(tmp_path, monkeypatch, capsys):
    _fake_engine(monkeypatch, None)   # import raises ImportError
    assert cli.main(["smoke-x86_64", "--output-dir", str(tmp_path)]) == 1
    assert "build pipeline (builder/pipeline.py) is not available" in capsys.readouterr().err


def test_user_error_from_the_engine_is_one_line(tmp_path, monkeypatch, capsys):
    from builder.errors import UserError

    def build_cells(cells, opts):
        raise UserError("--push needs --registry")
    _fake_engine(monkeypatch, types.SimpleNamespace(build_cells=build_cells))
    assert cli.main(["smoke-x86_64", "--output-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == "error: --push needs --registry\n"


@pytest.mark.parametrize("module", ["builder.publish", "builder.enroot", "builder.slurm", "builder.workflow",
                                    "devenv.bases", "devenv.engine", "devenv.slurm"])
def test_every_module_cli_reports_user_errors_on_one_line(module, capsys, monkeypatch):
    """Each `python -m builder.X` / `devenv.X` goes through errors.reports_user_errors: bad input -> one `error:`
    line, exit 2."""
    import argparse
    import importlib

    from builder.errors import UserError

    mod = importlib.import_module(module)

    def bad_input(self, *a, **k):
        raise UserError("what went wrong", where="where", fix="how to fix")

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", bad_input)
    assert mod.main([]) == 2
    err = capsys.readouterr().err
    assert err == "error: where: what went wrong (how to fix)\n"


def test_dry_run_of_a_cu129_hopper_cell_needs_no_argument():
    """The main job's plan on a fresh clone: every build arg has a value, each index, the lock step, FA3 prebuilt."""
    p = build("cu129-hopper-x86_64", "--dry-run", "--output-dir", str(ROOT))
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "missing required" not in out.lower() and "(required)" not in out
    head = "TORCH_INDEX_URL=https://download.pytorch.org/whl/cu129 VLLM_INDEX_URL=https://wheels.vllm.ai/0.31.0/cu129 "
    assert f"build args: {head}FLASH_INDEX_URL=https://download.pytorch.org/whl/cu126 VCS_REF=" in out
    for name in ("default", "torch", "vllm", "flash"):
        assert f"   index {name}: " in out
    assert "lock: locks/cu129-gpu-x86_64.txt + locks/cu129-hopper-x86_64.attention.txt (" in out
    assert "flash-attn-3: prebuilt wheel flash-attn-3==3.0.0 (cu126 build) from index flash, by hash" in out
    assert "compiled from source" not in out
    p = build("cu129-hopper-x86_64", "--dry-run", "--frozen", "--index", "torch=https://mirror.example/t/{variant}")
    assert "--frozen refuses to build" in p.stdout and "index torch: https://mirror.example/t/cu129" in p.stdout
    bad = build("cu129-hopper-x86_64", "--dry-run", "--index", "pytorch=https://x")
    assert bad.returncode == 2 and "unknown index 'pytorch'" in bad.stderr and len(bad.stderr.splitlines()) == 1


def test_a_source_build_under_emulation_is_refused_before_anything_runs(tmp_path):
    """The ampere aarch64 cells compile FlashAttention 2 (no prebuilt wheel for torch 2.13): on this x86 host
    `--arch aarch64` stops at once (exit 2, one line naming both cells, the way out and the selection that builds the
    rest), before any lock is resolved or any image step runs."""
    from builder import engine
    if engine.host_arch() != "x86_64":
        pytest.skip("the refusal is for a host of another arch")
    p = build("--arch", "aarch64")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    # A flavour of an ampere cell is built FROM it: refused with it.
    assert ("cu129-ampere-aarch64, cu130-ampere-aarch64, cu130-ampere-aarch64-unsloth, cu130-ampere-aarch64-verl "
            "compile flash-attn from source") in p.stderr, p.stderr
    assert "--buildx-builder" in p.stderr
    rest = p.stderr.split("the rest builds here: python build.py ")[1].rstrip().rstrip(")").split()
    assert rest == [c.tag for c in M.cells if c.arch == "aarch64" and c.gpu != "ampere"]
    assert not (ROOT / "locks" / "cu129-gpu-aarch64.txt").exists()


def _tree(root: Path) -> dict:
    """path -> (size, mtime_ns) of every file under ROOT: 'nothing written' compares two of these."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def test_a_foreign_matrix_never_writes_the_committed_images(tmp_path):
    other = tmp_path / "other.toml"
    other.write_text((ROOT / "matrix.toml").read_text())
    before = _tree(ROOT / "images"), _tree(ROOT / "locks")
    p = build("--matrix", str(other), "smoke", "--dry-run")
    assert p.returncode == 0, p.stderr
    assert (_tree(ROOT / "images"), _tree(ROOT / "locks")) == before
    said = [ln for ln in p.stderr.splitlines() if "rendering into" in ln]
    assert len(said) == 1, p.stderr
    out = Path(said[0].split("rendering into ", 1)[1].split(" (")[0])
    try:
        assert (out / "images/smoke-x86_64/Dockerfile").read_bytes() == \
            (ROOT / "images/smoke-x86_64/Dockerfile").read_bytes()
        assert f"context = the repository with images/ and locks/ from {out}" in p.stdout
        # the repository's fresh lock serves the same cell: copied, not re-resolved
        assert (out / "locks/smoke-x86_64.txt").read_bytes() == (ROOT / "locks/smoke-x86_64.txt").read_bytes()
        assert "lock: locks/smoke-x86_64.txt (fresh, used as is)" in p.stdout
    finally:
        import shutil
        shutil.rmtree(out, ignore_errors=True)
    given = build("--matrix", str(other), "smoke", "--dry-run", "-q", "--output-dir", str(tmp_path / "given"))
    assert given.returncode == 0 and (tmp_path / "given/images/smoke-aarch64/Dockerfile").is_file()
    refused = build("--matrix", str(other), "smoke", "--dry-run", "--output-dir", str(ROOT))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert len(refused.stderr.splitlines()) == 1 and "choose another --output-dir" in refused.stderr
    assert (_tree(ROOT / "images"), _tree(ROOT / "locks")) == before


@pytest.mark.parametrize("args, needle", [
    (["--registry", "127.0.0.1:5555/t"], "--registry 127.0.0.1:5555/t without --push: nothing would be pushed (add "
                                         "--push"),
    (["--push"], "--push needs --registry HOST[:PORT]/REPO (e.g. --registry 127.0.0.1:5555/trainbox)"),
    (["--base", "debian:bookworm=Local/Base:1"], "--base: 'Local/Base:1' is not an image reference"),
    (["--build-arg", "1X=2"], "--build-arg '1X=2': expected KEY=VALUE"),
    (["--secret", "id=a,src=/nonexistent/token"], "file /nonexistent/token does not exist"),
])
def test_build_inputs_refused_before_any_work(tmp_path, args, needle):
    """Checked when the options are made, before a file is rendered or an engine is asked (DOCKER_HOST: nothing)."""
    env = {**__import__("os").environ, "DOCKER_HOST": "unix:///nonexistent/trainbox.sock"}
    p = subprocess.run([sys.executable, str(ROOT / "build.py"), "smoke-x86_64", "--output-dir", str(tmp_path / "o"),
                        *args], capture_output=True, text=True, cwd=ROOT, env=env)
    assert p.returncode == 2 and p.stdout == "" and "Traceback" not in p.stderr
    assert p.stderr.count("\n") == 1 and p.stderr.startswith("error: ") and needle in p.stderr, p.stderr
    assert not (tmp_path / "o").exists()


def test_no_engine_names_make_engine(tmp_path):
    """DOCKER_HOST pointing at nothing: one line naming `make engine`, before any lock or build step."""
    env = {**__import__("os").environ, "DOCKER_HOST": "unix:///nonexistent/trainbox.sock"}
    p = subprocess.run([sys.executable, str(ROOT / "build.py"), "smoke-x86_64", "--output-dir", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, env=env)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no Docker engine answers at unix:///nonexistent/trainbox.sock")
    assert "`make engine`" in err[0]
    assert "DEPRECATED" not in p.stdout + p.stderr and "lock:" not in p.stdout


@pytest.mark.parametrize("extra, reaches_lock", [
    ([], False),
    (["--wheelhouse", "{wh}"], True),
    (["--build-arg", "TORCH_INDEX_URL=http://127.0.0.1:9/whl"], True),
])
def test_a_cpu_torch_build_without_its_wheel_is_one_short_line(tmp_path, monkeypatch, capsys, extra, reaches_lock):
    """Issue 64 case 3: `build.py --cell smoke --base debian:bookworm=...` without --wheelhouse stopped in the deps
    stage after the base stage's minutes, its message the whole RUN step (1,500 characters). Now one short line naming
    --wheelhouse, before the lock step; with the wheel, or an index for it, the build goes on."""
    from builder import engine, lock, pipeline
    from builder.errors import UserError

    wh = tmp_path / "wheels"
    wh.mkdir()
    (wh / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    monkeypatch.setattr(engine, "ROOT", tmp_path)          # the repository's wheelhouse/: empty here
    monkeypatch.setattr(pipeline, "choose_builder", lambda kind: types.SimpleNamespace(kind="buildkit", cli="docker"))
    monkeypatch.setattr(pipeline, "check_engine", lambda builder: None)

    def lock_step(*a, **k):
        raise UserError("reached the lock step")
    monkeypatch.setattr(lock, "ensure", lock_step)
    rc = cli.main(["--cell", "smoke", "--arch", "x86_64", "--base", "debian:bookworm=local/b:1",
                   "--output-dir", str(tmp_path / "o"), *(a.format(wh=wh) for a in extra)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    if reaches_lock:
        assert "reached the lock step" in err
    else:
        assert "cell smoke-x86_64 needs the wheel torch-2.13.0+cpu-*.whl" in err and "--wheelhouse" in err
        assert len(err) < 300, len(err)


@pytest.mark.parametrize("e", [e for e in M.exclusions if e.attention is None], ids=lambda e: e.describe())
def test_an_excluded_combination_names_its_rule_and_explain(e, tmp_path, capsys):
    """Issue 64 case 7: asking for a combination the rules exclude (an excluded CUDA 12.6/12.8 cell) said only "the
    selection matches no cell". Every excluded arch/CUDA/GPU combination of the matrix, asked for by its filters: one
    line naming the rule's id, this combination's reason and --explain; nothing written."""
    args = [a for flag, v in (("--arch", e.arch), ("--cuda", e.cuda), ("--gpu", e.gpu)) if v for a in (flag, v)]
    assert cli.main([*args, "--dry-run", "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "matches no cell" in err, err
    assert f"rule {e.rule}: " in err and e.detail in err and "python build.py --explain" in err, err
    assert not (tmp_path / "o").exists()


def test_a_registry_build_also_tags_the_local_name(monkeypatch, capsys):
    """Issue 64 case 1: after `make build` (--push --registry REG/trainbox) `docker run trainbox:smoke-x86_64` found no
    image: only REG/trainbox:TAG was tagged. build.py's builds now tag the plain local names too; only the registry's
    refs are pushed. The engine is a stand-in recording tags."""
    from builder import engine, lock, pipeline, publish

    tagged, pushed = [], []
    image = types.SimpleNamespace(id="sha256:built", architecture="amd64", size=1,
                                  root_fs=types.SimpleNamespace(layers=["sha256:l"]))
    client = types.SimpleNamespace(image=types.SimpleNamespace(
        inspect=lambda ref: image, exists=lambda ref: False, tag=lambda iid, ref: tagged.append(ref),
        remove=lambda ref, prune=False: None))
    monkeypatch.setattr(pipeline, "choose_builder",
                        lambda kind: types.SimpleNamespace(kind="buildkit", cli="docker", client=lambda: client))
    monkeypatch.setattr(pipeline, "check_engine", lambda builder: None)
    monkeypatch.setattr(lock, "ensure", lambda *a, **k: None)
    monkeypatch.setattr(engine, "build_image", lambda **k: ("sha256:built", []))
    monkeypatch.setattr(publish, "push_all", lambda cells, results, *a, **k: pushed.extend(results[0].refs))
    monkeypatch.setattr(pipeline.report, "emit", lambda *a, **k: None)
    repo = "127.0.0.1:5555/trainbox"
    assert cli.main(["smoke-x86_64", "--push", "--registry", repo, "--quiet",
                     "--build-arg", "TORCH_INDEX_URL=http://127.0.0.1:9/never-asked"]) == 0, capsys.readouterr().err
    cell = M.select(["smoke-x86_64"])[0]
    tags = [cell.tag, *cell.version_tags]
    assert pushed == [f"{repo}:{t}" for t in tags]
    assert sorted(tagged) == sorted([*pushed, *(f"trainbox:{t}" for t in tags)])
