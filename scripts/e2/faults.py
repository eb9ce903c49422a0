"""Fault injection for the kill and interrupt tests.

``E2_FAULT_AT=<name>`` stops the process at the checkpoint of that name:
SIGKILL by default (nothing runs after it), or the signal named by
``E2_FAULT_SIGNAL`` (``INT`` acts as a Ctrl-C). Unset, a checkpoint costs nothing.
"""

from __future__ import annotations

import os
import signal


def checkpoint(name: str) -> None:
    if os.environ.get("E2_FAULT_AT") == name:
        signum = getattr(signal, "SIG" + os.environ.get("E2_FAULT_SIGNAL", "KILL"))
        if signum == signal.SIGINT:
            # As a terminal's Ctrl-C reaches a foreground command: a process
            # started in the background of a script inherits SIGINT ignored.
            signal.signal(signal.SIGINT, signal.default_int_handler)
        os.kill(os.getpid(), signum)
