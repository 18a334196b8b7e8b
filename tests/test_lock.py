"""Per-cell hash locks: present and fresh for what can be locked here, GPU cells skipped with a clear reason."""
import dataclasses
import hashlib
import re
from pathlib import Path

import pytest

from builder import lock
from builder.matrix import ROOT, load_matrix

M = load_matrix(ROOT / "matrix.toml")
CELLS = {c.tag: c for c in M.cells}
LOCKABLE_HERE = ("smoke-x86_64", "smoke-aarch64")   # no extra index needed
CPU_TORCH = Path("/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl")


def parse(text: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes) from a `uv pip compile --generate-hashes` file."""
    out, current = {}, None
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)", line)
        if m:
            current = m.group(1).lower()
            out[current] = (m.group(2), [])
        for h in re.findall(r"--hash=sha256:([0-9a-f]{64})", line):
            out[current][1].append(h)
    return out


@pytest.mark.parametrize("tag", LOCKABLE_HERE)
def test_lock_exists_is_fresh_and_covers_the_pins(tag):
    cell = CELLS[tag]
    path = ROOT / cell.lock
    assert path.is_file(), f"missing {cell.lock}: run `python build.py --lock {tag}`"
    assert lock.is_fresh(cell), f"{cell.lock} is stale (matrix pins changed): run `python build.py --lock {tag}`"
    text = path.read_text()
    assert text.startswith(f"# trainbox lock for cell {tag} ({cell.uv_platform}, python {cell.python})")
    reqs = parse(text)
    for pkg in cell.pins:
        assert pkg in reqs, pkg
        assert reqs[pkg][0] == cell.requirement(pkg).split("==")[1]
    assert all(hashes for _, hashes in reqs.values()), "a requirement without a hash fails --require-hashes"
    # Machine-specific paths must not leak into a committed lock.
    assert "/opt/" not in text and "/work/" not in text and "file://" not in text


def test_smoke_x86_64_locks_the_local_cpu_torch_wheel():
    reqs = parse((ROOT / CELLS["smoke-x86_64"].lock).read_text())
    version, hashes = reqs["torch"]
    assert version == "2.13.0+cpu"
    assert not any(name.startswith("nvidia-") for name in reqs), "CPU torch must not pull CUDA packages"
    if CPU_TORCH.is_file():
        assert hashlib.sha256(CPU_TORCH.read_bytes()).hexdigest() in hashes


def test_smoke_aarch64_is_the_light_profile():
    reqs = parse((ROOT / CELLS["smoke-aarch64"].lock).read_text())
    assert "torch" not in reqs and "jupyterlab" in reqs and "pyyaml" in reqs


def test_no_stale_or_orphan_locks():
    for p in (ROOT / "locks").glob("*.txt"):
        tag = p.stem
        assert tag in CELLS, f"{p} belongs to no cell"
        assert lock.is_fresh(CELLS[tag]), f"{p} is stale"


def test_digest_follows_the_inputs():
    cell = CELLS["smoke-aarch64"]
    changed = dataclasses.replace(cell, pins={**cell.pins, "jupyterlab": "4.6.5"})
    assert lock.inputs_digest(changed) != lock.inputs_digest(cell)
    assert not lock.is_fresh(changed)
    other_py = dataclasses.replace(cell, python="3.12")
    assert lock.inputs_digest(other_py) != lock.inputs_digest(cell)
    assert lock.inputs_digest(cell) == lock.inputs_digest(dataclasses.replace(cell))


def test_gpu_cells_need_their_indexes(monkeypatch):
    monkeypatch.delenv("TORCH_INDEX_URL", raising=False)
    monkeypatch.delenv("VLLM_INDEX_URL", raising=False)
    cell = CELLS["cu129-hopper-aarch64"]
    assert lock.indexes(cell) == ["TORCH_INDEX_URL", "VLLM_INDEX_URL"]
    with pytest.raises(lock.Skip, match=r"needs TORCH_INDEX_URL and VLLM_INDEX_URL \(torch 2\.13\.0\+cu129"):
        lock.compile_lock(cell)
    assert lock.indexes(CELLS["smoke-x86_64"]) == []


def test_lock_cells_names_what_it_skipped(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TORCH_INDEX_URL", raising=False)
    monkeypatch.delenv("VLLM_INDEX_URL", raising=False)
    real = lock.compile_lock

    def offline(cell):
        if not lock.indexes(cell):
            return "# fake lock\n"   # keeps this test off the network; the real resolve is tested below
        return real(cell)
    monkeypatch.setattr(lock, "compile_lock", offline)
    gpu = [CELLS["cu129-hopper-x86_64"], CELLS["cu126-ampere-aarch64"]]
    assert lock.lock_cells(gpu, root=tmp_path) == 1
    assert not any(tmp_path.rglob("*"))
    err = capsys.readouterr().err
    assert "skipped cu129-hopper-x86_64: needs TORCH_INDEX_URL" in err and "skipped cu126-ampere-aarch64" in err
    assert lock.lock_cells([CELLS["smoke-aarch64"], *gpu], root=tmp_path) == 0
    assert sorted(p.name for p in (tmp_path / "locks").iterdir()) == ["smoke-aarch64.txt"]
    assert "1 locked, 2 skipped" in capsys.readouterr().err


def test_relock_reproduces_the_committed_pins(tmp_path):
    """A real resolve for the aarch64 smoke cell from an x86 host (default index; no torch)."""
    cell = CELLS["smoke-aarch64"]
    try:
        text = lock.compile_lock(cell)
    except Exception as e:  # noqa: BLE001 - only a network failure may skip this
        if re.search(r"(?i)connect|network|dns|timed out|fetch", str(e)):
            pytest.skip(f"package index unreachable: {e}")
        raise
    new, old = parse(text), parse((ROOT / cell.lock).read_text())
    for pkg in cell.pins:
        assert new[pkg][0] == old[pkg][0]
        assert set(old[pkg][1]) <= set(new[pkg][1]) or set(new[pkg][1]) <= set(old[pkg][1])
    assert lock.recorded_digest(_write(tmp_path, text)) == lock.inputs_digest(cell)


def _write(tmp_path, text):
    p = tmp_path / "x.txt"
    p.write_text(text)
    return p


# ---- the matrix's facts, re-checked against package metadata (resolution only, nothing large is downloaded) ----
def _resolve(reqs: list[str], platform: str, python: str = "3.12") -> tuple[int, str]:
    import os
    import subprocess
    env = dict(os.environ, SSL_CERT_FILE="/etc/ssl/certs/ca-certificates.crt", UV_NATIVE_TLS="1")
    p = subprocess.run([lock.uv_binary(), "pip", "compile", "-", "--quiet", "--no-header", "--no-annotate",
                        "--python-version", python, "--python-platform", platform],
                       input="\n".join(reqs) + "\n", capture_output=True, text=True, env=env)
    if p.returncode != 0 and re.search(r"(?i)failed to fetch|connect|dns|timed out|network", p.stderr):
        pytest.skip(f"package index unreachable: {p.stderr.strip()[:200]}")
    return p.returncode, p.stdout + p.stderr


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_fact_default_torch_is_a_cuda13_build(arch):
    """Why every CUDA-12 cell needs TORCH_INDEX_URL: the default index's torch 2.13.0 pulls CUDA 13 packages."""
    rc, out = _resolve(["torch==2.13.0"], f"{arch}-manylinux_2_28")
    assert rc == 0, out
    assert re.search(r"^nvidia-cudnn-cu13==", out, re.M) and not re.search(r"^nvidia-\S+-cu12==", out, re.M)


