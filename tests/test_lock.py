"""Per-cell hash locks: present and fresh for what can be locked here, GPU cells skipped with a clear reason."""
import dataclasses
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import liveindex
from builder import indexes, lock
from builder.errors import UserError
from builder.matrix import load_matrix
from builder.paths import ROOT

M = load_matrix(ROOT / "matrix.toml")
CELLS = {c.tag: c for c in M.cells}
# No extra index needed: the smoke cells and the CUDA 13 venvs (torch/vLLM's default builds are CUDA 13).
LOCKABLE_HERE = ("smoke-x86_64", "smoke-aarch64", "cu130-blackwell-x86_64", "cu130-blackwell-aarch64")
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
    assert text.startswith("# trainbox lock for ")
    assert f" {cell.venv} ({cell.uv_platform}, python {cell.python});" in text.splitlines()[0]
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
    owners = {str(path): (c, digest) for c in CELLS.values() for path, digest in lock.wanted(c)}
    for p in (ROOT / "locks").glob("*.txt"):
        rel = str(p.relative_to(ROOT))
        assert rel in owners, f"{p} belongs to no cell"
        assert lock.recorded_digest(p) == owners[rel][1], f"{p} is stale"


def test_cells_of_one_cuda_arch_and_stack_share_one_venv_lock():
    cu130 = [c for c in CELLS.values() if c.cuda == "13.0" and c.arch == "x86_64" and not c.flavour]
    assert {c.gpu for c in cu130} == {"ampere", "hopper", "blackwell"}
    assert {c.lock for c in cu130} == {Path("locks/cu130-gpu-x86_64.txt")}
    assert {lock.inputs_digest(c) for c in cu130} == {lock.inputs_digest(cu130[0])}
    # the FA3 wheel is locked per cell, by version and hash, in its own file
    hopper = CELLS["cu130-hopper-x86_64"]
    assert hopper.attention_lock == Path("locks/cu130-hopper-x86_64.attention.txt")
    assert [p for p, _ in lock.wanted(hopper)] == [hopper.lock, hopper.attention_lock]


def test_digest_follows_the_inputs():
    cell = CELLS["smoke-aarch64"]
    changed = dataclasses.replace(cell, pins={**cell.pins, "jupyterlab": "4.6.5"})
    assert lock.inputs_digest(changed) != lock.inputs_digest(cell)
    assert not lock.is_fresh(changed)
    other_py = dataclasses.replace(cell, python="3.12")
    assert lock.inputs_digest(other_py) != lock.inputs_digest(cell)
    assert lock.inputs_digest(cell) == lock.inputs_digest(dataclasses.replace(cell))


def test_gpu_cells_name_their_indexes():
    assert indexes.needed(CELLS["cu129-blackwell-aarch64"]) == ["torch", "vllm"]
    assert indexes.needed(CELLS["cu129-hopper-x86_64"]) == ["torch", "vllm", "flash"]
    assert indexes.needed(CELLS["cu130-blackwell-x86_64"]) == []      # the default index's CUDA 13 builds
    assert indexes.needed(CELLS["cu130-hopper-aarch64"]) == ["flash"]  # asked for an aarch64 FA3 wheel first
    assert indexes.needed(CELLS["cu130-ampere-aarch64"]) == []         # FA2 compiled natively, no flash index
    assert indexes.needed(CELLS["smoke-x86_64"]) == []
    args = indexes.build_args(CELLS["cu129-hopper-x86_64"], {"torch": "https://m.example/t/{variant}"})
    assert args == {"TORCH_INDEX_URL": "https://m.example/t/cu129", "VLLM_INDEX_URL": "https://wheels.vllm.ai/0.31.0/cu129",
                    "FLASH_INDEX_URL": "https://download.pytorch.org/whl/cu126"}
    env = {"TRAINBOX_INDEX_VLLM": "https://env.example/{vllm}", "TRAINBOX_INDEX_FLASH": ""}
    over = indexes.parse_overrides(["flash=https://flag.example/{flash_variant}"], {"vllm": "https://cfg.example"}, env)
    assert over == {"vllm": "https://cfg.example", "flash": "https://flag.example/{flash_variant}"}   # flag > config > env
    with pytest.raises(UserError, match="unknown index 'pytorch'"):
        indexes.parse_overrides(["pytorch=https://x"], env={})


def test_an_unreachable_index_is_one_clear_error_and_nothing_is_written(tmp_path):
    """Locking a cu129 cell needs PyTorch's index; where it can't be reached: exit 2, one line naming the index and the
    way out, no file. (A closed port on 127.0.0.1 stands for the unreachable host: same path, no DNS wait.)"""
    p = subprocess.run([sys.executable, str(ROOT / "build.py"), "--lock", "cu129-blackwell-x86_64", "--output-dir",
                        str(tmp_path), "--index", "torch=http://127.0.0.1:9/whl/{variant}"],
                       capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "UV_HTTP_RETRIES": "0"})  # uv's backoff on a closed port: ~20 s, same error
    assert p.returncode == 2, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    assert "torch = http://127.0.0.1:9/whl/cu129" in p.stderr and "--index NAME=URL" in p.stderr
    assert not any(tmp_path.rglob("*"))


