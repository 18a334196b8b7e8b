import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import enginefix  # noqa: E402
from devenv import slurm as devslurm  # noqa: E402

# The session fixtures live here, once, for every module: a fixture a test module imports is that module's own copy,
# and "session" scope then means once per importing module (the smoke .sqsh was exported five times, the test Slurm
# started and stopped four times). Test modules import only enginefix's helpers (docker, BUILD_TIMEOUT, ...);
# tests/test_shared_fixtures.py fails on a module that imports a session fixture.
from enginefix import engine, registry, smoke_arm64, smoke_build, smoke_image, smoke_sqsh, test_base  # noqa: E402,F401


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A 2-layer random Llama + locally trained BPE tokenizer with a chat template (no hub)."""
    from tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="session")
def slurm_cluster():
    """The test Slurm (devenv.slurm): the one-node partition plus two netns nodes, up once for the session's job tests,
    stopped at the end only if this session started it."""
    was_up = devslurm.answers(devslurm.load_state(), netns_nodes=2)
    info = devslurm.up(cpus=max(2, os.cpu_count() or 2), netns_nodes=2)
    yield dict(os.environ, SLURM_CONF=info["conf"]), info["netns_partition"]
    if not was_up:
        devslurm.down()


@pytest.fixture(scope="session")
def slurm(slurm_cluster):
    """The env (SLURM_CONF) of the test Slurm, whose default partition is this host's one node."""
    return slurm_cluster[0]


@pytest.fixture(scope="session")
def slurm2(slurm_cluster):
    """(env, partition): the test Slurm and the partition of its two netns nodes."""
    return slurm_cluster


# What the whole suite (engine tests included) took of the disk at its peak over its start, Debian packages already
# installed: images, build cache, .sqsh files, rootfs trees, venvs, caches (a CI-like rehearsal, 2026-11-28: 20.1 GB).
DISK_NEEDED_GB = 20  # README's "Set up" gives the same figure


def pytest_report_header(config):
    """The free disk under the temp dir and Docker's data root, so that a run that fills it says so up front."""
    import shutil
    import tempfile

    places = {}
    for where in (tempfile.gettempdir(), "/var/lib/docker" if os.path.isdir("/var/lib/docker") else "/"):
        places.setdefault(os.stat(where).st_dev, []).append(where)
    lines = []
    for names in places.values():
        free = shutil.disk_usage(names[0]).free / 2**30
        low = f" - LOW: the whole suite needs about {DISK_NEEDED_GB} GB" if free < DISK_NEEDED_GB else ""
        lines.append(f"disk: {free:.1f} GB free under {' and '.join(names)}{low}")
    return lines


ENGINE_OR_SLURM = {"engine", "slurm"}


def _needs_engine_or_slurm(item) -> bool:
    return any(item.get_closest_marker(m) for m in ENGINE_OR_SLURM) or any(
        enginefix.WARM_STAGES.get(f) or f.startswith("slurm") for f in getattr(item, "fixturenames", ()))


@pytest.hookimpl(trylast=True)  # after -m/-k deselection: the order and the warm-up follow what will run
def pytest_collection_modifyitems(config, items):
    """`gpuimage` tests build a real CUDA image (several GB from the default index): deselected unless the -m
    expression names them (`make test-gpu-image`), so `make test` and `make test-fast` never start one.

    Then the modules with no test that needs the engine or Slurm run first (whole modules: a module's own fixtures
    are set up once), while the session builds warm up in a child (enginefix.warm_start)."""
    if "gpuimage" not in (config.getoption("-m") or ""):
        keep = [i for i in items if i.get_closest_marker("gpuimage") is None]
        if len(keep) != len(items):
            config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("gpuimage") is not None])
            items[:] = keep
    heavy = {i.path for i in items if _needs_engine_or_slurm(i)}
    items.sort(key=lambda i: i.path in heavy)  # stable: file order within each part
    if not config.option.collectonly:
        enginefix.warm_start(enginefix.warm_stages({f for i in items for f in getattr(i, "fixturenames", ())}))


def pytest_sessionfinish(session):
    enginefix.warm_stop()