def test_fact_vllm_pins_torch_and_transformers_fits():
    m = load_matrix(ROOT / "matrix.toml")
    gpu = next(c for c in m.cells if c.gpu).pins
    rc, out = _resolve([f"vllm=={gpu['vllm']}", f"transformers=={gpu['transformers']}", f"trl[vllm]=={gpu['trl']}"],
                       "x86_64-manylinux_2_28")
    assert rc == 0, out
    assert f"\ntorch=={gpu['torch']}\n" in "\n" + out
    assert re.search(r"^cuda-toolkit==13\.", out, re.M), "vLLM's default build is CUDA 13: CUDA-12 cells need +cu12x"


def test_fact_trl_vllm_extra_rejects_newer_vllm():
    rc, out = _resolve(["trl[vllm]==1.16.0", "vllm==0.33.0"], "x86_64-manylinux_2_28")
    assert rc != 0 and "No solution found" in out


def test_fact_stack_needs_python_311():
    """Why GPU cells use Ubuntu 24.04 bases (python 3.12): the 22.04 images' python 3.10 can't carry trl 1.16."""
    rc, out = _resolve(["trl==1.16.0"], "x86_64-manylinux_2_28", python="3.10")
    assert rc != 0 and "Python>=3.11" in out.replace(" ", "")


