"""Image references checked with the grammar Docker uses (distribution/reference, regexp.go), before any work starts.

    reference  := name [ ":" tag ] [ "@" digest ]
    name       := [ domain "/" ] path-component ( "/" path-component )*
    domain     := host [ ":" port ]          host: DNS labels joined by "." (any case) or "[ipv6]"
    path-component := [a-z0-9]+ ( separator [a-z0-9]+ )*      separator := [._] | "__" | "-"+
    tag        := [\\w][\\w.-]{0,127}
A name is at most 255 characters.
"""
from __future__ import annotations

import re

from builder.errors import UserError

_ALNUM = r"[a-z0-9]+"
_SEPARATOR = r"(?:[._]|__|[-]+)"
_PATH_COMPONENT = rf"{_ALNUM}(?:{_SEPARATOR}{_ALNUM})*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_HOST = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])"
_DOMAIN = rf"{_HOST}(?::[0-9]+)?"
_NAME = rf"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"

NAME = re.compile(_NAME, re.ASCII)
REFERENCE = re.compile(rf"(?P<name>{_NAME})(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?", re.ASCII)
NAME_MAX = 255
EXAMPLE = "127.0.0.1:5555/trainbox"


USERINFO = ("it has user-info (a user name and password, then @) before the host; credentials never go in a "
            "reference: `docker login HOST` stores them")


def _why_not_a_name(text: str) -> str:
    """The likeliest reason TEXT is no repository name, in the user's terms."""
    if not text:
        return "it is empty"
    if "://" in text:
        return f"it has a scheme ({text.split('://', 1)[0]}://); give HOST[:PORT]/PATH without it"
    if any(ch.isspace() for ch in text):
        return "it contains white space"
    if "@" in text.split("/", 1)[0]:
        return USERINFO
    if "@" in text:
        return "it names a digest; give the repository only"
    head, sep, last = text.rpartition("/")
    if not sep and ":" in text:
        return f"it names no repository path after the registry; add one, e.g. {text}/trainbox"
    if ":" in last:
        return "it ends in a tag; give the repository only (each cell's tags are appended)"
    path = text.split("/", 1)[1] if sep else text   # the first component may be a host, which may be upper case
    if path != path.lower():
        return "the repository path must be lower case"
    if text.endswith("/") or "//" in text:
        return "it has an empty path component"
    return ("it is not HOST[:PORT]/PATH with path components of a-z, 0-9 joined by '.', '_', '__' or '-' "
            "(Docker's reference grammar)")


def is_name(text: str) -> bool:
    """Docker's reading of a repository name (ParseNormalizedNamed): the first component is the registry host only
    if it has a '.' or ':', is 'localhost' or has upper case (else the name is on Docker Hub); the rest must be lower
    case; then the whole must match the grammar."""
    first, sep, rest = text.partition("/")
    if sep and (any(ch in first for ch in ".:") or first == "localhost" or first != first.lower()):
        domain, remote = first, rest
    else:
        domain, remote = "docker.io", text
    return remote == remote.lower() and bool(NAME.fullmatch(f"{domain}/{remote}"))


def check_repository(text: str, flag: str = "--registry") -> str:
    """TEXT if it is a repository name per Docker's grammar (tags get appended to it), else one UserError."""
    if is_name(text) and len(text) <= NAME_MAX:
        return text
    why = f"longer than {NAME_MAX} characters" if is_name(text) else _why_not_a_name(text)
    raise UserError(f"{flag} {shown(text)!r} is not a repository reference: {why}", fix=f"e.g. {flag} {EXAMPLE}")


def shown(text: str) -> str:
    """TEXT as an error may echo it: user-info before the host (`user:password@host/x`) masked here, whole, so the
    message stays readable (the errors' own redaction would take the quote before it too)."""
    head, sep, rest = text.partition("/")
    if "@" in head:
        head = "***@" + head.rsplit("@", 1)[1]
    return head + sep + rest


def check_image(text: str, flag: str) -> str:
    """TEXT if it is an image reference (NAME[:TAG][@DIGEST]) per Docker's grammar, else one UserError."""
    m = REFERENCE.fullmatch(text)
    if m and len(m.group("name")) <= NAME_MAX:
        return text
    raise UserError(f"{flag}: {text!r} is not an image reference (NAME[:TAG], Docker's reference grammar: lower-case "
                    "repository path, no scheme)", fix="e.g. debian:bookworm or 127.0.0.1:5555/bases/debian:bookworm")

