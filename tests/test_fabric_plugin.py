"""NCCL net plugins (matrix.toml [fabric.plugins.NAME], a cell's `fabric_plugin`): validation of the pinned sources
(one-line UserError naming the field), the rendered fabric-plugin stage (devel image, pinned commit, only the prefix
reaches the runtime, hadolint-clean), committed files untouched, and the emulation refusal naming the stage."""
import subprocess

import pytest

from builder import engine as eng, render
from builder.errors import UserError
from builder.matrix import load_matrix
from builder.paths import ROOT
from tests.test_render import hadolint, instructions

MATRIX = (ROOT / "matrix.toml").read_text()
EFA_CELL = '''
[[cell]]
name = "efa"
arch = ["x86_64", "aarch64"]
cuda = "13.0"
gpu = "hopper"
base_image = "nvidia/cuda:13.0.2-base-ubuntu24.04"
python = "3.12"
stack = "gpu"
fabric_plugin = "efa"
'''
LIBFABRIC = "5de2d6a2df83595bcc38531cb91bf59495559495"
OFI = "2475c4c736907e68ebeadb3848f31231ee4a44d0"


def load(tmp_path, text):
    p = tmp_path / "matrix.toml"
    p.write_text(text)
    return load_matrix(p)


@pytest.fixture(scope="module")
def efa(tmp_path_factory):
    m = load(tmp_path_factory.mktemp("efa"), MATRIX + EFA_CELL)
    return {c.tag: c for c in m.cells if c.name == "efa"}


def test_the_default_matrix_defines_efa_but_no_cell_uses_it():
    m = load_matrix(ROOT / "matrix.toml")
    assert "efa" in m.data["fabric"]["plugins"]
    assert not any(c.fabric_plugin for c in m.cells)
    for c in m.cells:
        text = (ROOT / c.dockerfile).read_text()
        assert "fabric-plugin" not in text and "/opt/nccl-net" not in text
        assert render.render(c) == text            # the option changes nothing in the committed files


