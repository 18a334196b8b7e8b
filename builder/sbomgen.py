"""An image's SBOM (CycloneDX 1.6 JSON), built from what is in the image.

`generate(IMAGE)` runs the image once (`docker run --rm --network none --entrypoint /bin/sh`) and reads every Python
distribution /opt/venv's python sees (importlib.metadata, as `pip list` does) and every installed Debian package
(dpkg-query, status `ii`), then adds what the host knows: the sha256 hashes of the cell's lock (locks/<venv>.txt,
and locks/<tag>.attention.txt for the attention wheel) for the packages installed at the locked version, the base
image (org.opencontainers.image.base.name/.digest labels) and the image labels. The document is written by hand
(a flat list of components with purls, hashes and properties; why not cyclonedx-python-lib, measured: CONTRIBUTING).
Same image -> same bytes (serial number and timestamp come from the image). builder.referrers attaches it to the
image in a registry; builder.sbom is the CLI.
"""

from __future__ import annotations

import datetime
import json
import re
import subprocess
import uuid
from pathlib import Path
from urllib.parse import quote

from packaging.utils import canonicalize_name

from builder.docker import docker_cli, inspect_image
from builder.errors import UserError
from builder.matrix import load_matrix
from builder.paths import ROOT

MEDIA_TYPE = "application/vnd.cyclonedx+json"
VENV_PYTHON = "/opt/venv/bin/python"

# Inside the image: sections for os-release, installed Debian packages, the venv's distributions.
_PY_PROBE = r"""
import importlib.metadata as m, json, re, sys
seen, dists = set(), []
for d in m.distributions():  # sys.path order, first one of a name wins: what pip list shows
    name = d.metadata["Name"]
    key = re.sub(r"[-_.]+", "-", name or "").lower()
    if not name or key in seen:
        continue
    seen.add(key)
    item = {"name": name, "version": d.version}
    du = d.read_text("direct_url.json")
    if du:
        item["direct_url"] = json.loads(du)
    dists.append(item)
print(json.dumps({"python": sys.version.split()[0], "dists": dists}))
"""
_PROBE = f"""
echo '@@os'; cat /etc/os-release 2>/dev/null || :
echo '@@deb'
if command -v dpkg-query >/dev/null 2>&1; then
  dpkg-query -W -f '${{db:Status-Abbrev}}\\t${{Package}}\\t${{Version}}\\t${{Architecture}}\\t${{source:Package}}\\n'
fi
echo '@@py'
if [ -x {VENV_PYTHON} ]; then {VENV_PYTHON} -c "$0"; fi
"""


def probe(image_ref: str, docker: str | None = None) -> dict:
    """What is installed in IMAGE: {"os": {...}, "deb": [(name, version, arch, source)], "py": {...} or None}."""
    docker = docker or docker_cli()
    # The image's own environment (PYTHONPATH included), as `pip list` inside it sees the venv.
    r = subprocess.run([docker, "run", "--rm", "--network", "none", "--entrypoint", "/bin/sh", image_ref, "-c",
                        _PROBE, _PY_PROBE], capture_output=True, text=True)
    if r.returncode != 0:
        raise UserError(f"reading the contents of {image_ref} failed (exit {r.returncode}): "
                        f"{r.stderr.strip()[-500:] or 'no output'}",
                        fix="the image must be in the local engine and have /bin/sh; build or pull it first")
    sections: dict[str, list[str]] = {}
    cur = None
    for line in r.stdout.splitlines():
        if line.startswith("@@"):
            cur = sections.setdefault(line[2:], [])
        elif cur is not None:
            cur.append(line)
    os_release = {}
    for line in sections.get("os", []):
        k, sep, v = line.partition("=")
        if sep:
            os_release[k] = v.strip().strip('"')
    debs = []
    for line in sections.get("deb", []):
        status, name, version, arch, source = (line.split("\t") + [""] * 5)[:5]
        if status.strip() == "ii":
            debs.append((name, version, arch, source.split(" ")[0] or name))
    py_text = "\n".join(sections.get("py", [])).strip()
    return {"os": os_release, "deb": debs, "py": json.loads(py_text) if py_text else None}


