"""e2.container.Container on a real engine, with the busybox stand-in base.

Every way out of the with block removes the container; a container that
exits while it is waited for is an error carrying its log's tail.
"""

from __future__ import annotations

import pytest

from e2.container import Container, run_to_end
from e2.errors import E2Error
from e2.processes import Died

pytestmark = pytest.mark.docker_e2e

LABEL = {"org.vllm-e2.probe": "container-test"}


def _left(client) -> list:
    return client.containers.list(all=True, filters={"label": "org.vllm-e2.probe=container-test"})


def test_files_exec_logs_and_removal(docker_client, standin, tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"ok": 1}')
    with Container(docker_client, standin.tag, ["sh", "-c", "echo booted; sleep 600"],
                   labels=LABEL, files={"/e2-model": tmp_path / "model"}) as box:
        assert box.wait_until(lambda: "booted" if "booted" in box.logs() else None, 60,
                              "the box") == "booted"
        assert box.exec(["cat", "/e2-model/config.json"]) == (0, '{"ok": 1}')
        assert not box.dead()
    assert not _left(docker_client)


def test_an_exit_while_waiting_is_an_error_with_the_log_tail(docker_client, standin):
    with pytest.raises(Died) as died, Container(
            docker_client, standin.tag, ["sh", "-c", "echo no such flag; exit 3"],
            labels=LABEL) as box:
        box.wait_until(lambda: None, 60, "the engine in the stand-in")
    assert "the engine in the stand-in exited while starting:\nno such flag" in str(died.value)
    assert not _left(docker_client)


def test_an_error_or_interrupt_in_the_block_removes_the_container(docker_client, standin):
    for error in (RuntimeError("failed"), KeyboardInterrupt()):
        with pytest.raises(type(error)), Container(docker_client, standin.tag,
                                                   ["sleep", "600"], labels=LABEL):
            raise error
        assert not _left(docker_client)


def test_a_container_removed_under_the_wait_counts_as_dead(docker_client, standin):
    with pytest.raises(Died), Container(docker_client, standin.tag, ["sleep", "600"],
                                        labels=LABEL) as box:
        box.sdk.remove(force=True)
        box.wait_until(lambda: None, 60, "the box")


def test_run_to_end_returns_stdout_and_fails_with_the_tail(docker_client, standin):
    assert run_to_end(docker_client, standin.tag, ["sh", "-c", "echo out; echo err >&2"],
                      "echoing", labels=LABEL) == "out\n"
    with pytest.raises(E2Error, match=r"(?s)echoing in .* failed \(exit 2\):.*broken"):
        run_to_end(docker_client, standin.tag, ["sh", "-c", "echo broken; exit 2"], "echoing",
                   labels=LABEL)
    assert not _left(docker_client)
