"""The build's options, typed and checked once (from the CLI's strings) before any work starts; the engine reads only
this object."""
from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from builder import reference
from builder.errors import UserError, shorten
from builder.paths import ROOT
from common import atomic


def parse_bases(pairs: list[str] | None, table: Mapping | None = None, where: str = "--config") -> dict[str, str]:
    """{cell base: image to build FROM instead} from a config's [bases] table and --base OLD=NEW (which win), each
    side checked as an image reference."""
    out: dict[str, str] = {}
    if table is not None:
        if not isinstance(table, Mapping) or not all(isinstance(v, str) and v for v in table.values()):
            raise UserError("[bases] must map image names to image names", where=f"{where}: bases")
        for old, new in table.items():
            out[reference.check_image(old, f"{where}: bases")] = reference.check_image(new, f"{where}: bases.{old}")
    for pair in pairs or []:
        old, sep, new = pair.partition("=")
        if not sep or not old.strip() or not new.strip():
            raise UserError(f"--base {pair!r}: expected OLD=NEW", fix="e.g. --base debian:bookworm=local/bookworm:base")
        out[reference.check_image(old.strip(), "--base")] = reference.check_image(new.strip(), "--base")
    return out


SECRET_FIELDS = ("id", "src", "source", "env", "type", "required")


def parse_secrets(specs: list[str] | None) -> tuple[str, ...]:
    """`id=ID,src=PATH` (or env=VAR) specs, checked: known fields only, the file readable or the variable set
    (BuildKit would fail late and unclearly). Errors name the id, never the value of anything."""
    out = []
    for s in specs or []:
        fields = dict(kv.partition("=")[::2] for kv in s.split(","))
        unknown = sorted(set(fields) - set(SECRET_FIELDS))
        if unknown:
            raise UserError(f"--secret: unknown field {shorten(unknown[0], 40)!r}; expected id=ID,src=PATH or "
                            "id=ID,env=VAR", fix="e.g. id=hf_token,src=$HOME/.hf_token")
        sid, src = fields.get("id", ""), fields.get("src") or fields.get("source")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", sid) or not (src or fields.get("env")):
            raise UserError("--secret: expected id=ID,src=PATH or id=ID,env=VAR (ID: letters, digits, _ . -)",
                            fix="e.g. id=hf_token,src=$HOME/.hf_token")
        if src and not (Path(src).is_file() and os.access(src, os.R_OK)):
            raise UserError(f"--secret id={sid}: file {shorten(src, 120)} does not exist or is not readable")
        if fields.get("env") and fields["env"] not in os.environ:
            raise UserError(f"--secret id={sid}: environment variable {shorten(fields['env'], 60)} is not set")
        out.append(s)
    return tuple(out)


def check_dir(path: str | Path, flag: str) -> Path:
    """A folder the build will write into: a folder already, or creatable; writable; not under /proc, /sys, /dev."""
    why = atomic.why_not_a_folder(path)
    if why:
        raise UserError(f"{flag} {shorten(str(path), 120)}: {why}", fix="pass a writable folder on a real disk")
    return Path(path)


def check_file_target(path: str | Path, flag: str) -> Path:
    """A file a command will write (build.py --report, a job script, an SBOM...), checked now (not after an hour's
    build) by the writer's own rule, atomic.file_target: a new or regular file (a link to one is written through)
    in a folder this user can write; never a folder, device node, fifo, socket, broken link, nor under /proc, /sys,
    /dev; a name the file system can hold."""
    why = atomic.why_not_a_file(path)
    if why:
        raise UserError(f"{flag} {shorten(str(path), 120)}: {why}",
                        fix="pass the path of a regular file in a writable folder on a real disk")
    return Path(path)


def parse_build_args(pairs: list[str] | None) -> dict[str, str]:
    out = {}
    for p in pairs or []:
        key, sep, value = p.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise UserError(f"--build-arg {p!r}: expected KEY=VALUE (e.g. --build-arg MAX_JOBS=4)")
        out[key] = value
    return out


def check_registry(registry: str | None, push: bool) -> str | None:
    """--registry is the repository pushed to: checked by Docker's grammar; it and --push come together."""
    if registry is None:
        if push:
            raise UserError("--push needs --registry HOST[:PORT]/REPO", fix=f"e.g. --registry {reference.EXAMPLE}")
        return None
    reference.check_repository(registry)
    if not push:
        raise UserError(f"--registry {registry} without --push: nothing would be pushed",
                        fix="add --push, or drop --registry to tag the images locally as the matrix names them")
    return registry


# BuildKit's cache backends (buildx --cache-from/--cache-to: `type=TYPE,KEY=VALUE,...`, or a bare image reference for
# type=registry); inline only writes (it goes into the image).
CACHE_TYPES = ("registry", "local", "inline", "gha", "s3", "azblob")
CACHE_EXAMPLE = f"type=registry,ref={reference.EXAMPLE}-cache:smoke"


def _shown_spec(spec: str) -> str:
    """SPEC as an error may echo it: secret fields' values (s3's secret_access_key, session_token...) masked."""
    from common import redact

    fields = []
    for item in spec.split(","):
        key, sep, _ = item.partition("=")
        fields.append(f"{key}={redact.MASK}" if sep and re.fullmatch(redact.SECRET_NAME, key, re.I) else item)
    return shorten(",".join(fields), 160)


