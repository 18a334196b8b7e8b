"""`--help` of the trainers without importing them: their options come from TRL's and transformers' dataclasses,
whose import alone takes 6-9 s on a busy 2-core host. The text printed once (at image build: the Dockerfile runs
each `--help`) is kept beside a key of what produced it (the installed versions of the libraries that define the
options, and the sources of the entrypoint and of the package modules it imports, found with `ast`: editing
doctor.py leaves sft's text valid); the dispatcher prints it while the key still matches, else the entrypoint
renders it again and stores it. The text is the same on every host: help never looks at the GPU (config.parse_args).
Where it is kept does not depend on $HOME: the image's folder, or in a source checkout its git-ignored .cache/
(a fresh $HOME, as in CI, still hits); the user's cache only where neither can be written.
"""

from __future__ import annotations

import ast
import hashlib
import os
from importlib import metadata
from pathlib import Path

from common import commands

IMAGE_DIR = "/opt/trainbox/help"  # written at image build (the package folder's sibling)
LIBRARIES = ("trl", "transformers", "peft", "accelerate")


def asked(argv: list[str]) -> bool:
    """-h/--help among the options (not after `--`, where arguments go to another program)."""
    head = argv[: argv.index("--")] if "--" in argv else argv
    return "-h" in head or "--help" in head


PACKAGE = Path(__file__).resolve().parent
# Our packages, by import name: this one and its sibling `common` (the launcher's options are common/launch.py's).
OURS = ("trainbox", "common")


def _files(parts: list[str]) -> set[Path]:
    """The files importing our module `a.b.c` runs: a/__init__.py, a/b/__init__.py, then a/b/c.py (or its
    __init__.py); a name that is not a module (`from a.b import some_function`) adds nothing."""
    root, out = PACKAGE.parent, set()
    for i in range(1, len(parts) + 1):
        folder = root.joinpath(*parts[:i])
        out |= {f for f in (folder / "__init__.py", folder.with_suffix(".py")) if f.is_file()}
    return out


def _imports(path: Path) -> frozenset[Path]:
    """Files of our packages that `path` imports, anywhere in it (`from trainbox.training import a`,
    `import common.launch`, `from .b import c`: a relative import is of PATH's own package)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        package = list(path.resolve().parent.relative_to(PACKAGE.parent).parts)
    except (OSError, SyntaxError, ValueError):
        return frozenset()
    out: set[Path] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] in OURS:
                base = node.module.split(".")
            else:
                continue
            out |= _files(base)
            for a in node.names:
                out |= _files([*base, a.name])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in OURS:
                    out |= _files(a.name.split("."))
    return frozenset(out)


def sources(name: str) -> list[Path]:
    """The command's module, every module of ours it imports (transitively) and the packages' __init__ files."""
    seen, todo = set(), [*_files(commands.qualified(name).split("."))]
    while todo:
        f = todo.pop()
        if f in seen or not f.is_file():
            continue
        seen.add(f)
        todo += _imports(f)
    return sorted(seen)


def key(name: str) -> str:
    h = hashlib.sha256()
    for lib in LIBRARIES:
        try:
            h.update(f"{lib}={metadata.version(lib)}\n".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{lib}=none\n".encode())
    for src in sources(name):
        h.update(src.relative_to(PACKAGE.parent).as_posix().encode() + b"\0" + src.read_bytes())
    return h.hexdigest()[:32]


def _dirs() -> list[Path]:
    """$TRAINBOX_HELP_DIR, else the image's folder (in an image: beside /opt/trainbox/trainbox), else a source
    checkout's .cache (git-ignored); then the user's cache."""
    user = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trainbox" / "help"
    in_image = PACKAGE == Path(IMAGE_DIR).parent / "trainbox"
    checkout = PACKAGE.parent / ".cache" / "trainbox-help" if (PACKAGE.parent / "pyproject.toml").is_file() else None
    first = os.environ.get("TRAINBOX_HELP_DIR") or (IMAGE_DIR if in_image else checkout)
    return [Path(first), user] if first else [user]


def _file(d: Path, name: str) -> Path:
    return d / f"{name}.txt"


def load(name: str) -> str | None:
    """The stored help of entrypoint `name` if it was made by exactly what is installed now."""
    want = key(name)
    for d in _dirs():
        try:
            stored_key, _, text = _file(d, name).read_text(encoding="utf-8").partition("\n")
        except (OSError, UnicodeDecodeError):
            continue
        if stored_key == want:
            return text
    return None


def store(name: str, text: str) -> None:
    """Keep `text` in the first folder that takes it (whole or not at all); nowhere is fine too."""
    from common import atomic

    for d in _dirs():
        try:
            d.mkdir(parents=True, exist_ok=True)
            atomic.write_text(_file(d, name), f"{key(name)}\n{text}")
            return
        except OSError:
            continue


def render_all() -> list[str]:
    """Render and store the help of every trainer this install has (at image build: one Python, one TRL import)."""
    import contextlib
    import importlib
    import importlib.util
    import io

    done = []
    if importlib.util.find_spec("trl") is None:  # a light image (jupyter, doctor): no trainer to ask
        return done
    for name in commands.names(trainer=True):
        if not (PACKAGE.parent / commands.path(name)).is_file():
            continue
        module = importlib.import_module(commands.qualified(name))
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            module.parse(["--help"])
        if load(name) is None:
            raise RuntimeError(f"--help of {name} was not stored in any of {[str(d) for d in _dirs()]}")
        done.append(name)
    return done


if __name__ == "__main__":
    print("help rendered for", ", ".join(render_all()) or "no trainer (no TRL in this image)")
