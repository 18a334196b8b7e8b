"""Build and tag cell images on a Docker engine (the builder and CLI: builder/docker.py; the whole run, lock ->
build -> export -> push -> report: builder/pipeline.py; publishing: builder/publish.py).

The rendered Dockerfiles need BuildKit (the venv install uses a cache mount): `--builder legacy` is refused at the
build with one error. Every build runs with host networking (RUN steps reach the package index and the local
registry) and without a tag: only a finished image gets the cell's tags, so a failed build never leaves a final tag
on a half image. Secrets go in as BuildKit secrets only (never ARG/ENV/COPY).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from python_on_whales import DockerClient
from python_on_whales.exceptions import DockerException

from builder import bases as base_lock, indexes, lock
from builder.docker import Builder, choose_builder, host_arch, host_platform, platform_arch  # noqa: F401 (choose_builder: engine.X)
from builder.errors import UserError
from builder.options import (
    LEGACY_FIX,
    LEGACY_REFUSED,
    BuildOptions,  # noqa: F401 (engine.BuildOptions, as callers knew it)
    check_wheelhouse,
)
from builder.paths import ROOT

WHEELHOUSE = "wheelhouse"


# ----------------------------------------------------------------------------------------------------- cells, names
def cell_refs(cell, registry: str | None = None) -> list[str]:
    """The refs a built cell is tagged with: REPOSITORY:TAG for each of the cell's tags; with --registry
    HOST:PORT/REPO the repository is replaced by it (the tags stay)."""
    repo = registry or getattr(cell, "repository", None) or "trainbox"
    tags = list(getattr(cell, "tags", None) or getattr(cell, "version_tags", None) or [])
    if cell.tag not in tags:
        tags.insert(0, cell.tag)
    return [f"{repo}:{t}" for t in tags]


# --------------------------------------------------------------------------------------------------- build inputs
class Wheelhouse:
    """Puts DIR's wheels into CONTEXT/wheelhouse/ for one build (hard links, copies across filesystems) and removes
    exactly those afterwards; the Dockerfile's pip uses that folder with --find-links before any index."""

    def __init__(self, src: str | None, context: Path):
        self.src = Path(src) if src else None
        self.dest = context / WHEELHOUSE
        self.added: list[Path] = []

    def __enter__(self):
        if self.src is None:
            return self
        wheels = check_wheelhouse(self.src)
        self.dest.mkdir(exist_ok=True)
        for w in wheels:
            target = self.dest / w.name
            if target.exists():
                continue
            try:
                os.link(w, target)
            except OSError:
                shutil.copy2(w, target)
            self.added.append(target)
        return self

    def __exit__(self, *exc):
        for p in self.added:
            p.unlink(missing_ok=True)


def cpu_torch_wheel(cell) -> str | None:
    """The wheel a CPU-torch cell's Dockerfile looks for in its wheelhouse (the template's check: torch V+cpu is on no
    index the cell names), as a glob; None for other cells."""
    if getattr(cell, "torch_variant", None) != "cpu" or "torch" not in (getattr(cell, "pins", None) or {}):
        return None
    return f"torch-{cell.pins['torch']}+cpu-*.whl"


def check_cpu_torch(cells, wheelhouse: str | None, build_args, repo_wheelhouse: Path | None = None) -> None:
    """Refuses, before any lock or build step, a CPU-torch cell whose torch wheel is in neither --wheelhouse DIR nor
    the repository's wheelhouse/ while no TORCH_INDEX_URL build arg names an index: its Dockerfile would stop there
    after the base stage's minutes, with the whole RUN step in the message."""
    if "TORCH_INDEX_URL" in build_args:
        return
    folders = [Path(wheelhouse)] if wheelhouse else []
    folders.append(repo_wheelhouse if repo_wheelhouse is not None else ROOT / WHEELHOUSE)
    for cell in cells:
        pattern = cpu_torch_wheel(cell)
        if pattern and not any(f.is_dir() and any(f.glob(pattern)) for f in folders):
            raise UserError(f"cell {cell.tag} needs the wheel {pattern}, which is on no default index, and no "
                            "wheelhouse has it", fix="run `python -m devenv.buildinputs --wheelhouse .cache/wheels` "
                            "and add --wheelhouse .cache/wheels, as `make build` does; or --build-arg "
                            "TORCH_INDEX_URL=URL")


