"""Slurm job scripts per cell: multinode sft/grpo through pyxis, bare enroot, or bare processes (no container).

`python -m builder.slurm --tag TAG --entrypoint sft --config /data/sft.yaml --sqsh /abs/TAG.sqsh --nodes 2
 --gpus-per-node 8 [--partition P] [--time 04:00:00] [--data DIR] [--outputs DIR] [--hf-cache DIR]
 [--mount SRC:DST[:ro]] [--mode pyxis|enroot|bare] [-o job.sh] [-- TRAINER OPTIONS]` writes the script (stdout
without -o); a trainer's options go in its --config YAML (examples/*.yaml), after --, or both.
Every mode runs one task per node; each task runs the dispatcher (`trainbox ENTRYPOINT ... --nproc-per-node N`),
whose launcher (common/launch.py, the one home of the rendezvous rule) reads the step's Slurm variables and
starts torchrun: nothing depends on hooks that may or may not set RANK/LOCAL_RANK in the container, and the script
computes no address or port of its own.
verl jobs (`--entrypoint verl-ppo|verl-sft`, pyxis or bare) come from their own template, verl.sh.j2: PPO runs
verl's Ray driver on the head of a `trainbox ray` cluster, SFT runs verl's torchrun trainer through the launcher;
what comes after -- are verl's Hydra overrides (key=value).
Every option is checked before anything is written: one printable line per value, plain text in #SBATCH lines,
Slurm's own limits, and an option only some jobs use (--config, --grace, --python...) refused for the others.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

import jinja2

from builder.errors import UserError, reports_user_errors, shorten
from builder.options import check_file_target
from common import atomic, commands, launch

TEMPLATES = Path(__file__).resolve().parent / "templates" / "slurm"
# verl's job kinds -> the module each runs by default (--module: another, e.g. a verl recipe's main).
VERL_JOBS = {"verl-ppo": "verl.trainer.main_ppo", "verl-sft": "verl.trainer.sft_trainer"}
# The in-image commands with a job script (common/commands.py, the command table), then verl's job kinds.
ENTRYPOINTS = (*commands.names(slurm=True), *VERL_JOBS)
# Entrypoints that take no YAML config (their options go after --): all but the trainers.
NO_CONFIG = (*commands.names(slurm=True, trainer=False), *VERL_JOBS)
_MODULE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
MODES = ("pyxis", "enroot", "bare")
# Where the convenience mounts land in the image (CONTRIBUTING.md: outputs default /workspace/outputs).
DATA_DST, OUTPUTS_DST, HF_DST = "/data", "/workspace/outputs", "/cache/huggingface"
# Slurm's --time forms (src/common/parse_time.c, time_str2secs): MIN, MIN:SEC, H:MIN:SEC, D-H, D-H:MIN, D-H:MIN:SEC.
_TIME_RE = re.compile(r"(?:(?P<d>\d{1,9})-)?(?P<a>\d{1,9})(?::(?P<b>\d{1,9}))?(?::(?P<c>\d{1,9}))?")
NO_LIMIT = ("UNLIMITED", "INFINITE", "-1")   # and 0: "a time limit of zero requests that no time limit be imposed"
# Slurm keeps counts and time limits in seconds in C ints; the --signal warning time is 16 bits (sbatch(1)).
SLURM_INT_MAX, SIGNAL_TIME_MAX = 2**31 - 1, 65535
# Patterns are used with fullmatch: `$` also matches before a final newline ("t\n" would pass `^...$`).
_NAME_RE = re.compile(r"[A-Za-z0-9._-]+")
GRACE = 300  # seconds of warning (SIGUSR1) before the time limit, unless --grace says otherwise
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# #SBATCH lines are read by sbatch, not the shell (src/sbatch/opt.c, _get_argument): white space ends the value,
# ' " and \ are read its own way, an unquoted # starts a comment, and "hetjob"/"packjob" anywhere in the line is
# blanked out (the heterogeneous-job separator). A value there is plain text: no quoting is safe for both readers.
_SBATCH_TEXT_RE = re.compile(r"[A-Za-z0-9._/+@%=:,-]+")
_SBATCH_KEYWORDS = ("hetjob", "packjob")


def sqsh_name(tag: str) -> str:
    """File name of a cell's squashfs, as `build.py --sqsh DIR` writes it (the tag already names the arch)."""
    return f"{tag}.sqsh"


