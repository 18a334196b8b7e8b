"""Build, tag and push cell images on a Docker engine, and join a cell's arches into a manifest list.

Builder choice (`--builder auto`): buildx when the CLI has it (through python-on-whales); otherwise the engine's own
BuildKit through a classic CLI that still accepts DOCKER_BUILDKIT=1 (Docker < 23, e.g. Debian's /usr/bin/docker);
otherwise the legacy builder. Every build runs with host networking (RUN steps reach the package index and the local
registry) and without a tag: only a finished image gets the cell's tags, so a failed build never leaves a final tag
on a half image. Secrets go in as BuildKit secrets only (never ARG/ENV/COPY).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from python_on_whales import DockerClient
from python_on_whales.exceptions import DockerException

from builder.errors import UserError, reports_user_errors

ROOT = Path(__file__).resolve().parents[1]
WHEELHOUSE = "wheelhouse"
MANIFEST_LIST_TYPES = ("application/vnd.docker.distribution.manifest.list.v2+json",
                       "application/vnd.oci.image.index.v1+json")


# ----------------------------------------------------------------------------------------------------------- builders
@dataclass(frozen=True)
class Builder:
    kind: str  # buildx | buildkit | legacy
    cli: str

    def client(self) -> DockerClient:
        return DockerClient(client_call=[self.cli])


def _cli_version(cli: str) -> tuple[int, ...] | None:
    try:
        r = subprocess.run([cli, "version", "--format", "{{.Client.Version}}"], capture_output=True, text=True,
                           timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.match(r"(\d+)\.(\d+)", r.stdout.strip())
    return tuple(int(x) for x in m.groups()) if m else None


def _has_buildx(cli: str) -> bool:
    try:
        return subprocess.run([cli, "buildx", "version"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _candidate_clis() -> list[str]:
    seen, out = set(), []
    for c in [os.environ.get("TRAINBOX_DOCKER"), shutil.which("docker"), "/usr/bin/docker", "/usr/local/bin/docker"]:
        if c and Path(c).exists() and os.path.realpath(c) not in seen:
            seen.add(os.path.realpath(c))
            out.append(c)
    return out


def choose_builder(requested: str = "auto") -> Builder:
    clis = _candidate_clis()
    if not clis:
        raise UserError("no docker CLI found: run `make engine` (installs Debian's docker.io) or install Docker")
    if requested in ("auto", "buildx"):
        for cli in clis:
            if _has_buildx(cli):
                return Builder("buildx", cli)
        if requested == "buildx":
            raise UserError("--builder buildx: no docker CLI here has the buildx plugin; install docker-buildx or "
                            "use --builder auto")
    if requested in ("auto", "buildkit"):
        for cli in clis:
            v = _cli_version(cli)
            # Docker 23+ CLIs hand DOCKER_BUILDKIT=1 to buildx and refuse without it.
            if v and v < (23,):
                return Builder("buildkit", cli)
        if requested == "buildkit":
            raise UserError("--builder buildkit needs a classic docker CLI older than 23 (e.g. Debian's "
                            "/usr/bin/docker from docker.io) or buildx; set TRAINBOX_DOCKER to its path")
    return Builder("legacy", clis[0])


# ----------------------------------------------------------------------------------------------------- cells, names
def cell_refs(cell, registry: str | None = None) -> list[str]:
    """The refs a built cell is tagged with: REPOSITORY:TAG for each of the cell's tags; with --registry
    HOST:PORT/REPO the repository is replaced by it (the tags stay)."""
    repo = registry or getattr(cell, "repository", None) or "trainbox"
    tags = list(getattr(cell, "tags", None) or getattr(cell, "version_tags", None) or [])
    if cell.tag not in tags:
        tags.insert(0, cell.tag)
    return [f"{repo}:{t}" for t in tags]


def manifest_list_ref(cell, registry: str) -> str:
    return f"{registry}:{cell.name}"


def _registry_host(ref: str) -> str:
    return ref.split("/", 1)[0]


def _insecure(ref: str) -> bool:
    host = _registry_host(ref).split(":")[0]
    return host in ("localhost",) or host.startswith("127.") or os.environ.get("TRAINBOX_INSECURE_REGISTRY") == "1"


# --------------------------------------------------------------------------------------------------- build inputs
def parse_bases(pairs: list[str] | None) -> dict[str, str]:
    out = {}
    for p in pairs or []:
        old, sep, new = p.partition("=")
        if not sep or not old or not new:
            raise UserError(f"--base {p!r}: expected OLD=NEW (the cell's base image = the image to use instead)")
        out[old] = new
    return out


def parse_secrets(specs: list[str] | None) -> list[str]:
    """`id=ID,src=PATH` specs, checked: the file must exist (BuildKit would fail late and unclearly)."""
    out = []
    for s in specs or []:
        fields = dict(kv.partition("=")[::2] for kv in s.split(","))
        if not fields.get("id") or not (fields.get("src") or fields.get("env")):
            raise UserError(f"--secret {s!r}: expected id=ID,src=PATH (e.g. id=hf_token,src=$HOME/.hf_token)")
        if fields.get("src") and not Path(fields["src"]).is_file():
            raise UserError(f"--secret {s!r}: file {fields['src']} does not exist")
        out.append(s)
    return out


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
        if not self.src.is_dir():
            raise UserError(f"--wheelhouse {self.src}: not a directory; give a folder of .whl files")
        wheels = sorted(self.src.glob("*.whl"))
        if not wheels:
            raise UserError(f"--wheelhouse {self.src}: no .whl files in it")
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


# ---------------------------------------------------------------------------------------------- failure reporting
def failed_step(lines: list[str]) -> tuple[str, str]:
    """(step, reason) from a build log: BuildKit plain progress (`#N [stage k/n] RUN ...` + `#N ERROR: ...`) or the
    legacy builder (`Step k/n : RUN ...` + the error)."""
    headers: dict[str, str] = {}
    err_id, reason = None, ""
    for line in lines:
        m = re.match(r"#(\d+) (\[.*)$", line)
        if m and m.group(1) not in headers:
            headers[m.group(1)] = m.group(2).strip()
        m = re.match(r"#(\d+) ERROR: (.*)$", line)
        if m and err_id is None:
            err_id, reason = m.group(1), m.group(2).strip()
    final = next((ln for ln in reversed(lines) if re.match(r"(ERROR|error|failed to solve)", ln.strip())), "")
    if err_id is not None:
        step = headers.get(err_id, f"#{err_id}")
        # The step's own last error line (pip's "No matching distribution ...") says more than "exit code: 1".
        own = [re.sub(r"^#\d+ [\d.]+ ", "", ln).strip() for ln in lines
               if ln.startswith(f"#{err_id} ") and not ln.startswith(f"#{err_id} ERROR")
               and re.search(r"error|not found|denied|refused|no such", ln, re.I)]
        if own:
            reason = f"{own[-1]} ({reason})"

        m = re.match(r"\[internal\] load metadata for (\S+)", step)
        if m:
            step = f"FROM {m.group(1)}"
        return step, reason or final
    legacy_steps = [ln for ln in lines if re.match(r"Step \d+/\d+ : ", ln)]
    if legacy_steps:
        last = [ln for ln in lines if ln.strip()][-1] if lines else ""
        return legacy_steps[-1].split(" : ", 1)[1].strip(), last.strip()
    return "(before the first step)", (final or (lines[-1] if lines else "no output")).strip()


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


def _stream(argv: list[str], env: dict, quiet: bool, prefix: str) -> tuple[int, list[str]]:
    tail: deque[str] = deque(maxlen=400)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True,
                            errors="replace", bufsize=1)
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        tail.append(line)
        if not quiet:
            print(f"{prefix}{line}", flush=True)
    return proc.wait(), list(tail)


def build_image(*, dockerfile: Path, context: Path, platform: str, builder: Builder, label: str,
                build_args: dict[str, str] | None = None, secrets: list[str] | None = None, no_cache: bool = False,
                quiet: bool = False, network: str = "host", buildx_builder: str | None = None) -> tuple[str, list[str]]:
    """Build and return (image id, log lines); no tag. Raises UserError naming LABEL and the failing step."""
    build_args = build_args or {}
    secrets = secrets or []
    if secrets and builder.kind == "legacy":
        raise UserError(f"{label}: --secret needs BuildKit (buildx or a classic CLI with DOCKER_BUILDKIT=1); the "
                        "legacy builder would have to bake the secret into a layer")
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
        argv.append(str(context))
        rc, lines = _stream(argv, env, quiet, f"[{label}] ")
        if rc != 0 or not iidfile.exists():
            step, reason = failed_step(lines)
            raise UserError(f"build of cell {label} failed at step `{step[:200]}`: {reason[:400]}")
        return iidfile.read_text().strip(), lines


def _count_cached(lines: list[str]) -> tuple[int, int]:
    """(steps, cached steps) from the build log."""
    # FROM only resolves the base (never reported CACHED): not a step that builds anything
    steps = {m.group(1) for ln in lines if (m := re.match(r"#(\d+) \[(?!internal)[^]]*\] (?!FROM )", ln))}
    cached = {m.group(1) for ln in lines if (m := re.match(r"#(\d+) CACHED", ln))}
    legacy = [ln for ln in lines if re.match(r"Step \d+/\d+ : ", ln)]
    if not steps and legacy:
        return len(legacy), sum(1 for ln in lines if ln.strip() == "---> Using cache")
    return len(steps), len(cached & steps)


def _platform_arch(platform: str) -> str:
    return platform.split("/")[1]


def host_arch() -> str:
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine().lower())


def parse_build_args(pairs: list[str] | None) -> dict[str, str]:
    out = {}
    for p in pairs or []:
        key, sep, value = p.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise UserError(f"--build-arg {p!r}: expected KEY=VALUE (e.g. --build-arg MAX_JOBS=4)")
        out[key] = value
    return out


def vcs_ref(context: Path = ROOT) -> str:
    """The checkout's commit for the revision label; a snapshot context (not a git checkout) uses the repository's."""
    for d in (context, ROOT):
        r = subprocess.run(["git", "-C", str(d), "rev-parse", "HEAD"], capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip()
    return "unknown"


def compiles_under_emulation(cell, native_builder: bool = False) -> bool:
    """A cell whose attention wheel is compiled from source, built for another arch than this host's without a
    native builder (buildx --builder naming a node of that arch): QEMU would take many hours."""
    flash = getattr(cell, "flash", None) or {}
    return flash.get("how") == "source" and cell.arch != host_arch() and not native_builder


def refuse_emulated_compile(cell, native_builder: bool = False) -> None:
    if compiles_under_emulation(cell, native_builder):
        raise UserError(f"cell {cell.tag} compiles {cell.attention['package']} from source and this host is "
                        f"{host_arch()}: under QEMU that takes many hours, so it is refused",
                        fix=f"build it on a native {cell.arch} machine (the generated workflow does), or with "
                            "--buildx-builder NAME naming a buildx builder with a native node of that arch")


def cell_build_args(cell, *, bases: dict[str, str] | None = None, index_overrides: dict[str, str] | None = None,
                    extra: dict[str, str] | None = None, context: Path = ROOT) -> dict[str, str]:
    """Every build arg the cell's Dockerfile reads: substituted bases, the index URLs (matrix defaults or overrides),
    VCS_REF; then the --build-arg passthrough, which wins."""
    from builder import indexes
    bases = bases or {}
    out: dict[str, str] = {}
    base = getattr(cell, "base_image", None)
    if base and base in bases:
        out["BASE_IMAGE"] = bases[base]
    build_image = getattr(cell, "build_image", None)
    if build_image and build_image in bases and (getattr(cell, "flash", None) or {}).get("how") == "source":
        out["BUILD_IMAGE"] = bases[build_image]
    if hasattr(cell, "index_templates"):
        out.update(indexes.build_args(cell, index_overrides))
    out["VCS_REF"] = vcs_ref(context)
    out.update(extra or {})
    return out


def build_cell(cell, *, builder: Builder, context: Path = ROOT, registry: str | None = None,
               bases: dict[str, str] | None = None, wheelhouse: str | None = None, secrets: list[str] | None = None,
               no_cache: bool = False, quiet: bool = False, index_overrides: dict[str, str] | None = None,
               extra_args: dict[str, str] | None = None, native_builder: bool = False,
               buildx_builder: str | None = None) -> BuildResult:
    bases = bases or {}
    dockerfile = Path(cell.dockerfile)
    if not dockerfile.is_absolute():
        dockerfile = context / dockerfile
    if not dockerfile.exists():
        raise UserError(f"cell {cell.tag}: {dockerfile} does not exist; render it with `python build.py --dry-run`")
    refuse_emulated_compile(cell, native_builder)
    build_args = cell_build_args(cell, bases=bases, index_overrides=index_overrides, extra=extra_args,
                                 context=context)
    base = getattr(cell, "base_image", None)
    res = BuildResult(cell=cell.name, tag=cell.tag, arch=cell.arch, platform=cell.platform, builder=builder.kind)
    t0 = time.monotonic()
    with Wheelhouse(wheelhouse, context):
        image_id, lines = build_image(dockerfile=dockerfile, context=context, platform=cell.platform,
                                      builder=builder, label=cell.tag, build_args=build_args, secrets=secrets,
                                      no_cache=no_cache, quiet=quiet, buildx_builder=buildx_builder)
    res.seconds = round(time.monotonic() - t0, 1)
    res.steps, res.cached_steps = _count_cached(lines)
    client = builder.client()
    img = client.image.inspect(image_id)
    want = _platform_arch(cell.platform)
    if img.architecture != want:
        raise UserError(f"cell {cell.tag}: the built image says architecture {img.architecture}, expected {want} "
                        f"(is the base {build_args.get('BASE_IMAGE', base)} multi-arch?)")
    res.image_id, res.size, res.layers = image_id, int(img.size), len(img.root_fs.layers or [])
    res.refs = cell_refs(cell, registry)
    for ref in res.refs:  # only now: a failed build above never moved a tag
        client.image.tag(image_id, ref)
    return res


# ------------------------------------------------------------------------------------------------------ registry
def _skopeo(*args: str, ref: str) -> subprocess.CompletedProcess:
    tls = ["--tls-verify=false"] if _insecure(ref) else []
    return subprocess.run(["skopeo", args[0], *tls, *args[1:], f"docker://{ref}"], capture_output=True, text=True)


def registry_manifest(ref: str) -> tuple[dict, str] | None:
    """(manifest JSON, digest) as the registry serves REF, or None if it has no such tag."""
    if not shutil.which("skopeo"):
        raise UserError("skopeo is missing: run `make engine` (installs it) or apt-get install skopeo")
    r = _skopeo("inspect", "--raw", ref=ref)
    if r.returncode != 0:
        return None
    import hashlib
    return json.loads(r.stdout), "sha256:" + hashlib.sha256(r.stdout.encode()).hexdigest()


def _push(client: DockerClient, ref: str, label: str, quiet: bool) -> set[str]:
    """Push REF through the engine, streaming its progress; returns the short diff ids it reported as `Pushed`
    (layers the registry had, or mounted from another repository, cost no upload)."""
    pushed: set[str] = set()
    tail: deque[str] = deque(maxlen=20)
    try:
        for _source, raw in client.push(ref, stream_logs=True):
            line = raw.decode(errors="replace").rstrip()
            tail.append(line)
            m = re.match(r"([0-9a-f]{12}): Pushed$", line.strip())
            if m:
                pushed.add(m.group(1))
            if not quiet and not line.strip().endswith(("Preparing", "Waiting")):
                print(f"[{label}] {line}", flush=True)
    except DockerException as e:
        msg = [ln for ln in [*tail, *(e.stderr or "").splitlines()] if ln.strip()]
        raise UserError(f"push of cell {label} to {ref} failed: {msg[-1] if msg else e}; is the registry up and are "
                        "you logged in (`docker login HOST`)?") from None
    return pushed


def push_result(res: BuildResult, builder: Builder, quiet: bool = False) -> None:
    """Push RES's refs; fill digest (read back from the registry), layers and bytes actually uploaded."""
    client = builder.client()
    ref = res.refs[0]
    repo = ref.rsplit(":", 1)[0]
    t0 = time.monotonic()
    pushed: set[str] = set()
    for r in res.refs:
        pushed |= _push(client, r, res.tag, quiet)
    res.push_seconds = round(time.monotonic() - t0, 1)
    got = registry_manifest(ref)
    if not got:
        raise UserError(f"push of cell {res.tag}: the registry does not show {ref} after the push")
    man, digest = got
    res.digest, res.pushed_ref = digest, f"{repo}@{digest}"
    res.blobs = {b["digest"]: int(b["size"]) for b in [man.get("config", {}), *man.get("layers", [])] if b}
    # The manifest's layers are the image's diff ids in order, compressed: map the pushed ids to blob sizes.
    diff_ids = [str(d) for d in client.image.inspect(res.image_id).root_fs.layers or []]
    sizes = [int(layer["size"]) for layer in man.get("layers", [])]
    if len(diff_ids) == len(sizes):
        sent = [size for d, size in zip(diff_ids, sizes) if d.split(":")[-1][:12] in pushed]
        res.pushed_layers, res.pushed_bytes = len(sent), sum(sent)
    else:  # cannot map: count every reported upload at its manifest size unknown -> layers only
        res.pushed_layers, res.pushed_bytes = len(pushed), 0
    if not quiet:
        print(f"[{res.tag}] pushed {ref} {digest} ({res.pushed_layers} layers, {res.pushed_bytes} bytes sent)")


