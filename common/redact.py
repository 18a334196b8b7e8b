"""The one redaction of secrets in what we print or log, for both packages (builder/ imports it too).

- `text(s)`: every URL in `s` loses its user-info (`https://user:pw@host` -> `https://***@host`) and the values of
  query parameters whose name looks secret (`?token=...` -> `?token=***`). Any scheme case, and malformed URLs too:
  nothing here parses a URL (a bad port or a broken IPv6 host made urllib raise), it cuts text, and where a URL is
  ambiguous it hides more rather than less (user-info ends at the URL's last `@`).
- `argv(args)`: a command line with the values of secret options masked (`--hub_token X`, `--hub_token=X`, any
  option whose name contains token, password, passwd, secret, api_key or credential), and URLs in it redacted.
"""

from __future__ import annotations

import re

MASK = "***"
SECRET_NAME = r"[A-Za-z0-9_.-]*(?:token|password|passwd|secret|api[_-]?key|credential|signature)[A-Za-z0-9_.-]*"
# ASCII whitespace ends a URL (re.ASCII): Unicode spaces inside one are hidden with it rather than splitting it.
_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]*", re.ASCII)
# user:password@ outside a URL we recognised (a scheme-less mirror, or text that broke the URL at a quote or space);
# not an image digest (`HOST:PORT/REPO@sha256:HEX`: an algorithm name, then hex with a letter, which no port is)
_LOOSE_USERINFO = re.compile(r"[^\s/@]*:(?!//)[^\s@]+@(?![A-Za-z]+[0-9]+:[0-9a-fA-F]*[a-fA-F][0-9a-fA-F]*(?![\w.-]))",
                             re.ASCII)
_QUERY_SECRET = re.compile(rf"(?i)([?&;]{SECRET_NAME}=)[^&#;\s]*")
_OPTION = re.compile(rf"(?i)^--?{SECRET_NAME}$")
_OPTION_EQ = re.compile(rf"(?i)^(--?{SECRET_NAME}=)(.*)$", re.S)


def _url(m: re.Match) -> str:
    scheme, rest = m.group(0).split("://", 1)
    if "@" in rest:
        rest = MASK + "@" + rest.rsplit("@", 1)[1]
    return f"{scheme}://{_QUERY_SECRET.sub(lambda q: q.group(1) + MASK, rest)}"


def text(s: str) -> str:
    """`s` with the credentials of every URL in it masked; never raises."""
    return _LOOSE_USERINFO.sub(MASK + "@", _URL.sub(_url, s))


def argv(args: list[str] | tuple[str, ...]) -> list[str]:
    """A copy of a command line that can be printed or logged: secret options' values masked."""
    out: list[str] = []
    hide_next = False
    for a in args:
        a = str(a)
        if hide_next:
            out.append(MASK)
            hide_next = False
            continue
        m = _OPTION_EQ.match(a)
        if m:
            out.append(m.group(1) + MASK)
        elif _OPTION.match(a):
            out.append(a)
            hide_next = True
        else:
            out.append(text(a))
    return out