# ---------------------------------------------------------------------------------------------- failure reporting
_TLS = re.compile(r"CERTIFICATE_VERIFY_FAILED|certificate verify failed|invalid peer certificate|UnknownIssuer|"
                  r"self[- ]signed certificate", re.I)


@dataclass
class BuildLog:
    """What a failure report needs from a build's output, however long it ran: the last lines, every step's header
    (BuildKit `#N [stage k/n] INSTRUCTION`, legacy `Step k/n : INSTRUCTION`) and the steps that hit a TLS error."""
    tail: deque = field(default_factory=lambda: deque(maxlen=400))
    headers: dict = field(default_factory=dict)   # BuildKit step id -> "[stage k/n] INSTRUCTION"
    legacy_steps: list = field(default_factory=list)
    tls: set = field(default_factory=set)         # step ids (or "" for the legacy builder) whose output had TLS errors

    def add(self, line: str) -> None:
        self.tail.append(line)
        m = re.match(r"#(\d+) (\[.*)$", line)
        if m and m.group(1) not in self.headers:
            self.headers[m.group(1)] = m.group(2).strip()
        if re.match(r"Step \d+/\d+ : ", line):
            self.legacy_steps.append(line.split(" : ", 1)[1].strip())
        if _TLS.search(line):
            m = re.match(r"#(\d+) ", line)
            self.tls.add(m.group(1) if m else "")

    @property
    def lines(self) -> list[str]:
        return list(self.tail)


def dockerfile_line(dockerfile: Path | None, instruction: str) -> int | None:
    """The line of DOCKERFILE where INSTRUCTION (as BuildKit names the step: continuation lines joined) starts."""
    if dockerfile is None or not instruction:
        return None
    try:
        text = dockerfile.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    want = " ".join(instruction.split())
    for i, line in enumerate(text):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        logical, j = line, i
        while logical.rstrip().endswith("\\") and j + 1 < len(text):
            j += 1
            logical = logical.rstrip()[:-1] + " " + text[j]
        if " ".join(logical.split()) == want:
            return i + 1
    return None


def failed_step(log: BuildLog | list[str], dockerfile: Path | None = None) -> tuple[str, str]:
    """(step, reason) from a build log: BuildKit plain progress (`#N [stage k/n] RUN ...` + `#N ERROR: ...`) or the
    legacy builder (`Step k/n : RUN ...` + the error). The step is the Dockerfile instruction (with its line when
    DOCKERFILE is given), never BuildKit's bare `#N`."""
    if not isinstance(log, BuildLog):
        b = BuildLog(tail=deque(maxlen=None))
        for ln in log:
            b.add(ln)
        log = b
    lines = log.lines
    err_id, reason = None, ""
    for line in lines:
        m = re.match(r"#(\d+) ERROR: (.*)$", line)
        if m and err_id is None:
            err_id, reason = m.group(1), m.group(2).strip()
    final = next((ln for ln in reversed(lines) if re.match(r"(ERROR|error|failed to solve)", ln.strip())), "")
    if err_id is not None:
        header = log.headers.get(err_id)
        if header is None:   # BuildKit's summary names the step too: ` > [stage k/n] INSTRUCTION:`
            header = next((ln.strip()[2:].rstrip(":") for ln in lines if re.match(r"\s*> \[", ln)), None)
        # The step's own last error line (pip's "No matching distribution ...") says more than "exit code: 1".
        # BuildKit interleaves a step's stdout and stderr as they arrive: under load pip's stdout ("Could not fetch
        # URL ...", naming an SSLError) can land after its stderr, so an explicit error line wins over one that only
        # mentions an error.
        said = [re.sub(r"^#\d+ [\d.]+ ", "", ln).strip() for ln in lines
                if ln.startswith(f"#{err_id} ") and not ln.startswith(f"#{err_id} ERROR")]
        flagged = [ln for ln in said if re.match(r"(ERROR|error|fatal)\b|E: ", ln)]
        own = flagged or [ln for ln in said if re.search(r"error|not found|denied|refused|no such|mismatch", ln, re.I)]
        if own:
            reason = f"{own[-1]} ({reason})"
        if err_id in log.tls:
            reason = f"TLS certificate verification failed (CERTIFICATE_VERIFY_FAILED) inside the build: {reason}"
        if header is None:
            return f"step #{err_id} (its header scrolled out of the log)", reason or final
        m = re.match(r"\[internal\] load metadata for (\S+)", header)
        if m:
            return f"FROM {m.group(1)}", reason or final
        stage, _, instruction = header.partition("] ")
        where = dockerfile_line(dockerfile, instruction)
        at = f"{dockerfile.name}:{where}, " if where else ""
        return f"{instruction} ({at}{stage.lstrip('[').strip()})" if instruction else header, reason or final
    if log.legacy_steps:
        last = [ln for ln in lines if ln.strip()][-1] if lines else ""
        reason = last.strip()
        if log.tls:
            reason = f"TLS certificate verification failed (CERTIFICATE_VERIFY_FAILED) inside the build: {reason}"
        return log.legacy_steps[-1], reason
    return "(before the first step)", (final or (lines[-1] if lines else "no output")).strip()