def publish_manifest_list(list_ref: str, results: list[BuildResult], expected_arches: list[str],
                          builder: Builder) -> str:
    """Join the pushed per-arch images into LIST_REF; refuses unless every expected arch is in the registry.
    Returns the list's digest as read back."""
    by_arch = {_platform_arch(r.platform): r for r in results if r.digest}
    missing = [a for a in expected_arches if a not in by_arch]
    if missing:
        raise UserError(f"manifest list {list_ref}: no pushed image for {', '.join(missing)}; build and push every "
                        f"arch of the cell ({', '.join(expected_arches)}) in one run, nothing was published")
    members = []
    for arch in expected_arches:
        r = by_arch[arch]
        got = registry_manifest(r.pushed_ref)
        if not got or got[1] != r.digest:
            raise UserError(f"manifest list {list_ref}: {r.pushed_ref} is not in the registry; nothing was published")
        members.append(r.pushed_ref)
    client = builder.client()
    insecure = _insecure(list_ref)
    try:
        try:
            client.manifest.remove(list_ref)  # a stale local list from an earlier run would be amended, not replaced
        except DockerException:
            pass
        client.manifest.create(list_ref, members, insecure=insecure)
        cmd = [builder.cli, "manifest", "push", "--purge"] + (["--insecure"] if insecure else []) + [list_ref]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            raise UserError(f"pushing manifest list {list_ref} failed: {p.stderr.strip()[-300:]}")
    except DockerException as e:
        raise UserError(f"creating manifest list {list_ref} failed: {(e.stderr or str(e)).strip()[-300:]}") from None
    got = registry_manifest(list_ref)
    if not got or got[0].get("mediaType") not in MANIFEST_LIST_TYPES:
        raise UserError(f"manifest list {list_ref}: the registry does not serve a list after the push")
    listed = {m["digest"] for m in got[0]["manifests"]}
    want = {r.digest for r in by_arch.values() if _platform_arch(r.platform) in expected_arches}
    if listed != want:
        raise UserError(f"manifest list {list_ref} lists {sorted(listed)}, expected {sorted(want)}")
    return got[1]


