"""The notebook user (issue 12) against the real smoke image: JupyterLab in a real browser (Debian's headless
Chromium), a shipped notebook's first cells run by the server's kernel, the shipped notebooks executed top to bottom
with their outputs in ARTIFACT_DIR, a quiet start, and the workstation `compose.yaml` brought up by docker-compose.

One Lab container serves the browser and kernel tests; it runs as a mapped uid:gid (not the image's 1000) on a
mounted work folder owned by that uid, the way compose.yaml's TRAINBOX_UID/TRAINBOX_GID run it. Screenshots go to
$TRAINBOX_TEST_ARTIFACTS/browser (default: test-artifacts/browser in the repository, git-ignored).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from enginefix import BUILD_TIMEOUT, ROOT, docker
from test_data import write_dolly, write_verl_gsm8k

pytestmark = [pytest.mark.engine, pytest.mark.timeout(BUILD_TIMEOUT)]

UID = GID = 4321  # not the image's 1000: the mapping is what's tested
ENV = ["-e", "HF_HUB_OFFLINE=1", "-e", "OMP_NUM_THREADS=1", "-e", "TOKENIZERS_PARALLELISM=false"]
FAST = "--per_device_train_batch_size 2 --logging_steps 1 --disable_tqdm true --report_to none " \
       "--dataloader_num_workers 0"
SHOTS = Path(os.environ.get("TRAINBOX_TEST_ARTIFACTS", ROOT / "test-artifacts")) / "browser"
# Lines of a normal start that would read as trouble to a user.
NOISY = re.compile(r"^\[(W|E|C) |\b(403|500)\b|Traceback|error|Failed to load|could not be imported", re.I | re.M)
# Jupyter's log times carry milliseconds ("01:51:44.500"): they are not HTTP statuses.
LOG_TIME = re.compile(r"\b\d{2}:\d{2}:\d{2}\.\d{3}\b")


def noisy_lines(logs: str) -> list[str]:
    return [ln for ln in logs.splitlines() if NOISY.search(LOG_TIME.sub("<time>", ln))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(url: str, **kw) -> int | None:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, **kw), timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


def _api(base: str, token: str, path: str, method: str = "GET", body: dict | None = None) -> dict:
    req = urllib.request.Request(base + path, method=method, headers={"Authorization": f"token {token}",
                                 "Content-Type": "application/json"},
                                 data=None if body is None else json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read() or b"{}")


def _wait_api(base: str, name: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while _status(base + "/api") != 200:  # a readiness poll, not a timing assertion
        if time.monotonic() > deadline:
            logs = docker("logs", name, check=False)
            pytest.fail(f"jupyter did not answer on {base}:\n{logs.stdout[-2000:]}{logs.stderr[-2000:]}")
        time.sleep(0.5)


def _readable(*paths: Path) -> None:
    for top in paths:
        for p in [top, *top.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        top.parent.chmod(0o755)


@pytest.fixture(scope="module")
def inputs(tiny_model, tmp_path_factory):
    data = tmp_path_factory.mktemp("nbdata")
    write_verl_gsm8k(data / "gsm8k.parquet")
    write_dolly(data / "dolly.jsonl")
    _readable(tiny_model, data)
    return tiny_model, data


@pytest.fixture(scope="module")
def lab(smoke_image, tmp_path_factory):  # noqa: F811
    """One JupyterLab container for the module, as uid:gid 4321 on a mounted /workspace owned by 4321."""
    work = tmp_path_factory.mktemp("labwork")
    os.chown(work, UID, GID)
    work.chmod(0o755)
    work.parent.chmod(0o755)
    port, token, name = _free_port(), uuid.uuid4().hex, f"trainbox-lab-{uuid.uuid4().hex[:8]}"
    docker("run", "-d", "--name", name, "--user", f"{UID}:{GID}", "-p", f"127.0.0.1:{port}:8888",
           "-e", f"JUPYTER_TOKEN={token}", *ENV, "-v", f"{work}:/workspace", smoke_image, "jupyter")
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_api(base, name)
        deadline = time.monotonic() + 30
        while "JupyterLab is up" not in _logs(name) and time.monotonic() < deadline:
            time.sleep(0.5)  # the banner comes right after the auth probe
        yield {"base": base, "token": token, "name": name, "work": work}
    finally:
        docker("rm", "-f", name, check=False)


def _logs(name: str) -> str:
    r = docker("logs", name, check=False)
    return r.stdout + r.stderr


@functools.cache
def _profile() -> str:
    return tempfile.mkdtemp(prefix="trainbox-chromium-")  # a fresh browser profile per session


def _chromium(url: str, shot: Path | None = None, budget_ms: int = 30000, height: int = 800) -> str:
    """Headless Chromium (Debian's): the DOM after the page's scripts ran; a screenshot of it when asked."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe, "chromium is not installed: `make system-deps` installs Debian's"
    common = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
              f"--window-size=1280,{height}", f"--virtual-time-budget={budget_ms}", f"--user-data-dir={_profile()}"]
    SHOTS.mkdir(parents=True, exist_ok=True)
    dom = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    if shot is not None:
        r = subprocess.run([*common, f"--screenshot={shot}", url], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and shot.stat().st_size > 1000, r.stderr[-2000:]
    return dom.stdout


def test_start_is_quiet_and_the_mapped_user_owns_the_seeded_examples(lab):
    logs = _logs(lab["name"])
    assert "JupyterLab is up" in logs, logs[-3000:]
    assert not noisy_lines(logs), "error-looking lines in a normal start:\n" + "\n".join(noisy_lines(logs))
    assert logs.count("JupyterLab is up") == 1 and lab["token"] not in logs  # a given token is never echoed
    examples = lab["work"] / "examples"
    assert sorted(p.name for p in examples.glob("*.ipynb")) == ["grpo_gsm8k.ipynb", "qlora_dolly.ipynb"]
    assert (examples.stat().st_uid, examples.stat().st_gid) == (UID, GID)


def test_generated_token_url_printed_once(smoke_image, tmp_path):  # noqa: F811
    port, name = _free_port(), f"trainbox-lab-{uuid.uuid4().hex[:8]}"
    docker("run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8888", smoke_image, "jupyter")
    try:
        _wait_api(f"http://127.0.0.1:{port}", name)
        deadline = time.monotonic() + 30
        while "JupyterLab is up" not in (logs := _logs(name)) and time.monotonic() < deadline:
            time.sleep(0.5)
        tokens = re.findall(r"token=([0-9a-f]{48})\b", logs)
        assert len(set(tokens)) == 1, logs[-3000:]
        assert sum(tokens[0] in ln for ln in logs.splitlines()) == 2, logs[-3000:]  # one banner: 127.0.0.1 + host
        assert not noisy_lines(logs), logs[-3000:]
    finally:
        docker("rm", "-f", name, check=False)


def test_browser_login_refused_then_lab_loads(lab):
    base, token = lab["base"], lab["token"]
    no_token = _chromium(f"{base}/lab", SHOTS / "1-no-token-login.png")
    assert 'type="password"' in no_token and "jp-LabShell" not in no_token, no_token[-2000:]
    wrong = _chromium(f"{base}/lab?token=wrong{token}", SHOTS / "2-wrong-token-login.png")
    assert 'type="password"' in wrong and "jp-LabShell" not in wrong, wrong[-2000:]
    assert _status(f"{base}/api/contents?token=wrong{token}") == 403
    ok = _chromium(f"{base}/lab?token={token}", SHOTS / "3-right-token-lab.png")
    assert "jp-LabShell" in ok and "<title>JupyterLab</title>" in ok, ok[-2000:]


def _recv(ws, deadline: float) -> dict | None:
    """The next kernel message on WS, or None at DEADLINE. Frame by frame: the server pings every 30 s, and
    websocket-client's recv() answers pings and keeps waiting, so a socket timeout alone never ends the wait."""
    from websocket import ABNF, WebSocketTimeoutException

    while (left := deadline - time.monotonic()) > 0:
        ws.settimeout(min(left, 5))
        try:
            opcode, frame = ws.recv_data_frame(control_frame=True)
        except WebSocketTimeoutException:
            continue
        if opcode == ABNF.OPCODE_TEXT:
            return json.loads(frame.data)
        if opcode == ABNF.OPCODE_CLOSE:
            raise AssertionError("the server closed the kernel's websocket")
    return None


def _request(ws, msg_type: str, content: dict) -> str:
    msg_id = uuid.uuid4().hex
    ws.send(json.dumps({"header": {"msg_id": msg_id, "username": "test", "session": uuid.uuid4().hex,
                                   "msg_type": msg_type, "version": "5.3"},
                        "parent_header": {}, "metadata": {}, "channel": "shell", "content": content}))
    return msg_id


def _wait_iopub(ws, deadline: float) -> None:
    """kernel_info requests until one's status comes back on iopub: a fresh kernel's iopub subscription can miss
    what is published before it is connected (zmq's slow joiner), so outputs sent earlier would never arrive."""
    while time.monotonic() < deadline:
        msg_id, until = _request(ws, "kernel_info_request", {}), min(deadline, time.monotonic() + 2)
        while (m := _recv(ws, until)) is not None:
            if m.get("channel") == "iopub" and m.get("parent_header", {}).get("msg_id") == msg_id:
                return
    raise AssertionError("the kernel's iopub channel never answered")


def _execute(base: str, token: str, kernel_id: str, code: str, timeout: float = 120) -> list[dict]:
    """Run CODE on the kernel over the server's websocket (the channel the Lab UI uses); the iopub outputs."""
    import websocket

    deadline = time.monotonic() + timeout
    ws = websocket.create_connection(f"{base.replace('http', 'ws')}/api/kernels/{kernel_id}/channels",
                                     header=[f"Authorization: token {token}"], timeout=timeout)
    try:
        _wait_iopub(ws, deadline)
        msg_id = _request(ws, "execute_request", {"code": code, "silent": False, "store_history": True,
                                                  "user_expressions": {}, "allow_stdin": False})
        # done when both the shell reply and iopub's idle came: two channels, so either may come first
        outputs, status, idle = [], None, False
        while (m := _recv(ws, deadline)) is not None:
            if m.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = m["msg_type"]
            if kind == "stream":
                outputs.append({"output_type": "stream", "name": m["content"]["name"], "text": m["content"]["text"]})
            elif kind in ("execute_result", "display_data"):
                outputs.append({"output_type": kind, "data": m["content"]["data"], "metadata": {},
                                **({"execution_count": m["content"]["execution_count"]}
                                   if kind == "execute_result" else {})})
            elif kind == "error":
                raise AssertionError("\n".join(m["content"]["traceback"]))
            elif kind == "execute_reply":
                status = m["content"]["status"]
            elif kind == "status" and m["content"]["execution_state"] == "idle":
                idle = True
            if status and idle:
                return outputs
        raise AssertionError(f"no reply from the kernel in {timeout}s")
    finally:
        ws.close()


def test_kernel_runs_the_shipped_notebook_first_cells(lab):
    base, token, work = lab["base"], lab["token"], lab["work"]
    path = "examples/grpo_gsm8k.ipynb"
    nb = _api(base, token, f"/api/contents/{path}")["content"]
    kernel = _api(base, token, "/api/kernels", "POST", {"name": "python3"})
    try:
        code_cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
        for i, cell in enumerate(code_cells[:2], 1):  # parameters, then the built-in rewards on two completions
            cell["outputs"] = _execute(base, token, kernel["id"], "".join(cell["source"]))
            cell["execution_count"] = i
        text = "".join(o.get("text", "") for c in code_cells[:2] for o in c["outputs"])
        assert "correctness" in text and "[2.0, 0.0]" in text, text
        # the mapped user writes the mounted work folder
        _execute(base, token, kernel["id"], "open('/workspace/written-by-kernel.txt', 'w').write('ok')")
    finally:
        urllib.request.urlopen(urllib.request.Request(f"{base}/api/kernels/{kernel['id']}", method="DELETE",
                                                      headers={"Authorization": f"token {token}"}), timeout=30)
    written = work / "written-by-kernel.txt"
    assert written.read_text() == "ok" and (written.stat().st_uid, written.stat().st_gid) == (UID, GID)
    # save the executed cells and look at them in Lab
    _api(base, token, f"/api/contents/{path}", "PUT", {"type": "notebook", "format": "json", "content": nb})
    dom = _chromium(f"{base}/lab/tree/{path}?token={token}", SHOTS / "4-notebook-cells-executed.png", 40000, 1500)
    assert "jp-Notebook" in dom and "[2.0, 0.0]" in dom, dom[-2000:]  # the kernel's output, rendered by Lab


def test_shipped_notebooks_run_top_to_bottom_and_fill_artifact_dir(smoke_image, inputs, tmp_path):  # noqa: F811
    model, data = inputs
    out = tmp_path / "out"
    out.mkdir()
    os.chown(out, 1000, 1000)
    run = ("set -e; for nb in grpo_gsm8k qlora_dolly; do "
           "if [ $nb = grpo_gsm8k ]; then export NB_DATASET=/data/gsm8k.parquet "
           "NB_ARGS=\"--num_generations 2 --max_completion_length 8 --bf16 false $FAST\"; "
           "else export NB_DATASET=/data/dolly.jsonl NB_ARGS=\"--max_length 64 $FAST\"; fi; "
           "python -m nbconvert --to notebook --execute --ExecutePreprocessor.timeout=600 "
           "--output /workspace/outputs/$nb.ipynb /opt/trainbox/trainbox/image/examples/$nb.ipynb; done")
    r = docker("run", "--rm", *ENV, "-e", "NB_MODEL=/models/tiny", "-e", "NB_MAX_STEPS=2", "-e", f"FAST={FAST}",
               "-e", "ARTIFACT_DIR=/workspace/outputs/artifacts", "-v", f"{model}:/models/tiny:ro",
               "-v", f"{data}:/data:ro", "-v", f"{out}:/workspace/outputs", smoke_image, "bash", "-c", run,
               check=False, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    art = out / "artifacts"
    assert (art / "grpo-gsm8k" / "adapter_model.safetensors").is_file(), sorted(map(str, art.rglob("*")))
    assert (art / "qlora-dolly" / "adapter_model.safetensors").is_file()
    assert (art / "qlora-dolly" / "merged" / "model.safetensors").is_file()
    for name, log in (("grpo-gsm8k", "grpo.log"), ("qlora-dolly", "qlora.log")):
        text = (art / name / "logs" / log).read_text()
        assert "done:" in text and "steps 2/2" in text, text[-2000:]  # the finished log, summary line included
    executed = json.loads((out / "qlora_dolly.ipynb").read_text())
    stderr = "".join("".join(o.get("text", "")) for c in executed["cells"] for o in c.get("outputs", [])
                     if o.get("name") == "stderr")  # nbformat keeps a text as a string or a list of lines
    assert "Failed to load CPU gemm_4bit_forward" not in stderr, stderr[-2000:]


def test_compose_workstation_up_healthy_lab_and_clean_stop(smoke_image, tmp_path):  # noqa: F811
    exe = shutil.which("docker-compose")
    assert exe, "docker-compose is not installed: `make system-deps` installs Debian's"
    spec = yaml.safe_load((ROOT / "compose.yaml").read_text())
    svc = spec["services"]["jupyter"]
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    # The CPU override: no GPU here. Compose v1 merges device lists from override files (no `!reset`), so the
    # override is a copy of compose.yaml without the reservation; everything else is the shipped file.
    del svc["deploy"]
    project = tmp_path / "ws"
    (project / "work").mkdir(parents=True)
    (project / "outputs").mkdir()
    for d in (project / "work", project / "outputs"):
        os.chown(d, UID, GID)
    tmp_path.chmod(0o755)
    project.chmod(0o755)
    (project / "compose.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    port, token = _free_port(), uuid.uuid4().hex
    (project / ".env").write_text(f"JUPYTER_TOKEN={token}\nTRAINBOX_IMAGE={smoke_image}\nJUPYTER_PORT={port}\n"
                                  f"TRAINBOX_UID={UID}\nTRAINBOX_GID={GID}\n")
    name = f"tbx{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "COMPOSE_PROJECT_NAME": name}
    env.pop("JUPYTER_TOKEN", None)

    def compose(*args, timeout=180):
        return subprocess.run([exe, *args], cwd=project, env=env, capture_output=True, text=True, timeout=timeout)

    up = compose("up", "-d")
    try:
        assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
        cid = compose("ps", "-q", "jupyter").stdout.strip()
        deadline = time.monotonic() + 150
        while (health := docker("inspect", "-f", "{{.State.Health.Status}}", cid).stdout.strip()) != "healthy":
            assert health in ("starting", "healthy"), _logs(cid)[-3000:]
            if time.monotonic() > deadline:
                pytest.fail(f"not healthy after 150 s ({health}):\n{_logs(cid)[-3000:]}")
            time.sleep(2)
        base = f"http://127.0.0.1:{port}"
        assert _status(f"{base}/api/status") == 403
        assert _status(f"{base}/api/status?token={token}") == 200
        assert _status(f"{base}/lab?token={token}") == 200
        assert (project / "work" / "examples" / "grpo_gsm8k.ipynb").is_file()
        stop = compose("stop", timeout=120)
        assert stop.returncode == 0, stop.stderr[-2000:]
        state = json.loads(docker("inspect", "-f", "{{json .State}}", cid).stdout)
        assert state["Status"] == "exited" and state["ExitCode"] == 0, (state, _logs(cid)[-3000:])
    finally:
        down = compose("down", "-v", "--remove-orphans", timeout=120)
    assert down.returncode == 0, down.stderr[-2000:]