# ---------------------------------------------------------------- locks

_REQ_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;\\]+)")
_HASH_RE = re.compile(r"--hash=sha256:([0-9a-f]{64})")


def lock_hashes(path: Path) -> dict[str, tuple[str, list[str]]]:
    """{canonical name: (version, [sha256...])} of a hash-locked requirements file (uv pip compile's output)."""
    out: dict[str, tuple[str, list[str]]] = {}
    current = None
    for line in path.read_text(encoding="utf-8").splitlines():
        m = _REQ_RE.match(line)
        if m:
            current = canonicalize_name(m.group(1))
            out[current] = (m.group(2), [])
        if current:
            out[current][1].extend(_HASH_RE.findall(line))
        if not line.rstrip().endswith("\\"):
            current = None
    return out


def find_cell(tag: str | None, root: Path = ROOT):
    """The matrix cell with this tag (io.trainbox.tag), or None (no matrix here, or an image from elsewhere)."""
    if not tag or not (root / "matrix.toml").is_file():
        return None
    try:
        return next((c for c in load_matrix(root / "matrix.toml").cells if c.tag == tag), None)
    except UserError:
        return None


# ---------------------------------------------------------------- the document

def _purl_part(s: str) -> str:
    return quote(s, safe=".-_~")


def _prop(name: str, value) -> dict:
    return {"name": name, "value": str(value)}


def _sha256_list(hashes: list[str]) -> list[dict]:
    return [{"alg": "SHA-256", "content": h} for h in dict.fromkeys(hashes)]


def _base_component(labels: dict) -> dict | None:
    name = labels.get("org.opencontainers.image.base.name")
    if not name:
        return None
    digest = labels.get("org.opencontainers.image.base.digest") or ""
    repo, tag = name, ""
    if "@" in repo:
        repo, _, at = repo.partition("@")
        digest = digest or at
    last = repo.rsplit("/", 1)[-1]
    if ":" in last:
        repo, _, tag = repo.rpartition(":")
    qual = [f"repository_url={_purl_part(repo)}"] + ([f"tag={_purl_part(tag)}"] if tag else [])
    purl = f"pkg:oci/{_purl_part(repo.rsplit('/', 1)[-1])}" + (f"@{_purl_part(digest)}" if digest else "") + \
        "?" + "&".join(qual)
    comp = {"type": "container", "bom-ref": "base-image", "name": name, "purl": purl,
            "properties": [_prop("trainbox:role", "base image")]}
    if digest:
        comp["version"] = digest
        comp["hashes"] = _sha256_list([digest.split(":", 1)[1]]) if digest.startswith("sha256:") else []
    else:
        comp["properties"].append(_prop("trainbox:base-digest", "not recorded (label org.opencontainers.image."
                                                                "base.digest missing)"))
    return comp