@dataclass(frozen=True)
class Mount:
    src: str
    dst: str
    ro: bool = False

    @property
    def pyxis(self) -> str:
        return f"{self.src}:{self.dst}" + (":ro" if self.ro else "")

    @property
    def enroot(self) -> str:
        # enroot start --mount takes fstab fields separated by ':' (src/runtime.sh: `tr ':' ' '`).
        return f"{self.src}:{self.dst}:none:x-create=auto,rbind,ro" if self.ro else f"{self.src}:{self.dst}"


def parse_mount(spec: str) -> Mount:
    parts = spec.split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
        raise UserError(f"mount {spec!r} must be SRC:DST or SRC:DST:ro (absolute paths, no ':' or ',' in them)")
    src, dst = parts[0], parts[1]
    for what, p in (("source", src), ("destination", dst)):
        # Mount specs are embedded in single-quoted shell text: only characters that never need quoting.
        if not p.startswith("/") or "," in p or shlex.quote(p) != p:
            raise UserError(f"mount {spec!r}: {what} {p!r} must be an absolute path of letters, digits and "
                            "._/+@%=- only (no ',', spaces or quotes)")
    return Mount(src, dst, len(parts) == 3 and parts[2] == "ro")


@dataclass(frozen=True)
class JobSpec:
    tag: str
    entrypoint: str = "sft"
    mode: str = "pyxis"
    config: str | None = None  # YAML path as the training process sees it (inside the image unless bare)
    sqsh: str | None = None
    nodes: int = 1
    gpus_per_node: int = 8
    nproc_per_node: int | None = None  # default: gpus_per_node, or 1 without GPUs
    partition: str | None = None
    account: str | None = None
    time: str = "04:00:00"
    cpus_per_task: int | None = None
    mounts: tuple[Mount, ...] = ()
    data: str | None = None
    outputs: str | None = None
    hf_cache: str | None = None
    log_dir: str = "."
    grace: int | None = None  # job.sh: default GRACE; verl jobs get no warning signal (refused)
    python: str | None = None  # bare mode (default "python3")
    workdir: str | None = None  # bare mode: dir holding trainbox/ and common/ (the repo root)
    env: tuple[tuple[str, str], ...] = ()
    args: tuple[str, ...] = field(default=())  # extra entrypoint options
    # grpo: the last node(s) run `trl vllm-serve`, the others train (trainbox/training/grpo/vllm_server.py)
    vllm_nodes: int = 0
    module: str | None = None  # verl jobs: the Python module to run (default: VERL_JOBS[entrypoint])
    ray_args: tuple[str, ...] = ()  # verl-ppo: `trainbox ray` options (--num-cpus 8, --gpu-free-head is refused)


