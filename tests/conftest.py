import json
import os
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import enginefix  # noqa: E402
from common import atomic  # noqa: E402
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
DISK_NEEDED_GB = 20  # docs/getting-started.md gives the same figure


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
HEAVY_GROUP = "engine-and-slurm"


def _needs_engine_or_slurm(item) -> bool:
    return any(item.get_closest_marker(m) for m in ENGINE_OR_SLURM) or any(
        enginefix.WARM_STAGES.get(f) or f.startswith("slurm") for f in getattr(item, "fixturenames", ()))


def _groups_file(run: str) -> Path:
    return Path(tempfile.gettempdir()) / f"trainbox-test-groups-{run}.json"


def pytest_configure(config):
    # One id for the whole run, its xdist workers' too (enginefix's warm-up starts once a run; the groups file).
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        config.option.testrunuid = config.option.testrunuid or uuid.uuid4().hex  # the xdist controller
    enginefix.RUN_ID = (getattr(config, "workerinput", {}).get("testrunuid")
                        or getattr(config.option, "testrunuid", None) or uuid.uuid4().hex)


def pytest_collection_modifyitems(config, items):
    """`gpuimage` tests build a real CUDA image (several GB from the default index): deselected unless the -m
    expression names them (`make test-gpu-image`), so `make test` and `make test-fast` never start one.

    Then the order (whole modules: a module's own fixtures are set up once). The session builds warm up in a child
    (enginefix.warm_start), so the modules that need the engine or Slurm go in the order of the builds they wait for.
    In one process the others go first, while the child builds. Under xdist (`make test`: -n 2) the modules needing
    the engine or Slurm go first and are one unit of work (pytest_xdist_make_scheduler), so one worker runs them
    all (one engine, one test Slurm, started once) and the other worker every other module."""
    if "gpuimage" not in (config.getoption("-m") or ""):
        keep = [i for i in items if i.get_closest_marker("gpuimage") is None]
        if len(keep) != len(items):
            config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("gpuimage") is not None])
            items[:] = keep
    heavy, rank = set(), {}
    for i in items:
        if _needs_engine_or_slurm(i):
            heavy.add(i.path)
        rank[i.path] = max(rank.get(i.path, 0), enginefix.warm_rank(getattr(i, "fixturenames", ())),
                           AFTER_BUILDS if i.get_closest_marker("after_builds") else 0)
    worker = hasattr(config, "workerinput")
    items.sort(key=lambda i: ((i.path not in heavy) if worker else (i.path in heavy), rank[i.path]))  # stable
    if worker:  # for the controller's scheduler, which sees node ids only (every worker writes the same)
        groups = {i.nodeid.split("::")[0]: HEAVY_GROUP for i in items if i.path in heavy}
        atomic.write_text(_groups_file(enginefix.RUN_ID), json.dumps(groups))


# A load-sensitive module (marked after_builds) goes after every module that waits for a warm-up build, and its
# tests wait for the build child to end: the 2-node Ray jobs, whose nodes missed Ray's fixed startup waits on the
# loaded 2-core machine (their cause and fix: trainbox/cli/ray_cluster.py RAY_START).
AFTER_BUILDS = len(enginefix.WARM_ORDER) + 1


def pytest_runtest_setup(item):
    if item.get_closest_marker("after_builds"):
        enginefix.warm_wait(enginefix.WARM_ORDER[-1])  # at once where this run builds nothing


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's loadscope with whole modules as units, and the engine-and-Slurm modules one unit (xdist's own
    loadgroup marks have no effect under pytest 9: it renames items through a field pytest no longer reads)."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleGroups(LoadScopeScheduling):
        groups: dict | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                self.groups = json.loads(_groups_file(enginefix.RUN_ID).read_text())
            module = nodeid.split("::")[0]
            return self.groups.get(module, module)

    return ModuleGroups(config, log)


def pytest_collection_finish(session):
    """After -m/-k deselection: the warm-up builds what the tests that will run need."""
    if not session.config.option.collectonly:
        enginefix.warm_start(enginefix.warm_stages({f for i in session.items for f in getattr(i, "fixturenames", ())}))


def pytest_sessionfinish(session):
    enginefix.warm_stop()
    if not hasattr(session.config, "workerinput"):
        _groups_file(enginefix.RUN_ID).unlink(missing_ok=True)
