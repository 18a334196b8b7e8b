"""Issue 29's hostile cases on `python -m builder.slurm` and the output targets every host writer shares
(#1 injection through --log-dir, #2 and #7 output targets, #16 Slurm's limits, #17 options of other commands).
Each: exit 2, one `error:` line, nothing written or replaced."""
from __future__ import annotations

import os
import socket
import stat
import subprocess
from pathlib import Path

import pytest

from builder import options, sbom, sbomgen, slurm
from builder.errors import UserError
from common import atomic
from test_fuzz_cli import call  # noqa: E402  (the one in-process CLI runner of the tests)

SL = ["--tag", "smoke-x86_64", "--entrypoint", "sft", "--sqsh", "/shared/x.sqsh", "--nodes", "2",
      "--config", "/data/a.yaml"]


def refused(rc: int, err: str, needle: str) -> None:
    assert "Traceback" not in err, err
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("error: ") and needle in err, (rc, err)


# ------------------------------------------------------------------ #2, #7: output targets (one rule, every writer)

# Never /dev/null itself: a regression (or this test run without the fix, as root) would replace the machine's
# /dev/null with a file. A new name under /dev shows the rule; the device node is made in tmp (root) or linked to.
DEV = Path(f"/dev/trainbox-hostile-{os.getpid()}.sqsh")


@pytest.fixture(autouse=True)
def _no_file_left_in_dev():
    yield
    if DEV.is_file() and not DEV.is_symlink():
        DEV.unlink()
        pytest.fail(f"{DEV} was written")


def _targets(tmp: Path) -> dict[str, tuple[Path, str]]:
    """Paths a write must not replace, with the reason's words."""
    (tmp / "folder").mkdir()
    os.mkfifo(tmp / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp / "sock"))
    (tmp / "dangling").symlink_to(tmp / "nowhere")
    (tmp / "loop").symlink_to(tmp / "loop")
    (tmp / "to-proc").symlink_to("/proc/self/status")   # stat says a regular file; it lies under /proc
    return {"/proc/t.sh": (Path("/proc/t.sh"), "under /proc"), "/sys/t.sh": (Path("/sys/t.sh"), "under /sys"),
            "/dev/x.sqsh": (DEV, "under /dev"),
            "folder": (tmp / "folder", "is a folder"), "fifo": (tmp / "fifo", "named pipe"),
            "socket": (tmp / "sock", "socket"), "dangling": (tmp / "dangling", "broken symbolic link"),
            "loop": (tmp / "loop", "can't be followed"), "to-proc": (tmp / "to-proc", "under /proc")}


def _snapshot(tmp: Path) -> dict[str, tuple[int, str | None]]:
    return {p.name: (p.lstat().st_mode, os.readlink(p) if p.is_symlink() else None) for p in tmp.iterdir()}


@pytest.mark.parametrize("which", ["/proc/t.sh", "/sys/t.sh", "/dev/x.sqsh", "folder", "fifo", "socket",
                                   "dangling", "loop", "to-proc"])
def test_slurm_and_sbom_refuse_what_a_write_would_destroy(tmp_path, monkeypatch, which):
    """#2 (a traceback before) and #7 (the node or link replaced by a regular file, exit 0)."""
    path, needle = _targets(tmp_path)[which]
    before = _snapshot(tmp_path)
    refused(*call(slurm.main, *SL, "-o", str(path))[::2], needle)
    monkeypatch.setattr(sbomgen, "generate", lambda image, *a, **k: {"x": 1})   # no engine: the check comes first
    refused(*call(sbom.main, "--output", str(path), "trainbox:smoke-x86_64")[::2], needle)
    assert _snapshot(tmp_path) == before


def test_the_shared_check_and_the_writer_refuse_alike(tmp_path):
    """build.py --report, builder.sbom, builder.slurm and builder.enroot's .sqsh all call options.check_file_target
    (or atomic.why_not_a_file); the writer itself refuses too, so a caller that forgot to check fails closed."""
    for path, needle in _targets(tmp_path).values():
        with pytest.raises(UserError, match=needle):
            options.check_file_target(path, "--report")
        with pytest.raises(atomic.UnwritableTarget):
            atomic.write_text(path, "x")
        with pytest.raises(atomic.UnwritableTarget):
            atomic.write_all({path: "x"})
    assert "under /dev" in atomic.why_not_a_file("/dev/null")   # what builder.enroot's check needs
    assert atomic.why_not_a_file("/dev/shm/x.sqsh") in (None, f"/dev/shm is not writable by this user "
                                                              f"(uid {os.getuid()})")


