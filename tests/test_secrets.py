"""Build-time credentials go in only as BuildKit secrets: a known fake token must appear in no layer, no history
entry, no label and no env of the image, while a RUN step really received it. A control build that passes the same
token the wrong way (a build ARG) proves the scan finds it when it is there."""

from __future__ import annotations

import hashlib
import json
import subprocess
import textwrap

import pytest

from builder import engine as eng
from builder.errors import UserError
from builder.options import parse_secrets
from devenv import engine as devengine
from enginefix import BUILD_TIMEOUT, FAKE_TOKEN, SECRET_ID, ThrowawayCell, docker, secret_file

# a cold first build (debootstrap + the session images, arm64 under QEMU) runs inside the first test's setup
pytestmark = [pytest.mark.engine, pytest.mark.timeout(BUILD_TIMEOUT)]


def leaks(image: str, needle: str) -> list[str]:
    """Where NEEDLE occurs in IMAGE: every layer's bytes (docker save), the history, the config (labels, env)."""
    found = []
    save = subprocess.run([devengine.docker_cli(), "save", image], capture_output=True, check=True)
    if needle.encode() in save.stdout:
        found.append("saved image (layers or config)")
    hist = docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", image).stdout
    if needle in hist:
        found.append("history")
    cfg = json.loads(docker("image", "inspect", image).stdout)[0]["Config"]
    if needle in json.dumps(cfg.get("Labels") or {}):
        found.append("labels")
    if needle in json.dumps(cfg.get("Env") or []):
        found.append("env")
    return found


def _build(tmp_path, test_base, dockerfile: str, tag: str, **kw):  # noqa: F811
    ctx = tmp_path / tag
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(textwrap.dedent(dockerfile))
    cell = ThrowawayCell(name=tag, tag=tag, repository="trainbox-test")
    return eng.build_cell(cell, builder=eng.choose_builder("auto"), context=ctx,
                          bases={"debian:bookworm": test_base}, **kw)


def test_secret_reaches_run_but_no_layer_history_or_label(tmp_path, test_base):  # noqa: F811
    res = _build(tmp_path, test_base, """\
        ARG BASE_IMAGE=debian:bookworm
        FROM ${BASE_IMAGE}
        LABEL io.trainbox.test="secrets"
        # what a gated download does with the token; only its hash is kept, to prove it arrived
        RUN --mount=type=secret,id=hf_token sha256sum /run/secrets/hf_token | cut -d' ' -f1 > /token.sha256
        """, "secret-ok", secrets=[f"id={SECRET_ID},src={secret_file()}"], no_cache=True)
    image = res.refs[0]
    got = docker("run", "--rm", "--entrypoint", "cat", image, "/token.sha256").stdout.strip()
    assert got == hashlib.sha256(FAKE_TOKEN.encode()).hexdigest()  # the RUN step really had the secret
    assert leaks(image, FAKE_TOKEN) == []


def test_the_scan_finds_a_token_passed_the_wrong_way(tmp_path, test_base):  # noqa: F811
    # build_cell offers no way to pass arbitrary build args (on purpose); the control goes through build_image
    ctx = tmp_path / "leak"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text('ARG BASE_IMAGE\nFROM ${BASE_IMAGE}\nARG HF_TOKEN\nRUN echo "$HF_TOKEN" > /leaked\n')
    image_id, _ = eng.build_image(dockerfile=ctx / "Dockerfile", context=ctx, platform="linux/amd64",
                                  builder=eng.choose_builder("auto"), label="secret-leak", quiet=True,
                                  build_args={"BASE_IMAGE": test_base, "HF_TOKEN": FAKE_TOKEN})
    where = leaks(image_id, FAKE_TOKEN)
    assert "saved image (layers or config)" in where and "history" in where


def test_smoke_image_built_with_the_secret_holds_no_trace(smoke_build):  # noqa: F811
    # the session's smoke build passed FAKE_TOKEN as a BuildKit secret (enginefix.build_args)
    assert leaks(smoke_build.refs[0], FAKE_TOKEN) == []


def test_secret_specs_are_checked(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        parse_secrets([f"id=hf_token,src={tmp_path}/missing"])
    with pytest.raises(UserError, match="id=ID,src=PATH"):
        parse_secrets(["hf_token"])
    with pytest.raises(UserError, match="legacy builder"):
        eng.build_image(dockerfile=tmp_path / "Dockerfile", context=tmp_path, platform="linux/amd64",
                        builder=eng.Builder("legacy", devengine.docker_cli()), label="x",
                        secrets=[f"id=hf_token,src={secret_file()}"])
