"""Engines run as local processes: a free port, a process group, one polling loop.

An engine (``vllm serve``'s API server) forks an engine core and workers; each
is started in its own session, so stopping it reaches the whole group. The
polling loop here is the driver's only one: a local process and a container
(``e2.container``) both wait with it, each saying what "dead" means for it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from e2.errors import E2Error

T = TypeVar("T")
STOP_GRACE_S = 30


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.splitlines()[-lines:])


class Died(E2Error):
    """What was waited for exited first; the message carries its log's tail."""


class TimedOut(E2Error):
    """What was waited for was still not ready at the deadline."""


def poll_until(ready: Callable[[], T | None], dead: Callable[[], bool], timeout_s: float,
               what: str, log: Callable[[], str], interval_s: float = 1.0) -> T:
    """``ready()``'s first answer that is not None; ``Died`` once ``dead()``, ``TimedOut``
    after ``timeout_s``. ``ready`` is asked before ``dead``, so an answer given just
    before an exit still counts; ``what`` names the thing in the errors."""
    started = time.monotonic()
    while True:
        answer = ready()
        if answer is not None:
            return answer
        if dead():
            raise Died(f"{what} exited while starting:\n{tail(log())}")
        if time.monotonic() - started >= timeout_s:
            raise TimedOut(f"{what} not ready within {timeout_s:.0f} s:\n{tail(log())}")
        time.sleep(interval_s)


def http_answers(url: str, timeout_s: float = 60) -> bool:
    """Whether a GET of ``url`` gets a 2xx answer (a refused or failed one: False)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s):
            return True
    except OSError:  # refused, reset, an HTTP error status (URLError is an OSError)
        return False


class ProcessGroup:
    """A command in its own process group, its output in ``log``; see ``started``."""

    def __init__(self, process: subprocess.Popen, log: Path):
        self.process, self.log_path = process, log

    @property
    def pid(self) -> int:
        return self.process.pid

    def exited(self) -> bool:
        return self.process.poll() is not None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_until(self, ready: Callable[[], T | None], timeout_s: float, what: str) -> T:
        return poll_until(ready, self.exited, timeout_s, what, self.log)

    def wait_http(self, url: str, timeout_s: float, what: str) -> float:
        """Until ``url`` answers; the seconds it took."""
        started = time.monotonic()
        self.wait_until(lambda: True if http_answers(url) else None, timeout_s, what)
        return round(time.monotonic() - started, 1)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the group, wait ``grace_s``, then SIGKILL; workers left in the group
        after their parent exited are killed too."""
        if self.process.poll() is None:
            _signal_group(self.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(self.pid, signal.SIGKILL)
                self.process.wait(timeout=grace_s)
        _signal_group(self.pid, signal.SIGKILL)


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)


@contextlib.contextmanager
def started(command: list[str], log: Path, env: dict[str, str], cwd: Path | None = None,
            header: str | None = None) -> Iterator[ProcessGroup]:
    """Run ``command`` in a new session (stdin closed, stdout and stderr into ``log``)
    for the length of the block; its whole group is stopped on the way out, also
    on an error or Ctrl-C."""
    with log.open("w") as handle:
        if header is not None:
            handle.write(header)
            handle.flush()
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                                   start_new_session=True)
    group = ProcessGroup(process, log)
    try:
        yield group
    finally:
        group.stop()
