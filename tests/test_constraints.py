"""The lock as pip/uv constraints in every image (issue 21 item 4): /etc/trainbox/constraints.txt written from the
venv's lock during the build, PIP_CONSTRAINT/UV_CONSTRAINT set, `pip` turning a conflict with a pin into one line.

Real derived images `FROM` the session's smoke image (built once by enginefix) with a local PEP 503 index of tiny
wheels on 127.0.0.1 (builds and runs use --network host): installing a new package builds; asking for another torch
fails with the one line; a package needing another transformers, `python -m pip`, uv and the override are checked in
one container of the derived image; doctor warns about the overridden package.
"""
from __future__ import annotations

import re
import shutil
import uuid
from pathlib import Path

import pytest

from common.errors import UsageError
from enginefix import BUILD_TIMEOUT, docker
from simpleindex import serve, stand_in_wheel, write_index
from trainbox.image import constraints, pipwrap

ROOT = Path(__file__).resolve().parents[1]
FILE = "/etc/trainbox/constraints.txt"


def _engine(f):  # real-image tests: the engine marker and the build-heavy timeout (the session smoke build)
    return pytest.mark.engine(pytest.mark.timeout(BUILD_TIMEOUT)(f))


# ---------------------------------------------------------------------------------------------------------------
# The file itself (no engine)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lock", sorted(p.name for p in (ROOT / "locks").glob("*.txt")))
def test_every_lock_becomes_one_pin_per_package_without_hashes(lock):
    text = (ROOT / "locks" / lock).read_text()
    lines = constraints.from_lock(text, lock)
    pinned = [ln for ln in text.splitlines() if ln[:1].isalnum() and "==" in ln]
    assert len(lines) == len(pinned) > 10
    assert all("--hash" not in ln and "[" not in ln and ln.count("==") == 1 for ln in lines)
    assert [ln.split("==")[0] for ln in lines] == [ln.split("==")[0] for ln in pinned]


def test_from_lock_joins_continuations_and_drops_extras_hashes_options():
    text = ("# header\n--index-url http://example.invalid/simple\nfoo[bar]==1.0 \\\n    --hash=sha256:aa \\\n"
            "    --hash=sha256:bb\n    # via x\nbaz==2.0+cpu ; sys_platform == 'linux' \\\n    --hash=sha256:cc\n")
    assert constraints.from_lock(text) == ["foo==1.0", "baz==2.0+cpu ; sys_platform == 'linux'"]


@pytest.mark.parametrize("text, err", [("foo>=1.0\n", "lock:1: 'foo>=1.0' is not pinned with =="),
                                       ("# only comments\n", "no pinned requirement"),
                                       ("foo==1.0 \\\n", "ends inside a continued line")])
def test_bad_lock_is_one_clear_error(text, err):
    with pytest.raises(UsageError, match=err):
        constraints.from_lock(text, "lock")