def time_limit(value: str) -> int | None:
    """Slurm's --time VALUE in seconds, rounded up to whole minutes as Slurm keeps it; None: no limit."""
    m = _TIME_RE.fullmatch(value)
    if value.upper() in NO_LIMIT:
        return None
    if not m:
        raise UserError(f"--time {shorten(value, 40)!r} is not a Slurm time",
                        fix="use MIN, MIN:SEC, H:MIN:SEC, D-H, D-H:MIN, D-H:MIN:SEC or UNLIMITED, e.g. 04:00:00")
    d, a, b, c = (int(x) if x is not None else None for x in m.group("d", "a", "b", "c"))
    if d is not None:
        seconds = d * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    elif c is not None:
        seconds = a * 3600 + b * 60 + c
    else:
        seconds = a * 60 + (b or 0)
    if seconds > SLURM_INT_MAX - 59:
        raise UserError(f"--time {value!r} is longer than Slurm can hold ({SLURM_INT_MAX} s)",
                        fix="use UNLIMITED for no limit")
    return -(-seconds // 60) * 60 or None


def _texts(spec: JobSpec) -> list[tuple[str, str]]:
    """(option, value) for every text of SPEC that reaches the script."""
    out = [(f"--{f.name.replace('_', '-')}", getattr(spec, f.name)) for f in fields(spec)
           if isinstance(getattr(spec, f.name), str)]
    out += [("--env", f"{k}={v}") for k, v in spec.env] + [("--mount", m.pyxis) for m in spec.mounts]
    return out + [("an argument after --", a) for a in spec.args] + [("--ray-arg", a) for a in spec.ray_args]


def _check_text(spec: JobSpec) -> None:
    """Every value on one line of printable text: a newline or other control character would end the line it is
    rendered on (in an #SBATCH line: a command that runs before `set -euo pipefail`). Values in #SBATCH lines are
    plain besides (_SBATCH_TEXT_RE): the shell's quoting means something else to sbatch."""
    for flag, value in _texts(spec):
        bad = next((ch for ch in value if not ch.isprintable() and ch != " "), None)
        if bad is not None:
            raise UserError(f"{flag} {shorten(value, 80)!r} holds the control character {bad!r}",
                            fix="give each value on one line, printable characters only")
    for flag, value in (("--tag", spec.tag), ("--partition", spec.partition), ("--account", spec.account),
                        ("--log-dir", spec.log_dir)):
        if value is None:
            continue
        if not _SBATCH_TEXT_RE.fullmatch(value):
            raise UserError(f"{flag} {shorten(value, 80)!r} goes into an #SBATCH line, which sbatch (not the shell) "
                            "reads: white space, quotes, '\\', '#' and other shell characters can't be quoted there",
                            fix="use letters, digits and ._/+@%=:,- only (for a folder whose name has a space: a "
                                "symbolic link to it without one)")
        word = next((w for w in _SBATCH_KEYWORDS if w in value.lower()), None)
        if word:
            raise UserError(f"{flag} {shorten(value, 80)!r}: sbatch blanks out {word!r} anywhere in an #SBATCH line "
                            "(its heterogeneous-job separator)", fix=f"choose a value without {word!r}")


def _check(spec: JobSpec) -> None:
    _check_text(spec)
    if spec.entrypoint not in ENTRYPOINTS:
        raise UserError(f"entrypoint {spec.entrypoint!r} has no job script; choose one of {', '.join(ENTRYPOINTS)}")
    if spec.mode not in MODES:
        raise UserError(f"mode {spec.mode!r} unknown; choose one of {', '.join(MODES)}")
    if not _NAME_RE.fullmatch(spec.tag):
        raise UserError(f"tag {spec.tag!r} may only use letters, digits, '.', '_' and '-' (it names the job)")
    for flag, n in (("--nodes", spec.nodes), ("--gpus-per-node", spec.gpus_per_node),
                    ("--nproc-per-node", spec.nproc_per_node), ("--cpus-per-task", spec.cpus_per_task)):
        if n is not None and n > SLURM_INT_MAX:
            raise UserError(f"{flag} {shorten(str(n), 40)} is more than Slurm accepts ({SLURM_INT_MAX})")
    if spec.nodes < 1:
        raise UserError(f"--nodes must be at least 1, got {spec.nodes}")
    if spec.gpus_per_node < 0:
        raise UserError(f"--gpus-per-node must be 0 or more, got {spec.gpus_per_node}")
    if spec.nproc_per_node is not None and spec.nproc_per_node < 1:
        raise UserError(f"--nproc-per-node must be at least 1, got {spec.nproc_per_node}")
    if spec.cpus_per_task is not None and spec.cpus_per_task < 1:
        raise UserError(f"--cpus-per-task must be at least 1, got {spec.cpus_per_task}")
    limit = time_limit(spec.time)
    for what, v in (("partition", spec.partition), ("account", spec.account)):
        if v is not None and not _NAME_RE.fullmatch(v):
            raise UserError(f"--{what} {v!r} may only use letters, digits, '.', '_' and '-'")
    grace = GRACE if spec.grace is None else spec.grace
    if not 0 <= grace <= SIGNAL_TIME_MAX:
        raise UserError(f"--grace {shorten(str(grace), 40)} is not 0 to {SIGNAL_TIME_MAX} seconds "
                        "(the range of Slurm's --signal warning time)")
    if limit is not None and grace >= limit and spec.entrypoint not in VERL_JOBS:
        raise UserError(f"--grace {grace} is not shorter than the time limit (--time {spec.time}: {limit} s): "
                        "Slurm would send the warning to checkpoint as the job starts",
                        fix=f"use a --grace under {limit} s, or a longer --time")
    if spec.entrypoint == "ray" and not [a for a in spec.args if a != "--"]:
        raise UserError("--entrypoint ray needs the command the head runs, after --: python -m builder.slurm "
                        "--entrypoint ray ... -- python my_driver.py (ray options first: -- --gpu-free-head -- CMD)")
    if not spec.config and spec.entrypoint not in NO_CONFIG and not [a for a in spec.args if a != "--"]:
        # a trainer takes its options from a YAML file, from the command line (after --), or both
        raise UserError(f"no --config given: pass the {spec.entrypoint} YAML path "
                        + ("on the nodes" if spec.mode == "bare" else "as seen inside the image (e.g. /data/x.yaml)")
                        + f", or {spec.entrypoint}'s options after -- (e.g. -- --model_name_or_path /models/m "
                        "--dataset /data/train.jsonl)")
    for k, _ in spec.env:
        if not _ENV_NAME_RE.fullmatch(k):
            raise UserError(f"--env {k!r} is not a variable name")
    if spec.vllm_nodes:
        if spec.entrypoint != "grpo" or spec.vllm_nodes != 1:
            raise UserError(f"--vllm-nodes {spec.vllm_nodes}: only grpo has a vLLM server, and `trl vllm-serve` "
                            "serves from one node; use --vllm-nodes 1 with --entrypoint grpo")
        if spec.nodes <= spec.vllm_nodes:
            raise UserError(f"--vllm-nodes {spec.vllm_nodes} with --nodes {spec.nodes} leaves no node to train; "
                            f"use --nodes {spec.vllm_nodes + 1} or more")
    if spec.entrypoint in VERL_JOBS:
        _check_verl(spec)
    elif spec.module or spec.ray_args:
        raise UserError(f"--module/--ray-arg are for verl jobs ({', '.join(VERL_JOBS)}), not {spec.entrypoint}")
    _check_scope(spec)
    if spec.mode == "bare":
        if spec.sqsh or spec.mounts or spec.data or spec.outputs or spec.hf_cache:
            raise UserError("bare mode runs on the nodes without a container: drop --sqsh/--mount/--data/--outputs/"
                            "--hf-cache and give host paths in the config")
        if not spec.workdir or not spec.workdir.startswith("/"):
            raise UserError("bare mode needs --workdir ABS_DIR (the directory that holds trainbox/ and common/)")
    else:
        # pyxis takes a path only if it starts with / or ./ (else it pulls from a registry); be strict: absolute.
        if not spec.sqsh or not spec.sqsh.startswith("/") or not spec.sqsh.endswith(".sqsh"):
            raise UserError(f"--sqsh {spec.sqsh!r} must be an absolute path to a .sqsh file (pyxis would otherwise "
                            "try to pull it from a registry); export one with `python -m builder.enroot`")
        if "," in spec.sqsh or shlex.quote(spec.sqsh) != spec.sqsh:
            raise UserError(f"--sqsh {spec.sqsh!r} must not contain spaces, commas, quotes or shell characters")


def _check_scope(spec: JobSpec) -> None:
    """Options only some jobs use are refused for the others: an accepted option is honoured, never dropped."""
    if spec.config and spec.entrypoint in NO_CONFIG:
        raise UserError(f"--config: {spec.entrypoint} takes no YAML config (every node would refuse it)",
                        fix=f"drop --config; give {spec.entrypoint}'s own options after -- "
                            f"(trainbox {spec.entrypoint} --help lists them)")
    if spec.nproc_per_node is not None and spec.entrypoint == "ray":
        raise UserError("--nproc-per-node: `trainbox ray` starts one Ray node per Slurm node, no torchrun; Ray "
                        "places the driver's processes", fix="drop it; the GPUs per node come from --gpus-per-node")
    if spec.grace is not None and spec.entrypoint in VERL_JOBS:
        raise UserError(f"--grace: {spec.entrypoint} jobs get no warning signal (verl handles no SIGUSR1; it "
                        "checkpoints every trainer.save_freq steps)", fix="drop --grace")
    if spec.mode != "bare" and (spec.python is not None or spec.workdir is not None):
        raise UserError(f"--python/--workdir are for --mode bare; {spec.mode} mode runs the image's own Python",
                        fix="drop them, or use --mode bare")


def _check_verl(spec: JobSpec) -> None:
    if spec.mode == "enroot":
        raise UserError(f"{spec.entrypoint} jobs run through pyxis or bare; on an enroot-only cluster use --mode "
                        "enroot --entrypoint ray -- python3 -m verl.trainer.main_ppo trainer.nnodes=N ...")
    if spec.config:
        raise UserError(f"{spec.entrypoint} takes verl's Hydra overrides after -- (e.g. -- data.train_files=/data/"
                        "train.parquet model.path=/models/m), not --config")
    if spec.module is not None and not _MODULE_RE.fullmatch(spec.module):
        raise UserError(f"--module {spec.module!r} is not a Python module name (e.g. verl.trainer.main_ppo)")
    if spec.entrypoint == "verl-ppo":
        if spec.nproc_per_node is not None:
            raise UserError("--nproc-per-node: verl-ppo's processes are Ray's, one per GPU (trainer.n_gpus_per_node "
                            "comes from --gpus-per-node); drop it")
        if "--gpu-free-head" in spec.ray_args or "--" in spec.ray_args:
            raise UserError("--ray-arg: verl places its workers on every node's GPUs (trainer.nnodes = the job's "
                            "nodes), so no --gpu-free-head and no '--' (the command is verl's)")
    elif spec.ray_args:
        raise UserError("--ray-arg: verl-sft runs under torchrun, without Ray; drop it")
    bad = [a for a in spec.args if a.startswith(("trainer.nnodes=", "trainer.n_gpus_per_node="))]
    if bad and spec.entrypoint == "verl-ppo":
        raise UserError(f"{bad[0]}: the job sets trainer.nnodes and trainer.n_gpus_per_node from Slurm "
                        "(--nodes, --gpus-per-node); drop it")


def _all_mounts(spec: JobSpec) -> list[Mount]:
    mounts = list(spec.mounts)
    for src, dst in ((spec.data, DATA_DST), (spec.outputs, OUTPUTS_DST), (spec.hf_cache, HF_DST)):
        if src:
            mounts.append(parse_mount(f"{src}:{dst}"))
    dsts = [m.dst for m in mounts]
    dup = sorted({d for d in dsts if dsts.count(d) > 1})
    if dup:
        raise UserError(f"two mounts share the destination {dup[0]}; give each destination once")
    return mounts


def render(spec: JobSpec) -> str:
    _check(spec)
    mounts = _all_mounts(spec)
    env = list(spec.env)
    if spec.hf_cache:
        env.append(("HF_HOME", HF_DST))
    if spec.outputs:
        env.append(("OUTPUT_DIR", OUTPUTS_DST))
    nproc = spec.nproc_per_node or (spec.gpus_per_node or 1)
    jenv = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                              keep_trailing_newline=True, autoescape=False)
    jenv.filters["q"] = lambda v: shlex.quote(str(v))
    # Names whose values the job (not the image) decides; pyxis lets the image env win for everything else.
    container_env = [k for k, _ in env]
    if spec.entrypoint in VERL_JOBS:
        return jenv.get_template("verl.sh.j2").render(
            kind=spec.entrypoint, module=spec.module or VERL_JOBS[spec.entrypoint], tag=spec.tag, mode=spec.mode,
            nodes=spec.nodes, nproc=nproc, job_name=f"{spec.entrypoint}-{spec.tag}", gpus_per_node=spec.gpus_per_node,
            cpus_per_task=spec.cpus_per_task, partition=spec.partition, account=spec.account, time=spec.time,
            log_dir=spec.log_dir.rstrip("/") or "/", sqsh=spec.sqsh, python=spec.python or "python3",
            workdir=spec.workdir,
            env=env, args=spec.args, ray_args=spec.ray_args, mounts=mounts, container_workdir="/workspace",
            container_env=container_env)
    return jenv.get_template("job.sh.j2").render(
        entrypoint=spec.entrypoint, tag=spec.tag, mode=spec.mode, nodes=spec.nodes, nproc=nproc,
        job_name=f"{spec.entrypoint}-{spec.tag}", gpus_per_node=spec.gpus_per_node, cpus_per_task=spec.cpus_per_task,
        partition=spec.partition, account=spec.account, time=spec.time, log_dir=spec.log_dir.rstrip("/") or "/",
        grace=GRACE if spec.grace is None else spec.grace, sqsh=spec.sqsh, python=spec.python or "python3",
        workdir=spec.workdir, env=env,
        args=[*(["--config", spec.config] if spec.config else []), *_ray_args(spec),
              *(["--vllm_server_nodes", str(spec.vllm_nodes)] if spec.vllm_nodes else [])], mounts=mounts,
        vllm_nodes=spec.vllm_nodes,
        container_workdir="/workspace",
        container_env=container_env, slurm_env=list(launch.SLURM_STEP_ENV),
    )


