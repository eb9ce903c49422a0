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
        os.kill(os.getpid(), getattr(signal, "SIG" + os.environ.get("E2_FAULT_SIGNAL", "KILL")))
