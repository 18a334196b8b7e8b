"""The smoke cell for aarch64 (light profile: no torch, only what doctor/jupyter need), built on this x86 host under
QEMU from the arm64 half of the debootstrapped multi-arch base; it says arm64 and runs arm64 code."""

from __future__ import annotations

import json

import pytest

from enginefix import BUILD_TIMEOUT, docker

# a cold first build (debootstrap + the session images, arm64 under QEMU) runs inside the first test's setup
pytestmark = [pytest.mark.engine, pytest.mark.timeout(BUILD_TIMEOUT)]


def test_image_config_says_arm64(smoke_arm64):  # noqa: F811
    info = json.loads(docker("image", "inspect", smoke_arm64.refs[0]).stdout)[0]
    assert info["Architecture"] == "arm64" and info["Os"] == "linux"
    assert info["Config"]["Labels"]["io.trainbox.arch"] == "aarch64"
    assert smoke_arm64.platform == "linux/arm64" and smoke_arm64.arch == "aarch64"


def test_runs_arm64_code_under_qemu(smoke_arm64):  # noqa: F811
    r = docker("run", "--rm", "--platform", "linux/arm64", "--entrypoint", "python", smoke_arm64.refs[0], "-c",
               "import platform, trainbox; print(platform.machine(), trainbox.__file__)")
    assert r.stdout.split() == ["aarch64", "/opt/trainbox/trainbox/__init__.py"]


def test_doctor_runs_on_arm64(smoke_arm64):  # noqa: F811
    r = docker("run", "--rm", "--platform", "linux/arm64", smoke_arm64.refs[0], "doctor", "--json", check=False,
               timeout=900)
    # The image's own ENTRYPOINT (tini) starts under QEMU, and a CPU image on a CPU host is fit to train: exit 0.
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(r.stdout)
    assert report["verdict"] == "ok" and report["host"]["machine"] == "aarch64"
    assert "smoke-aarch64" in json.dumps(report)
    plain = docker("run", "--rm", "--platform", "linux/arm64", smoke_arm64.refs[0], "doctor", check=False,
                   timeout=900)
    assert plain.returncode == r.returncode and "aarch64" in plain.stdout