def test_frozen_refuses_a_missing_or_stale_lock(tmp_path):
    cell = CELLS["cu129-hopper-x86_64"]
    with pytest.raises(UserError, match=r"--frozen: locks/cu129-gpu-x86_64.txt is missing \(cell cu129-hopper-x86_64"):
        lock.ensure([cell], root=tmp_path, frozen=True)
    smoke = CELLS["smoke-aarch64"]
    (tmp_path / "locks").mkdir()
    (tmp_path / smoke.lock).write_text((ROOT / smoke.lock).read_text().replace(lock.inputs_digest(smoke), "0" * 64))
    with pytest.raises(UserError, match="is stale"):
        lock.ensure([smoke], root=tmp_path, frozen=True)
    assert lock.ensure([CELLS["smoke-x86_64"]], root=ROOT, frozen=True) == []   # committed and fresh: fine


@pytest.mark.network
def test_relock_reproduces_the_committed_pins(tmp_path):
    """A real resolve for the aarch64 smoke cell from an x86 host (default index; no torch)."""
    cell = CELLS["smoke-aarch64"]
    try:
        text = lock.compile_lock(cell)
    except Exception as e:  # noqa: BLE001 - only a network failure may skip this
        if re.search(r"(?i)connect|network|dns|timed out|fetch", str(e)):
            liveindex.unreachable(str(e))
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
        liveindex.unreachable(p.stderr.strip()[:200])
    return p.returncode, p.stdout + p.stderr


@pytest.mark.network
@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_fact_default_torch_is_a_cuda13_build(arch):
    """Why every CUDA-12 cell needs TORCH_INDEX_URL: the default index's torch 2.13.0 pulls CUDA 13 packages."""
    rc, out = _resolve(["torch==2.13.0"], f"{arch}-manylinux_2_28")
    assert rc == 0, out
    assert re.search(r"^nvidia-cudnn-cu13==", out, re.M) and not re.search(r"^nvidia-\S+-cu12==", out, re.M)


@pytest.mark.network
def test_fact_vllm_pins_torch_and_transformers_fits():
    m = load_matrix(ROOT / "matrix.toml")
    gpu = next(c for c in m.cells if c.gpu).pins
    rc, out = _resolve([f"vllm=={gpu['vllm']}", f"transformers=={gpu['transformers']}", f"trl[vllm]=={gpu['trl']}"],
                       "x86_64-manylinux_2_28")
    assert rc == 0, out
    assert f"\ntorch=={gpu['torch']}\n" in "\n" + out
    assert re.search(r"^cuda-toolkit==13\.", out, re.M), "vLLM's default build is CUDA 13: CUDA-12 cells need +cu12x"


@pytest.mark.network
def test_fact_trl_vllm_extra_rejects_newer_vllm():
    rc, out = _resolve(["trl[vllm]==1.16.0", "vllm==0.33.0"], "x86_64-manylinux_2_28")
    assert rc != 0 and "No solution found" in out


@pytest.mark.network
def test_fact_stack_needs_python_311():
    """Why GPU cells use Ubuntu 24.04 bases (python 3.12): the 22.04 images' python 3.10 can't carry trl 1.16."""
    rc, out = _resolve(["trl==1.16.0"], "x86_64-manylinux_2_28", python="3.10")
    assert rc != 0 and "Python>=3.11" in out.replace(" ", "")




def test_uv_error_keeps_the_reason_at_any_wrap_width():
    """uv wraps its error to a width that depends on where it runs; the one line we show must not depend on it (a run
    under two xdist workers once showed only the hint, the reason cut off with the lines before the last three)."""
    import textwrap

    from builder.lock import uv_error

    reason = ("Because only flash-attn-3==3.0.0 is available and flash-attn-3==3.0.0 has no wheels with a matching "
              "platform tag (e.g., `manylinux_2_35_x86_64`), we can conclude that your requirements are unsatisfiable.")
    hint = "hint: Wheels are available for `flash-attn-3` (v3.0.0) on the following platform: `manylinux_2_28_aarch64`"
    shown = set()
    for width in (40, 80, 200):
        fill = dict(width=width, break_on_hyphens=False, break_long_words=False)
        body = textwrap.fill(reason, initial_indent="  ╰─▶ ", subsequent_indent="      ", **fill)
        stderr = "  × No solution found when resolving dependencies:\n" + body + "\n\n" + textwrap.fill(hint, **fill)
        shown.add(uv_error(stderr))
    assert len(shown) == 1
    line = shown.pop()
    assert "has no wheels with a matching platform tag" in line and line.endswith("`manylinux_2_28_aarch64`")
    assert "╰" not in line and "×" not in line and "\n" not in line
    long = uv_error("error: Failed to fetch\n" + "  Caused by: x\n" * 100 + "  Caused by: Connection refused")
    assert long.startswith("... ") and long.endswith("Caused by: Connection refused") and len(long) <= 504


def test_a_long_lock_error_is_redacted_before_it_is_cut(tmp_path, monkeypatch):
    """The error is cut to its end; a credential URL straddling the cut must not leave a fragment of the secret."""
    import types

    secret = "s3cr3tPASSWORDvalue"
    after = "@mirror.invalid/simple/flash-attn-3/ refused " + "z" * 400
    after += "z" * (500 - 9 - len(after))  # unredacted, the last 500 characters start 9 characters into the secret
    stderr = "error: Failed to fetch\n  Caused by: " + f"https://user:{secret}" + after
    monkeypatch.setattr(lock.subprocess, "run", lambda *a, **k: types.SimpleNamespace(returncode=2, stdout="",
                                                                                         stderr=stderr))
    cell = next(c for c in load_matrix(ROOT / "matrix.toml").cells if c.name == "smoke")
    with pytest.raises(UserError) as e:
        lock._uv(cell, "x", "torch\n", [], {})
    assert not any(secret[i:i + 6] in str(e.value) for i in range(len(secret) - 5)), str(e.value)
