#!/usr/bin/env python3
"""Kept for old command lines: the multi-turn benchmark is the package's ``bc-bench`` console
script (``bc_tools/bench/cli.py``); this runs it with the same arguments."""

import sys

from bc_tools.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
