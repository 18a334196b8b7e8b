"""The matrix's data model: Cell (one image), Exclusion (a combination the rules leave out, and why) and Matrix
(the cells, exclusions and rule reasons of one matrix.toml, with the CLI's selection). A Cell field copied from a
matrix.toml table says so itself (from_table): schema.py allows the key there and expand.py copies it, so a new key is
this field, its value in matrix.toml and its user."""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from builder.errors import UserError

# The tables a cell draws values from, each the cell's own row of it: its [[cell]] table (explicit cells only), its
# [arch.X], [cuda.X] and [gpu.X] (none for a CPU cell), its [torch_variant.X] (none without one) and [naming].
CELL_TABLES = ("cell", "arch", "cuda", "gpu", "torch_variant", "naming")
_FROM_TABLE = "trainbox.matrix"   # the metadata key of a from_table field


@dataclass(frozen=True)
class TableKey:
    """A Cell field's home in matrix.toml: the key of the field's name in the first of TABLES whose row the cell has
    and that holds it; allowed there with TYPE, required in each if REQUIRED."""
    tables: tuple[str, ...]
    type: type | tuple[type, ...]
    required: bool


def from_table(*tables: str, required: bool = False, type: type | tuple[type, ...] = str,
               default: Any = MISSING) -> Any:
    """A Cell field whose value is the matrix.toml key of its name in TABLES (the first that has it: "cell" before
    "cuda" lets an explicit cell override its CUDA's value); DEFAULT where none does (a CPU cell has no [cuda] row).
    An array becomes a tuple (a Cell is frozen and hashable)."""
    unknown = [t for t in tables if t not in CELL_TABLES]
    if not tables or unknown:
        raise ValueError(f"from_table: tables must be among {CELL_TABLES}, got {tables}")
    return field(default=default, metadata={_FROM_TABLE: TableKey(tables, type, required)})


def table_keys(table: str) -> dict[str, TableKey]:
    """The keys of TABLE that Cell fields come from, in field order."""
    return {f.name: f.metadata[_FROM_TABLE] for f in fields(Cell)
            if _FROM_TABLE in f.metadata and table in f.metadata[_FROM_TABLE].tables}


def table_values(rows: dict[str, dict | None]) -> dict[str, Any]:
    """The from_table fields' values from a cell's ROWS (CELL_TABLES -> its row, None where it has none); a field no
    row gives is left out (its default applies)."""
    out: dict[str, Any] = {}
    for f in fields(Cell):
        key = f.metadata.get(_FROM_TABLE)
        for table in key.tables if key else ():
            row = rows[table]
            if row is not None and f.name in row:
                value = row[f.name]
                out[f.name] = tuple(value) if isinstance(value, list) else value
                break
    return out


@dataclass(frozen=True)
class Exclusion:
    """A combination the rules leave out, and why."""
    arch: str | None
    cuda: str | None
    gpu: str | None
    attention: str | None
    rule: str
    reason: str   # the rule's reason, then this combination's own detail in parentheses
    detail: str = ""   # that detail alone ("no vLLM 0.31.0 build for torch variant cu126"): a short error names it

    def describe(self) -> str:
        parts = [f"arch={self.arch or '*'}", f"cuda={self.cuda or '*'}", f"gpu={self.gpu or '*'}"]
        if self.attention:
            parts.append(f"attention={self.attention}")
        return " ".join(parts)


