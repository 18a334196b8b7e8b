"""A real PEP 503 simple index on 127.0.0.1 for the tests: http.server over a folder of wheels (what a mirror or an
air-gapped wheelhouse looks like to pip and uv), and tiny stand-in wheels for packages no index here serves
(stand_in_wheel: the one wheel builder of the tests)."""
from __future__ import annotations

import base64
import contextlib
import hashlib
import html
import re
import socket
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterable
from pathlib import Path


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def write_index(wheels: Path, root: Path) -> None:
    """PEP 503: /simple/ lists projects, /simple/<normalized>/ lists files with #sha256= fragments."""
    projects: dict[str, list[Path]] = {}
    for w in sorted(wheels.glob("*.whl")):
        projects.setdefault(norm(w.name.split("-")[0]), []).append(w)
    (root / "files").mkdir(parents=True)
    (root / "simple").mkdir(parents=True)
    for name, files in projects.items():
        d = root / "simple" / name
        d.mkdir(parents=True)
        links = []
        for f in files:
            (root / "files" / f.name).symlink_to(f.resolve())
            digest = hashlib.sha256(f.read_bytes()).hexdigest()
            links.append(f'<a href="../../files/{html.escape(f.name)}#sha256={digest}">{html.escape(f.name)}</a><br>')
        (d / "index.html").write_text("<!DOCTYPE html><html><body>\n" + "\n".join(links) + "\n</body></html>\n")
    (root / "simple" / "index.html").write_text(
        "<!DOCTYPE html><html><body>\n" + "\n".join(f'<a href="{n}/">{n}</a><br>' for n in sorted(projects))
        + "\n</body></html>\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(root: Path, log: Path, bind: str = "127.0.0.1"):
    """http.server over ROOT; yields the /simple/ URL. BIND 0.0.0.0 lets a build container reach it too."""
    port = free_port()
    with open(log, "w") as f:
        server = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", bind, str(port),
                                   "--directory", str(root)], stderr=f, stdout=f)
    try:
        deadline = time.monotonic() + 60   # a loaded CI box can take seconds to start python
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/simple/"
    finally:
        server.terminate()
        server.wait(timeout=10)


def stand_in_wheel(folder: Path, name: str, version: str, tag: str = "py3-none-any", module: str | None = None,
                   requires: Iterable[str] = (), origin: str | None = None) -> Path:
    """A valid wheel (METADATA, WHEEL, RECORD) whose module only records its version: it stands in for a wheel no
    index reachable from here serves (FlashAttention 3's live on PyTorch's index), or for a package whose
    dependencies are what a test is about.

    REQUIRES: Requires-Dist lines, as written (markers included); each extra a marker names (`extra == "verl-core"`)
    is also declared with Provides-Extra, as a real wheel does. ORIGIN: an `ORIGIN = ...` line in the module, so
    same-named wheels served by two indexes differ in bytes (a lock's hash then says which index it took).
    Deterministic: the same arguments give the same bytes (fixed zip timestamps), so hashes are stable."""
    dist = re.sub(r"[-.]+", "_", name)
    module = module or dist
    info = f"{dist}-{version}.dist-info"
    requires = list(requires)
    extras = sorted({e for r in requires for e in re.findall(r"""\bextra\s*==\s*['"]([^'"]+)['"]""", r)})
    meta = (f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
            + "".join(f"Provides-Extra: {e}\n" for e in extras) + "".join(f"Requires-Dist: {r}\n" for r in requires))
    source = f"__version__ = {version!r}\nSTAND_IN = True\n" + (f"ORIGIN = {origin!r}\n" if origin is not None else "")
    files = {f"{module}/__init__.py": source.encode(),
             f"{info}/METADATA": meta.encode(),
             f"{info}/WHEEL": (f"Wheel-Version: 1.0\nGenerator: trainbox-tests\nRoot-Is-Purelib: false\nTag: {tag}\n"
                               .encode())}
    record = [f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b'=').decode()},{len(b)}"
              for p, b in files.items()]
    files[f"{info}/RECORD"] = ("\n".join(record + [f"{info}/RECORD,,"]) + "\n").encode()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{dist}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, b in files.items():
            z.writestr(zipfile.ZipInfo(p, date_time=(2026, 1, 1, 0, 0, 0)), b)
    return path