def test_the_rendered_stage_builds_from_the_devel_image_and_the_runtime_copies_only_the_prefix(efa, tmp_path):
    cell = efa["efa-x86_64"]
    assert cell.has_compile_stage and not cell.has_source_stage
    text = render.render(cell)
    ins = instructions(text)
    froms = [rest for op, rest in ins if op == "FROM"]
    assert "${BUILD_IMAGE} AS fabric-plugin" in froms
    assert f"ARG BUILD_IMAGE={cell.build_image}" in text and cell.build_image.endswith("-devel-ubuntu24.04")
    stage = text.split("AS fabric-plugin", 1)[1].split("\nFROM ", 1)[0]
    for commit in (LIBFABRIC, OFI):
        assert "git fetch -q --depth 1" in stage and commit in stage
        assert f'test "$(git rev-parse HEAD)" = "{commit}"' in stage
    assert "./configure --prefix=/opt/nccl-net --enable-efa=yes" in stage
    assert "--with-libfabric=/opt/nccl-net --with-cuda=/usr/local/cuda --enable-platform-aws --disable-tests" in stage
    assert "libhwloc-dev" in stage and "autoconf" in stage
    assert "[ ! -e /opt/nccl-net/lib/libnccl-net.so ]" in stage
    runtime = text.split("AS runtime", 1)[1]
    copies = [rest for op, rest in instructions(runtime) if op == "COPY" and "fabric-plugin" in rest]
    assert copies == ["--from=fabric-plugin /opt/nccl-net/ /opt/nccl-net/"]
    assert "LD_LIBRARY_PATH=/opt/nccl-net/lib:/usr/local/nvidia/lib" in runtime
    assert "NCCL_" not in runtime                  # the job's NCCL_* settings are never shadowed
    base = text.split("AS base", 1)[1].split("\nFROM ", 1)[0]
    assert "libhwloc15" in base and "libnuma1" in base and "libhwloc-dev" not in base
    assert "git" not in base.split("apt-get install", 1)[1].split("\n")[0].split()
    record = render.image_record(cell)
    assert record["fabric_plugin"] == "efa" and 'io.trainbox.fabric_plugin="efa"' in text
    df = tmp_path / "Dockerfile"
    df.write_text(text)
    p = subprocess.run([hadolint(), "--no-color", "--failure-threshold", "error", str(df)], capture_output=True,
                       text=True, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr


def test_a_tarball_source_is_fetched_and_checked_by_sha256(tmp_path):
    sha = "a" * 64
    text = MATRIX.replace(f'source = "git+https://github.com/ofiwg/libfabric@{LIBFABRIC}"',
                          'source = "https://example.invalid/libfabric-2.6.0.tar.bz2", sha256 = "' + sha + '"')
    assert text != MATRIX
    cell = {c.tag: c for c in load(tmp_path, text + EFA_CELL).cells}["efa-x86_64"]
    out = render.render(cell)
    assert f'echo "{sha}  /tmp/trainbox/libfabric.tar" | sha256sum -c -' in out
    df = tmp_path / "Dockerfile"
    df.write_text(out)
    p = subprocess.run([hadolint(), "--no-color", "--failure-threshold", "error", str(df)], capture_output=True,
                       text=True, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr


BAD = [
    (f"@{OFI}", "@v1.21.1", "builds[1].source", "not pinned to a commit"),
    (f"@{OFI}", f"@{OFI[:12]}", "builds[1].source", "not pinned to a commit"),
    (f'source = "git+https://github.com/ofiwg/libfabric@{LIBFABRIC}"',
     'source = "https://example.invalid/libfabric-2.6.0.tar.bz2"', "builds[0].sha256", "needs sha256"),
    (f'source = "git+https://github.com/ofiwg/libfabric@{LIBFABRIC}"',
     'source = "https://example.invalid/libfabric.tar.gz", sha256 = "abc"', "builds[0].sha256", "needs sha256"),
    (f'source = "git+https://github.com/ofiwg/libfabric@{LIBFABRIC}"',
     'source = "ftp://example.invalid/libfabric.tar.gz"', "builds[0].source", "neither git+https"),
    (f'source = "git+https://github.com/ofiwg/libfabric@{LIBFABRIC}"',
     f'source = "git+https://github.com/ofiwg/libfabric@{LIBFABRIC}", sha256 = "{"a" * 64}"', "builds[0].sha256",
     "pinned by its commit"),
    ('"--disable-tests"', '"--disable-tests; curl x"', "plugins.efa.builds[1]", "not a configure flag"),
    ('"--disable-tests"', '"--prefix=/usr"', "builds[1].configure", "--prefix comes from"),
    ('prefix = "/opt/nccl-net"', 'prefix = "opt/nccl net"', "plugins.efa", "not an absolute path"),
    ('packages = ["libhwloc15", "libnuma1"]', 'packages = ["libhwloc15 && curl"]', "plugins.efa", "Debian package"),
    ('library = "lib/libnccl-net.so"\n', "", "plugins.efa", "missing required key 'library'"),
    ('description = "AWS EFA', 'descripton = "AWS EFA', "plugins.efa", "unknown key 'descripton'"),
]


@pytest.mark.parametrize("old,new,where,needle", BAD)
def test_bad_plugin_fields_are_one_line_errors_naming_the_field(tmp_path, old, new, needle, where):
    assert MATRIX.count(old) >= 1
    with pytest.raises(UserError) as e:
        load(tmp_path, MATRIX.replace(old, new, 1) + EFA_CELL)
    msg = str(e.value)
    assert needle in msg and where in msg and "\n" not in msg.strip(), msg


def test_a_cell_naming_an_unknown_plugin_or_without_cuda_is_refused(tmp_path):
    with pytest.raises(UserError, match=r"cell\[1\]\.fabric_plugin: unknown fabric plugin 'tcpx'"):
        load(tmp_path, MATRIX + EFA_CELL.replace('"efa"\n', '"tcpx"\n'))
    cpu = ('\n[[cell]]\nname = "cpu-efa"\narch = "x86_64"\ntorch_variant = "cpu"\nbase_image = "debian:bookworm"\n'
           'python = "3.11"\nstack = "light"\nfabric_plugin = "efa"\n')
    with pytest.raises(UserError, match=r"needs a CUDA cell"):
        load(tmp_path, MATRIX + cpu)


def test_emulation_refuses_the_plugin_stage_and_a_native_builder_allows_it(efa, monkeypatch):
    monkeypatch.setattr(eng, "host_arch", lambda: "x86_64")
    x86, arm = efa["efa-x86_64"], efa["efa-aarch64"]
    assert not eng.compiles_under_emulation(x86)
    assert eng.compiles_under_emulation(arm) and not eng.compiles_under_emulation(arm, native_builder=True)
    with pytest.raises(UserError) as e:
        eng.refuse_emulated_compile([x86, arm])
    msg = str(e.value)
    assert "efa-aarch64 compiles" in msg and "the efa NCCL net plugin (stage fabric-plugin)" in msg
    assert "python build.py efa-x86_64" in msg
    eng.refuse_emulated_compile([arm], native_builder=True)
    args = eng.cell_build_args(arm, bases={arm.build_image: "local/devel:1"})
    assert args["BUILD_IMAGE"] == "local/devel:1"
