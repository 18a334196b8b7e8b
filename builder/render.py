"""Cell -> Dockerfile text (template: images/templates/Dockerfile.j2) and the image record (image.json).

Rendering is a pure function of the cell: no dates, no commit, no host facts, so two renders are byte-identical and
the committed files can be checked for freshness. The commit goes in at build time (build arg VCS_REF).
"""
from __future__ import annotations

import json
from pathlib import Path

import jinja2

from builder import atomic, lock
from builder.errors import UserError
from builder.matrix import ROOT, Cell

TEMPLATES = ROOT / "images" / "templates"

# OS packages per kind of cell: CUDA cells also compile (FA source builds, triton/torch JIT need a C compiler and
# Python headers); CPU cells only need python.
_APT_BASE = ("ca-certificates", "python3", "python3-venv")
_APT_GPU = ("build-essential", "git", "python3-dev")


def _env() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                              trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, autoescape=False)


def _label_value(value) -> str:
    text = "" if value is None else str(value)
    if any(ch in text for ch in '"\\$\n'):
        raise UserError(f"value {text!r} can't go into a Dockerfile label", fix="drop quotes, $, \\ and newlines")
    return text


def image_record(cell: Cell) -> dict:
    """/etc/trainbox/image.json: the contract's keys (CONTRIBUTING.md) plus a few extra facts."""
    versions = {p: cell.requirement(p).split("==", 1)[1] for p in cell.pins}
    if cell.attention.get("package") and cell.attention.get("version"):
        versions[cell.attention["package"]] = cell.attention["version"]
    return {
        "cell": cell.name, "tag": cell.tag, "arch": cell.arch, "platform": cell.platform, "cuda": cell.cuda,
        "gpu": cell.gpu, "cuda_arch_list": cell.cuda_arch_list or None, "torch_variant": cell.torch_variant,
        "torch_arch_list": cell.torch_arch_list or None, "attention_backend": cell.attention_backend,
        "min_driver": cell.min_driver, "python": cell.python, "base_image": cell.base_image,
        "image": cell.image, "version": cell.version, "versions": dict(sorted(versions.items())),
    }


def _labels(cell: Cell, record: dict) -> list[tuple[str, str]]:
    out = [(f"io.trainbox.{k}", _label_value(record[k])) for k in
           ("cell", "tag", "arch", "cuda", "gpu", "cuda_arch_list", "torch_variant", "attention_backend",
            "min_driver", "python")]
    out += [(f"io.trainbox.version.{p}", _label_value(v)) for p, v in record["versions"].items()]
    return out


def _flash(cell: Cell) -> dict | None:
    a = cell.attention
    if not a.get("package"):
        return None
    if cell.cuda is None:
        raise UserError(f"cell {cell.tag}: attention {cell.attention_backend} needs a CUDA cell")
    pkg = a["package"]
    requirement = f"{pkg}=={a['version']}" if a.get("version") else pkg
    if a.get("source"):
        sub = f"#subdirectory={a['source_subdir']}" if a.get("source_subdir") else ""
        source_requirement = f"{pkg} @ {a['source']}{sub}"
    else:
        source_requirement = requirement
    return {"package": pkg, "requirement": requirement, "source_requirement": source_requirement,
            "max_jobs": a.get("max_jobs", 4), "build_env": sorted(a.get("build_env", {}).items()),
            "sources": a["sources"]}


def render(cell: Cell) -> str:
    """The cell's Dockerfile text."""
    record = image_record(cell)
    desc = (f"{cell.gpu} GPUs, CUDA {cell.cuda}, {cell.arch}" if cell.gpu else f"CPU only ({cell.stack} stack), "
            f"{cell.arch}")
    ctx = {
        "c": cell,
        "apt_packages": sorted(set(_APT_BASE + (_APT_GPU if cell.cuda else ()))),
        "needs_torch_index": bool(cell.torch_variant and cell.torch_variant != "cpu"),
        "needs_vllm_index": bool(cell.cuda and "vllm" in cell.pins),
        "cpu_torch": cell.torch_variant == "cpu" and "torch" in cell.pins,
        "lock_vars": " and ".join(lock.indexes(cell)) or "nothing",
        "flash": _flash(cell),
        "ld_library_path": "/usr/local/nvidia/lib:/usr/local/nvidia/lib64" if cell.cuda else "/usr/local/lib",
        "labels": _labels(cell, record),
        "description": _label_value(desc),
    }
    try:
        return _env().get_template("Dockerfile.j2").render(**ctx)
    except jinja2.TemplateError as e:
        raise UserError(f"cannot render the Dockerfile template: {e}", where=str(TEMPLATES / "Dockerfile.j2")) from None


def render_record(cell: Cell) -> str:
    return json.dumps(image_record(cell), indent=2, sort_keys=False) + "\n"


def _write_atomic(path: Path, text: str) -> bool:
    """Write via a temp file + rename; returns whether the content changed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        if path.read_text(encoding="utf-8") == text:
            return False
    except OSError:
        pass
    atomic.write_text(path, text)
    return True


def write_cells(cells: list[Cell], root: Path | str = ROOT) -> dict[str, Path]:
    """Render every cell first (so a bad cell writes nothing), then write images/<tag>/{Dockerfile,image.json}."""
    root = Path(root)
    rendered = [(c, render(c), render_record(c)) for c in cells]
    out: dict[str, Path] = {}
    for cell, dockerfile, record in rendered:
        path = root / cell.dockerfile
        _write_atomic(path, dockerfile)
        _write_atomic(path.parent / "image.json", record)
        out[cell.tag] = path
    return out