def failure_fix(step: str, reason: str) -> str | None:
    """The next step for a failed build, where the log says which."""
    if "CERTIFICATE_VERIFY_FAILED" in reason:
        return ("the index's certificate is not trusted inside the image (a TLS-intercepting proxy?): copy its CA "
                "certificate to images/certs/NAME.crt (the build adds it to the image's trust store) and build again")
    if step.startswith("FROM ") and re.search(r"not found|pull access denied|no such host|dial tcp|manifest unknown|"
                                              r"unauthorized|connection refused|i/o timeout|no match for platform",
                                              reason, re.I):
        return (f"the base {step[5:]} cannot be pulled from here: build FROM another image with --base OLD=NEW, "
                "or `make bases` and --config .cache/bases.toml for local test bases")
    return None


def snapshot_context(dest: Path, src: Path = ROOT) -> Path:
    """Copy SRC's build context (tracked and untracked-but-not-ignored files, plus the git-ignored images/certs/)
    into DEST: for builds that change a file (benchmarks, cache tests) without touching the working tree."""
    r = subprocess.run(["git", "-C", str(src), "ls-files", "-co", "--exclude-standard", "-z"], capture_output=True)
    if r.returncode != 0:
        raise UserError(f"cannot list the files of {src} (not a git checkout?): {r.stderr.decode().strip()}")
    names = [n for n in r.stdout.decode().split("\0") if n]
    names += [str(p.relative_to(src)) for p in (src / "images" / "certs").glob("*.crt")]
    for name in names:
        s = src / name
        if not s.is_file():
            continue  # deleted in the work tree but still in the index
        d = dest / name
        d.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(s, d)
    return dest


# ------------------------------------------------------------------------------------------------------- building
@dataclass
class BuildResult:
    cell: str
    tag: str
    arch: str
    platform: str
    builder: str
    image_id: str = ""
    refs: list[str] = field(default_factory=list)
    seconds: float = 0.0
    size: int = 0
    layers: int = 0
    steps: int = 0
    cached_steps: int = 0
    digest: str = ""
    pushed_ref: str = ""
    pushed_layers: int = 0
    pushed_bytes: int = 0
    push_seconds: float = 0.0
    blobs: dict = field(default_factory=dict)   # digest -> compressed size of the pushed manifest's config + layers


def _stream(argv: list[str], env: dict, quiet: bool, prefix: str) -> tuple[int, BuildLog]:
    log = BuildLog()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                            errors="replace", bufsize=1)
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        log.add(line)
        if not quiet:
            print(f"{prefix}{line}", flush=True)
    return proc.wait(), log


