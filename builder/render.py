"""Cell -> Dockerfile text (template: builder/templates/Dockerfile.j2) and the image record (image.json).

Rendering is a pure function of the cell: no dates, no commit, no host facts, so two renders are byte-identical and
the committed files can be checked for freshness. The commit goes in at build time (build arg VCS_REF).
"""
from __future__ import annotations

import json
from pathlib import Path

import jinja2

from builder import bases, indexes
from builder.errors import UserError
from builder.matrix import Cell
from builder.matrix.fabric import PLUGIN_PREFIX
from builder.paths import ROOT
from common import atomic

# Package data next to this module, so an installed host package finds it too.
TEMPLATES = Path(__file__).resolve().parent / "templates"

# OS packages of the runtime: CPU cells only need python; CUDA cells add what Triton's JIT needs at first use (a C
# compiler and Python headers for its launcher stub) and matrix.toml's [fabric] packages (RDMA userspace for NCCL).
# nvcc, git and the CUDA devel image live only in the stage that compiles FlashAttention from source.
_APT_BASE = ("ca-certificates", "python3", "python3-venv", "tini")  # tini: the image's PID 1
_APT_GPU = ("gcc", "libc6-dev", "python3-dev")


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
    if cell.flavour:  # the base cell's facts, with the flavour's names and versions
        base = image_record(cell.base)
        versions = {p: cell.requirement(p).split("==", 1)[1] for p in cell.pins}
        if cell.attention.get("package") in base["versions"]:
            versions[cell.attention["package"]] = base["versions"][cell.attention["package"]]
        return {**base, "cell": cell.name, "tag": cell.tag, "base_image": cell.base_image, "image": cell.image,
                "versions": dict(sorted(versions.items())), "flavour": cell.flavour, "base_tag": cell.base.tag}
    versions = {p: cell.requirement(p).split("==", 1)[1] for p in cell.pins}
    if cell.flash:
        versions[cell.attention["package"]] = cell.attention["version"]
    record = {
        "cell": cell.name, "tag": cell.tag, "arch": cell.arch, "platform": cell.platform, "cuda": cell.cuda,
        "gpu": cell.gpu, "cuda_arch_list": cell.cuda_arch_list or None, "torch_variant": cell.torch_variant,
        "torch_arch_list": cell.torch_arch_list or None, "attention_backend": cell.attention_backend,
        "min_driver": cell.min_driver, "python": cell.python, "base_image": cell.base_image,
        "attention_source": _attention_source(cell),
        # matrix.toml's GPU generations and their SMs: doctor names the GPU it finds from these, not a table of its own
        "gpu_generations": {g: list(sms) for g, sms in cell.gpu_generations},
        "image": cell.image, "version": cell.version, "versions": dict(sorted(versions.items())),
    }
    if cell.fabric_plugin:  # only in cells that opt in: every other record stays as it was
        record["fabric_plugin"] = cell.fabric_plugin["name"]
    return record


def _attention_source(cell: Cell) -> str | None:
    if not cell.flash:
        return None
    out = cell.flash["how"] + (f" ({cell.flash['flash_variant']} build)" if cell.flash.get("flash_variant") else "")
    if cell.flash.get("probe"):  # rendering is pure: what the lock step found is the label io.trainbox.attention_from
        out += f" if the flash index has a wheel for {cell.arch}, else source (label io.trainbox.attention_from)"
    return out


def _labels(cell: Cell, record: dict) -> list[tuple[str, str]]:
    out = [(f"io.trainbox.{k}", _label_value(record[k])) for k in
           ("cell", "tag", "arch", "cuda", "gpu", "cuda_arch_list", "torch_variant", "attention_backend",
            "attention_source", "min_driver", "python")]
    if "fabric_plugin" in record:
        out.append(("io.trainbox.fabric_plugin", _label_value(record["fabric_plugin"])))
    out += [(f"io.trainbox.version.{p}", _label_value(v)) for p, v in record["versions"].items()]
    return out


def _flash(cell: Cell) -> dict | None:
    if not cell.flash:
        return None
    a = cell.attention
    if cell.flash["how"] == "none":
        raise UserError(f"cell {cell.tag}: attention {cell.attention_backend} has no prebuilt {cell.arch} wheel and no "
                        "source", where="matrix.toml", fix=f"add a source or a prebuilt entry to [attention."
                        f"{cell.attention_backend}]")
    sub = f"#subdirectory={a['source_subdir']}" if a.get("source_subdir") else ""
    return {"how": cell.flash["how"], "probe": bool(cell.flash.get("probe")), "source_stage": cell.has_source_stage,
            "package": a["package"], "version": a["version"],
            "source_requirement": f"{a['package']} @ {a.get('source', '')}{sub}",
            "max_jobs": a.get("max_jobs", 4), "build_env": sorted(a.get("build_env", {}).items())}


def _plugin(cell: Cell) -> dict | None:
    """The fabric-plugin stage's facts: each pinned source (a git commit or a tarball by sha256) and its configure."""
    p = cell.fabric_plugin
    if not p:
        return None
    builds = []
    for b in p["builds"]:
        src = b["source"]
        url, _, commit = src[len("git+"):].rpartition("@") if src.startswith("git+") else (src, "", "")
        builds.append({"name": b["name"], "source": src, "url": url, "commit": commit, "sha256": b.get("sha256", ""),
                       "configure": " ".join(b.get("configure", []))})
    return {"name": p["name"], "description": p.get("description", ""), "builds": builds,
            "prefix": p.get("prefix", PLUGIN_PREFIX), "library": p["library"], "max_jobs": p.get("max_jobs", 8),
            "build_packages": " ".join(sorted(set(p.get("build_packages", [])) | set(_PLUGIN_TOOLS))),
            "env": sorted(p.get("env", {}).items())}


