#!/usr/bin/env python3
"""Thin CLI over the host-side package: `python build.py --help`."""
import sys

from builder.cli import main

if __name__ == "__main__":
    sys.exit(main())
