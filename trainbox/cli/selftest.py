"""Prove this image trains on this machine: every kernel against eager, a 3-step sft/qlora/grpo, vLLM, NCCL.

In about 3 minutes on a GPU, with nothing downloaded (tiny models and data made on the spot): the driver against the
image's floor; each attention kernel the image ships, forward and backward against eager on tiny models with the
features it claims (sliding window, softcap, sinks, packed rows); Liger's kernels; bitsandbytes' 4-bit matmul; the
fused optimizer step; a 3-step sft, qlora and grpo (once per rollout engine the image has: transformers, the static
decoder, vLLM) whose loss is finite and falls and whose saved model loads again; vLLM's engine starting and
generating; an NCCL all-reduce across the visible GPUs with the transport it used. Without a GPU what can run runs
(the CPU attention kernels, the tiny trainings) and the rest is SKIP with the reason; outside an image the image's own
rows (the driver floor) are SKIP.

Exit codes: 0 nothing failed; 1 a row failed (its reason says what); 2 bad usage.
TRAINBOX_SELFTEST_FAULT=ROW plants a fault in that row (the check of the check: it must FAIL).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from trainbox.cli.argtypes import OneLineParser, positive
from trainbox.image import selftestchecks


def main(argv: list[str]) -> int:
    p = OneLineParser(prog="trainbox selftest", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--only", metavar="ROW[,ROW]", help=f"run only these rows, of: {', '.join(selftestchecks.ROWS)}")
    p.add_argument("--timeout", type=positive, default=int(selftestchecks.CHILD_TIMEOUT), metavar="SECONDS",
                   help=f"each child process's limit (default {selftestchecks.CHILD_TIMEOUT:.0f}; more under "
                   "emulation, e.g. an arm64 image under QEMU)")
    p.add_argument("--keep", metavar="DIR", help="keep the children's logs, models and data in DIR (default: a "
                   "temporary folder, removed)")
    args = p.parse_args(argv)
    selftestchecks.select(args.only)   # bad input first: before any folder is made
    selftestchecks.fault()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="trainbox-selftest-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    rows = None
    try:
        info, rows = selftestchecks.run(args.only, work, args.timeout)
    finally:
        # a failed row's log stays for its reader (the reason names it)
        if not args.keep and not (rows and selftestchecks.exit_code(rows)):
            shutil.rmtree(work, ignore_errors=True)
    seconds = time.monotonic() - t0
    if args.json:
        print(selftestchecks.as_json(info, rows, seconds))
    else:
        print(selftestchecks.render(info, rows, seconds))
        if selftestchecks.exit_code(rows) and not args.keep:
            print(f"the children's logs: {work}")
    return selftestchecks.exit_code(rows)


if __name__ == "__main__":
    from trainbox.dispatch import run_main

    sys.exit(run_main(main, prog="trainbox selftest"))