def build_image(*, dockerfile: Path, context: Path, platform: str, builder: Builder, label: str,
                build_args: dict[str, str] | None = None, secrets: list[str] | None = None, no_cache: bool = False,
                quiet: bool = False, network: str = "host", buildx_builder: str | None = None,
                cache_from: tuple[str, ...] = (), cache_to: str | None = None) -> tuple[str, list[str]]:
    """Build and return (image id, log lines); no tag. Raises UserError naming LABEL and the failing step."""
    build_args = build_args or {}
    secrets = secrets or []
    if builder.kind == "legacy":   # options.check_buildable refuses it first; a caller that skipped it too
        raise UserError(f"{label}: {LEGACY_REFUSED}", fix=LEGACY_FIX)
    with tempfile.TemporaryDirectory(prefix="trainbox-build-") as tmp:
        iidfile = Path(tmp) / "iid"
        env = dict(os.environ)
        if builder.kind == "buildx":
            argv = [builder.cli, "buildx", "build", "--load", "--progress=plain"]
            if buildx_builder:
                argv += ["--builder", buildx_builder]
        else:
            env["DOCKER_BUILDKIT"] = "1" if builder.kind == "buildkit" else "0"
            argv = [builder.cli, "build"]
            if builder.kind == "buildkit":
                argv.append("--progress=plain")
        argv += ["--network", network, "--platform", platform, "-f", str(dockerfile), "--iidfile", str(iidfile)]
        for k, v in build_args.items():
            argv += ["--build-arg", f"{k}={v}"]
        for s in secrets:
            argv += ["--secret", s]
        if no_cache:
            argv.append("--no-cache")
        for spec in cache_from:
            argv += ["--cache-from", spec]
        if cache_to:
            argv += ["--cache-to", cache_to]
        argv.append(str(context))
        rc, log = _stream(argv, env, quiet, f"[{label}] ")
        if rc != 0 or not iidfile.exists():
            step, reason = failed_step(log, dockerfile)
            raise UserError(f"build of cell {label} failed at `{step[:240]}`: {reason[:400]}",
                            fix=failure_fix(step, reason))
        return iidfile.read_text().strip(), log.lines


def _count_cached(lines: list[str]) -> tuple[int, int]:
    """(steps, cached steps) from the build log."""
    # FROM only resolves the base (never reported CACHED): not a step that builds anything
    steps = {m.group(1) for ln in lines if (m := re.match(r"#(\d+) \[(?!internal)[^]]*\] (?!FROM )", ln))}
    cached = {m.group(1) for ln in lines if (m := re.match(r"#(\d+) CACHED", ln))}
    legacy = [ln for ln in lines if re.match(r"Step \d+/\d+ : ", ln)]
    if not steps and legacy:
        return len(legacy), sum(1 for ln in lines if ln.strip() == "---> Using cache")
    return len(steps), len(cached & steps)