# What every plugin build needs on the devel image besides its own build_packages (autotools, a fetcher).
_PLUGIN_TOOLS = ("autoconf", "automake", "ca-certificates", "curl", "git", "libtool", "make")


def render_flavour(cell: Cell) -> str:
    """A flavour cell's Dockerfile (builder/templates/Flavour.j2): FROM its base cell's image, one install layer."""
    record = image_record(cell)
    ctx = {"c": cell, "base": cell.base, "cpu_torch": cell.torch_variant == "cpu" and "torch" in cell.pins,
           "index_defaults": {"INDEX_URL": indexes.url(cell, "default"),
                              **{indexes.ARGS[n]: indexes.url(cell, n) for n in indexes.needed(cell)}},
           "deps_args": [indexes.ARGS[n] for n in indexes.needed(cell) if n != "flash"],
           "labels": [(f"io.trainbox.{k}", _label_value(record[k])) for k in ("cell", "tag", "flavour", "base_tag")]
           + [(f"io.trainbox.version.{p}", _label_value(v)) for p, v in record["versions"].items()],
           "description": _label_value(f"the {cell.flavour} flavour of {cell.base.tag}"),
           "cmd": json.dumps(list(cell.cmd)) if cell.cmd else "",
           # The base template's constraints step (constraints.j2), where it exists: the flavour regenerates the file.
           "has_constraints": (TEMPLATES / "constraints.j2").is_file()}
    try:
        return _env().get_template("Flavour.j2").render(**ctx)
    except jinja2.TemplateError as e:
        raise UserError(f"cannot render the flavour template: {e}", where=str(TEMPLATES / "Flavour.j2")) from None


def _base_refs(cell: Cell) -> dict:
    """The FROM images by digest where locks/bases.toml pins them (builder/bases.py); an unpinned one says so."""
    build = cell.build_image if cell.has_compile_stage else ""
    unpinned = [i for i in (cell.base_image, build) if i in bases.images(cell) and "@" not in bases.ref(i, cell)]
    return {"base_ref": bases.ref(cell.base_image, cell), "build_ref": bases.ref(build, cell) if build else "",
            "base_digest": bases.digest_for(cell.base_image, cell.platform) if cell.base_image in bases.images(cell)
            else "",
            "base_notes": [f"Not pinned by digest: {bases.PATH} has no entry for {i} (run `python build.py "
                           f"--lock-bases {cell.tag}` where its registry is reachable); --frozen refuses this cell."
                           for i in unpinned]}


def render(cell: Cell) -> str:
    """The cell's Dockerfile text."""
    if cell.flavour:
        return render_flavour(cell)
    record = image_record(cell)
    desc = (f"{cell.gpu} GPUs, CUDA {cell.cuda}, {cell.arch}" if cell.gpu else f"CPU only ({cell.stack} stack), "
            f"{cell.arch}")
    plugin = _plugin(cell)
    ld_library_path = "/usr/local/nvidia/lib:/usr/local/nvidia/lib64" if cell.cuda else "/usr/local/lib"
    if plugin:  # NCCL dlopens libnccl-net.so from the library path: no NCCL_NET_PLUGIN needed
        ld_library_path = f"{plugin['prefix']}/lib:{ld_library_path}"
    ctx = {
        "c": cell,
        "apt_packages": sorted(set(_APT_BASE + (_APT_GPU if cell.cuda else ()) + cell.fabric_packages
                                   + tuple((cell.fabric_plugin or {}).get("packages", ())))),
        "cpu_torch": cell.torch_variant == "cpu" and "torch" in cell.pins,
        # Shared stages must not name the cell (they would differ between the cells that share them).
        "lock_hint": (f"python build.py --lock --cuda {cell.cuda} --arch {cell.arch}" if cell.venv != cell.tag
                      else f"python build.py --lock {cell.tag}"),
        # The matrix's URLs as ARG defaults, so the committed Dockerfile builds without this tool.
        "index_defaults": {"INDEX_URL": indexes.url(cell, "default"),
                           **{indexes.ARGS[n]: indexes.url(cell, n) for n in indexes.needed(cell)}},
        "deps_args": [indexes.ARGS[n] for n in indexes.needed(cell) if n != "flash"],
        "flash": _flash(cell),
        "plugin": plugin,
        "ld_library_path": ld_library_path,
        "labels": _labels(cell, record),
        "description": _label_value(desc),
        **_base_refs(cell),
    }
    try:
        return _env().get_template("Dockerfile.j2").render(**ctx)
    except jinja2.TemplateError as e:
        raise UserError(f"cannot render the Dockerfile template: {e}", where=str(TEMPLATES / "Dockerfile.j2")) from None


def render_record(cell: Cell) -> str:
    return json.dumps(image_record(cell), indent=2, sort_keys=False) + "\n"


def write_cells(cells: list[Cell], root: Path | str = ROOT) -> dict[str, Path]:
    """Render every cell first (so a bad cell writes nothing), then write images/<tag>/{Dockerfile,image.json}."""
    root = Path(root)
    rendered = [(c, render(c), render_record(c)) for c in cells]
    files: dict[Path, str] = {}
    for cell, dockerfile, record in rendered:
        files[root / cell.dockerfile] = dockerfile
        files[(root / cell.dockerfile).parent / "image.json"] = record
    # All cells or none: an error or Ctrl-C while writing leaves images/ as it was (atomic.write_all).
    atomic.write_all(files)
    return {cell.tag: root / cell.dockerfile for cell, _, _ in rendered}
