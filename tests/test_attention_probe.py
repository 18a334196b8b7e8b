"""GH200 cells and FlashAttention 3: aarch64 is a `probe` arch in matrix.toml. The lock step asks the flash index
(here a real PEP 503 index on 127.0.0.1 serving stand-in wheels: PyTorch's index is not reachable from here) for the
cell's platform. A wheel there is locked by hash and the image installs it, nothing compiled, so an x86 host builds
the GH200 image; without one the lock records that, and the cell compiles FA3 from its pinned source on a native
builder only (refused under emulation, one line). An index that cannot be reached stays an error, as does a missing
wheel for an arch the matrix confirms."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import simpleindex
from builder import cli, engine as eng, lock
from builder.errors import UserError
from builder.matrix import load_matrix
from builder.paths import ROOT
from enginefix import install_certs

M = load_matrix(ROOT / "matrix.toml")
CELLS = {c.tag: c for c in M.cells}
GH200 = CELLS["cu130-hopper-aarch64"]
FA3 = "flash-attn-3"


def _index(tmp_path: Path, *platforms: str) -> Path:
    """An index folder whose flash-attn-3 3.0.0 has stand-in wheels for PLATFORMS only."""
    wheels = tmp_path / "wheels"
    for plat in platforms:
        simpleindex.stand_in_wheel(wheels, FA3, "3.0.0", f"cp39-abi3-{plat}")
    simpleindex.stand_in_wheel(wheels, FA3, "2.9.9", "cp39-abi3-manylinux_2_28_aarch64")  # never the pinned one
    root = tmp_path / "index"
    simpleindex.write_index(wheels, root)
    return root


def _seed(out: Path, cell) -> None:
    """The cell's committed venv lock, so only the attention lock is resolved (no default index needed)."""
    (out / cell.lock).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / cell.lock, out / cell.lock)


def test_matrix_probes_aarch64_fa3_and_nothing_else():
    probed = sorted(c.tag for c in M.cells if c.flash and c.flash.get("probe"))
    assert probed == ["cu129-hopper-aarch64", "cu130-hopper-aarch64"]
    assert eng.attention_how(GH200, ROOT / "no-such-root") is None            # undecided until the lock step
    assert eng.attention_how(CELLS["cu130-hopper-x86_64"]) == "index"         # confirmed
    assert eng.attention_how(CELLS["cu130-ampere-aarch64"]) == "source"       # FA2: no wheel for torch 2.13


def test_an_aarch64_wheel_on_the_index_is_locked_by_hash_and_nothing_compiles(tmp_path):
    root = _index(tmp_path, "manylinux_2_28_aarch64", "manylinux_2_28_x86_64")
    out = tmp_path / "out"
    _seed(out, GH200)
    with simpleindex.serve(root, tmp_path / "server.log") as url:
        written = lock.ensure([GH200], root=out, overrides={"flash": url}, quiet=True)
    assert written == [GH200.attention_lock]
    text = (out / GH200.attention_lock).read_text()
    wheel = tmp_path / "wheels" / "flash_attn_3-3.0.0-cp39-abi3-manylinux_2_28_aarch64.whl"
    assert f"{FA3}==3.0.0" in text and f"--hash=sha256:{hashlib.sha256(wheel.read_bytes()).hexdigest()}" in text
    # the index's URL only in the "resolved from" comment (issue 20: a lock says where it came from), never an input
    naming = [ln for ln in text.splitlines() if url.split("/")[2] in ln]
    assert len(naming) == 1 and naming[0].startswith("# resolved from: "), naming
    assert eng.attention_how(GH200, out) == "index" and lock.is_fresh(GH200, out)
    assert not eng.compiles_under_emulation(GH200, False, out)
    eng.refuse_emulated_compile([GH200], False, out)                          # nothing to refuse
    args = eng.cell_build_args(GH200, index_overrides={"flash": url}, context=out)
    assert args["ATTENTION_FROM"] == "index" and args["FLASH_INDEX_URL"] == url
    plan = "\n".join(cli.plan_lines([GH200], {}, {GH200.tag: out / GH200.dockerfile}, out, {"flash": url}))
    assert "prebuilt wheel flash-attn-3==3.0.0 (cu130 build) from index flash, by hash" in plan
    assert "(the lock step found it); nothing compiles" in plan and "REFUSED" not in plan


def test_no_aarch64_wheel_locks_the_source_build_which_emulation_refuses(tmp_path, engine):  # noqa: F811
    """The CLI on this x86 host: the lock step records 'source', then the build stops with one line (exit 2) before
    any image step; the lock it wrote is whole and says why."""
    if eng.host_arch() != "x86_64":
        pytest.skip("the refusal is for a host of another arch")
    root = _index(tmp_path, "manylinux_2_28_x86_64")
    out = tmp_path / "out"
    _seed(out, GH200)
    before = _image_id(GH200.image)      # an image a real GH200 build left in this engine stays; none is made here
    with simpleindex.serve(root, tmp_path / "server.log") as url:
        p = subprocess.run([sys.executable, str(ROOT / "build.py"), GH200.tag, "--output-dir", str(out),
                            "--index", f"flash={url}", "--quiet"], capture_output=True, text=True, cwd=ROOT,
                           timeout=300)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert f"{GH200.tag} compiles flash-attn-3 from source" in p.stderr and "--buildx-builder" in p.stderr
    text = (out / GH200.attention_lock).read_text()
    assert lock.SOURCE_MARK + "index flash has no flash-attn-3==3.0.0 wheel for aarch64-manylinux_2_35" in text
    assert "--hash" not in text and lock.is_fresh(GH200, out)
    assert eng.attention_how(GH200, out) == "source"
    assert eng.compiles_under_emulation(GH200, False, out) and not eng.compiles_under_emulation(GH200, True, out)
    plan = "\n".join(cli.plan_lines([GH200], {}, {GH200.tag: out / GH200.dockerfile}, out))
    assert "REFUSED here under emulation" in plan
    assert _image_id(GH200.image) == before                                   # no image, no tag moved


