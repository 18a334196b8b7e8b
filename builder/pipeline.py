"""The build run on top of the floor: lock -> build -> export -> push -> report, for the cells build.py selected.

Below it: engine.py (build and tag one cell), enroot.py (.sqsh), publish.py (push, SBOM, manifest lists), report.py,
and the outside world's two doors, docker.py (the engine) and registry.py. Nothing below imports this module.
"""
from __future__ import annotations

from pathlib import Path

from builder import enroot, lock, publish, registry, report
from builder.docker import check_engine, choose_builder, platform_arch
from builder.engine import BuildResult, TagJournal, build_cell, build_context, check_cpu_torch, refuse_emulated_compile
from builder.errors import UserError
from builder.options import BuildOptions, check_buildable


def build_cells(cells, opts: BuildOptions) -> int:
    """The CLI's real build: build every cell, optionally push and join arches into manifest lists, report. With
    --push every tag the run moved is put back when any of its builds, pushes or manifest lists fails."""
    quiet = opts.quiet
    check_buildable(opts, cells)  # what the dry run refuses too (cli.run checked it; a direct caller may not have)
    refuse_emulated_compile(cells, opts.native_builder, opts.output_dir)  # before any lock or build work
    if opts.push:
        # Before minutes (a GPU cell: an hour) of building: a registry that does not answer, or wants a login this
        # host lacks, was found only at the push.
        registry.reachable(opts.registry)
    builder = choose_builder("buildx" if opts.buildx_builder else opts.builder)
    check_engine(builder)
    if not quiet:
        print(f"builder: {builder.kind} ({builder.cli})", flush=True)
    check_cpu_torch(cells, opts.wheelhouse, opts.build_args)   # before the lock step and the base stage's minutes
    # The lock step: every missing or stale lock of the selection is resolved before the first build.
    lock.ensure([c for c in cells if hasattr(c, "venv")], root=opts.output_dir, overrides=dict(opts.index_overrides),
                frozen=opts.frozen, quiet=quiet, bases=dict(opts.bases))
    refuse_emulated_compile(cells, opts.native_builder, opts.output_dir)  # a probed arch's lock may say "source"
    results: list[BuildResult] = []
    lists: dict[str, str] = {}
    journal = TagJournal(builder.client()) if opts.push else None
    try:
        with build_context(opts.output_dir, cells) as context:
            for cell in cells:
                res = build_cell(cell, builder=builder, context=context, registry=opts.registry, bases=dict(opts.bases),
                                 wheelhouse=opts.wheelhouse, secrets=list(opts.secrets), no_cache=opts.no_cache,
                                 quiet=quiet, index_overrides=dict(opts.index_overrides),
                                 extra_args=dict(opts.build_args), native_builder=opts.native_builder,
                                 buildx_builder=opts.buildx_builder, journal=journal,
                                 cache_from=opts.cache_from, cache_to=opts.cache_to, local_too=True)
                results.append(res)
                if opts.sqsh:
                    enroot.export_image(res.refs[0], Path(opts.sqsh) / f"{cell.tag}.sqsh",
                                        compression=opts.sqsh_compression, block_size=opts.sqsh_block_size,
                                        use_enroot=opts.use_enroot, progress=not quiet,
                                        arch=platform_arch(cell.platform))
        if opts.push:
            publish.push_all(cells, results, lists, opts.registry, builder, quiet, lock_root=opts.output_dir)
    except BaseException as e:
        stuck = journal.rollback() if journal else []
        if stuck and isinstance(e, UserError):
            raise UserError(f"{e}; these tags could not be removed: {', '.join(stuck)}") from None
        raise
    report.emit(results, lists, opts.report, quiet=quiet)
    return 0
