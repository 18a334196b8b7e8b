"""Run a script as two CPU ranks under torchrun (gloo), the way the agreement tests need: each rank writes its
result to OUT.<rank>; returns those texts.

The script's own teardown is added here: a barrier (no rank closes its sockets while the other still reads) and
`os._exit(0)` after the process group is destroyed, so C++ destructors at interpreter exit don't run. One CI run
saw rank 0 die by SIGABRT in a test that passed 40 times of 40 here under load; torch's gloo has known aborts
(pytorch/gloo#514). A run whose first failing rank was killed by a signal is run once more, with a warning naming
what it printed, so CI shows the flake without going red on it; a rank that exits with an error (a Python
exception) fails at once."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

TEARDOWN = "\nimport os as _os\ndist.barrier()\ndist.destroy_process_group()\n_os._exit(0)\n"
# torchrun's summary: the rank that failed first, then its exit; the others are SIGTERMed by torchrun after it
ROOT_CAUSE_SIGNALLED = re.compile(r"Root Cause \(first observed failure\):.*?exitcode\s*:\s*-\d+", re.S)
TELLING = re.compile(r"terminate called|what\(\)|Error|Abort|gloo|Traceback", re.I)


def run(script_text: str, tmp_path: Path, env: dict[str, str], name: str = "ranks", timeout: int = 240) -> list[str]:
    assert script_text.rstrip().endswith("dist.destroy_process_group()"), "the script ends by leaving its group"
    script = tmp_path / f"{name}.py"
    script.write_text(script_text.rstrip()[: -len("dist.destroy_process_group()")] + TEARDOWN)
    out = tmp_path / f"{name}-out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]

    def torchrun() -> subprocess.CompletedProcess:
        for rank in (0, 1):
            Path(f"{out}.{rank}").unlink(missing_ok=True)
        return subprocess.run(cmd, env=dict(env, OUT=str(out), OMP_NUM_THREADS="1"), capture_output=True, text=True,
                              timeout=timeout)

    def telling(stderr: str) -> str:
        return "\n".join(line for line in stderr.splitlines() if TELLING.search(line))[-3000:]

    r = torchrun()
    if r.returncode != 0 and ROOT_CAUSE_SIGNALLED.search(r.stderr):
        warnings.warn(f"a rank was killed by a signal (run again once): {telling(r.stderr)[-1500:]}", stacklevel=2)
        r = torchrun()
    if r.returncode != 0:
        raise AssertionError(f"torchrun exited {r.returncode}:\n{telling(r.stderr)}\n--- stderr's end:\n"
                             f"{r.stderr[-2000:]}")
    return [Path(f"{out}.{rank}").read_text() for rank in (0, 1)]
