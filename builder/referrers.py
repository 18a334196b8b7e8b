"""An SBOM attached to its image in a registry, as an OCI 1.1 referrer (builder.registry's client), and read back.

`attach(SBOM, REGISTRY_REF)` pushes it as an OCI 1.1 artifact (artifactType application/vnd.cyclonedx+json) whose
`subject` is the image manifest REGISTRY_REF names (for an index: the manifest of the SBOM's platform, since an SBOM
describes one platform's files). Registries without the Referrers API (distribution 2.8, the local one) get the
spec's fallback, the `sha256-<hex>` tag holding an index of referrers, as oras and cosign do. `read_back` finds it.
"""

from __future__ import annotations

import hashlib
import json

from builder.errors import UserError
from builder.registry import INDEX_TYPES, OCI_EMPTY, OCI_INDEX, OCI_MANIFEST, Registry, shown, split_ref
from builder.sbomgen import MEDIA_TYPE, dumps, image_id_of, platform_of


def subject_of(reg: Registry, ref: str, platform: tuple[str, str] | None) -> dict:
    """The descriptor of the image manifest REF names; for an index, its manifest for PLATFORM."""
    got = reg.manifest(ref)
    if got is None:
        raise UserError(f"{shown(reg.host, reg.repo, ref)} is not in the registry", fix="push the image first")
    body, mt, digest = got
    if mt in INDEX_TYPES:
        doc = json.loads(body)
        want = [m for m in doc.get("manifests", []) if platform and
                (m.get("platform", {}).get("os"), m.get("platform", {}).get("architecture")) == platform]
        if len(want) != 1:
            raise UserError(f"{shown(reg.host, reg.repo, ref)} is an index with no single "
                            f"{'/'.join(platform or ('?', '?'))} manifest", fix="attach to the platform's own tag or "
                                                                              "digest")
        return {"mediaType": want[0]["mediaType"], "digest": want[0]["digest"], "size": want[0]["size"]}
    return {"mediaType": mt, "digest": digest, "size": len(body)}


def check_subject(reg: Registry, ref: str, subject: dict, sbom: dict) -> None:
    """The image in the registry must be the one the SBOM was read from: the same platform (an amd64 SBOM on an
    arm64 manifest is wrong), and the same image (its config is the local image's id) where the SBOM names one."""
    platform, image_id = platform_of(sbom), image_id_of(sbom)
    if not platform and not image_id:
        return
    got = reg.manifest(subject["digest"])
    config = json.loads(got[0]).get("config", {}).get("digest") if got else None
    if not config:
        return   # not an image manifest: nothing to compare
    where = shown(reg.host, reg.repo, ref)
    if platform:
        cfg = json.loads(reg.blob(config))
        have = (cfg.get("os"), cfg.get("architecture"))
        if have != tuple(platform):
            raise UserError(f"--attach {where} is a {'/'.join(map(str, have))} image, the SBOM describes a "
                            f"{'/'.join(platform)} one (an SBOM lists one platform's files)",
                            fix=f"attach it to the {platform[1]} image's own tag or digest")
    if image_id and image_id not in (config, subject["digest"]):
        raise UserError(f"--attach {where} is another image (config {config[:19]}...) than the one the SBOM was read "
                        f"from ({image_id[:19]}...)", fix="push the local image to that tag first, or attach to the "
                                                          "tag it was pushed as")


def _fallback_tag(digest: str) -> str:
    alg, _, hexpart = digest.partition(":")
    return f"{alg}-{hexpart}"


def attach(sbom: dict, image_ref_in_registry: str) -> str:
    """Push SBOM as an OCI referrer of the image IMAGE_REF_IN_REGISTRY names; returns the referrer's digest."""
    host, repo, ref = split_ref(image_ref_in_registry)
    reg = Registry(host, repo)
    subject = subject_of(reg, ref, platform_of(sbom))
    check_subject(reg, ref, subject, sbom)
    config = reg.put_blob(b"{}")
    layer = reg.put_blob(dumps(sbom).encode())
    created = sbom.get("metadata", {}).get("timestamp", "")
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": MEDIA_TYPE,
        "config": {"mediaType": OCI_EMPTY, **config},
        "layers": [{"mediaType": MEDIA_TYPE, **layer,
                    "annotations": {"org.opencontainers.image.title": "sbom.cdx.json"}}],
        "subject": subject,
        "annotations": {"org.opencontainers.image.created": created},
    }
    body = json.dumps(manifest, separators=(",", ":")).encode()
    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    r = reg.put_manifest(digest, body, OCI_MANIFEST)
    if not r.headers.get("OCI-Subject"):  # the registry keeps no referrers itself: the tag schema (OCI 1.1 fallback)
        desc = {"mediaType": OCI_MANIFEST, "digest": digest, "size": len(body), "artifactType": MEDIA_TYPE,
                "annotations": manifest["annotations"]}
        tag = _fallback_tag(subject["digest"])
        got = reg.manifest(tag)
        index = json.loads(got[0]) if got else {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": []}
        if all(m["digest"] != digest for m in index["manifests"]):
            index["manifests"].append(desc)
            reg.put_manifest(tag, json.dumps(index, separators=(",", ":")).encode(), OCI_INDEX)
    return digest


def referrers(image_ref_in_registry: str, artifact_type: str = MEDIA_TYPE, platform=None) -> list[dict]:
    """Descriptors of the referrers of the image (Referrers API, else the tag schema), of ARTIFACT_TYPE."""
    host, repo, ref = split_ref(image_ref_in_registry)
    reg = Registry(host, repo)
    subject = subject_of(reg, ref, platform)
    r = reg.request("GET", f"{reg.base}/referrers/{subject['digest']}", headers={"Accept": OCI_INDEX})
    if r.ok and r.headers.get("Content-Type", "").startswith(OCI_INDEX):
        manifests = r.json().get("manifests", [])
    else:
        got = reg.manifest(_fallback_tag(subject["digest"]))
        manifests = json.loads(got[0]).get("manifests", []) if got else []
    return [m for m in manifests if m.get("artifactType") == artifact_type]


def read_back(image_ref_in_registry: str, platform=None) -> list[dict]:
    """Every SBOM attached to the image, as dicts, oldest first (each checked against its digests)."""
    host, repo, _ = split_ref(image_ref_in_registry)
    reg = Registry(host, repo)
    out = []
    for desc in referrers(image_ref_in_registry, MEDIA_TYPE, platform):
        got = reg.manifest(desc["digest"])
        if got is None or got[2] != desc["digest"]:
            raise UserError(f"referrer {desc['digest']} of {image_ref_in_registry} is missing or altered")
        layers = [lay for lay in json.loads(got[0]).get("layers", []) if lay["mediaType"] == MEDIA_TYPE]
        out.extend(json.loads(reg.blob(lay["digest"])) for lay in layers)
    return out