@pytest.mark.skipif(os.geteuid() != 0, reason="making a device node needs root")
def test_a_device_node_is_not_replaced(tmp_path):
    node = tmp_path / "null"
    os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    (tmp_path / "link").symlink_to(node)
    refused(*call(slurm.main, *SL, "-o", str(node))[::2], "character device")
    refused(*call(slurm.main, *SL, "-o", str(tmp_path / "link"))[::2], "character device")
    assert stat.S_ISCHR(node.lstat().st_mode) and (tmp_path / "link").is_symlink()


def test_a_link_to_a_regular_file_is_written_through(tmp_path):
    """The decision: a symbolic link to a regular file is followed (as `>` would): the target gets the new text
    and keeps its mode, the link stays a link."""
    (tmp_path / "jobs").mkdir()
    target = tmp_path / "jobs" / "v3.sh"
    target.write_text("old\n")
    target.chmod(0o640)
    link = tmp_path / "job.sh"
    link.symlink_to("jobs/v3.sh")
    rc, out, err = call(slurm.main, *SL, "-o", str(link))
    assert rc == 0, err
    assert link.is_symlink() and os.readlink(link) == "jobs/v3.sh"
    assert target.read_text().startswith("#!/bin/bash\n") and stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.sh", "jobs"]
    assert sorted(p.name for p in (tmp_path / "jobs").iterdir()) == ["v3.sh"]
    atomic.write_all({link: "all\n"})
    assert link.is_symlink() and target.read_text() == "all\n" and stat.S_IMODE(target.stat().st_mode) == 0o640


def test_a_new_file_in_a_folder_is_written(tmp_path):
    rc, _, err = call(slurm.main, *SL, "-o", str(tmp_path / "j.sh"))
    assert rc == 0, err
    assert subprocess.run(["bash", "-n", str(tmp_path / "j.sh")]).returncode == 0


# ------------------------------------------------------------------ #1: nothing a value holds becomes a command

def test_a_newline_in_log_dir_is_refused_not_run(tmp_path):
    """#1: the line landed in `#SBATCH --output=` and ran before `set -euo pipefail`."""
    rc, _, err = call(slurm.main, *SL, "-o", str(tmp_path / "j.sh"), "--log-dir", "/logs\necho INJECTED;#")
    refused(rc, err, "--log-dir '/logs\\necho INJECTED;#' holds the control character '\\n'")
    assert list(tmp_path.iterdir()) == []


BARE = ["--tag", "t", "--mode", "bare", "--workdir", "/repo", "--config", "/c.yaml"]
VERL = ["--tag", "t", "--entrypoint", "verl-ppo", "--sqsh", "/s/t.sqsh"]