# --------------------------------------------------------------------------------------------------- entry point
def build_cells(cells, args) -> int:
    """The CLI's real build: build every cell, optionally push and join arches into manifest lists, report."""
    from builder import report

    from builder import lock

    quiet = bool(getattr(args, "quiet", False))
    buildx_builder = getattr(args, "buildx_builder", None)
    builder = choose_builder("buildx" if buildx_builder else (getattr(args, "builder", None) or "auto"))
    context = Path(getattr(args, "context", None) or ROOT)
    bases = parse_bases(getattr(args, "base", None))
    secrets = parse_secrets(getattr(args, "secret", None))
    registry = getattr(args, "registry", None)
    push = bool(getattr(args, "push", False))
    if push and not registry:
        raise UserError("--push needs --registry HOST:PORT/REPO (e.g. --registry 127.0.0.1:5555/trainbox)")
    index_overrides = getattr(args, "index_overrides", None) or {}
    extra_args = parse_build_args(getattr(args, "build_arg", None))
    for cell in cells:  # refuse before any lock or build work
        refuse_emulated_compile(cell, bool(buildx_builder))
    # The lock step: every missing or stale lock of the selection is resolved before the first build.
    lock.ensure([c for c in cells if hasattr(c, "venv")], root=context, overrides=index_overrides,
                frozen=bool(getattr(args, "frozen", False)), quiet=quiet)
    if not quiet:
        print(f"builder: {builder.kind} ({builder.cli})", flush=True)
    results: list[BuildResult] = []
    lists: dict[str, str] = {}
    for cell in cells:
        res = build_cell(cell, builder=builder, context=context, registry=registry, bases=bases,
                         wheelhouse=getattr(args, "wheelhouse", None), secrets=secrets,
                         no_cache=bool(getattr(args, "no_cache", False)), quiet=quiet,
                         index_overrides=index_overrides, extra_args=extra_args,
                         native_builder=bool(buildx_builder), buildx_builder=buildx_builder)
        results.append(res)
        if getattr(args, "sqsh", None):
            from builder import enroot
            dest = Path(args.sqsh) / f"{cell.tag}.sqsh"
            enroot.export_image(res.refs[0], dest, compression=getattr(args, "sqsh_compression", None),
                                block_size=getattr(args, "sqsh_block_size", None),
                                use_enroot=bool(getattr(args, "use_enroot", False)), progress=not quiet,
                                arch=_platform_arch(cell.platform))
    if push:
        for res in results:
            push_result(res, builder, quiet)
        by_name: dict[str, list[BuildResult]] = {}
        for res in results:
            by_name.setdefault(res.cell, []).append(res)
        for name, group in by_name.items():
            cell = next(c for c in cells if c.name == name)
            expected = [_platform_arch(c.platform) for c in cells if c.name == name]
            if len(expected) < 2:
                continue  # a single-arch run: nothing to join
            ref = manifest_list_ref(cell, registry)
            lists[ref] = publish_manifest_list(ref, group, expected, builder)
            if not quiet:
                print(f"manifest list {ref} {lists[ref]}")
    report.emit(results, lists, getattr(args, "report", None), quiet=quiet)
    return 0