def test_cli_writes_the_file_atomically_and_pins_reads_it_back(tmp_path):
    import subprocess
    import sys

    lock = tmp_path / "venv.txt"
    lock.write_text("Torch==2.13.0+cpu \\\n    --hash=sha256:aa\ntyping_extensions==4.16.0\n")
    out = tmp_path / "c.txt"
    r = subprocess.run([sys.executable, "-m", "trainbox.image.constraints", str(lock), "-o", str(out)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert out.read_text().splitlines()[-2:] == ["Torch==2.13.0+cpu", "typing_extensions==4.16.0"]
    assert "PIP_CONSTRAINT= pip install" in out.read_text()  # the header says how to override
    assert constraints.pins(out) == {"torch": ("Torch", "2.13.0+cpu"),
                                     "typing-extensions": ("typing_extensions", "4.16.0")}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt", "venv.txt"]
    r = subprocess.run([sys.executable, "-m", "trainbox.image.constraints", str(tmp_path / "nope.txt")], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "cannot read the lock" in r.stderr


def test_conflict_line_needs_a_constraint_in_the_block():
    other = "The conflict is caused by:\n    a 1.0 depends on b<2\n    c 1.0 depends on b>=2\n\nTo fix this\n"
    assert pipwrap.conflict_line(other, ["install", "a", "c"], FILE) is None


# ---------------------------------------------------------------------------------------------------------------
# Real derived images
# ---------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """A local index: a new package, a fake torch 2.12.0, a package that needs transformers<5 (and a transformers
    4 to offer), a fake absl-py 2.4.0 (overridden on purpose below)."""
    d = tmp_path_factory.mktemp("cindex")
    wheels = d / "wheels"
    stand_in_wheel(wheels, "tbx-extra", "1.0", "py3-none-any")
    stand_in_wheel(wheels, "torch", "2.12.0", "py3-none-any")
    stand_in_wheel(wheels, "transformers", "4.57.0", "py3-none-any")
    stand_in_wheel(wheels, "absl-py", "2.4.0", "py3-none-any")
    stand_in_wheel(wheels, "old-tf-user", "1.0", requires=["transformers<5"])
    write_index(wheels, d / "root")
    with serve(d / "root", d / "http.log") as url:
        yield url


def derived(base: str, run: str, tmp_path: Path, url: str, tag: str):
    """docker build of `FROM base` + RUN (as root, as a derived Dockerfile usually does) with the index as
    PIP_INDEX_URL."""
    (tmp_path / "Dockerfile").write_text(f"FROM {base}\nARG PIP_INDEX_URL\nUSER root\nRUN {run}\nUSER 1000:1000\n")
    return docker("build", "--network", "host", "--build-arg", f"PIP_INDEX_URL={url}", "-t", tag, str(tmp_path),
                  check=False)


@pytest.fixture(scope="module")
def extended(smoke_image, index, tmp_path_factory):
    tag = f"trainbox-test/constraints:{uuid.uuid4().hex[:8]}"
    r = derived(smoke_image, "pip install --no-cache-dir tbx-extra", tmp_path_factory.mktemp("ok"), index, tag)
    yield r, tag
    docker("rmi", "-f", tag, check=False)


@_engine
def test_a_derived_image_adding_a_package_builds(extended):
    r, tag = extended
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Successfully installed tbx-extra-1.0" in r.stdout
    got = docker("run", "--rm", "--entrypoint", "sh", tag, "-c",
                 f'echo "$PIP_CONSTRAINT $UV_CONSTRAINT"; python -c "import tbx_extra, torch; print(torch.__version__)";'
                 f" grep -vc '^#' {FILE}; grep -c -- --hash /etc/trainbox/lock.txt").stdout.split()
    assert got[:3] == [FILE, FILE, "2.13.0+cpu"]
    assert int(got[3]) == len(constraints.from_lock((ROOT / "locks/smoke-x86_64.txt").read_text()))
    assert int(got[4]) > int(got[3])  # the lock keeps its hashes, the constraints have none


@_engine
def test_the_images_user_adds_a_package_in_a_running_container_and_pins_hold(smoke_image, index):
    """A notebook's `%pip install X` runs as the image's user (uid 1000, the venv's owner): a new package installs,
    another torch is still refused by the constraints."""
    script = ("id -u; python -m pip install --no-cache-dir tbx-extra >/dev/null && python -c 'import tbx_extra' "
              "&& echo added; pip install --no-cache-dir torch==2.12.0 2>&1 | grep '^error: '; "
              "python -c 'import torch; print(torch.__version__)'")
    out = docker("run", "--rm", "--network", "host", "-e", f"PIP_INDEX_URL={index}", "--entrypoint", "sh",
                 smoke_image, "-c", script, check=False)
    lines = out.stdout.splitlines()
    assert lines[:2] == ["1000", "added"], out.stdout + out.stderr
    assert lines[2].startswith("error: torch is pinned to 2.13.0+cpu by this image") and lines[3] == "2.13.0+cpu"


@_engine
def test_a_derived_image_asking_for_another_torch_fails_with_one_line(smoke_image, index, tmp_path):
    tag = f"trainbox-test/constraints:torch-{uuid.uuid4().hex[:8]}"
    r = derived(smoke_image, "pip install --no-cache-dir torch==2.12.0", tmp_path, index, tag)
    docker("rmi", "-f", tag, check=False)
    log = re.sub(r"\x1b\[[0-9;]*m", "", r.stdout + r.stderr)  # the legacy builder colours a RUN's stderr
    assert r.returncode != 0
    errors = [ln for ln in log.splitlines() if ln.startswith("error: ")]
    assert errors == [f"error: torch is pinned to 2.13.0+cpu by this image ({FILE}) and this install needs another "
                      "version (you asked for torch==2.12.0); to change it anyway: PIP_CONSTRAINT= pip install "
                      "--no-cache-dir torch==2.12.0"], log[-3000:]
    assert "The conflict is caused by" not in log and "ResolutionImpossible" not in log
    assert "returned a non-zero code: 2" in log


@_engine
def test_in_the_derived_image_pins_hold_for_python_m_pip_and_uv_and_doctor_sees_an_override(extended, index):
    r, tag = extended
    assert r.returncode == 0
    uv = shutil.which("uv", path=str(ROOT / ".venv/bin")) or shutil.which("uv")
    script = "; ".join([
        "pip install old-tf-user; echo rc=$?",
        "python -m pip install torch==2.12.0 2>&1; echo rc=$?",
        # uv is not in the image: the host's static-enough binary, mounted, shows UV_CONSTRAINT is honoured.
        f"{'/uv' if uv else 'true'} pip install --python /opt/venv/bin/python --index-url $PIP_INDEX_URL "
        "torch==2.12.0 2>&1; echo rc=$?",
        "PIP_CONSTRAINT= pip install --no-deps absl-py==2.4.0 >/dev/null; echo rc=$?",
        "trainbox doctor | grep '^constraints'",
    ])
    mount = ["-v", f"{uv}:/uv:ro"] if uv else []
    out = docker("run", "--rm", "--network", "host", "-u", "0", "-e", f"PIP_INDEX_URL={index}", *mount,
                 "--entrypoint", "sh", tag, "-c", script, check=False)
    text = out.stdout + out.stderr
    lines = text.splitlines()
    # `pip`: a requirement of the new package that needs another transformers -> one line naming transformers.
    assert (f"error: transformers is pinned to 5.17.0 by this image ({FILE}) and this install needs another version "
            "(old-tf-user 1.0 depends on transformers<5); to change it anyway: PIP_CONSTRAINT= pip install "
            "old-tf-user") in lines, text
    assert "rc=2" in lines
    # `python -m pip` (and %pip) bypass the wrapper: pip's own message, whose constraint line names torch.
    assert "    The user requested (constraint) torch==2.13.0+cpu" in lines and "rc=1" in lines
    if uv:
        assert "torch==2.13.0+cpu" in text and "torch==2.12.0" in text and "unsatisfiable" in text
        assert lines.count("rc=1") == 2
    # The override on purpose works, and doctor names what changed (a WARN: exit code unchanged).
    assert "rc=0" in lines
    row = [ln for ln in lines if ln.startswith("constraints")]
    assert len(row) == 1 and "WARN" in row[0] and "absl-py 2.4.0 (pinned 2.5.1)" in row[0], text
