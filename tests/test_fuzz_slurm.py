"""Fuzz every option of `python -m builder.slurm` with hostile strings and numbers: whatever the input, exit 0 or 2
(one `error:` line, nothing written), never a traceback; an accepted script passes `bash -n`, its #SBATCH lines are
plain (sbatch reads them itself), and no option value adds a shell command: bash's own parser (`bash --pretty-print`,
which never executes) finds the template's commands and no other, and each free-text value sits in the script as one
shell-quoted word. Fuzzed in-process (main()); the script is only parsed, never run."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from collections import Counter

from hypothesis import example, given, strategies as st

from builder import slurm
from test_fuzz_cli import HOSTILE, SETTINGS, call, one_error

# Commands the templates run, by their first word (job.sh, verl.sh.j2): anything else came from a value.
HEADS = {"set", "export", "ARGS=", "LAUNCH=", "echo", "NODE_TASK=", "srun", "PY=", "LAUNCHER="}
SBATCH_LINE = re.compile(r"#SBATCH --[a-z-]+=[A-Za-z0-9._/+@%=:,-]+")

text = st.one_of(st.sampled_from(HOSTILE), st.text(max_size=12),
                 st.builds(lambda a, b: a + b, st.sampled_from(HOSTILE), st.sampled_from(HOSTILE)),
                 st.sampled_from(["/data/a b.yaml", "/c.yaml", "/x;id", "/l/'q'", "--x=$(id)", "a\\", "`id`",
                                  "/data/x.yaml # c", "}", "'\"'\"'", "%x", "-"]))
paths = st.one_of(text, st.sampled_from(["/lus/d", "/s/t.sqsh", "/lus/o", "/repo", "/a b", "/a,b", "rel", "/"]),
                  st.builds(lambda t: "/" + t, text))
numbers = st.one_of(st.integers(-3, 10).map(str), st.sampled_from(["0", "1", "65535", "65536", "2147483647",
                                                                   "2147483648", "9" * 25, "x", "", " 2", "1e3"]))
times = st.one_of(text, st.sampled_from(["04:00:00", "1", "0", "5:00", "1-0", "1-02:03", "1-2:3:4", "UNLIMITED",
                                         "infinite", "-1", "1:2:3:4", "99999999-0", "0-0:4"]))
OPTIONS = {
    "--tag": st.one_of(text, st.sampled_from(["smoke-x86_64", "HetJob", "a.b_c"])),
    "--entrypoint": st.sampled_from([*slurm.ENTRYPOINTS, "jupyter", ""]),
    "--mode": st.sampled_from([*slurm.MODES, "docker"]), "--config": paths, "--sqsh": paths,
    "--nodes": numbers, "--gpus-per-node": numbers, "--nproc-per-node": numbers, "--cpus-per-task": numbers,
    "--partition": text, "--account": text, "--time": times, "--data": paths, "--outputs": paths,
    "--hf-cache": paths, "--mount": st.one_of(text, st.builds(lambda a, b, ro: f"{a}:{b}{ro}", paths, paths,
                                                              st.sampled_from(["", ":ro", ":rw", ":x"]))),
    "--env": st.one_of(text, st.builds(lambda k, v: f"{k}={v}", st.sampled_from(["A", "B_2", "1A", "", "A B"]), text)),
    "--log-dir": paths, "--grace": numbers, "--python": paths, "--workdir": paths,
    "--vllm-nodes": numbers, "--module": st.one_of(text, st.sampled_from(["recipe.dapo.main_dapo", "a..b"])),
    "--ray-arg": text,
}
BASES = {"pyxis": ["--tag", "t", "--config", "/c.yaml", "--sqsh", "/s/t.sqsh"],
         "bare": ["--tag", "t", "--mode", "bare", "--config", "/c.yaml", "--workdir", "/repo"],
         "ray": ["--tag", "t", "--entrypoint", "ray", "--sqsh", "/s/t.sqsh", "--", "python3", "d.py"],
         "verl": ["--tag", "t", "--entrypoint", "verl-ppo", "--sqsh", "/s/t.sqsh"]}


def commands(script: str) -> list[str]:
    """The script's commands as bash parses them, one per line (the script inside a function, which
    --pretty-print writes one command a line; it implies noexec: nothing runs)."""
    r = subprocess.run(["bash", "--pretty-print", "/dev/stdin"], input=f"f() {{\n{script}\n}}\n", text=True,
                       capture_output=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return [line[4:].removesuffix(";") for line in r.stdout.splitlines()
            if line.startswith("    ") and not line.startswith("     ")]


def head(command: str) -> str:
    m = re.match(r"[A-Za-z_][A-Za-z0-9_]*=|\S+", command)
    return m[0] if m else command


def check_script(script: str, argv: list[str]) -> None:
    assert subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True).returncode == 0, script
    lines = script.splitlines()
    first_command = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    for i, line in enumerate(lines):
        if line.startswith("#SBATCH"):
            # sbatch reads directives up to the first command; each is one plain word (no quoting, no 'hetjob')
            assert i < first_command and SBATCH_LINE.fullmatch(line), line
            assert "hetjob" not in line.lower() and "packjob" not in line.lower(), line
    cmds = commands(script)
    heads = Counter(head(c) for c in cmds)
    assert set(heads) <= HEADS, (heads, script)
    assert all(n == 1 for h, n in heads.items() if h != "export"), heads
    envs = [v for k, v in zip(argv, argv[1:]) if k == "--env"]
    mounted = sum(f in argv[:argv.index("--")] if "--" in argv else f in argv for f in ("--outputs", "--hf-cache"))
    assert heads["export"] == len(envs) + mounted + (2 if "--mode" in argv and _last(argv, "--mode") == "bare"
                                                      else 1), (heads, argv)
    for e in envs:   # each value one quoted word
        k, _, v = e.partition("=")
        assert f"export {k}={shlex.quote(v)}" in cmds, (e, cmds)
    if "--" in argv:
        extra = argv[argv.index("--") + 1:]
        if extra:
            assert " ".join(shlex.quote(a) for a in extra) in script, (extra, script)


def _last(argv: list[str], flag: str) -> str | None:
    vals = [v for k, v in zip(argv, argv[1:]) if k == flag]
    return vals[-1] if vals else None


@SETTINGS
@given(base=st.sampled_from(list(BASES)), picks=st.lists(st.sampled_from(list(OPTIONS)), max_size=4),
       data=st.data(), extra=st.lists(text, max_size=3),
       to_file=st.sampled_from([None, "job.sh", "folder", "dangling", "fifo", "/proc/t.sh", "/sys/t.sh"]))
@example(base="pyxis", picks=["--log-dir"], data=None, extra=[], to_file="job.sh")
def test_every_option_renders_a_safe_script_or_one_error(tmp_path_factory, base, picks, data, extra, to_file):
    argv = list(BASES[base])
    tail = []
    if "--" in argv:
        argv, tail = argv[:argv.index("--")], argv[argv.index("--"):]
    for flag in picks:
        value = data.draw(OPTIONS[flag], label=flag) if data is not None else "/logs\necho INJECTED;#"
        argv += [f"{flag}={value}"]   # = : a value starting with '-' stays a value
    tail = (tail or (["--"] if extra else [])) + extra
    tmp = tmp_path_factory.mktemp("slurm")
    (tmp / "keep").write_text("x")
    (tmp / "folder").mkdir()
    (tmp / "dangling").symlink_to(tmp / "nowhere")
    os.mkfifo(tmp / "fifo")
    before = sorted((p.name, p.lstat().st_mode) for p in tmp.iterdir())
    out = tmp / to_file if to_file and not to_file.startswith("/") else to_file
    rc, stdout, err = call(slurm.main, *argv, *(["-o", str(out)] if to_file else []), *tail)
    assert rc in (0, 2), (rc, err)
    assert "Traceback" not in err, err
    if rc == 2:
        one_error(err)
        assert stdout == "" and sorted((p.name, p.lstat().st_mode) for p in tmp.iterdir()) == before
        return
    assert to_file in (None, "job.sh"), to_file   # every other target is refused
    script = out.read_text() if to_file else stdout
    assert os.access(out, os.X_OK) if to_file else True
    split = [w for a in argv for w in (a.split("=", 1) if a.startswith("--") and "=" in a else [a])]
    check_script(script, split + tail)


def test_the_checker_sees_an_injected_command():
    """The oracle itself: a value that escaped its quotes shows up as a command (or a bad #SBATCH line)."""
    good = slurm.render(slurm.JobSpec(tag="t", config="/c.yaml", sqsh="/s/t.sqsh", env=(("A", "x;y"),)))
    check_script(good, ["--env", "A=x;y"])
    for bad in (good.replace("export A='x;y'", "export A=x;id"),
                good.replace("ARGS=(sft", "ARGS=(sft $(id)) && rm -rf /x; X=(y"),
                good.replace("#SBATCH --nodes=1", "#SBATCH --nodes=1\necho INJECTED")):
        try:
            check_script(bad, ["--env", "A=x;y"])
        except AssertionError:
            continue
        raise AssertionError(f"not caught:\n{bad}")