def _fake_wheel(index: Path, name: str, version: str, tag: str, requires=()) -> str:
    """A minimal valid wheel in a PEP 503 file:// index; returns its sha256."""
    import zipfile
    dist = f"{name}-{version}"
    files = {f"{name}/__init__.py": "",
             f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                           + "".join(f"Requires-Dist: {r}\n" for r in requires),
             f"{dist}.dist-info/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: {tag}\n"}
    files[f"{dist}.dist-info/RECORD"] = "".join(f"{k},,\n" for k in files) + f"{dist}.dist-info/RECORD,,\n"
    d = index / name
    d.mkdir(parents=True)
    fn = f"{dist}-{tag}.whl"
    with zipfile.ZipFile(d / fn, "w") as z:
        for k, v in sorted(files.items()):
            z.writestr(zipfile.ZipInfo(k, (2020, 1, 1, 0, 0, 0)), v)
    digest = hashlib.sha256((d / fn).read_bytes()).hexdigest()
    (d / "index.html").write_text(f'<html><body><a href="{fn}#sha256={digest}">{fn}</a></body></html>\n')
    return digest


def test_gpu_cell_locks_through_its_variant_indexes(tmp_path, monkeypatch):
    """The GPU lock path end to end, with stand-in torch/vLLM variant wheels in local indexes (the real ones are
    GBs on indexes this machine can't reach); everything else resolves from the default index."""
    cell = CELLS["cu129-hopper-x86_64"]
    torch_hash = _fake_wheel(tmp_path / "torch" / "cu129", "torch", "2.13.0+cu129",
                             "cp312-cp312-manylinux_2_28_x86_64", ["filelock"])
    vllm_hash = _fake_wheel(tmp_path / "vllm", "vllm", "0.31.0+cu129", "cp38-abi3-manylinux_2_28_x86_64",
                            ["torch==2.13.0"])
    monkeypatch.setenv("TORCH_INDEX_URL", f"file://{tmp_path}/torch/")
    monkeypatch.setenv("VLLM_INDEX_URL", f"file://{tmp_path}/vllm")
    out = tmp_path / "out"
    try:
        rc = lock.lock_cells([cell], root=out, quiet=True)
    except Exception as e:  # noqa: BLE001 - only a network failure may skip this
        if re.search(r"(?i)connect|network|dns|timed out|fetch", str(e)):
            pytest.skip(f"package index unreachable: {e}")
        raise
    assert rc == 0
    text = (out / cell.lock).read_text()
    reqs = parse(text)
    assert reqs["torch"] == ("2.13.0+cu129", [torch_hash])
    assert reqs["vllm"] == ("0.31.0+cu129", [vllm_hash])
    for pkg in ("transformers", "trl", "peft", "accelerate", "bitsandbytes", "ninja", "wheel"):
        assert reqs[pkg][0] == cell.pins[pkg]
    assert str(tmp_path) not in text and "file://" not in text   # index URLs never land in the lock
    assert lock.recorded_digest(out / cell.lock) == lock.inputs_digest(cell)