def _image_id(image: str) -> str:
    return subprocess.run(["docker", "images", "-q", image], capture_output=True, text=True, check=True).stdout.strip()


def test_an_unreachable_index_or_a_confirmed_arch_without_a_wheel_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("UV_HTTP_RETRIES", "0")  # uv's backoff on a closed port: ~20 s, same error
    out = tmp_path / "out"
    _seed(out, GH200)
    port = simpleindex.free_port()
    with pytest.raises(UserError, match=r"cannot lock .* through flash = http://127\.0\.0\.1:\d+/simple/"):
        lock.ensure([GH200], root=out, overrides={"flash": f"http://127.0.0.1:{port}/simple/"}, quiet=True)
    assert not (out / GH200.attention_lock).exists()                          # nothing half-written
    x86 = CELLS["cu130-hopper-x86_64"]                                         # confirmed: no silent fallback
    _seed(out, x86)
    root = _index(tmp_path, "manylinux_2_28_aarch64")
    with simpleindex.serve(root, tmp_path / "server.log") as url:
        with pytest.raises(UserError, match="no wheels with a matching platform tag"):
            lock.ensure([x86], root=out, overrides={"flash": url}, quiet=True)
    assert not (out / x86.attention_lock).exists()


PROBE_CELL = '''
[[cell]]
name = "probe"
arch = "x86_64"
cuda = "13.0"
gpu = "hopper"
torch_variant = "cu130"
base_image = "debian:bookworm"
python = "3.11"
attention = "fa3"
stack = "light"
'''


@pytest.mark.network
@pytest.mark.engine
@pytest.mark.timeout(1800)
def test_a_probed_cell_builds_with_the_wheel_the_lock_found(tmp_path, test_base):  # noqa: F811
    """A real BuildKit build of the rendered two-way Dockerfile: a foreign matrix probes x86_64 too (native here, so
    quick) for a light-stack Hopper cell. The lock finds the stand-in wheel; ATTENTION_FROM=index builds only the
    prebuilt stage: the source stage's CUDA devel image is never pulled (it can't be from here, so the build would
    fail if BuildKit touched it). The wheel lands in the venv; the label says where it came from."""
    mfile = tmp_path / "m.toml"
    mfile.write_text((ROOT / "matrix.toml").read_text().replace('probe = ["aarch64"]', 'probe = ["aarch64", "x86_64"]')
                     + PROBE_CELL)
    cell = next(c for c in load_matrix(mfile).cells if c.name == "probe")
    assert cell.flash["probe"]
    install_certs()   # the host's extra CA certificates (a TLS-intercepting proxy here) into images/certs/
    root = _index(tmp_path, "manylinux_2_28_x86_64")
    wheelhouse = tmp_path / "wheels"   # the build container reaches no 127.0.0.1 index: the same files, offered first
    out = tmp_path / "out"
    with simpleindex.serve(root, tmp_path / "server.log") as url:
        p = subprocess.run([sys.executable, str(ROOT / "build.py"), "--matrix", str(mfile), "probe", "--output-dir",
                            str(out), "--index", f"flash={url}", "--base", f"debian:bookworm={test_base}",
                            "--wheelhouse", str(wheelhouse), "--build-arg", "FLASH_INDEX_URL=file:///nonexistent",
                            "--report", str(tmp_path / "report.json")],
                           capture_output=True, text=True, cwd=ROOT, timeout=1700)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "lock: wrote locks/probe-x86_64.attention.txt" in p.stdout
    image = json.loads((tmp_path / "report.json").read_text())["cells"][0]["image_id"]
    labels = json.loads(subprocess.run(["docker", "image", "inspect", "--format", "{{json .Config.Labels}}", image],
                                       capture_output=True, text=True, check=True).stdout)
    assert labels["io.trainbox.attention_from"] == "index"
    assert labels["io.trainbox.version.flash-attn-3"] == "3.0.0"
    r = subprocess.run(["docker", "run", "--rm", "--entrypoint", "/opt/venv/bin/python", image, "-c",
                        "import flash_attn_3 as f; print(f.__version__, f.STAND_IN, f.__file__)"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split()[:2] == ["3.0.0", "True"], r.stderr
    assert r.stdout.split()[2].startswith("/opt/venv/lib/python3.11/site-packages/flash_attn_3/")
    subprocess.run(["docker", "image", "rm", "-f", image], capture_output=True)
    # The switch really switches: forced to "source", the same build goes for the devel image's stage (here a
    # substitute that does not exist, so it stops at once with one error naming that FROM).
    devel = f"{test_base.split('/')[0]}/trainbox/no-such-devel:1"
    with simpleindex.serve(root, tmp_path / "server2.log") as url:
        p = subprocess.run([sys.executable, str(ROOT / "build.py"), "--matrix", str(mfile), "probe", "--output-dir",
                            str(out), "--index", f"flash={url}", "--base", f"debian:bookworm={test_base}",
                            "--base", f"{cell.build_image}={devel}", "--wheelhouse", str(wheelhouse),
                            "--build-arg", "ATTENTION_FROM=source", "--quiet"],
                           capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert devel in p.stderr, p.stderr
