"""The ``e2`` command's entry point.

A Ctrl-C while the driver's modules load (about half a second on a busy
machine) says "interrupted" and exits 130, as one while a verb runs does
(cli.main), instead of a KeyboardInterrupt traceback.
"""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from e2.cli import main as run
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    return run()