@pytest.mark.parametrize("base, option", [
    (SL, ["--tag", "{v}"]), (SL, ["--config", "{v}"]), (SL, ["--sqsh", "/s/{v}.sqsh"]), (SL, ["--partition", "{v}"]),
    (SL, ["--account", "{v}"]), (SL, ["--time", "10{v}"]), (SL, ["--log-dir", "{v}"]), (SL, ["--data", "/d{v}"]),
    (SL, ["--outputs", "/o{v}"]), (SL, ["--hf-cache", "/h{v}"]), (SL, ["--mount", "/a{v}:/b"]),
    (SL, ["--env", "A={v}"]), (SL, ["--env", "A{v}=1"]), (SL, ["--", "--max_steps", "{v}"]),
    (BARE, ["--python", "{v}"]), (BARE, ["--workdir", "/r{v}"]), (VERL, ["--module", "m{v}"]),
    (VERL, ["--ray-arg", "{v}"]), (VERL, ["--", "data.x={v}"]),
])
@pytest.mark.parametrize("char", ["\n", "\r", "\x0b", "\x1b", "\u2028", "\x85"])
def test_a_control_character_in_any_option_is_one_error(tmp_path, base, option, char):
    argv = [*base, "-o", str(tmp_path / "j.sh"), *(a.format(v=f"x{char}echo INJECTED") for a in option)]
    rc, _, err = call(slurm.main, *argv)
    refused(rc, err, "")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("option, needle", [
    (["--log-dir", "/my logs"], "goes into an #SBATCH line"), (["--log-dir", "/logs#x"], "goes into an #SBATCH line"),
    (["--log-dir", "/l'o\"g"], "goes into an #SBATCH line"), (["--log-dir", "/a\\b"], "goes into an #SBATCH line"),
    (["--log-dir", "/logs/$(id)"], "goes into an #SBATCH line"), (["--log-dir", ""], "goes into an #SBATCH line"),
    (["--log-dir", "/logs/HetJob"], "blanks out 'hetjob'"), (["--partition", "packjob"], "blanks out 'packjob'"),
    (["--tag", "a b"], "goes into an #SBATCH line"), (["--account", "a;b"], "goes into an #SBATCH line"),
])
def test_values_of_sbatch_lines_are_plain(tmp_path, option, needle):
    """sbatch reads #SBATCH lines itself (quotes, '\\', '#', white space; 'hetjob' blanked): refused, with why."""
    rc, _, err = call(slurm.main, *SL, "-o", str(tmp_path / "j.sh"), *option)
    refused(rc, err, needle)
    assert list(tmp_path.iterdir()) == []


def test_shell_values_stay_quoted(tmp_path):
    """Spaces and shell characters where the shell reads them: quoted, one word each."""
    rc, out, err = call(slurm.main, *SL[:-1], "/data/my config;$(id).yaml", "--env", "A=x y `id`", "--log-dir",
                        "/lus/logs/%u", "--", "--run_name", "a b")
    assert rc == 0, err
    assert "export A='x y `id`'" in out and "ARGS=(sft --config '/data/my config;$(id).yaml' --run_name 'a b')" in out
    assert "#SBATCH --output=/lus/logs/%u/%x-%j.out" in out
    assert subprocess.run(["bash", "-n"], input=out, text=True).returncode == 0


# ------------------------------------------------------------------ #16: Slurm's own limits

@pytest.mark.parametrize("option, needle", [
    (["--nodes", "99999999999999999999"], "--nodes 99999999999999999999 is more than Slurm accepts (2147483647)"),
    (["--nodes", "2147483648"], "more than Slurm accepts"), (["--gpus-per-node", "2147483648"], "more than Slurm"),
    (["--cpus-per-task", "9" * 30], "more than Slurm"), (["--nproc-per-node", "2147483648"], "more than Slurm"),
    (["--grace", "70000"], "--grace 70000 is not 0 to 65535 seconds"), (["--grace", "-1"], "is not 0 to 65535"),
    (["--time", "1", "--grace", "300"], "--grace 300 is not shorter than the time limit (--time 1: 60 s)"),
    (["--time", "5:00"], "not shorter than the time limit (--time 5:00: 300 s)"),          # MM:SS
    (["--time", "0:04:59"], "(--time 0:04:59: 300 s)"),                                     # H:MM:SS, to the minute
    (["--time", "0-1", "--grace", "3600"], "(--time 0-1: 3600 s)"),                          # D-H
    (["--time", "0-0:5"], "is not shorter"),                                                 # D-H:MM
    (["--time", "0-0:4:30"], "is not shorter"),                                              # D-H:MM:SS
    (["--time", "2h"], "is not a Slurm time"), (["--time", "1:2:3:4"], "is not a Slurm time"),
    (["--time", "99999999-0"], "longer than Slurm can hold"), (["--nodes", "two"], "invalid int value"),
])
def test_values_beyond_slurms_limits_are_refused(tmp_path, option, needle):
    rc, _, err = call(slurm.main, *SL, "-o", str(tmp_path / "j.sh"), *option)
    refused(rc, err, needle)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("option, signal", [
    (["--time", "1", "--grace", "59"], "USR1@59"), (["--time", "5:01"], "USR1@300"), (["--time", "0-1"], "USR1@300"),
    (["--time", "UNLIMITED", "--grace", "65535"], "USR1@65535"), (["--time", "0", "--grace", "3000"], "USR1@3000"),
    (["--time", "infinite"], "USR1@300"), (["--nodes", "2147483647"], "USR1@300"),
])
def test_values_within_slurms_limits_render(option, signal):
    rc, out, err = call(slurm.main, *SL, *option)
    assert rc == 0 and f"#SBATCH --signal={signal}\n" in out, err
    assert slurm.time_limit("1-00:00:00") == 86400 and slurm.time_limit("90") == 5400
    assert slurm.time_limit("1:30") == 120 and slurm.time_limit("UNLIMITED") is None


