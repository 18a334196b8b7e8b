"""Shared pytest fixtures for the real-image tests: engine + registry, the debootstrapped test base, the smoke images.

Everything is built once per session and cached between runs (debootstrap layers under $TRAINBOX_CACHE, the engine's
build cache). tests/conftest.py registers the fixtures, once: a test module names them as arguments and imports from
here only the helpers (docker, BUILD_TIMEOUT, ...), never a fixture (its own copy would run again for that module;
tests/test_shared_fixtures.py checks). The builds are memoised too, for the helpers that call them directly.

- `engine`      {"registry": "127.0.0.1:PORT", "docker": CLI} after `python -m devenv.engine up`.
- `test_base`   REGISTRY/trainbox/base:bookworm-KEY, amd64+arm64; `--base debian:bookworm=<it>` for the smoke cell.
- `smoke_build` BuildResult of the smoke cell for x86_64 (full stack, CPU torch from a wheelhouse); `smoke_image`
                its local ref (str), e.g. `trainbox:smoke-x86_64`. No test may build anything else under that tag:
                `image_id(smoke_image) == smoke_build.image_id` all session (tests/test_readme.py builds the smoke cell
                from a copy of the checkout under a repository of its own).
- `smoke_sqsh`  the .sqsh exported from `smoke_build.image_id` (the image, not the tag), with its sidecars.
- `smoke_arm64` BuildResult of the smoke cell for aarch64 (light profile) built under QEMU.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from builder import engine as eng  # noqa: E402
from builder.options import parse_bases, parse_secrets  # noqa: E402
from devenv import bases, buildinputs, engine as devengine  # noqa: E402
from devenv.common import pid_alive  # noqa: E402

# A known fake build-time credential: every smoke build gets it as a BuildKit secret; test_secrets proves it never
# lands in a layer, a history entry or a label.
FAKE_TOKEN = "hf_trainboxFAKEtoken0123456789abcdefXYZ"
SECRET_ID = "hf_token"
# Seconds a test may take when it triggers the cold session builds (bases + x86 + arm64 under QEMU on 2 cores);
# modules using these fixtures set it with pytest.mark.timeout(BUILD_TIMEOUT) over pyproject's 900 s default.
BUILD_TIMEOUT = 5400


@dataclass(frozen=True)
class ThrowawayCell:
    """The fields build_cell reads, for tests that build a small Dockerfile of their own (not a matrix cell)."""
    name: str
    tag: str
    repository: str
    base_image: str = "debian:bookworm"
    arch: str = "x86_64"
    platform: str = "linux/amd64"
    dockerfile: str = "Dockerfile"
    tags: list = field(default_factory=list, hash=False)


@functools.cache
def engine_info() -> dict:
    return devengine.up()


@functools.cache
def base_ref() -> str:
    return bases.publish(engine_info()["registry"])


def install_certs() -> None:
    """The host's extra CA certificates into images/certs/ (devenv.buildinputs; a TLS-intercepting proxy here)."""
    buildinputs.install_certs()


def smoke_cells() -> dict:
    from builder.matrix import load_matrix

    return {c.arch: c for c in load_matrix(ROOT / "matrix.toml").cells if c.name == "smoke"}


@functools.cache
def torch_wheelhouse(requirement: str) -> str:
    """A folder holding the smoke cell's torch wheel (devenv.buildinputs, the one `make build` uses too)."""
    return str(buildinputs.torch_wheelhouse(requirement))


def secret_file() -> Path:
    path = devengine.cache_dir() / "fake-secret" / SECRET_ID
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(FAKE_TOKEN)
    return path


def build_args(cell, **over) -> SimpleNamespace:
    """An argparse-like namespace for builder.engine.build_cells, as the CLI would pass it."""
    args = dict(push=False, registry=None, wheelhouse=None, builder="auto", no_cache=False, report=None,
                secret=[f"id={SECRET_ID},src={secret_file()}"], base=[f"{cell.base_image}={base_ref()}"], sqsh=None,
                sqsh_compression=None, use_enroot=False, quiet=False)
    if "torch" in cell.pins:
        args["wheelhouse"] = torch_wheelhouse(cell.requirement("torch"))
    args.update(over)
    return SimpleNamespace(**args)


@functools.cache
def build_smoke(arch: str):
    engine_info()
    install_certs()
    cell = smoke_cells()[arch]
    args = build_args(cell)
    builder = eng.choose_builder(args.builder)
    return eng.build_cell(cell, builder=builder, bases=parse_bases(args.base), wheelhouse=args.wheelhouse,
                          secrets=parse_secrets(args.secret))


# The cold session builds (engine, debootstrapped base, smoke x86_64, smoke aarch64 under QEMU: 10-14 min on 2 cores)
# start in a child process as soon as collection shows that a selected test needs them (conftest), once a run: the
# first process of the run (the only one, or the first xdist worker) to take the run's lock starts it. Meanwhile the
# tests that need none of it run. A fixture waits for its own stage of the child ("warm: STAGE done" in its log, or the
# child's end) and then builds in this process from the child's caches (the debootstrap layers, BuildKit's cache):
# seconds, and never two builds of one thing at once. A child that failed changes nothing: the in-process build fails
# with the real error. Its output: warm_log(RUN_ID).
WARM_STAGES = {"engine": ("engine",), "registry": ("engine",), "test_base": ("engine", "base"),
               "smoke_build": ("engine", "base", "x86_64"), "smoke_image": ("engine", "base", "x86_64"),
               "smoke_sqsh": ("engine", "base", "x86_64"), "smoke_arm64": ("engine", "base", "aarch64")}
