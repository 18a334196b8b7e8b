"""Publish built cell images: push, read back what the registry stores, join a cell's arches into a manifest list.

Digests are sha256 of the bytes the registry serves (builder.registry's client), never of re-encoded JSON. Manifest
lists are made by `docker buildx imagetools create` where the CLI has buildx, else by `docker manifest create/push`.
CLI: `python -m builder.publish manifest --registry HOST:PORT/REPO CELL...` (one CI job per arch pushed; this joins
them). A list always joins every arch the matrix gives the cell: naming one arch's tag joins the whole cell's list.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

from python_on_whales import DockerClient
from python_on_whales.exceptions import DockerException

from builder import reference, referrers, registry as reg, sbomgen
from builder.docker import Builder, choose_builder, platform_arch
from builder.engine import BuildResult, cell_refs
from builder.errors import UserError, reports_user_errors
from builder.matrix import load_matrix
from builder.paths import ROOT

MANIFEST_LIST_TYPES = reg.INDEX_TYPES


def manifest_list_ref(cell, registry: str) -> str:
    return f"{registry}:{cell.name}"


def insecure_registry(ref: str) -> bool:
    return reg.insecure(ref.split("/", 1)[0])


def registry_manifest(ref: str) -> tuple[dict, str] | None:
    """(manifest JSON, digest) as the registry serves REF, or None if it has no such tag (a UserError if the registry
    does not answer). The digest is sha256 of the served bytes, as the registry computes it."""
    return reg.manifest(ref)


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


def _drop_local_list(client: DockerClient, list_ref: str) -> None:
    """A list that was not pushed must not stay behind in the CLI's local manifest store."""
    try:
        client.manifest.remove(list_ref)
    except DockerException:
        pass


def _imagetools_create(builder: Builder, list_ref: str, members: list[str]) -> None:
    """buildx makes and pushes the list in one registry-side step (nothing kept in a local manifest store)."""
    p = subprocess.run([builder.cli, "buildx", "imagetools", "create", "--tag", list_ref, *members],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise UserError(f"creating manifest list {list_ref} failed: {p.stderr.strip()[-300:]}")


def _manifest_create(builder: Builder, list_ref: str, members: list[str]) -> None:
    """`docker manifest create` + `push --purge` (no buildx here): the list must not stay in the local store."""
    client = builder.client()
    insecure = insecure_registry(list_ref)
    try:
        try:
            client.manifest.remove(list_ref)  # a stale local list from an earlier run would be amended, not replaced
        except DockerException:
            pass
        client.manifest.create(list_ref, members, insecure=insecure)
        cmd = [builder.cli, "manifest", "push", "--purge"] + (["--insecure"] if insecure else []) + [list_ref]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            _drop_local_list(client, list_ref)
            raise UserError(f"pushing manifest list {list_ref} failed: {p.stderr.strip()[-300:]}")
    except DockerException as e:
        _drop_local_list(client, list_ref)
        raise UserError(f"creating manifest list {list_ref} failed: {(e.stderr or str(e)).strip()[-300:]}") from None


def publish_manifest_list(list_ref: str, results: list[BuildResult], expected_arches: list[str],
                          builder: Builder) -> str:
    """Join the pushed per-arch images into LIST_REF; refuses unless every expected arch is in the registry.
    Returns the list's digest as read back."""
    by_arch = {platform_arch(r.platform): r for r in results if r.digest}
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
    if builder.kind == "buildx":
        _imagetools_create(builder, list_ref, members)
    else:
        _manifest_create(builder, list_ref, members)
    got = registry_manifest(list_ref)
    if not got or got[0].get("mediaType") not in MANIFEST_LIST_TYPES:
        raise UserError(f"manifest list {list_ref}: the registry does not serve a list after the push")
    listed = {m["digest"] for m in got[0]["manifests"]}
    want = {r.digest for r in by_arch.values() if platform_arch(r.platform) in expected_arches}
    if listed != want:
        raise UserError(f"manifest list {list_ref} lists {sorted(listed)}, expected {sorted(want)}")
    return got[1]


def push_all(cells, results: list[BuildResult], lists: dict[str, str], registry: str, builder: Builder,
             quiet: bool, lock_root: Path | None = None) -> None:
    """Push every result with its SBOM (read from the image, attached as an OCI referrer of the pushed manifest); join
    each cell whose arches were all built in this run into its manifest list. LOCK_ROOT: where the cells' locks are."""
    for res in results:
        push_result(res, builder, quiet)
        cell = next(c for c in cells if c.tag == res.tag)
        referrer = referrers.attach(sbomgen.generate(res.refs[0], cell, root=lock_root or ROOT), res.pushed_ref)
        if not quiet:
            print(f"[{res.tag}] SBOM attached: {res.pushed_ref.rsplit('@', 1)[0]}@{referrer}", flush=True)
    by_name: dict[str, list[BuildResult]] = {}
    for res in results:
        by_name.setdefault(res.cell, []).append(res)
    for name, group in by_name.items():
        cell = next(c for c in cells if c.name == name)
        expected = [platform_arch(c.platform) for c in cells if c.name == name]
        if len(expected) < 2:
            continue  # a single-arch run: nothing to join
        ref = manifest_list_ref(cell, registry)
        lists[ref] = publish_manifest_list(ref, group, expected, builder)
        if not quiet:
            print(f"manifest list {ref} {lists[ref]}")


def whole_cells(matrix, names: list[str]) -> dict[str, list]:
    """{cell name: every cell of that name (one per arch)} for NAMES (cell names or tags): a list joins all the
    arches the matrix gives a cell, so a tag of one arch never makes a one-arch list over a two-arch one."""
    out: dict[str, list] = {}
    for n in names:   # every name checked (select's error) before the registry is asked anything
        for c in matrix.select([n]):
            out.setdefault(c.name, [x for x in matrix.cells if x.name == c.name])
    return out


def join_pushed(cell_names: list[str], registry: str, matrix_path: str | None = None) -> dict[str, str]:
    """Manifest lists for cells whose arches were pushed by separate runs (one CI job per arch): each arch's image
    is read back from REGISTRY; a missing arch refuses the list. Returns {list ref: digest}."""
    matrix = load_matrix(matrix_path) if matrix_path else load_matrix()
    selected = whole_cells(matrix, cell_names)
    builder = choose_builder("auto")
    out = {}
    for name, cells in selected.items():
        results = []
        for c in cells:
            ref = cell_refs(c, registry)[0]
            got = registry_manifest(ref)
            if got is None:
                continue
            results.append(BuildResult(cell=c.name, tag=c.tag, arch=c.arch, platform=c.platform, builder="-",
                                       digest=got[1], pushed_ref=f"{registry}@{got[1]}"))
        ref = manifest_list_ref(cells[0], registry)
        out[ref] = publish_manifest_list(ref, results, [platform_arch(c.platform) for c in cells], builder)
        print(f"{ref}@{out[ref]}")
    return out


@reports_user_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m builder.publish")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("manifest", aliases=["join"], help="join the pushed arches of cells into manifest lists")
    m.add_argument("--registry", required=True, help="HOST:PORT/REPO the cells were pushed to")
    m.add_argument("--matrix", default=None)
    m.add_argument("cells", nargs="+", help="cell names, e.g. smoke")
    a = p.parse_args(argv)
    join_pushed(a.cells, reference.check_repository(a.registry), a.matrix)
    return 0


if __name__ == "__main__":
    sys.exit(main())

