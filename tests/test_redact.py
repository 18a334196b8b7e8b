"""One redaction (common/redact.py) for every URL and secret option the tool prints: any scheme case,
user-info and query-string secrets, malformed URLs (never raises), secret options in command lines; through the real
CLI (--dry-run, TRAINBOX_INDEX_*, --lock's error path with an unreachable index) and fuzzed with hypothesis."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import assume, given, settings, strategies as st

from builder.errors import UserError
from common import redact

ROOT = Path(__file__).resolve().parents[1]
SECRET = "s3cret"
URLS = ["HTTPS://u:s3cret@h/", "https://u:s3c{ret@h/", "https://u:s3cret@h:99999/", "https://h/?token=s3cret",
        "https://u:s3cret@[fe80::1/x", "hTtP://s3cret@h/simple", "https://h/p?a=1&API_KEY=s3cret#frag",
        "https://u:pa/s3cret@h/", "https://u:s3cret#x@h/", "git+https://u:s3cret@h/repo.git@abc"]


@pytest.mark.parametrize("url", URLS)
def test_text_hides_the_secret_and_keeps_the_host(url):
    out = redact.text(f"index torch = {url} failed")
    assert "s3c" not in out, out
    assert out.startswith("index torch = ") and out.endswith(" failed")


def test_text_leaves_plain_urls_and_text_alone():
    for s in ["https://h/whl/cu130", "no url here", "https://h:8080/simple?page=2", "pkg==1.0 @ file:///x.whl"]:
        assert redact.text(s) == s


@pytest.mark.parametrize("args,expect", [
    (["--hub_token", "hf_s3cret", "--lr", "1"], ["--hub_token", "***", "--lr", "1"]),
    (["--hub_token=hf_s3cret"], ["--hub_token=***"]),
    (["--HUB-TOKEN", "x"], ["--HUB-TOKEN", "***"]),
    (["--wandb_api_key", "k", "--db_password=p", "--my_secret", "z"],
     ["--wandb_api_key", "***", "--db_password=***", "--my_secret", "***"]),
    (["--model", "https://u:s3cret@h/m"], ["--model", "https://***@h/m"]),
    (["--max_length", "512"], ["--max_length", "512"]),
])
def test_argv_masks_secret_options(args, expect):
    assert redact.argv(args) == expect


@settings(max_examples=300, deadline=None)
@given(user=st.text(min_size=0, max_size=12), secret=st.text(alphabet=st.characters(blacklist_categories=("Cs",),
       blacklist_characters="@ \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0'\"<>`"), min_size=6, max_size=20),
       scheme=st.sampled_from(["https", "HTTPS", "Http", "git+https", "s3"]),
       host=st.sampled_from(["h", "h:99999", "[::1", "[fe80::1]:x", "h.example:443", ""]),
       tail=st.text(max_size=20))
def test_text_never_raises_and_never_returns_the_password(user, secret, scheme, host, tail):
    assume(secret not in f"{scheme}://{user}" and secret not in f"@{host}/{tail}")
    url = f"{scheme}://{user}:{secret}@{host}/{tail}"
    out = redact.text(f"x {url}")
    assert secret not in out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=30), max_size=8), st.text(alphabet="abcdefghij0123456789_", min_size=8, max_size=16))
def test_argv_never_leaks_a_token_value(args, value):
    masked = redact.argv([*args, "--hub_token", "hf_" + value, f"--api_token=tk_{value}"])
    assert "hf_" + value not in masked and f"tk_{value}" not in " ".join(masked)


def test_user_errors_are_redacted_and_bounded():
    e = UserError("x" * 10_000_000 + " https://u:s3cret@h/", where="w" * 5000, fix="f")
    assert len(str(e)) < 3000 and SECRET not in str(e)


def cli(*args, env=None):
    e = {k: v for k, v in os.environ.items() if not k.startswith("TRAINBOX_INDEX_")}
    e.update(env or {})
    return subprocess.run([sys.executable, "build.py", *args], cwd=ROOT, env=e, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("url", ["HTTPS://u:s3cret@h/{variant}", "https://u:s3c{ret@h/", "https://u:s3cret@h:99999/",
                                 "https://h/{variant}?token=s3cret"])
def test_dry_run_and_env_never_print_the_secret(url, tmp_path):
    for r in (cli("--dry-run", "--output-dir", str(tmp_path / "a"), "--cell", "cu130-hopper-x86_64",
                  "--index", f"torch={url}", "--index", f"flash={url}"),
              cli("--dry-run", "--output-dir", str(tmp_path / "b"), "--cell", "cu130-hopper-x86_64",
                  env={"TRAINBOX_INDEX_FLASH": url, "TRAINBOX_INDEX_DEFAULT": url})):
        assert r.returncode in (0, 2), r.stderr
        assert "Traceback" not in r.stderr
        assert "s3c" not in r.stdout + r.stderr, r.stdout + r.stderr
        if r.returncode == 2:
            assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("url", ["HTTPS://u:s3cret@127.0.0.1:1/simple", "https://u:s3cret@127.0.0.1:99999/",
                                 "https://127.0.0.1:1/simple?token=s3cret"])
def test_lock_error_with_an_unreachable_index_never_prints_the_secret(url, tmp_path):
    r = cli("--lock", "smoke-x86_64", "--output-dir", str(tmp_path), "--index", f"default={url}")
    assert r.returncode == 2, r.stderr
    assert "s3c" not in r.stdout + r.stderr and "Traceback" not in r.stderr
    assert not list(tmp_path.rglob("*.txt")), "a failed lock wrote a lock"
