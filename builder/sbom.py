"""`python -m builder.sbom IMAGE_REF --output FILE [--attach REGISTRY_REF]`: write the CycloneDX SBOM of a local
image (builder.sbomgen), optionally attached to the pushed image as an OCI referrer (builder.referrers).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from builder import options, reference, referrers, sbomgen
from builder.errors import UserError, reports_user_errors
from builder.registry import split_ref
from common import atomic


@reports_user_errors
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m builder.sbom",
                                description="Write the CycloneDX SBOM of a local image, read from its contents; "
                                            "optionally attach it to the image in a registry (OCI referrer).")
    p.add_argument("image", help="local image reference, e.g. trainbox:smoke-x86_64")
    p.add_argument("--output", required=True, help="where to write the SBOM (JSON)")
    p.add_argument("--attach", metavar="REGISTRY_REF", default=None,
                   help="the pushed image, e.g. 127.0.0.1:5555/trainbox:smoke-x86_64 (or @sha256:...)")
    a = p.parse_args(argv)
    why = atomic.why_not_a_folder(Path(a.output).absolute().parent)
    if why:
        raise UserError(f"--output {a.output}: cannot write there: {why}", fix="give a writable path")
    options.check_file_target(a.output, "--output")   # the writers' one rule (atomic.file_target)
    reference.check_image(a.image, "image")   # bad input before any work
    if a.attach is not None:   # `--attach ''` too: an option given is honoured or refused, never ignored
        split_ref(a.attach)
    sbom = sbomgen.generate(a.image)
    # attached first: a failed attach leaves no file behind
    attached = referrers.attach(sbom, a.attach) if a.attach is not None else None
    atomic.write_text(a.output, sbomgen.dumps(sbom))
    if attached:
        print(f"attached {attached} to {a.attach}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
