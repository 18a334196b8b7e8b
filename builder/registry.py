"""The one registry client: the few OCI distribution-API calls the release path needs, over HTTP (requests).

publish reads back what a push stored (digests are sha256 of the bytes the registry serves, never of re-encoded JSON);
sbom pushes an SBOM artifact and its referrers index. One client for both, and this one rather than skopeo: skopeo
cannot push a manifest with a `subject` (an OCI referrer) nor update the referrers tag, while these calls read
manifests as well as it did, and they tell an unreachable registry from a missing tag (skopeo's exit 1 is both).

Credentials are Docker's (`docker login`: ~/.docker/config.json, $DOCKER_CONFIG; `auths`, credHelpers, credsStore),
for basic or bearer-token auth; plain HTTP where the engine pushes without TLS (local registries on 127.0.0.0/8,
localhost, or TRAINBOX_INSECURE_REGISTRY=1).
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
from pathlib import Path

import requests

from builder import reference
from builder.errors import UserError
from builder.reference import REFERENCE

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_EMPTY = "application/vnd.oci.empty.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MANIFEST_TYPES = [OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST, DOCKER_LIST]
INDEX_TYPES = (OCI_INDEX, DOCKER_LIST)
# Docker Hub: a reference without a registry host names it; its API host and its key in config.json differ.
HUB, HUB_API, HUB_AUTH_KEY = "docker.io", "registry-1.docker.io", "https://index.docker.io/v1/"


def insecure(host: str) -> bool:
    """Registries the engine pushes to over plain HTTP (DESIGN.md: the local one on 127.0.0.1)."""
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    return name == "localhost" or name.startswith("127.") or os.environ.get("TRAINBOX_INSECURE_REGISTRY") == "1"


def has_host(name: str) -> bool:
    """Docker's reading: the first component is a registry host if it has '.' or ':' or is localhost."""
    first, sep, _ = name.partition("/")
    return bool(sep) and (any(ch in first for ch in ".:") or first == "localhost")


def shown(host: str, repo: str, ref: str) -> str:
    """HOST/REPO:TAG or HOST/REPO@DIGEST, as the user would type it."""
    return f"{host}/{repo}{'@' if ':' in ref else ':'}{ref}"


def split_ref(ref: str, hub: bool = False) -> tuple[str, str, str]:
    """HOST/REPO[:TAG][@DIGEST] -> (host, repo, tag or digest). HUB: a name without a registry host is Docker Hub's
    (as docker push reads it); otherwise it is refused."""
    m = REFERENCE.fullmatch(ref)
    if m and not has_host(m["name"]) and hub:
        repo = m["name"] if "/" in m["name"] else f"library/{m['name']}"
        return HUB, repo, m["digest"] or m["tag"] or "latest"
    if not m or not has_host(m["name"]):
        why = (reference.USERINFO if "@" in ref.partition("/")[0] else "it names no registry host" if m else
               "it is not an image reference by Docker's grammar (lower-case repository path, no scheme, no spaces)")
        # no `HOST:PORT/REPO@...` in the help: that is the shape of a user:password@ one, which errors mask
        raise UserError(f"{reference.shown(ref)!r} is not a registry image reference: {why}",
                        fix="give REGISTRY/REPO:TAG or REGISTRY/REPO@sha256:DIGEST, "
                            "e.g. 127.0.0.1:5555/trainbox:smoke-x86_64")
    host, _, repo = m["name"].partition("/")
    return host, repo, m["digest"] or m["tag"] or "latest"


def _reason(e: requests.RequestException) -> str:
    """The innermost cause in a few words ('[Errno 111] Connection refused'), not urllib3's nested repr."""
    text = str(e)
    found = re.findall(r"\[Errno -?\d+\] [^'\")]+", text)
    if found:
        return found[-1].strip()
    if isinstance(e, requests.Timeout):
        return "no answer in time"
    if isinstance(e, requests.exceptions.SSLError):
        return "TLS handshake failed: " + (re.findall(r"SSLError\((.*?)\)", text) or [type(e).__name__])[-1][:200]
    return type(e).__name__


