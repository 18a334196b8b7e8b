"""argparse front-end: select cells, then list / explain / render (dry run) / lock / build."""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import tomllib
from pathlib import Path
from types import MappingProxyType

from builder.errors import UserError, reports_user_errors, shorten
from builder.matrix import DEFAULT_MATRIX, Cell, Matrix, load_matrix
from builder.options import (
    BuildOptions,
    check_buildable,
    check_dir,
    check_file_target,
    check_registry,
    parse_bases,
    parse_build_args,
    parse_secrets,
)
from builder.paths import ROOT


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="build.py", description="Build trainbox images from matrix.toml.")
    sel = p.add_argument_group("selection (all filters combine; none = every cell)")
    sel.add_argument("names", nargs="*", metavar="CELL", help="cell names (smoke, cu129-hopper) or tags")
    sel.add_argument("--cell", action="append", default=[], metavar="CELL", help="same as a positional CELL")
    sel.add_argument("--arch", action="append", metavar="ARCH", help="x86_64 or aarch64 (repeatable)")
    sel.add_argument("--cuda", action="append", metavar="VER", help="CUDA version, e.g. 12.9 (repeatable)")
    sel.add_argument("--gpu", action="append", metavar="GEN", help="ampere, hopper or blackwell (repeatable)")
    mode = p.add_argument_group("modes (default: render the selected cells, then build them)")
    mode.add_argument("--list", action="store_true", help="print the valid cells")
    mode.add_argument("--explain", action="store_true", help="print every excluded combination and why")
    mode.add_argument("--dry-run", action="store_true", help="render Dockerfiles and print the build plan")
    mode.add_argument("--lock", action="store_true", help="re-lock the selected cells' requirements")
    mode.add_argument("--lock-bases", action="store_true",
                      help="pin the selected GPU cells' base images by digest in locks/bases.toml (asks the registry)")
    mode.add_argument("--frozen", action="store_true",
                      help="build only with committed, fresh locks (refuse instead of locking; what CI uses)")
    inp = p.add_argument_group("inputs")
    inp.add_argument("--matrix", type=Path, default=DEFAULT_MATRIX, metavar="FILE", help="matrix file")
    inp.add_argument("--config", type=Path, metavar="FILE",
                     help="TOML with [bases] (OLD = NEW images) and/or [index] (NAME = URL) tables")
    inp.add_argument("--index", action="append", default=[], metavar="NAME=URL",
                     help="replace one of matrix.toml's [index] URLs (default, torch, vllm, flash), e.g. a mirror; "
                          "also TRAINBOX_INDEX_<NAME>")
    inp.add_argument("--base", action="append", default=[], metavar="OLD=NEW",
                     help="build FROM NEW where the cell's base is OLD (repeatable; a BASE_IMAGE build arg)")
    inp.add_argument("--output-dir", type=Path, metavar="DIR",
                     help="where images/<tag>/Dockerfile and locks/ are written (default: the repository for its own "
                          "matrix.toml; a new temporary folder for another --matrix, never the repository)")
    p.add_argument("--quiet", "-q", action="store_true", help="print only what was asked for")
    b = p.add_argument_group("build (builder/pipeline.py)")
    b.add_argument("--push", action="store_true",
                   help="push the images and per-cell manifest lists to --registry (a failed push leaves no tag)")
    b.add_argument("--registry", metavar="HOST:PORT/REPO",
                   help="repository to push to, checked with Docker's reference grammar (lower-case path, no scheme, "
                        "no tag); only with --push (without it: error)")
    b.add_argument("--wheelhouse", metavar="DIR", help="wheels to offer pip before any index (torch, FA3...)")
    b.add_argument("--builder", choices=["auto", "buildx", "buildkit", "legacy"], default="auto")
    b.add_argument("--buildx-builder", metavar="NAME",
                   help="buildx builder to use (e.g. one with a native arm64 node: source builds are then allowed "
                        "for that arch)")
    b.add_argument("--build-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="extra build arg, passed last (wins over the tool's own)")
    b.add_argument("--no-cache", action="store_true", help="build without the layer cache")
    b.add_argument("--cache-from", action="append", default=[], metavar="SPEC",
                   help="BuildKit cache to read, e.g. type=registry,ref=REG/trainbox-cache:VENV (repeatable; buildx only)")
    b.add_argument("--cache-to", metavar="SPEC",
                   help="BuildKit cache to write, e.g. type=registry,ref=REG/trainbox-cache:VENV,mode=max (buildx only)")
    b.add_argument("--report", metavar="FILE", help="write the build report (JSON) here")
    b.add_argument("--secret", action="append", default=[], metavar="id=ID,src=PATH", help="BuildKit secret")
    b.add_argument("--sqsh", nargs="?", const="out", metavar="DIR", help="also export .sqsh files (enroot)")
    b.add_argument("--sqsh-compression", choices=["lzo", "zstd", "zstd-max", "gzip", "lz4", "xz"],
                   help="mksquashfs compressor (default zstd: faster, smaller; lzo: enroot's own, for a cluster whose "
                        "squashfs reader lacks zstd; docs/journeys/slurm.md says how to check)")
    b.add_argument("--sqsh-block-size", metavar="SIZE", help="mksquashfs block size, e.g. 1M (default: mksquashfs's)")
    b.add_argument("--use-enroot", action="store_true", help="export with the real `enroot import`")
    return p


def read_config(config: Path | None) -> dict:
    if config is None:
        return {}
    try:
        data = tomllib.loads(config.read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"cannot read the config: {e.strerror or e}", where=str(config)) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"not valid TOML: {e}", where=str(config)) from None
    unknown = set(data) - {"bases", "index"}
    if unknown:
        raise UserError(f"unknown key {sorted(unknown)[0]!r}", where=str(config), fix="only [bases] and [index] are read")
    if not isinstance(data.get("index", {}), dict):
        raise UserError("[index] must map index names to URLs", where=f"{config}: index")
    return data


def _fmt_cell(c: Cell) -> str:
    keys = ("torch", "vllm", "transformers", "trl", "jupyterlab")
    pins = " ".join(f"{k}={c.pins[k]}" for k in keys if k in c.pins)
    torch = f"+{c.torch_variant}" if c.torch_variant else ""
    return (f"{c.tag:<31} {c.arch:<8} cuda={c.cuda or '-':<5} gpu={c.gpu or '-':<9} attn={c.attention_backend:<4} "
            f"python={c.python} {pins}{' torch-variant=' + torch[1:] if torch else ''}")


def cmd_list(m: Matrix, cells: list[Cell]) -> None:
    for c in cells:
        print(_fmt_cell(c))


def cmd_explain(m: Matrix, quiet: bool) -> None:
    if not quiet:
        print(f"{len(m.exclusions)} excluded combinations in {m.path}:")
    for e in m.exclusions:
        print(f"{e.describe():<44} rule={e.rule}: {e.reason}")
    if "unsloth-fits" in m.rules:  # an optional flavour: says per stack whether it fits, excludes nothing
        from builder.rules import unsloth_lines

        plain = [c for c in m.cells if not c.flavour]
        for line in unsloth_lines(m.data.get("facts", {}), plain, m.rules["unsloth-fits"], str(m.path)):
            print(line)
    for line in flavour_lines(m):
        print(line)
    # What a host needs to run the cells: CUDA minor-version compatibility sets the floor, not the toolkit's GA driver.
    by_driver: dict[str, list[str]] = {}
    for cuda, spec in sorted(m.data.get("cuda", {}).items(), key=lambda kv: tuple(map(int, kv[0].split(".")))):
        by_driver.setdefault(spec["min_driver"], []).append(cuda)
    for driver, cudas in by_driver.items():
        print(f"driver: CUDA {', '.join(cudas)} images run on any driver >= {driver} (CUDA minor-version "
              f"compatibility: the wheels ship kernels for every GPU they support, no PTX JIT needed)")


def flavour_lines(m: Matrix) -> list[str]:
    """--explain's lines per flavour: its cells, the pins it changes, and each rule its pins passed with the reason."""
    from builder import rules as rules_mod
    out = []
    for fname, t in m.data.get("flavour", {}).items():
        cells = [c for c in m.cells if c.flavour == fname]
        changed = ", ".join(f"{p} {v}" for p, v in sorted(t["packages"].items()))
        removed = f"; removes {', '.join(t['remove'])}" if t.get("remove") else ""
        sdists = cells[0].sdists if cells else ()
        built = (f"; builds from a source archive (by its locked hash, no wheel published): {', '.join(sdists)}"
                 if sdists else "")
        out.append(f"flavour {fname}: {len(cells)} image(s) ({', '.join(c.tag for c in cells)}), built FROM each base "
                   f"cell's image; pins {changed}{removed}{built}")
        pins = cells[0].pins if cells else {}
        checked = [r for r in rules_mod.STACK_CHECKS if r in m.rules and "vllm" in pins] + list(t.get("rules", []))
        for r in checked:
            out.append(f"  rule={r}: fits — {m.rules[r]}")
    return out


def with_bases(cells: list[Cell], m: Matrix, bases: dict, registry: str | None) -> tuple[list[Cell], dict]:
    """The build's order: each flavour cell's base cell first (added when not selected, unless --base/--config gives
    its image), and BASE_IMAGE pointed at the ref the base build tags (the registry's name under --push)."""
    if not any(c.flavour for c in cells):
        return cells, dict(bases)
    from builder import engine
    out = [c for c in cells if not c.flavour]
    bases = dict(bases)
    for c in cells:
        if not c.flavour:
            continue
        if c.base_image not in bases:
            if c.base not in out:
                out.append(c.base)
            bases[c.base_image] = engine.cell_refs(c.base, registry)[0]
    return out + [c for c in cells if c.flavour], bases


def plan_lines(cells: list[Cell], bases, paths: dict, root: Path = ROOT, overrides=None, frozen: bool = False,
               native: bool = False, registry: str | None = None) -> list[str]:
    from builder import engine, indexes, lock
    context = "repository root" if root == ROOT else f"the repository with images/ and locks/ from {root}"
    lines = [f"build plan: {len(cells)} image(s), context = {context}, host = {engine.host_arch()}"]
    for i, c in enumerate(cells, 1):
        base = bases.get(c.base_image, c.base_image)
        lines.append(f"{i}. {c.tag} ({c.platform}{', emulated (QEMU)' if c.arch != engine.host_arch() else ''})")
        lines.append(f"   dockerfile: {paths[c.tag]}")
        sub = f" (substituted for {c.base_image})" if base != c.base_image else ""
        from builder import bases as base_lock  # the pinned TAG@sha256 the Dockerfile pulls (locks/bases.toml)
        lines.append(f"   base: {base if sub else base_lock.ref(c.base_image, c)}{sub}")
        args = engine.cell_build_args(c, bases=bases, index_overrides=overrides, native_builder=native)
        lines.append("   build args: " + " ".join(f"{k}={indexes.redact(v)}" for k, v in args.items()))
        if c.arch != engine.host_arch() and not native and not c.flavour:
            plat = engine.host_platform()
            lines.append("   venv stage: " + (f"natively, on the base at {plat} (host-base)" if "VENV_BASE" in args
                                             else f"under QEMU: {base} serves no {plat} image its registry names"))
        default = indexes.url(c, "default", overrides) or "the installer's default index"
        for name in ["default", *indexes.needed(c)]:
            lines.append(f"   index {name}: {indexes.redact(indexes.url(c, name, overrides)) or default}")
        local = f", and locally {' '.join(engine.cell_refs(c))}" if registry else ""
        lines.append(f"   tags: {' '.join(engine.cell_refs(c, registry))}{' (pushed)' if registry else ''}{local}")
        st = lock.state(c, root)
        locks = " + ".join(str(p) for p, _ in lock.wanted(c))
        if st == "fresh":
            step = "fresh, used as is"
        elif frozen:
            step = f"{st}: --frozen refuses to build (run python build.py --lock {c.tag})"
        else:
            step = f"{st}: locked automatically before the build (uv pip compile for {c.uv_platform}, python {c.python})"
        lines.append(f"   lock: {locks} ({step})")
        for line in _heavy_sources(c, overrides, native, root):
            lines.append(f"   {line}")
    return lines


def _heavy_sources(c: Cell, overrides, native: bool, root: Path = ROOT) -> list[str]:
    """Where each multi-hundred-MB wheel comes from: the answer to 'does anything compile here?'."""
    from builder import engine, indexes
    out = []
    for pkg, name in (("torch", "torch"), ("vllm", "vllm")):
        if pkg in c.pins and c.torch_variant:
            where = ("the wheelhouse (or TORCH_INDEX_URL's cpu variant)" if c.torch_variant == "cpu" else
                     f"index {name}" if name in indexes.needed(c) else "the default index")
            out.append(f"{pkg}: prebuilt wheel {c.requirement(pkg)} from {where}")
    if c.flash:
        a = c.attention
        how = engine.attention_how(c, root)
        if how is None:  # a probed arch before its lock step
            emulated = c.arch != engine.host_arch() and not native
            out.append(f"{a['package']}: prebuilt wheel {a['package']}=={a['version']} ({c.flash['flash_variant']} "
                       f"build) from index flash, by hash, if it has one for {c.arch} (asked at the lock step); if not, "
                       f"compiled from source on a native {c.arch} builder only"
                       + (": then REFUSED here under emulation" if emulated else ""))
        elif how == "index":
            found = " (the lock step found it)" if c.flash.get("probe") else ""
            out.append(f"{a['package']}: prebuilt wheel {a['package']}=={a['version']} ({c.flash['flash_variant']} "
                       f"build) from index flash, by hash ({c.attention_lock}){found}; nothing compiles")
        elif how == "source" and engine.compiles_under_emulation(c, native, root):
            out.append(f"{a['package']}: no prebuilt {c.arch} wheel; compiled from source only on a native {c.arch} "
                       f"builder: REFUSED here under emulation (build on a native runner or --buildx-builder)")
        else:
            out.append(f"{a['package']}: no prebuilt {c.arch} wheel; compiled from source natively in the "
                       f"attention stage on {c.build_image}")
    if c.fabric_plugin:
        p = c.fabric_plugin
        srcs = ", ".join(b["name"] for b in p["builds"])
        emulated = c.arch != engine.host_arch() and not native
        out.append(f"NCCL net plugin {p['name']}: {srcs} compiled from pinned sources in the fabric-plugin stage on "
                   f"{c.build_image}" + (": REFUSED here under emulation (build on a native runner or "
                                         "--buildx-builder)" if emulated else ""))
    return out


def output_dir(args) -> Path:
    """Where rendered files and locks go: the repository for its own matrix; for a foreign --matrix, --output-dir or
    a new temporary folder (a foreign matrix never writes over the committed images/ and locks/)."""
    own = args.matrix.resolve() == DEFAULT_MATRIX.resolve()
    if args.output_dir is None:
        if own:
            return ROOT
        out = Path(tempfile.mkdtemp(prefix="trainbox-render-"))
        print(f"{args.matrix} is not the repository's matrix: rendering into {out} (choose with --output-dir)",
              file=sys.stderr)
        return out
    out, root = args.output_dir.resolve(), ROOT.resolve()
    if not own and (out == root or root in out.parents):
        raise UserError(f"--matrix {args.matrix} with --output-dir {args.output_dir}: a foreign matrix would write "
                        "inside the repository (over or beside its committed images/ and locks/)",
                        fix="choose another --output-dir, outside the repository")
    if own and root in out.parents:
        raise UserError(f"--output-dir {args.output_dir} is inside the repository: its images/ and locks/ would "
                        "be a second, stray copy", fix="leave --output-dir out (the repository itself) or pick a "
                        "folder outside it")
    return args.output_dir


def build_options(args, config: dict, out: Path) -> BuildOptions:
    """The one typed options object, from the parsed arguments; every check here runs before any work."""
    from builder import indexes
    where = str(args.config) if args.config else "--config"
    # Everything a build writes or reads at its end is checked now: a bad one costs seconds, not a GPU build.
    if args.output_dir is not None:
        check_dir(args.output_dir, "--output-dir")
    if args.sqsh is not None:
        check_dir(args.sqsh, "--sqsh")
        from builder import enroot
        enroot.squash_options(args.sqsh_compression, args.sqsh_block_size)
    elif args.sqsh_block_size is not None or args.sqsh_compression is not None:
        raise UserError("--sqsh-block-size/--sqsh-compression without --sqsh", fix="add --sqsh DIR")
    if args.report is not None:
        check_file_target(args.report, "--report")
    return BuildOptions(
        output_dir=out, bases=MappingProxyType(parse_bases(args.base, config.get("bases"), where)),
        index_overrides=MappingProxyType(indexes.parse_overrides(args.index, config.get("index"))),
        registry=check_registry(args.registry, args.push), wheelhouse=args.wheelhouse, builder=args.builder,
        buildx_builder=args.buildx_builder, build_args=MappingProxyType(parse_build_args(args.build_arg)),
        secrets=parse_secrets(args.secret), no_cache=args.no_cache, cache_from=tuple(args.cache_from),
        cache_to=args.cache_to, frozen=args.frozen, quiet=args.quiet,
        report=args.report, sqsh=args.sqsh, sqsh_compression=args.sqsh_compression,
        sqsh_block_size=args.sqsh_block_size, use_enroot=args.use_enroot)


def no_cell_error(m: Matrix, args) -> UserError:
    """The error for a selection that matches no cell: where the rules excluded what the filters ask for, the rules'
    ids and `--explain`, not only `--list`."""
    def hit(value, wanted):
        return not wanted or value is None or value in wanted
    excluded = [e for e in m.exclusions if e.attention is None and not args.names and not args.cell
                and hit(e.arch, args.arch) and hit(e.cuda, args.cuda) and hit(e.gpu, args.gpu)]
    if not excluded:
        return UserError("the selection matches no cell", where=str(args.matrix),
                         fix="see `python build.py --list`; filters combine with AND")
    by_rule: dict[str, set[str]] = {}
    for e in excluded:
        by_rule.setdefault(e.rule, set()).add(e.detail)
    asked = " ".join(f"--{k} {' '.join(v)}" for k, v in (("arch", args.arch), ("cuda", args.cuda), ("gpu", args.gpu))
                     if v)
    why = "; ".join(f"rule {rule}: {shorten(', '.join(sorted(d for d in details if d)), 120)}"
                    for rule, details in by_rule.items())
    return UserError(f"{asked} matches no cell: excluded by {why}", where=str(args.matrix),
                     fix="`python build.py --explain` says why for each excluded combination")


# The modes that each do one whole job: two of them at once would leave one silently ignored (`--lock --dry-run`
# rewrote the committed lock). --frozen is a build rule: with --dry-run the plan shows it; --lock/--lock-bases write
# locks, which --frozen forbids.
EXCLUSIVE_MODES = ("list", "explain", "dry_run", "lock", "lock_bases")
FROZEN_CONFLICTS = ("lock", "lock_bases")


def check_modes(args) -> None:
    """One error for modes that exclude each other, before any work."""
    flag = lambda name: "--" + name.replace("_", "-")   # noqa: E731
    given = [m for m in EXCLUSIVE_MODES if getattr(args, m)]
    if len(given) > 1:
        raise UserError(f"{' and '.join(flag(m) for m in given)} exclude each other: each is a whole mode",
                        fix=f"run one at a time, e.g. `python build.py {flag(given[0])} ...`, then "
                            f"`python build.py {flag(given[1])} ...`")
    if args.frozen and given and given[0] in FROZEN_CONFLICTS:
        raise UserError(f"--frozen with {flag(given[0])}: --frozen forbids writing locks, {flag(given[0])} writes "
                        "them", fix=f"drop --frozen to re-lock, or drop {flag(given[0])} to build from the committed "
                                    "locks")


def run(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    check_modes(args)
    m = load_matrix(args.matrix)
    config = read_config(args.config)
    opts = build_options(args, config, ROOT)   # checked before anything is written; output_dir set below
    if args.explain:
        cmd_explain(m, args.quiet)
        return 0
    cells = m.select(names=list(args.names) + list(args.cell), arch=args.arch, cuda=args.cuda, gpu=args.gpu)
    if not cells:
        raise no_cell_error(m, args)
    if args.list:
        cmd_list(m, cells)
        return 0
    from builder import lock
    if not args.lock:
        cells, flavour_bases = with_bases(cells, m, opts.bases, opts.registry)
        opts = dataclasses.replace(opts, bases=MappingProxyType(flavour_bases))
    opts = dataclasses.replace(opts, output_dir=output_dir(args))
    temporary = opts.output_dir != ROOT and args.output_dir is None  # output_dir() made it for a foreign matrix
    try:
        if args.lock_bases:
            from builder import bases
            return bases.lock_bases(cells, root=opts.output_dir, quiet=args.quiet)
        if args.lock:
            return lock.lock_cells(cells, root=opts.output_dir, quiet=args.quiet, overrides=opts.index_overrides)
        from builder import render
        check_buildable(opts, cells)   # the dry run refuses what the build would (options.py), before a file is written
        paths = render.write_cells(cells, root=opts.output_dir)
        lock.seed(cells, opts.output_dir)
    except BaseException:
        if temporary:  # a failed foreign render leaves no empty temporary folder behind
            import shutil
            shutil.rmtree(opts.output_dir, ignore_errors=True)
        raise
    if args.dry_run:
        if not args.quiet:
            print("\n".join(plan_lines(cells, opts.bases, paths, opts.output_dir, opts.index_overrides, opts.frozen,
                                        opts.native_builder, opts.registry)))
        return 0
    try:
        from builder import pipeline  # python-on-whales and requests: only a real build needs them
    except ImportError as e:
        print(f"error: the build pipeline (builder/pipeline.py) is not available: {e}", file=sys.stderr)
        return 1
    return pipeline.build_cells(cells, opts)


@reports_user_errors
def main(argv: list[str] | None = None) -> int:
    try:
        return run(argv)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
