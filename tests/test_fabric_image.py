"""The fabric layer really installs: the base stage of a rendered GPU Dockerfile (cu130-hopper-x86_64), built on
the debootstrapped bookworm base (the CUDA base image can't be pulled here; Ubuntu 24.04 has the same package names),
holds the RDMA userspace NCCL dlopens for its InfiniBand/RoCE transport: libibverbs.so.1 (by that soname), librdmacm
and the verbs providers (mlx5 for ConnectX, efa for AWS), in the same apt layer as the base's other packages."""
from __future__ import annotations

import pytest

from enginefix import BUILD_TIMEOUT, ROOT, docker, install_certs

pytestmark = [pytest.mark.engine, pytest.mark.timeout(BUILD_TIMEOUT)]
CELL = "cu130-hopper-x86_64"


def test_gpu_base_stage_carries_the_rdma_userspace(test_base):  # noqa: F811
    install_certs()
    tag = f"trainbox-test/fabric:{CELL}-base"
    docker("build", "--network", "host", "--target", "base", "--build-arg", f"BASE_IMAGE={test_base}",
           "-f", f"images/{CELL}/Dockerfile", "-t", tag, ".", cwd=ROOT, timeout=1200)
    try:
        libs = docker("run", "--rm", "--network", "none", "--entrypoint", "ldconfig", tag, "-p").stdout
        for soname in ("libibverbs.so.1", "librdmacm.so.1"):
            assert soname in libs, soname
        providers = docker("run", "--rm", "--network", "none", "--entrypoint", "sh", tag, "-c",
                           "ls /usr/lib/*-linux-gnu/libibverbs/").stdout.split()
        assert any(p.startswith("libmlx5-rdmav") for p in providers), providers
        assert any(p.startswith("libefa-rdmav") for p in providers), providers
        # The verbs tools run (no HCA in a build container: an empty list, not a missing library).
        r = docker("run", "--rm", "--network", "none", "--entrypoint", "ibv_devices", tag, check=False)
        assert "error while loading shared libraries" not in r.stderr, r.stderr
        # One apt layer: the fabric rides with the base's other packages (shared by every cell of this base).
        history = docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", tag).stdout
        assert sum("apt-get install" in line for line in history.splitlines()) == 1
        assert "ibverbs-providers" in history
    finally:
        docker("rmi", "-f", tag, check=False)
