"""The report's registry line: bytes a registry stores (each blob once) against the sum of the images' sizes."""
from builder.engine import BuildResult
from builder.report import storage, table


def _res(tag, blobs):
    return BuildResult(cell=tag, tag=tag, arch="x86_64", platform="linux/amd64", builder="buildkit", blobs=blobs)


def test_shared_layers_are_counted_once():
    venv = {"sha256:venv": 4_000_000_000, "sha256:base": 100_000_000}
    a = _res("cu130-hopper-x86_64", {**venv, "sha256:cfg-a": 10_000, "sha256:record-a": 1_000})
    b = _res("cu130-blackwell-x86_64", {**venv, "sha256:cfg-b": 10_000, "sha256:record-b": 1_000})
    s = storage([a, b])
    assert s["stored_bytes"] == 4_100_022_000 and s["images_bytes"] == 2 * 4_100_011_000
    assert s["stored_bytes"] <= 1.1 * s["largest_image_bytes"] and s["ratio"] == 0.5
    assert "registry stores 4100.0 MB for 2 image(s) of 8200.0 MB together (50.0 %" in table([a, b])


def test_nothing_pushed_no_line():
    assert storage([_res("smoke-x86_64", {})]) is None
    assert "registry stores" not in table([_res("smoke-x86_64", {})])
