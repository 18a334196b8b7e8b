"""Where the repository is: builder/ is a folder of it, so its root is this file's grandparent (matrix.toml, locks/,
images/, .dockerignore, the build context)."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