def check_cache(spec: str, flag: str) -> str:
    """A buildx cache spec (--cache-from/--cache-to), checked before any work: buildx would refuse a bad one only
    after the lock step, in a build log line that does not name the flag. Errors never echo a secret field."""
    writes = flag == "--cache-to"

    def bad(why: str) -> UserError:
        return UserError(f"{flag} {_shown_spec(spec)!r}: {why}",
                         fix=f"e.g. {flag} {CACHE_EXAMPLE}{',mode=max' if writes else ''} (BuildKit's cache syntax)")

    if not spec or not spec.isascii() or not spec.isprintable() or any(ch.isspace() or ch in "\"'\\" for ch in spec):
        raise bad("empty, or has white space, quotes, backslashes or characters outside printable ASCII")
    if "=" not in spec:   # a bare image reference: buildx reads it as type=registry,ref=SPEC
        if not reference.REFERENCE.fullmatch(spec):
            raise bad("not an image reference (Docker's reference grammar) and no type=TYPE")
        return spec
    fields: dict[str, str] = {}
    for item in spec.split(","):
        key, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[a-z][a-z0-9_-]*", key, re.ASCII) or not value:
            raise bad(f"field {shorten(key, 40)!r} is not KEY=VALUE (lower-case key, non-empty value)")
        if key in fields:
            raise bad(f"field {key!r} given twice")
        fields[key] = value
    kind = fields.get("type")
    if kind not in CACHE_TYPES or (kind == "inline" and not writes):
        raise bad(f"type must be one of {', '.join(t for t in CACHE_TYPES if writes or t != 'inline')}")
    if kind == "registry" and not reference.REFERENCE.fullmatch(fields.get("ref", "")):
        raise bad("type=registry needs ref=IMAGE (Docker's reference grammar: lower-case repository path, no scheme)")
    if kind == "local" and not fields.get("dest" if writes else "src"):
        raise bad(f"type=local needs {'dest' if writes else 'src'}=FOLDER")
    if "mode" in fields and fields["mode"] not in ("min", "max"):
        raise bad("mode must be min or max")
    return spec


@dataclass(frozen=True)
class BuildOptions:
    """What `build.py` hands the engine. Every field is already checked."""
    output_dir: Path = ROOT                   # images/<tag>/ and locks/ (the build context is made from it)
    bases: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    index_overrides: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    registry: str | None = None               # push target repository (implies push)
    wheelhouse: str | None = None
    builder: str = "auto"                     # auto | buildx | buildkit | legacy
    buildx_builder: str | None = None         # a buildx builder with native nodes: source builds allowed
    build_args: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    secrets: tuple[str, ...] = ()
    no_cache: bool = False
    cache_from: tuple[str, ...] = ()          # buildx --cache-from specs (e.g. type=registry,ref=REG/cache:venv)
    cache_to: str | None = None               # buildx --cache-to spec
    frozen: bool = False
    quiet: bool = False
    report: str | None = None
    sqsh: str | None = None
    sqsh_compression: str | None = None
    sqsh_block_size: str | None = None
    use_enroot: bool = False

    def __post_init__(self):   # made in one place (cli.build_options); the cache specs are checked here
        for spec in self.cache_from:
            check_cache(spec, "--cache-from")
        if self.cache_to is not None:
            check_cache(self.cache_to, "--cache-to")

    @property
    def push(self) -> bool:
        return self.registry is not None

    @property
    def native_builder(self) -> bool:
        return self.buildx_builder is not None


LEGACY_REFUSED = ("the legacy builder cannot build these Dockerfiles: their venv install uses a BuildKit cache mount "
                  "(RUN --mount=type=cache) and secrets go in as BuildKit secrets")
LEGACY_FIX = ("use --builder auto: buildx, or a classic docker CLI older than 23 with DOCKER_BUILDKIT=1 (`make engine` "
              "installs Debian's)")


def check_wheelhouse(src: str | Path) -> list[Path]:
    """--wheelhouse DIR's wheels; a UserError for a folder that is missing or holds none."""
    src = Path(src)
    if not src.is_dir():
        raise UserError(f"--wheelhouse {src}: not a directory; give a folder of .whl files")
    wheels = sorted(src.glob("*.whl"))
    if not wheels:
        raise UserError(f"--wheelhouse {src}: no .whl files in it")
    return wheels


def check_buildable(opts: BuildOptions, cells=()) -> None:
    """What a real build refuses about its inputs, checked alike by `--dry-run` and the build (cli.run, before
    anything is rendered; pipeline.build_cells again): `--builder legacy`, a --wheelhouse without wheels, and a
    builder asked for (or needed: --cache-from/--cache-to want buildx) that this host's docker CLIs don't offer.
    The dry run accepted all three, and the build refused them minutes later. Not here: the engine and the registry
    (a dry run contacts neither; the build checks both first), and emulated compiles (the plan names them)."""
    if opts.builder == "legacy":
        tags = ", ".join(c.tag for c in cells)
        raise UserError(f"--builder legacy{' for ' + tags if tags else ''}: {LEGACY_REFUSED}", fix=LEGACY_FIX)
    if opts.wheelhouse is not None:
        check_wheelhouse(opts.wheelhouse)
    caching = bool(opts.cache_from or opts.cache_to)
    requested = "buildx" if opts.buildx_builder else opts.builder
    if caching or requested != "auto":
        from builder.docker import choose_builder  # a docker CLI probe (no engine): only when a choice hangs on it

        builder = choose_builder(requested)
        if caching and builder.kind != "buildx":
            raise UserError(f"--cache-from/--cache-to need buildx; the builder here is {builder.kind} ({builder.cli})",
                            fix="install Docker's buildx plugin (docker/setup-buildx-action in CI), or build without "
                                "them")
