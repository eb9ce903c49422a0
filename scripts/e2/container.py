"""One container for the length of a ``with`` block, through the Docker SDK.

Modelled on cibuildwheel's OCIContainer: entering pulls the image if the
engine lacks it, creates the container (command, environment, volumes,
network, labels, GPUs), copies in any local folders and starts it; leaving
removes it, always: after an error and after Ctrl-C too. In between:
``wait_until`` (the driver's one polling loop, with one meaning of a dead
container: exited, or gone), ``logs`` and ``exec``.
"""

from __future__ import annotations

import contextlib
import io
import tarfile
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from e2.dockerhost import device_requests, docker_reason, pull_if_missing
from e2.errors import E2Error
from e2.processes import poll_until, tail

if TYPE_CHECKING:
    from docker import DockerClient
    from docker.models.containers import Container as SdkContainer

T = TypeVar("T")
LABEL_PROBE = "org.vllm-e2.probe"


class Container:
    """``with Container(client, image, command, ...) as box:`` the started container.

    ``files`` maps a path inside the container to a local folder, copied in
    before the start (a remote engine cannot see this machine's paths);
    ``gpus`` is ``docker run --gpus``'s 'all' or comma-separated ids.
    """

    def __init__(self, client: DockerClient, image: str, command: list[str], *,
                 entrypoint: list[str] | None = None, env: dict[str, str] | None = None,
                 volumes: dict[str, dict[str, str]] | None = None, network: str = "none",
                 shm_size: str | None = None, labels: dict[str, str] | None = None,
                 gpus: str | None = None, files: dict[str, Path] | None = None):
        self.client, self.image, self.command = client, image, command
        self.entrypoint, self.env, self.volumes = entrypoint, env or {}, volumes or {}
        self.network, self.shm_size, self.labels = network, shm_size, labels or {}
        self.gpus, self.files = gpus, files or {}
        self._sdk: SdkContainer | None = None

    @property
    def sdk(self) -> SdkContainer:
        """The SDK's container object, while the block runs."""
        if self._sdk is None:
            raise RuntimeError("the container exists only inside its with block")
        return self._sdk

    def __enter__(self) -> Container:
        import docker

        pull_if_missing(self.client, self.image)
        try:
            self._sdk = self.client.containers.create(
                self.image, self.command, entrypoint=self.entrypoint, environment=self.env,
                volumes=self.volumes, network_mode=self.network, shm_size=self.shm_size,
                labels=self.labels, device_requests=device_requests(self.gpus) or None)
            for target, source in self.files.items():
                self.sdk.put_archive(str(Path(target).parent), _tar(source, Path(target).name))
            self.sdk.start()  # where a missing GPU runtime shows
        except docker.errors.DockerException as exc:
            self._remove()
            raise E2Error(f"starting {self.image} failed: {docker_reason(exc)}",
                          hint="--gpus needs the NVIDIA container toolkit on the Docker host"
                          if self.gpus else None) from None
        except BaseException:  # Ctrl-C or a failed copy: nothing is left behind
            self._remove()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._remove()

    def _remove(self) -> None:
        import docker

        if self._sdk is not None:
            with contextlib.suppress(docker.errors.DockerException):
                self._sdk.remove(force=True)
            self._sdk = None

    def dead(self) -> bool:
        """Exited (or dead), or gone from the engine."""
        import docker

        try:
            self.sdk.reload()
        except docker.errors.NotFound:
            return True
        return self.sdk.status in ("exited", "dead")

    def logs(self, stdout: bool = True, stderr: bool = True) -> str:
        import docker

        try:
            return self.sdk.logs(stdout=stdout, stderr=stderr).decode(errors="replace")
        except docker.errors.NotFound:
            return ""

    def exec(self, argv: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
        """Run ``argv`` in the running container: its exit code and output."""
        result = self.sdk.exec_run(argv, environment=env)
        return result.exit_code, result.output.decode(errors="replace")

    def wait_until(self, ready: Callable[[], T | None], timeout_s: float, what: str) -> T:
        """``ready()``'s first answer that is not None; an E2Error with the log's tail
        once the container is dead, or at the deadline."""
        return poll_until(ready, self.dead, timeout_s, what, self.logs)

    def wait_exit(self, timeout_s: float | None = None) -> int:
        """Until the container's command ends; its exit code."""
        return int(self.sdk.wait(timeout=timeout_s)["StatusCode"])


def run_to_end(client: DockerClient, image: str, command: list[str], what: str,
               stderr: bool = False, **options: Any) -> str:
    """Run ``command`` in a container of ``image`` (``Container``'s options) to its end;
    its output (stdout, with ``stderr`` also that). A non-zero exit is an E2Error
    with the log's tail."""
    with Container(client, image, command, **options) as box:
        code = box.wait_exit()
        if code != 0:
            raise E2Error(f"{what} in {image} failed (exit {code}):\n{tail(box.logs(), 60)}")
        return box.logs(stderr=stderr)


def _tar(source: Path, name: str) -> bytes:
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        tar.add(source, arcname=name)
    return archive.getvalue()