def _ray_args(spec: JobSpec) -> tuple[str, ...]:
    """ray: the extra arguments are the head's command (`-- python driver.py`), or `RAY_OPTIONS -- COMMAND`."""
    if spec.entrypoint != "ray" or "--" in spec.args:
        return spec.args
    return ("--", *spec.args)


def write(spec: JobSpec, dest) -> Path:
    """Render and write through the one atomic writer (temp sibling, fsync, rename), executable; DEST checked first
    by the writers' one rule (options.check_file_target: no folder, device, fifo, broken link, /proc /sys /dev)."""
    text = render(spec)
    dest = check_file_target(dest, "-o")
    if not dest.parent.is_dir():
        raise UserError(f"output directory {str(dest.parent)!r} does not exist; create it first")
    atomic.write_text(dest, text, mode=0o755)
    return dest


def _env_pair(s: str) -> tuple[str, str]:
    if "=" not in s:
        raise UserError(f"--env {s!r} must be NAME=VALUE")
    k, v = s.split("=", 1)
    return k, v


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (reports_user_errors), not argparse's usage block
        raise UserError(message, fix="see python -m builder.slurm --help")


@reports_user_errors
def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="python -m builder.slurm", description=__doc__.split("\n")[0])
    p.add_argument("--tag", required=True, help="the cell's image tag (names the job)")
    p.add_argument("--entrypoint", default="sft", choices=ENTRYPOINTS)
    p.add_argument("--mode", default="pyxis", choices=MODES,
                   help="pyxis: srun --container-image; enroot: enroot create/start per node; bare: no container")
    p.add_argument("--config", help="entrypoint YAML, as the training process sees it")
    p.add_argument("--sqsh", help="absolute path of the image's .sqsh on the cluster (pyxis/enroot)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nproc-per-node", type=int, default=None, help="default: GPUs per node, or 1 without GPUs")
    p.add_argument("--cpus-per-task", type=int, default=None)
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--time", default="04:00:00", help="Slurm time limit (HH:MM:SS, D-HH:MM:SS, minutes)")
    p.add_argument("--data", help=f"host dir mounted at {DATA_DST}")
    p.add_argument("--outputs", help=f"host dir mounted at {OUTPUTS_DST} (OUTPUT_DIR)")
    p.add_argument("--hf-cache", help=f"host dir mounted at {HF_DST} (HF_HOME)")
    p.add_argument("--mount", action="append", default=[], help="extra SRC:DST[:ro], repeatable")
    p.add_argument("--env", action="append", default=[], help="NAME=VALUE exported to the job, repeatable")
    p.add_argument("--log-dir", default=".", help="where Slurm writes JOBNAME-JOBID.out (default: submit dir)")
    p.add_argument("--grace", type=int, help=f"seconds before the time limit to send SIGUSR1 (default {GRACE}; "
                   "not for verl jobs)")
    p.add_argument("--python", help="bare mode: the Python with the training stack (default python3)")
    p.add_argument("--workdir", help="bare mode: directory holding trainbox/ and common/ (e.g. the repo root)")
    p.add_argument("--vllm-nodes", type=int, default=0,
                   help="grpo: the last node runs `trl vllm-serve`, the others train with vllm_mode server (1 or 0)")
    p.add_argument("--module", help=f"verl jobs: the module to run (default: {', '.join(VERL_JOBS.values())}; "
                   "a verl recipe's main, e.g. recipe.dapo.main_dapo)")
    p.add_argument("--ray-arg", action="append", default=[], dest="ray_args",
                   help="verl-ppo: one `trainbox ray` option word (--ray-arg=--num-cpus --ray-arg=8), repeatable")
    p.add_argument("-o", "--output", help="write here (else stdout)")
    p.add_argument("extra", nargs="*", help="more entrypoint options, after --")
    a = p.parse_args(argv)
    spec = JobSpec(
        tag=a.tag, entrypoint=a.entrypoint, mode=a.mode, config=a.config, sqsh=a.sqsh, nodes=a.nodes,
        gpus_per_node=a.gpus_per_node, nproc_per_node=a.nproc_per_node, partition=a.partition,
        account=a.account, time=a.time, cpus_per_task=a.cpus_per_task,
        mounts=tuple(parse_mount(m) for m in a.mount), data=a.data, outputs=a.outputs, hf_cache=a.hf_cache,
        log_dir=a.log_dir, grace=a.grace, python=a.python, workdir=a.workdir,
        env=tuple(_env_pair(e) for e in a.env), args=tuple(a.extra), vllm_nodes=a.vllm_nodes,
        module=a.module, ray_args=tuple(a.ray_args),
    )
    if a.output:
        write(spec, a.output)
    else:
        sys.stdout.write(render(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