WARM_ORDER = ("engine", "base", "x86_64", "aarch64")
RUN_ID = "single"  # conftest sets it: the run's id, shared by its xdist workers
_warm: list[tuple[subprocess.Popen, Path]] = []


def _warm_file(run: str, suffix: str) -> Path:
    return devengine.state_dir() / f"test-warm-{run}.{suffix}"


def warm_log(run: str) -> Path:
    return _warm_file(run, "log")


def warm_stages(fixturenames) -> list[str]:
    """The stages of WARM_ORDER that tests using FIXTURENAMES (all of them, any order) need."""
    wanted = {s for name in fixturenames for s in WARM_STAGES.get(name, ())}
    return [s for s in WARM_ORDER if s in wanted]


def warm_rank(fixturenames) -> int:
    """How far into WARM_ORDER a test using FIXTURENAMES waits (0: none of it)."""
    stages = warm_stages(fixturenames)
    return WARM_ORDER.index(stages[-1]) + 1 if stages else 0


def warm_start(stages: list[str]) -> None:
    """Run STAGES in a child (`python tests/enginefix.py STAGE...`) unless another process of this run did."""
    if not stages:
        return
    lock = _warm_file(RUN_ID, "lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    for old in lock.parent.glob("test-warm-*.log"):  # earlier runs'
        old.unlink(missing_ok=True)
    with open(warm_log(RUN_ID), "w") as out:
        child = subprocess.Popen([sys.executable, __file__, *stages], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
    _warm.append((child, lock))


def warm_wait(stage: str) -> None:
    """Until this run's child has done STAGE or ended; at once where the run has no child."""
    lock, log = _warm_file(RUN_ID, "lock"), warm_log(RUN_ID)
    while lock.exists():
        text = log.read_text() if log.exists() else ""
        pid = text.split("\n", 1)[0].removeprefix("warm: pid ")
        if f"warm: {stage} done" in text or "warm: end" in text or (pid.isdigit() and not pid_alive(int(pid))):
            return
        time.sleep(1)


def warm_stop() -> None:
    """End of the starter's session: a child still building (the session ended early) is stopped, the lock removed."""
    for child, lock in _warm:
        if child.poll() is None:  # its group: the docker/debootstrap processes it runs too (dockerd has its own)
            os.killpg(child.pid, signal.SIGTERM)
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
        lock.unlink(missing_ok=True)
    _warm.clear()


def _warm_run(stages: list[str]) -> None:
    steps = {"engine": engine_info, "base": base_ref, "x86_64": lambda: build_smoke("x86_64"),
             "aarch64": lambda: build_smoke("aarch64")}
    print(f"warm: pid {os.getpid()}", flush=True)
    try:
        for stage in stages:
            steps[stage]()
            print(f"warm: {stage} done", flush=True)
    finally:
        print("warm: end", flush=True)


@pytest.fixture(scope="session")
def engine():
    warm_wait("engine")
    return engine_info()


@pytest.fixture(scope="session")
def registry(engine):
    return engine["registry"]


@pytest.fixture(scope="session")
def test_base(engine):
    warm_wait("base")
    return base_ref()


@pytest.fixture(scope="session")
def smoke_build(engine):
    warm_wait("x86_64")
    return build_smoke("x86_64")


@pytest.fixture(scope="session")
def smoke_image(smoke_build):
    return smoke_build.refs[0]


@pytest.fixture(scope="session")
def smoke_sqsh(smoke_build, tmp_path_factory):
    """The x86_64 smoke image as an enroot .sqsh (zstd, the default; fixed SOURCE_DATE_EPOCH), exported once per session
    from smoke_build.image_id: its sidecars (.sha256, .cdx.json) and every test comparing with it name that one image,
    whatever a tag names by the time they run."""
    from builder.enroot import export_image

    d = tmp_path_factory.mktemp("smoke-sqsh")
    os.environ["SOURCE_DATE_EPOCH"] = "1700000000"
    try:
        return export_image(smoke_build.image_id, d / "smoke.sqsh", progress=False, arch="amd64")
    finally:
        del os.environ["SOURCE_DATE_EPOCH"]


@pytest.fixture(scope="session")
def smoke_arm64(engine):
    warm_wait("aarch64")
    return build_smoke("aarch64")


def image_id(ref: str) -> str | None:
    """The ID of the local image REF names, or None where it names none."""
    r = docker("image", "inspect", "--format", "{{.Id}}", ref, check=False)
    return r.stdout.strip() if r.returncode == 0 else None


def docker(*args: str, check: bool = True, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    """The engine's CLI (the one devenv.engine started or found), output captured as text."""
    r = subprocess.run([devengine.docker_cli(), *args], capture_output=True, text=True, timeout=timeout, **kw)
    if check and r.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n"
                             f"{r.stderr[-3000:]}")
    return r


if __name__ == "__main__":  # the warm-up child (warm_start)
    _warm_run(sys.argv[1:])
