"""No dependency confusion (issue 20 item 3): each package resolves from the one index it belongs to. Real PEP 503
indexes on 127.0.0.1: a "torch" index serving the cell's torch build AND an impostor `numpy` with a higher version, a
"vllm" index serving vLLM, a "default" index serving the genuine numpy and every other pin of a real matrix cell. The
lock must take torch and vLLM from their indexes and numpy (a dependency of torch) from the default index; merely
listing the variant indexes, as the lock did before, picks the impostor."""
from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

import simpleindex
from builder import lock
from builder.matrix import load_matrix
from builder.paths import ROOT

CELL = {c.tag: c for c in load_matrix(ROOT / "matrix.toml").cells}["cu129-blackwell-x86_64"]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def three_indexes(tmp_path_factory):
    """name -> (simple URL, {wheel name: path}) for the default, torch and vllm indexes, served over HTTP."""
    tmp = tmp_path_factory.mktemp("confusion")
    torch_v = CELL.requirement("torch").split("==")[1]     # 2.13.0+cu129
    vllm_v = CELL.requirement("vllm").split("==")[1]
    plan = {
        "default": [("numpy", "2.0.0", (), "genuine"), ("torch", torch_v, ("numpy",), "default-index torch")]
                   + [(p, v, (), "default") for p, v in CELL.pins.items() if p not in ("torch", "vllm")],
        "torch": [("torch", torch_v, ("numpy",), "torch-index torch"), ("numpy", "99.0.0", (), "IMPOSTOR")],
        "vllm": [("vllm", vllm_v, (f"torch=={torch_v}",), "vllm-index vllm")],
    }
    built: dict[str, dict[str, Path]] = {}
    for name, wheels in plan.items():
        built[name] = {n: simpleindex.stand_in_wheel(tmp / f"wheels-{name}", n, v, requires=r, origin=o)
                       for n, v, r, o in wheels}
        simpleindex.write_index(tmp / f"wheels-{name}", tmp / "www" / name)
    with simpleindex.serve(tmp / "www", tmp / "server.log") as url:
        base = url.removesuffix("simple/")
        yield {name: (f"{base}{name}/simple/", files) for name, files in built.items()}


def test_each_package_comes_from_its_one_index(three_indexes, tmp_path):
    urls = {n: u for n, (u, _) in three_indexes.items()}
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, str(ROOT / "build.py"), "--lock", CELL.tag, "--output-dir", str(out),
                        "--index", f"default={urls['default']}", "--index", f"torch={urls['torch']}",
                        "--index", f"vllm={urls['vllm']}"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    text = (out / CELL.lock).read_text()
    got = {ln.split("==")[0]: ln.split("==")[1].split()[0] for ln in text.splitlines() if "==" in ln
           and not ln.startswith((" ", "#"))}
    assert got["numpy"] == "2.0.0", "the impostor numpy on the torch index was picked"
    hashes = lambda pkg: set(text.split(f"\n{pkg}==", 1)[1].split("\n", 1)[1].split("# via")[0].split())  # noqa: E731
    assert f"--hash=sha256:{_sha(three_indexes['default'][1]['numpy'])}" in hashes("numpy")
    assert f"--hash=sha256:{_sha(three_indexes['torch'][1]['torch'])}" in hashes("torch")       # not the default's
    assert f"--hash=sha256:{_sha(three_indexes['default'][1]['torch'])}" not in hashes("torch")
    assert f"--hash=sha256:{_sha(three_indexes['vllm'][1]['vllm'])}" in hashes("vllm")
    # The header records what it was resolved from, outside the inputs digest.
    header = text.splitlines()[2]
    assert header.startswith("# resolved from: default = " + urls["default"]), header
    assert f"torch = {urls['torch']} (only torch)" in header and f"vllm = {urls['vllm']} (only vllm)" in header
    assert lock.recorded_digest(out / CELL.lock) == lock.inputs_digest(CELL)


def test_listing_the_variant_indexes_picks_the_impostor(three_indexes):
    """The failure the routing prevents, on the same indexes: the variant indexes given as extra indexes (what the lock
    did before; uv's default strategy takes the first index that has a name, pip's and the old best-match flag the
    highest version anywhere) resolve numpy from the torch index."""
    urls = {n: u for n, (u, _) in three_indexes.items()}
    p = subprocess.run([lock.uv_binary(), "pip", "compile", "-", "--quiet", "--no-header", "--python-version",
                        CELL.python, "--python-platform", CELL.uv_platform, "--default-index", urls["default"],
                        "--extra-index-url", urls["torch"], "--extra-index-url", urls["vllm"]],
                       input=lock.requirements_in(CELL), capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "numpy==99.0.0" in p.stdout


def test_the_header_redacts_credentials_and_names_the_routes():
    a = lock.resolved_from(CELL, {"torch": "https://u:secret@mirror.example/t/cu129",
                                  "vllm": "https://mirror.example/v?token=abc"}, "", [])
    assert "secret" not in a and "abc" not in a and "mirror.example/t/cu129 (only torch)" in a
    assert "default = (the installer default index)" in a and "(only vllm)" in a