def generate(image_ref: str, cell=None, docker: str | None = None, root: Path = ROOT) -> dict:
    """The CycloneDX 1.6 SBOM of IMAGE_REF (a local image) as a dict. CELL (a matrix Cell) names the locks; None
    finds it by the image's io.trainbox.tag label."""
    inspect = inspect_image(image_ref, docker)
    cfg = inspect.get("Config") or {}
    labels = cfg.get("Labels") or {}
    found = probe(image_ref, docker)
    cell = cell or find_cell(labels.get("io.trainbox.tag"), root)

    locked: dict[str, tuple[str, list[str]]] = {}
    attention: dict[str, tuple[str, list[str]]] = {}
    lock_files = []
    if cell is not None:
        if (root / cell.lock).is_file():
            locked = lock_hashes(root / cell.lock)
            lock_files.append(str(cell.lock))
        if cell.attention_lock and (root / cell.attention_lock).is_file():
            attention = lock_hashes(root / cell.attention_lock)
            lock_files.append(str(cell.attention_lock))

    components = []
    for d in (found["py"] or {}).get("dists", []):
        key = canonicalize_name(d["name"])
        comp = {"type": "library", "bom-ref": f"pkg:pypi/{key}@{_purl_part(d['version'])}", "name": d["name"],
                "version": d["version"], "purl": f"pkg:pypi/{key}@{_purl_part(d['version'])}"}
        props = []
        for source, table in (("lock", locked), ("attention lock", attention)):
            if key in table:
                version, hashes = table[key]
                if version == d["version"]:
                    comp["hashes"] = _sha256_list(hashes)
                    props.append(_prop("trainbox:hashes", f"{source} (the installed file matched one of them)"))
                else:
                    props.append(_prop("trainbox:lock-version", f"{version} in the {source}, {d['version']} installed"))
                if source == "attention lock":
                    props.append(_prop("trainbox:role", "attention wheel"))
        if d.get("direct_url"):
            props.append(_prop("trainbox:direct_url", json.dumps(d["direct_url"], sort_keys=True)))
        if props:
            comp["properties"] = props
        components.append(comp)

    distro = found["os"].get("ID", "debian")
    distro_q = f"{distro}-{found['os']['VERSION_ID']}" if found["os"].get("VERSION_ID") else distro
    for name, version, arch, source in found["deb"]:
        purl = f"pkg:deb/{_purl_part(distro)}/{_purl_part(name)}@{_purl_part(version)}?arch={arch}&distro={distro_q}"
        if source != name:
            purl += f"&upstream={_purl_part(source)}"
        components.append({"type": "library", "bom-ref": purl, "name": name, "version": version, "purl": purl})
    if found["os"]:
        components.append({"type": "operating-system", "bom-ref": "os", "name": found["os"].get("ID", "linux"),
                           "version": found["os"].get("VERSION_ID", ""),
                           "description": found["os"].get("PRETTY_NAME", "")})
    base = _base_component(labels)
    if base:
        components.append(base)
    components.sort(key=lambda c: (c["type"], c["name"].lower(), c.get("version", "")))

    image_id = inspect["Id"]
    created = _timestamp(inspect.get("Created"))
    props = [_prop(k, v) for k, v in sorted(labels.items())]
    props += [_prop("trainbox:image-id", image_id), _prop("trainbox:platform",
                                                          f"{inspect.get('Os')}/{inspect.get('Architecture')}")]
    props += [_prop("trainbox:lock", f) for f in lock_files]
    if found["py"]:
        props.append(_prop("trainbox:python", found["py"]["python"]))
    title = image_ref.rsplit("@", 1)[0]
    name, _, tag = title.rpartition(":") if ":" in title.rsplit("/", 1)[-1] else (title, "", "")
    subject = {"type": "container", "bom-ref": "image", "name": name,
               "version": labels.get("org.opencontainers.image.version") or tag or image_id,
               "hashes": _sha256_list([image_id.split(":", 1)[1]]), "properties": props}
    return {
        "bomFormat": "CycloneDX",
        "specVersion": "1.6",
        # the same image gives the same document (a sidecar next to a reproducible .sqsh stays reproducible)
        "serialNumber": f"urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, 'trainbox-sbom:' + image_id)}",
        "version": 1,
        "metadata": {"timestamp": created, "tools": {"components": [
                         {"type": "application", "name": "trainbox builder.sbom", "version": _version()}]},
                     "component": subject},
        "components": components,
    }


def _timestamp(created: str | None) -> str:
    """The image's creation time as CycloneDX wants it (RFC 3339, seconds), or now where the engine gave none."""
    if created:
        try:
            t = datetime.datetime.fromisoformat(re.sub(r"(\.\d{6})\d+", r"\1", created.replace("Z", "+00:00")))
            return t.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        except ValueError:
            pass
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trainbox")
    except PackageNotFoundError:
        return "0"


def dumps(sbom: dict) -> str:
    return json.dumps(sbom, indent=1, ensure_ascii=False) + "\n"


def platform_of(sbom: dict) -> tuple[str, str] | None:
    for p in sbom.get("metadata", {}).get("component", {}).get("properties", []):
        if p["name"] == "trainbox:platform":
            os_, _, arch = p["value"].partition("/")
            return os_, arch
    return None


def image_id_of(sbom: dict) -> str | None:
    for p in sbom.get("metadata", {}).get("component", {}).get("properties", []):
        if p["name"] == "trainbox:image-id":
            return p["value"]
    return None