@dataclass(frozen=True, kw_only=True)
class Cell:
    """One image: a (cell name, arch) pair with everything the renderer, locker and engine need. The from_table
    fields are matrix.toml keys, copied as they are (keyword-only: a new one may go anywhere, with its default)."""
    name: str
    tag: str
    arch: str
    platform: str = from_table("arch", required=True)
    uv_platform: str = from_table("arch", required=True)   # [cuda.X] glibc, when given, overrides it (expand.py)
    cuda: str | None
    gpu: str | None
    base_image: str = from_table("cell", "cuda", required=True)
    # the CUDA devel image, for a stage that compiles (never the runtime)
    build_image: str | None = from_table("cuda", default=None)
    python: str = from_table("cell", "cuda", required=True)
    stack: str
    pins: dict = field(hash=False, compare=True)
    torch_variant: str | None
    cuda_arch_list: str = from_table("gpu", required=True, default="")
    torch_arch_list: str
    attention_backend: str
    attention: dict = field(hash=False, compare=True)   # the backend's table: package, source, build_env...
    min_driver: str | None = from_table("cuda", required=True, default=None)
    repository: str = from_table("naming", required=True)
    version: str = from_table("naming", required=True)
    source: str = from_table("naming", required=True)
    version_tags: tuple[str, ...]
    venv: str                 # lock name: cells that share (CUDA, arch, stack, python) share locks/<venv>.txt
    # torch (and vLLM) come from the default index, no +variant local version
    default_index: bool = from_table("torch_variant", type=bool, default=False)
    flash: dict | None = field(default=None, hash=False, compare=True)   # {"how": "index"|"source", ...}
    index_templates: dict = field(default_factory=dict, hash=False, compare=False)
    # [fabric]: GPU cells only (NCCL's InfiniBand/RoCE transport needs the RDMA userspace; CPU cells run no NCCL).
    fabric_packages: tuple[str, ...] = ()
    fabric_env: tuple[tuple[str, str], ...] = ()
    # [fabric.plugins.NAME] a cell opted into: {"name": NAME, **table}; None for every cell that didn't.
    fabric_plugin: dict | None = field(default=None, hash=False, compare=True)
    # A flavour cell ([flavour.NAME]): its flavour's name and the cell it is built FROM (base_image = that cell's
    # image); None for every plain cell.
    flavour: str | None = None
    base: Cell | None = field(default=None, hash=False, compare=False, repr=False)
    files: tuple[tuple[str, str], ...] = ()   # (folder in the repository, path in the image)
    cmd: tuple[str, ...] = ()                 # the image's default CMD ('' = the base's)
    sdists: tuple[str, ...] = ()              # the only packages its lock may take as source archives (no wheel)
    # every [gpu] generation -> its SMs (the image record's gpu_generations: doctor names a GPU from the matrix's table)
    gpu_generations: tuple[tuple[str, tuple[str, ...]], ...] = field(default=(), compare=False)

    @property
    def dockerfile(self) -> Path:
        return Path("images") / self.tag / "Dockerfile"

    @property
    def lock(self) -> Path:
        return Path("locks") / f"{self.venv}.txt"

    @property
    def attention_lock(self) -> Path | None:
        """locks/<tag>.attention.txt: the prebuilt FlashAttention wheel, by version and hash (its own small layer)."""
        if self.flavour:  # the attention layer comes with the base image
            return None
        return Path("locks") / f"{self.tag}.attention.txt" if self.flash and self.flash["how"] == "index" else None

    @property
    def has_source_stage(self) -> bool:
        """The Dockerfile has a stage that compiles the attention wheel: a source build, or a probed arch's fallback."""
        return bool(self.flash) and (self.flash["how"] == "source" or bool(self.flash.get("probe")))

    @property
    def has_compile_stage(self) -> bool:
        """Any stage on the CUDA devel image: the attention source build or the fabric-plugin stage."""
        return self.has_source_stage or bool(self.fabric_plugin)

    @property
    def tags(self) -> list[str]:
        return [self.tag, *self.version_tags]

    @property
    def image(self) -> str:
        return f"{self.repository}:{self.tag}"

    def requirement(self, package: str) -> str:
        """`name==version` with the torch wheel variant as the local version (torch==2.13.0+cu129)."""
        version = self.pins[package]
        # CUDA-12 cells need the variant builds of torch and vLLM (the default index has CUDA 13 builds only).
        if self.torch_variant and not self.default_index and (package == "torch" or (package == "vllm" and self.cuda)):
            version = f"{version}+{self.torch_variant}"
        return f"{package}=={version}"

    def requirements(self) -> list[str]:
        return [self.requirement(p) for p in sorted(self.pins)]


@dataclass(frozen=True)
class Matrix:
    path: Path
    cells: tuple[Cell, ...]
    exclusions: tuple[Exclusion, ...]
    rules: dict
    data: dict = field(hash=False, compare=False, repr=False)
    # [ci] gpu_runners (ci.py): (GPU generation, arch) -> the labels of a runner that tests those images
    gpu_runners: dict = field(default_factory=dict, hash=False, compare=False)

    def names(self) -> list[str]:
        return sorted({c.name for c in self.cells})

    def select(self, names=(), arch=None, cuda=None, gpu=None) -> list[Cell]:
        """Cells matching every given filter; names may be cell names or tags. Unknown values are errors."""
        names = list(names or ())
        known = {c.name for c in self.cells} | {c.tag for c in self.cells}
        for n in names:  # flavour cells are cells: `--cell cu130-hopper-unsloth` picks them like any other
            if n not in known:
                raise UserError(f"no cell named {n!r}", where=str(self.path),
                                fix="see `python build.py --list` for cell names and tags")
        for flag, value, pool in (("--arch", arch, self.data["arch"]), ("--gpu", gpu, self.data["gpu"]),
                                  ("--cuda", cuda, self.data.get("cuda", {}))):
            for v in value or ():
                if v not in pool:
                    raise UserError(f"{flag} {v!r} is not in the matrix", where=str(self.path),
                                    fix=f"choose one of {', '.join(sorted(pool))}")
        out = []
        for c in self.cells:
            if names and c.name not in names and c.tag not in names:
                continue
            if arch and c.arch not in arch:
                continue
            if cuda and c.cuda not in cuda:
                continue
            if gpu and c.gpu not in gpu:
                continue
            out.append(c)
        return out

