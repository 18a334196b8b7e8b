"""The build workflow's GPU gate: `trainbox selftest --json` in each pushed GPU image, on a real GPU, before anything
is published (builder/workflow.py puts these pieces into build.yml).

matrix.toml's `[ci] gpu_runners` (builder/matrix/ci.py) names a self-hosted runner per GPU generation and arch. For
each planned GPU image with a runner, one `gpu-test` job pulls the image by the digest its build job pushed (the
build report's pushed_ref) and runs the selftest (exit 0 only when no row failed; the JSON is kept as an artifact).
The publish jobs need that job: manifest lists and tags are published only when every GPU test passed or none ran.
Without a runner there is no gpu-test job, and each publish job names in its log, as a warning, the images of its
cell it publishes without a GPU test.
"""
from __future__ import annotations

from pathlib import Path

from builder.matrix import DEFAULT_MATRIX, load_matrix

JOB = "gpu-test"


def rows(include: list[dict], matrix_path: str | Path = DEFAULT_MATRIX) -> list[dict]:
    """One gpu-test job per planned GPU image whose (generation, arch) has a runner: its tag, its build job's venv
    (whose report holds the pushed digest) and the runner's labels."""
    m = load_matrix(matrix_path)
    planned = {t: i["venv"] for i in include for t in i["cells"].split()}
    return [{"tag": c.tag, "venv": planned[c.tag], "runner": list(m.gpu_runners[(c.gpu, c.arch)])}
            for c in sorted(m.cells, key=lambda c: c.tag)
            if c.tag in planned and c.cuda and (c.gpu, c.arch) in m.gpu_runners]


def untested(include: list[dict], matrix_path: str | Path = DEFAULT_MATRIX) -> dict[str, list[str]]:
    """Cell name -> its planned GPU images that no runner tests (the publish log names them)."""
    m = load_matrix(matrix_path)
    planned = {t for i in include for t in i["cells"].split()}
    out: dict[str, list[str]] = {}
    for c in sorted(m.cells, key=lambda c: c.tag):
        if c.tag in planned and c.cuda and (c.gpu, c.arch) not in m.gpu_runners:
            out.setdefault(c.name, []).append(c.tag)
    return out


def configured(matrix_path: str | Path = DEFAULT_MATRIX) -> bool:
    return bool(load_matrix(matrix_path).gpu_runners)


def publish_if(base: str) -> str:
    """The publish job's condition with the gate: its own, plus the build passed and the GPU tests passed or were
    skipped (none planned). `!cancelled()` keeps a skipped gpu-test from skipping publish."""
    return (f"{base} && !cancelled() && needs.build.result == 'success' && "
            f"(needs.{JOB}.result == 'success' || needs.{JOB}.result == 'skipped')")


def untested_step() -> dict:
    return {"name": "Images of ${{ matrix.cell }} published without a GPU test",
            "if": "matrix.untested != ''",
            "env": {"UNTESTED": "${{ matrix.untested }}"},
            "run": "\n".join([
                'for tag in $UNTESTED; do',
                '  echo "::warning title=published without a GPU test::$tag: matrix.toml [ci] gpu_runners names no '
                'runner for its GPU generation and arch, so no trainbox selftest ran on a GPU"',
                "done",
            ]) + "\n"}


def job(login_step: dict, registry_expr: str, pushing: str) -> dict:
    """The gpu-test job (`pushing`: the workflow's push condition; pull requests push nothing to test)."""
    pull = "\n".join([
        'ref=$(jq -r --arg tag "$TAG" \'.cells[] | select(.tag == $tag) | .pushed_ref\' "report-$VENV.json")',
        'if [ -z "$ref" ] || [ "$ref" = "null" ]; then',
        '  echo "::error::report-$VENV.json has no pushed digest for $TAG"',
        "  exit 1",
        "fi",
        'docker pull "$ref"',
        'echo "ref=$ref" >> "$GITHUB_OUTPUT"',
    ]) + "\n"
    selftest = "\n".join([
        "status=0",
        # the image's entrypoint is trainbox (tini first); the exit status is the verdict (1: a row failed)
        'docker run --rm --gpus all "$REF" selftest --json > "selftest-$TAG.json" || status=$?',
        'jq -r \'.rows[] | "\\(.row)\\t\\(.status)\\t\\(.reason)"\' "selftest-$TAG.json" || cat "selftest-$TAG.json"',
        'exit "$status"',
    ]) + "\n"
    return {
        "name": "GPU test ${{ matrix.tag }}: trainbox selftest",
        "needs": ["plan", "build"],
        "if": f"{pushing} && needs.plan.outputs.gputest_any == 'true'",
        "runs-on": "${{ matrix.runner }}",
        "timeout-minutes": 30,
        "strategy": {"fail-fast": False, "matrix": "${{ fromJSON(needs.plan.outputs.gputest) }}"},
        "steps": [
            {"uses": "actions/download-artifact@v4", "with": {"name": "report-${{ matrix.venv }}"}},
            login_step,
            {"name": "Pull ${{ matrix.tag }} by the digest its build pushed", "id": "pull",
             "env": {"TAG": "${{ matrix.tag }}", "VENV": "${{ matrix.venv }}", "REGISTRY": registry_expr},
             "run": pull},
            {"name": "trainbox selftest --json on this runner's GPU (no row may fail)",
             "env": {"REF": "${{ steps.pull.outputs.ref }}", "TAG": "${{ matrix.tag }}"},
             "run": selftest},
            {"uses": "actions/upload-artifact@v4", "if": "always()",
             "with": {"name": "selftest-${{ matrix.tag }}", "path": "selftest-${{ matrix.tag }}.json",
                      "if-no-files-found": "ignore"}},
            {"name": "Remove the image (a self-hosted runner keeps its disk)", "if": "always()",
             "env": {"REF": "${{ steps.pull.outputs.ref }}"},
             "run": 'if [ -n "$REF" ]; then docker rmi "$REF" || true; fi\n'},
        ],
    }