# ------------------------------------------------------------------------------------- `python -m builder.engine`
def join_pushed(cell_names: list[str], registry: str, matrix_path: str | None = None) -> dict[str, str]:
    """Manifest lists for cells whose arches were pushed by separate runs (one CI job per arch): each arch's image
    is read back from REGISTRY; a missing arch refuses the list. Returns {list ref: digest}."""
    from builder.matrix import load_matrix

    matrix = load_matrix(matrix_path) if matrix_path else load_matrix()
    builder = choose_builder("auto")
    out = {}
    for name in cell_names:
        cells = matrix.select([name])
        results = []
        for c in cells:
            ref = cell_refs(c, registry)[0]
            got = registry_manifest(ref)
            if got is None:
                continue
            results.append(BuildResult(cell=c.name, tag=c.tag, arch=c.arch, platform=c.platform, builder="-",
                                       digest=got[1], pushed_ref=f"{registry}@{got[1]}"))
        ref = manifest_list_ref(cells[0], registry)
        out[ref] = publish_manifest_list(ref, results, [_platform_arch(c.platform) for c in cells], builder)
        print(f"{ref}@{out[ref]}")
    return out


@reports_user_errors
def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m builder.engine")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("manifest", help="join the pushed arches of cells into manifest lists")
    m.add_argument("--registry", required=True, help="HOST:PORT/REPO the cells were pushed to")
    m.add_argument("--matrix", default=None)
    m.add_argument("cells", nargs="+", help="cell names, e.g. smoke")
    a = p.parse_args(argv)
    join_pushed(a.cells, a.registry, a.matrix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
