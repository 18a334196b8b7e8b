import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A 2-layer random Llama + locally trained BPE tokenizer with a chat template (no hub)."""
    from tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def pytest_collection_modifyitems(config, items):
    """`gpuimage` tests build a real CUDA image (several GB from the default index): deselected unless the -m
    expression names them (`make test-gpu-image`), so `make test` and `make test-fast` never start one."""
    if "gpuimage" in (config.getoption("-m") or ""):
        return
    keep = [i for i in items if i.get_closest_marker("gpuimage") is None]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("gpuimage") is not None])
        items[:] = keep
