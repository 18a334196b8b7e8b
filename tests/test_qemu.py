"""devenv/qemu.py's pure parts: the version it reads, the mirror it takes from the machine's own apt sources."""
from __future__ import annotations

from devenv import qemu


def test_parse_version():
    assert qemu.parse_version("qemu-aarch64 version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18+b3)\n") == (7, 2, 22)
    assert qemu.parse_version("qemu-aarch64 version 10.0.2 (Debian 1:10.0.2+ds-2)") >= qemu.MIN_VERSION
    assert qemu.parse_version("qemu-aarch64 version 7.2.22") < qemu.MIN_VERSION
    assert qemu.parse_version("no such thing") is None


def test_mirror_from_the_machines_sources_not_the_security_one(tmp_path):
    (tmp_path / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.invalid/debian-security\nSuites: bookworm-security\n\n"
        "Types: deb\nURIs: http://mirror.invalid/debian\nSuites: bookworm bookworm-updates\n")
    assert qemu.debian_mirror(tmp_path, tmp_path / "none.list") == "http://mirror.invalid/debian"
    text = qemu.backports_source("http://mirror.invalid/debian", "bookworm")
    assert "Suites: bookworm-backports\n" in text and "URIs: http://mirror.invalid/debian\n" in text


def test_mirror_from_a_one_line_list(tmp_path):
    (tmp_path / "sources.list").write_text("deb [arch=amd64] http://mirror.invalid/debian bookworm main\n")
    assert qemu.debian_mirror(tmp_path, tmp_path / "sources.list") == "http://mirror.invalid/debian"
