"""`python -m trainbox NAME [ARGS]` — the dispatcher (also `/usr/local/bin/trainbox` in the image)."""

import sys

from trainbox.dispatch import main


def run() -> None:
    """Console-script target (`trainbox = "trainbox.__main__:run"`)."""
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    run()
