"""e2.processes: the polling loop, the port finder and process groups."""

from __future__ import annotations

import os
import socket
import sys
import time

import pytest

from e2.processes import Died, TimedOut, free_port, poll_until, started


def test_poll_returns_the_first_answer_and_asks_before_checking_death():
    answers = iter([None, None, "up"])
    assert poll_until(lambda: next(answers), lambda: False, 5, "x",
                      lambda: "", interval_s=0) == "up"
    # an answer given by something already dead still counts
    assert poll_until(lambda: 1, lambda: True, 5, "x", lambda: "") == 1


def test_poll_reports_death_with_the_log_tail_and_a_timeout():
    log = "\n".join(f"line {i}" for i in range(100))
    with pytest.raises(Died) as died:
        poll_until(lambda: None, lambda: True, 5, "the engine", lambda: log)
    assert str(died.value).startswith("the engine exited while starting:\nline 70\n")
    assert str(died.value).endswith("line 99")
    started_at = time.monotonic()
    with pytest.raises(TimedOut, match="the engine not ready within 0 s"):
        poll_until(lambda: None, lambda: False, 0.2, "the engine", lambda: "", interval_s=0.05)
    assert time.monotonic() - started_at < 5


def test_free_port_is_bindable():
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_a_started_group_is_stopped_whole_on_error(tmp_path):
    # the parent forks a child that ignores nothing and outlives it unless the group dies
    script = ("import os, subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
              "print(child.pid, flush=True)\n"
              "time.sleep(600)\n")
    with pytest.raises(RuntimeError), started([sys.executable, "-c", script],
                                              tmp_path / "log", dict(os.environ)) as group:
        pid = poll_until(lambda: (group.log().split() or [None])[0], group.exited, 30,
                         "the parent", group.log, interval_s=0.05)
        raise RuntimeError("the block failed")
    assert group.exited()
    for _ in range(100):  # the grandchild got SIGTERM with its group
        if not _alive(int(pid)):
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"process {pid} of the group is still alive")


def test_wait_http_sees_a_process_that_dies(tmp_path):
    command = [sys.executable, "-c", "import sys; print('bad flag'); sys.exit(3)"]
    with started(command, tmp_path / "log", dict(os.environ)) as group:
        with pytest.raises(Died, match="bad flag"):
            group.wait_http(f"http://127.0.0.1:{free_port()}/health", 30, "the engine")


def _alive(pid: int) -> bool:
    """Running, not gone and not a zombie waiting for a parent that never reaps it."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
