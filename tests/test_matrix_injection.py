"""A matrix cannot inject: every string literal of matrix.toml, mutated with what would break out of its place in a
Dockerfile (a newline, a trailing backslash, quotes, shell syntax, control characters, format specs), is refused with
exit 2 and one line and nothing rendered, or renders Dockerfiles with exactly the instructions of the original
(the parsed instruction list per cell), never an injected one."""

from __future__ import annotations

import contextlib
import io
import os
import re
import tomllib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from builder import cli
from builder.paths import ROOT

BASE_TEXT = (ROOT / "matrix.toml").read_text()
# Every basic string literal outside comments: (start, end) in the text.
ALL = [m.span() for m in re.finditer(r'"(?:[^"\\\n]|\\.)*"', BASE_TEXT)
       if "#" not in BASE_TEXT[BASE_TEXT.rfind("\n", 0, m.start()) + 1:m.start()]]
PAYLOADS = ["\nRUN echo pwned", "\\", "\\\nRUN echo pwned", '" && echo pwned && "', "' ; echo pwned #", " x",
            "$(id)", "`id`", "\r", "\u2028", "\x00", "\t", "{name:>99999}", "\u00e9", "\x85", " \\"]


def toml_str(value: str) -> str:
    return '"' + "".join(f"\\u{ord(ch):04x}" if ch in '"\\' or ord(ch) < 0x20 or 0x7F <= ord(ch) <= 0x9F else ch
                         for ch in value) + '"'


def instructions(dockerfile: str) -> list[str]:
    """The instruction keywords in order (continuation lines joined, comments and blank lines skipped)."""
    out, joined = [], ""
    for line in dockerfile.splitlines():
        if not joined and (not line.strip() or line.lstrip().startswith("#")):
            continue
        joined += line
        if line.endswith("\\"):
            joined = joined[:-1]
            continue
        out.append(joined.split(None, 1)[0].upper())
        joined = ""
    return out


def render(tmp: Path, text: str) -> tuple[int, str, dict[str, list[str]]]:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "matrix.toml").write_text(text, encoding="utf-8")
    out_dir = tmp / "out"
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = cli.main(["--matrix", str(tmp / "matrix.toml"), "--dry-run", "--quiet", "--output-dir", str(out_dir)])
    files = sorted((out_dir / "images").glob("*/Dockerfile")) if out_dir.exists() else []
    return rc, err.getvalue(), {p.parent.name: instructions(p.read_text()) for p in files}


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    rc, err, rendered = render(tmp_path_factory.mktemp("orig"), BASE_TEXT)
    assert rc == 0 and rendered, err
    return rendered


def mutated(i: int, payload: str, how: str) -> str:
    a, b = ALL[i]
    value = tomllib.loads("v = " + BASE_TEXT[a:b])["v"]
    new = {"end": value + payload, "start": payload + value, "replace": payload}[how]
    return BASE_TEXT[:a] + toml_str(new) + BASE_TEXT[b:]


def check(original, tmp: Path, text: str):
    rc, err, rendered = render(tmp, text)
    assert "Traceback" not in err
    if rc == 2:
        assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
        assert rendered == {}, "a refused matrix rendered something"
        return "refused"
    assert rc == 0, err
    # A mutation may rename cells or change which exist: every rendered cell must have the instruction list of some
    # original cell (an injected or swallowed instruction makes a list no original has); same cells -> same lists.
    known = {tuple(v) for v in original.values()}
    assert all(tuple(v) in known for v in rendered.values()), "instructions changed"
    if rendered.keys() == original.keys():
        assert rendered == original
    return "rendered"


def test_the_literals_are_found():
    assert len(ALL) > 50, len(ALL)


@pytest.mark.parametrize("i", range(len(ALL)))
def test_a_newline_in_any_string_is_refused(original, tmp_path, i):
    assert check(original, tmp_path, mutated(i, "\nRUN echo pwned", "end")) == "refused"


SETTINGS = settings(max_examples=int(os.environ.get("TRAINBOX_FUZZ_EXAMPLES", "150")), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@SETTINGS
@given(i=st.integers(0, len(ALL) - 1), payload=st.sampled_from(PAYLOADS),
       how=st.sampled_from(["end", "start", "replace"]))
def test_any_mutation_is_refused_or_renders_the_same_instructions(original, tmp_path_factory, i, payload, how):
    check(original, tmp_path_factory.mktemp("m"), mutated(i, payload, how))


@pytest.mark.parametrize("old,new,needle", [
    ('repository = "trainbox"', 'repository = "Train Box!"', "is not an image repository name"),
    ('platform = "linux/amd64"', 'platform = "amd64"', "is not a platform"),
    ('python = "3.12"', 'python = "3.12\\" && echo x && \\""', "is not a Python version"),
    ('packages = { jupyterlab = "4.6.6"', 'packages = { "jupyterlab ; os_name == \'nt\'" = "4.6.6"',
     "is not a package name"),
    ('packages = { jupyterlab = "4.6.6"', 'packages = { "jupyter lab" = "4.6.6"', "is not a package name"),
])
def test_values_with_the_wrong_grammar_are_refused(original, tmp_path, old, new, needle):
    assert old in BASE_TEXT
    rc, err, rendered = render(tmp_path, BASE_TEXT.replace(old, new, 1))
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1 and rendered == {}, err


def test_a_non_ascii_cell_name_and_a_deep_matrix_are_one_line(tmp_path):
    # the smoke flavour names the cell by tag: renamed with it, so the name itself is what gets refused
    rc, err, _ = render(tmp_path / "a", BASE_TEXT.replace('name = "smoke"', 'name = "smöke"', 1)
                        .replace('cells = ["smoke-x86_64"]', 'cells = ["smöke-x86_64"]'))
    assert rc == 2 and "usable in an image tag" in err, err
    rc, err, _ = render(tmp_path / "b", BASE_TEXT + "\n[deep]\nx = " + "[" * 5000 + "]" * 5000 + "\n")
    assert rc == 2 and "nested" in err and len(err.strip().splitlines()) == 1, err