# ------------------------------------------------------------------ #17: options other jobs would ignore or refuse

@pytest.mark.parametrize("argv, needle", [
    (["--entrypoint", "nccl-check", "--sqsh", "/s/t.sqsh", "--config", "/data/a.yaml"],
     "--config: nccl-check takes no YAML config"),
    (["--entrypoint", "ray", "--sqsh", "/s/t.sqsh", "--config", "/data/a.yaml", "--", "python", "d.py"],
     "--config: ray takes no YAML config"),
    (["--entrypoint", "verl-ppo", "--sqsh", "/s/t.sqsh", "--config", "/data/a.yaml"], "not --config"),
    (["--entrypoint", "ray", "--sqsh", "/s/t.sqsh", "--nproc-per-node", "2", "--", "python", "d.py"],
     "--nproc-per-node: `trainbox ray`"),
    (["--entrypoint", "verl-sft", "--sqsh", "/s/t.sqsh", "--grace", "120"], "--grace: verl-sft jobs get no warning"),
    (["--entrypoint", "sft", "--sqsh", "/s/t.sqsh", "--config", "/c.yaml", "--python", "/v/bin/python"],
     "--python/--workdir are for --mode bare"),
    (["--entrypoint", "sft", "--mode", "enroot", "--sqsh", "/s/t.sqsh", "--config", "/c.yaml", "--workdir", "/r"],
     "--python/--workdir are for --mode bare"),
    (["--entrypoint", "grpo", "--sqsh", "/s/t.sqsh", "--config", "/c.yaml", "--vllm-nodes", "1"], "leaves no node"),
    (["--entrypoint", "sft", "--sqsh", "/s/t.sqsh", "--config", "/c.yaml", "--nodes", "2", "--vllm-nodes", "1"],
     "only grpo has a vLLM server"),
    (["--entrypoint", "grpo", "--sqsh", "/s/t.sqsh", "--config", "/c.yaml", "--module", "m"], "are for verl jobs"),
])
def test_an_option_the_job_would_not_honour_is_refused(tmp_path, argv, needle):
    """#17: `--entrypoint nccl-check --config X` rendered `nccl-check --config X`, which every node refused."""
    rc, _, err = call(slurm.main, "--tag", "t", "-o", str(tmp_path / "j.sh"), *argv)
    refused(rc, err, needle)
    assert list(tmp_path.iterdir()) == []


def test_options_in_their_scope_still_render():
    ok = [["--entrypoint", "nccl-check", "--sqsh", "/s/t.sqsh", "--", "--max-bytes", "256M"],
          ["--entrypoint", "sft", "--mode", "bare", "--config", "/c.yaml", "--workdir", "/r", "--python", "/v/py"],
          ["--entrypoint", "ray", "--sqsh", "/s/t.sqsh", "--grace", "60", "--", "python", "d.py"],
          ["--entrypoint", "verl-sft", "--sqsh", "/s/t.sqsh", "--nproc-per-node", "2"]]
    for argv in ok:
        rc, out, err = call(slurm.main, "--tag", "t", *argv)
        assert rc == 0 and out.startswith("#!/bin/bash\n"), (argv, err)
    assert "export TRAINBOX_PYTHON=python3\n" in call(slurm.main, "--tag", "t", *ok[1][:-2])[1]
    assert "#SBATCH --signal=USR1@300\n" in call(slurm.main, "--tag", "t", *SL[2:])[1]