class Registry:
    """One repository of one registry: manifests and blobs read and written, with Docker's credentials."""

    def __init__(self, host: str, repo: str):
        self.host, self.repo = host, repo
        api = HUB_API if host == HUB else host
        self.base = f"{'http' if insecure(host) else 'https'}://{api}/v2/{repo}"
        self.session = requests.Session()
        self._auth_header: str | None = None

    @classmethod
    def of(cls, ref: str, hub: bool = False) -> tuple[Registry, str]:
        host, repo, tag = split_ref(ref, hub)
        return cls(host, repo), tag

    def _creds(self) -> tuple[str, str] | None:
        cfg_dir = Path(os.environ.get("DOCKER_CONFIG", Path.home() / ".docker"))
        key = HUB_AUTH_KEY if self.host == HUB else self.host
        try:
            cfg = json.loads((cfg_dir / "config.json").read_text())
        except (OSError, ValueError):
            return None
        auth = (cfg.get("auths", {}).get(key) or {}).get("auth")
        if auth:
            user, _, pw = base64.b64decode(auth).decode(errors="replace").partition(":")
            return user, pw
        helper = (cfg.get("credHelpers") or {}).get(key) or cfg.get("credsStore")
        if not helper or not re.fullmatch(r"[A-Za-z0-9_.-]+", helper):
            return None
        try:   # the protocol `docker login` uses: the server on stdin, {"Username", "Secret"} on stdout
            r = subprocess.run([f"docker-credential-{helper}", "get"], input=key, capture_output=True, text=True,
                               timeout=30)
            got = json.loads(r.stdout) if r.returncode == 0 else {}
        except (OSError, ValueError, subprocess.TimeoutExpired):
            return None
        return (got["Username"], got["Secret"]) if got.get("Secret") else None

    def request(self, method: str, url: str, **kw):
        headers = dict(kw.pop("headers", {}))
        r = None
        for _ in range(2):
            if self._auth_header:
                headers["Authorization"] = self._auth_header
            try:
                r = self.session.request(method, url, headers=headers, timeout=(30, 120), **kw)
            except requests.RequestException as e:
                raise UserError(f"registry {self.host} did not answer: it is unreachable ({_reason(e)})",
                                fix="is the registry up (`make engine` starts the local one) and the --registry host "
                                    "and port right?") from None
            if r.status_code != 401 or self._auth_header:
                return r
            self._authenticate(r.headers.get("WWW-Authenticate", ""))
        return r

    def _authenticate(self, challenge: str) -> None:
        creds = self._creds()
        scheme, _, params = challenge.partition(" ")
        if scheme.lower() == "basic" and creds:
            self._auth_header = "Basic " + base64.b64encode(":".join(creds).encode()).decode()
        elif scheme.lower() == "bearer":
            p = dict(re.findall(r'(\w+)="([^"]*)"', params))
            q = {"service": p.get("service", ""), "scope": f"repository:{self.repo}:pull,push"}
            try:
                tok = self.session.get(p.get("realm", ""), params=q, auth=creds, timeout=(30, 60))
            except requests.RequestException as e:
                raise UserError(f"registry {self.host}: its token service is unreachable ({_reason(e)})") from None
            if tok.ok:
                body = tok.json()
                self._auth_header = "Bearer " + (body.get("token") or body.get("access_token", ""))
        if not self._auth_header:
            raise UserError(f"registry {self.host} wants credentials for {self.repo}",
                            fix=f"docker login {self.host}")

    def check(self, r, what: str):
        if not r.ok:
            raise UserError(f"{what} at {self.host}/{self.repo} failed: HTTP {r.status_code} {r.text.strip()[:300]}")
        return r

    def manifest(self, ref: str) -> tuple[bytes, str, str] | None:
        """(bytes, media type, digest) the registry serves for tag or digest REF, None if it has none."""
        r = self.request("GET", f"{self.base}/manifests/{ref}", headers={"Accept": ", ".join(MANIFEST_TYPES)})
        if r.status_code == 404:
            return None
        self.check(r, f"reading manifest {ref}")
        body = r.content
        mt = r.headers.get("Content-Type", "").split(";")[0] or json.loads(body).get("mediaType", "")
        return body, mt, "sha256:" + hashlib.sha256(body).hexdigest()

    def put_blob(self, data: bytes) -> dict:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if self.request("HEAD", f"{self.base}/blobs/{digest}").status_code != 200:
            r = self.check(self.request("POST", f"{self.base}/blobs/uploads/"), "starting a blob upload")
            loc = r.headers["Location"]
            loc = loc if loc.startswith("http") else f"{self.base.split('/v2/')[0]}{loc}"
            self.check(self.request("PUT", loc, params={"digest": digest}, data=data,
                                    headers={"Content-Type": "application/octet-stream"}), "uploading a blob")
        return {"digest": digest, "size": len(data)}

    def blob(self, digest: str) -> bytes:
        r = self.check(self.request("GET", f"{self.base}/blobs/{digest}"), f"reading blob {digest}")
        if "sha256:" + hashlib.sha256(r.content).hexdigest() != digest:
            raise UserError(f"blob {digest} from {self.host}/{self.repo} does not match its digest")
        return r.content

    def put_manifest(self, ref: str, body: bytes, media_type: str):
        return self.check(self.request("PUT", f"{self.base}/manifests/{ref}", data=body,
                                       headers={"Content-Type": media_type}), f"pushing manifest {ref}")


def reachable(repository: str) -> None:
    """The registry of REPOSITORY (HOST[:PORT]/REPO, as --registry gives it) answers its API's base, /v2/, with
    this host's credentials where it asks for them; else one UserError: unreachable (a closed port, a wrong host, no
    answer in time), wants a login, or answers but not as a registry."""
    reg, _ = Registry.of(f"{repository}:probe")
    url = f"{reg.base.split('/v2/')[0]}/v2/"
    r = reg.request("GET", url)
    if r.status_code not in (200, 401):   # 401 after request()'s own login: the push authenticates per repository
        raise UserError(f"registry {reg.host} answers HTTP {r.status_code} at /v2/, not as an image registry",
                        fix="check the --registry host and port (the registry's own address, not a web page)")


def manifest(ref: str) -> tuple[dict, str] | None:
    """(manifest JSON, digest) as the registry serves REF, None if it has no such tag; a UserError if the registry
    does not answer. REF without a registry host is Docker Hub's, as for docker push."""
    reg, tag = Registry.of(ref, hub=True)
    got = reg.manifest(tag)
    return (json.loads(got[0]), got[2]) if got else None