def vcs_ref(context: Path = ROOT) -> str:
    """The checkout's commit for the revision label; a snapshot context (not a git checkout) uses the repository's."""
    for d in (context, ROOT):
        r = subprocess.run(["git", "-C", str(d), "rev-parse", "HEAD"], capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip()
    return "unknown"


def attention_how(cell, root: Path = ROOT) -> str | None:
    """lock.attention_how for a matrix cell; None for a cell without an attention wheel (or not from the matrix)."""
    if not getattr(cell, "flash", None):
        return None
    return lock.attention_how(cell, root)


def compiles_under_emulation(cell, native_builder: bool = False, root: Path = ROOT) -> bool:
    """A cell that compiles (its attention wheel from source, or its fabric-plugin stage), built for another arch than
    this host's without a native builder (buildx --builder naming a node of that arch): QEMU would take many hours."""
    return bool(_emulated_compiles(cell, native_builder, root))


def _emulated_compiles(cell, native_builder: bool = False, root: Path = ROOT) -> list[str]:
    """What CELL would compile under emulation, in words: the attention package, the fabric-plugin stage."""
    if cell.arch == host_arch() or native_builder:
        return []
    if getattr(cell, "base", None) is not None:  # a flavour is built FROM its base cell, which the build adds
        return _emulated_compiles(cell.base, native_builder, root)
    out = []
    if attention_how(cell, root) == "source":
        out.append(cell.attention["package"])
    plugin = getattr(cell, "fabric_plugin", None)
    if plugin:
        out.append(f"the {plugin['name']} NCCL net plugin (stage fabric-plugin)")
    return out


def refuse_emulated_compile(cells, native_builder: bool = False, root: Path = ROOT) -> None:
    """One error naming every cell of CELLS that would compile under emulation, and the selection that builds the
    rest."""
    cells = list(cells)
    bad = [c for c in cells if compiles_under_emulation(c, native_builder, root)]
    if not bad:
        return
    rest = [c.tag for c in cells if c not in bad]
    pkgs = sorted({what for c in bad for what in _emulated_compiles(c, native_builder, root)})
    raise UserError(f"{', '.join(c.tag for c in bad)} compile{'s' if len(bad) == 1 else ''} {' and '.join(pkgs)} "
                    f"from source and this host is {host_arch()}: under QEMU that takes many hours, so "
                    f"{'it is' if len(bad) == 1 else 'they are'} refused",
                    fix=f"build {'it' if len(bad) == 1 else 'them'} on a native {bad[0].arch} machine (the generated "
                        "workflow does), or with --buildx-builder NAME naming a buildx builder with a native node of "
                        "that arch" + (f"; the rest builds here: python build.py {' '.join(rest)}" if rest else ""))


def host_base(cell, bases: dict[str, str], native_builder: bool = False, context: Path = ROOT) -> dict[str, str]:
    """VENV_BASE/HOST_BASE_IMAGE for a build under QEMU: the venv stage on the cell's base for this host's platform
    (the template's host-base stage), so uv installs the target's wheels natively. A locked base is the tag at this
    platform's digest; a substituted one is the same reference where its registry says it serves this platform too
    (a multi-arch list). None for a native build, a flavour (its base is the cell image, one arch only) or a
    substitute that serves only the target's platform or whose platforms are unknown: the venv stage then runs on
    `base`, under QEMU, slower but on a base that exists."""
    base = getattr(cell, "base_image", None)
    if not base or native_builder or cell.arch == host_arch() or getattr(cell, "flavour", None):
        return {}
    if base in bases:
        ref = bases[base]
        if host_platform() not in (base_lock.platforms(ref) or ()):
            return {}
    else:
        ref = base_lock.ref(base, cell, context, platform=host_platform())
    return {"VENV_BASE": "host-base", "HOST_BASE_IMAGE": ref}


def cell_build_args(cell, *, bases: dict[str, str] | None = None, index_overrides: dict[str, str] | None = None,
                    extra: dict[str, str] | None = None, context: Path = ROOT,
                    native_builder: bool = False) -> dict[str, str]:
    """Every build arg the cell's Dockerfile reads: substituted bases, the venv stage's base under emulation
    (host_base), the index URLs (matrix defaults or overrides), ATTENTION_FROM (a probed arch: what its lock in
    CONTEXT found), VCS_REF; then the --build-arg passthrough, which wins."""
    bases = bases or {}
    out: dict[str, str] = {}
    base = getattr(cell, "base_image", None)
    if base and base in bases:
        out["BASE_IMAGE"] = bases[base]
    out.update(host_base(cell, bases, native_builder, context))
    build_image = getattr(cell, "build_image", None)
    if build_image and build_image in bases and getattr(cell, "has_compile_stage", False):
        out["BUILD_IMAGE"] = bases[build_image]
    if hasattr(cell, "index_templates"):
        out.update(indexes.build_args(cell, index_overrides))
    how = attention_how(cell, context)
    if (getattr(cell, "flash", None) or {}).get("probe") and how:
        out["ATTENTION_FROM"] = how
    out["VCS_REF"] = vcs_ref(context)
    out.update(extra or {})
    return out


class TagJournal:
    """The tags one push run moves, with the image each named before: when a build, push or manifest list of the run
    fails, `rollback()` puts every tag back (or removes it), so a failed push leaves no registry-prefixed tag."""

    def __init__(self, client: DockerClient):
        self.client = client
        self.moved: list[tuple[str, str | None]] = []

    def tag(self, image_id: str, ref: str) -> None:
        before = self.client.image.inspect(ref).id if self.client.image.exists(ref) else None
        self.client.image.tag(image_id, ref)
        self.moved.append((ref, before))

    def rollback(self) -> list[str]:
        """Undo every move, newest first; returns the refs it could not restore (e.g. used by a container)."""
        stuck = []
        for ref, before in reversed(self.moved):
            try:
                if before:
                    self.client.image.tag(before, ref)
                else:
                    self.client.image.remove(ref, prune=False)
            except DockerException:
                stuck.append(ref)
        self.moved.clear()
        return stuck


@contextlib.contextmanager
def build_context(output_dir: Path, cells):
    """The folder to build from: the repository itself, or (for files rendered elsewhere, e.g. a foreign --matrix) a
    temporary snapshot of it with the cells' images/<tag>/ and locks from OUTPUT_DIR laid over."""
    output_dir = Path(output_dir)
    if output_dir.resolve() == ROOT.resolve():
        yield ROOT
        return
    with tempfile.TemporaryDirectory(prefix="trainbox-context-") as tmp:
        ctx = snapshot_context(Path(tmp), ROOT)
        for cell in cells:
            shutil.copytree(output_dir / Path(cell.dockerfile).parent, ctx / Path(cell.dockerfile).parent,
                            dirs_exist_ok=True)
        if (output_dir / "locks").is_dir():
            shutil.copytree(output_dir / "locks", ctx / "locks", dirs_exist_ok=True)
        yield ctx


def build_cell(cell, *, builder: Builder, context: Path = ROOT, registry: str | None = None,
               bases: dict[str, str] | None = None, wheelhouse: str | None = None, secrets: list[str] | None = None,
               no_cache: bool = False, quiet: bool = False, index_overrides: dict[str, str] | None = None,
               extra_args: dict[str, str] | None = None, native_builder: bool = False,
               buildx_builder: str | None = None, journal: TagJournal | None = None,
               cache_from: tuple[str, ...] = (), cache_to: str | None = None,
               local_too: bool = False) -> BuildResult:
    bases = bases or {}
    dockerfile = Path(cell.dockerfile)
    if not dockerfile.is_absolute():
        dockerfile = context / dockerfile
    if not dockerfile.exists():
        raise UserError(f"cell {cell.tag}: {dockerfile} does not exist; render it with `python build.py --dry-run`")
    refuse_emulated_compile([cell], native_builder, context)
    build_args = cell_build_args(cell, bases=bases, index_overrides=index_overrides, extra=extra_args,
                                 context=context, native_builder=native_builder or bool(buildx_builder))
    base = getattr(cell, "base_image", None)
    res = BuildResult(cell=cell.name, tag=cell.tag, arch=cell.arch, platform=cell.platform, builder=builder.kind)
    t0 = time.monotonic()
    with Wheelhouse(wheelhouse, context):
        image_id, lines = build_image(dockerfile=dockerfile, context=context, platform=cell.platform,
                                      builder=builder, label=cell.tag, build_args=build_args, secrets=secrets,
                                      no_cache=no_cache, quiet=quiet, buildx_builder=buildx_builder,
                                      cache_from=cache_from, cache_to=cache_to)
    res.seconds = round(time.monotonic() - t0, 1)
    res.steps, res.cached_steps = _count_cached(lines)
    client = builder.client()
    img = client.image.inspect(image_id)
    want = platform_arch(cell.platform)
    if img.architecture != want:
        raise UserError(f"cell {cell.tag}: the built image says architecture {img.architecture}, expected {want} "
                        f"(is the base {build_args.get('BASE_IMAGE', base)} multi-arch?)")
    res.image_id, res.size, res.layers = image_id, int(img.size), len(img.root_fs.layers or [])
    res.refs = cell_refs(cell, registry)   # what a push sends
    # LOCAL_TOO (build.py's builds): with --registry the plain local name too, so `docker run trainbox:TAG` works after
    # `make build` (it found no such image: issue 64 case 1); the journal puts it back when the run's push fails.
    local = [r for r in cell_refs(cell) if r not in res.refs] if registry and local_too else []
    for ref in [*res.refs, *local]:  # only now: a failed build above never moved a tag
        if journal is not None:
            journal.tag(image_id, ref)
        else:
            client.image.tag(image_id, ref)
    return res
