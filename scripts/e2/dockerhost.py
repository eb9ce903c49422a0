"""The Docker engine the driver talks to: the connection, images on it, GPU requests.

DOCKER_HOST decides the engine (ssh:// included). This module sits below
everything that uses Docker (image builds, the CPU base, containers, the
probes) and imports none of them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from e2 import console
from e2.errors import E2Error

if TYPE_CHECKING:
    from docker import DockerClient
    from docker.models.images import Image
    from docker.types import DeviceRequest

# Labels e2 writes on the images it makes and reads from a base.
LABEL_SITE_PACKAGES = "org.vllm-e2.site-packages"
LABEL_VLLM_VERSION = "org.vllm-e2.vllm-version"


def connect(context: Path | None = None, timeout: int = 900) -> DockerClient:
    """A client for DOCKER_HOST (or the default socket) that has answered a ping."""
    import docker  # imported late: render and verify need no Docker at all

    # ssh://: use the ssh binary (the SDK's paramiko route needs an extra package)
    use_ssh = shutil.which("ssh") is not None
    where = os.environ.get("DOCKER_HOST") or "the default socket (unix:///var/run/docker.sock)"
    try:
        client = docker.from_env(timeout=timeout, use_ssh_client=use_ssh)
        client.ping()
    except docker.errors.DockerException as exc:
        ready = f"; the build context is ready at {context}" if context else ""
        raise E2Error(f"no Docker daemon reachable at {where}: {exc}{ready}",
                      hint="start one (eval \"$(ci/dockerd.sh start)\") or set DOCKER_HOST "
                           "(ssh://user@host works)") from None
    return client


def docker_reason(exc: Exception) -> str:
    """The daemon's own words for a failed request, on one line."""
    text = getattr(exc, "explanation", None) or str(exc)
    return " ".join(str(text).split())


class ImageUnavailable(E2Error):
    """The image is not on the engine and cannot be pulled (no registry, offline, unknown)."""

    def __init__(self, ref: str, reason: str):
        super().__init__(f"image {ref}: not on the Docker host and cannot be pulled: {reason}",
                         hint="build it (e2 image build) or pull it there")
        self.ref, self.reason = ref, reason


def pull_if_missing(client: DockerClient, ref: str) -> Image:
    """The image ``ref`` on the engine, pulled first when the engine lacks it."""
    import docker

    try:
        return client.images.get(ref)
    except docker.errors.ImageNotFound:
        pass
    try:
        with console.status(f"pulling {ref}"):
            return client.images.pull(ref)
    except docker.errors.DockerException as exc:
        raise ImageUnavailable(ref, docker_reason(exc)) from None


def device_requests(gpus: str | None) -> list[DeviceRequest]:
    """``docker run --gpus``: None or '' for none, 'all', or comma-separated device ids."""
    import docker

    if not gpus:
        return []
    if gpus == "all":
        return [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])]
    return [docker.types.DeviceRequest(device_ids=gpus.split(","), capabilities=[["gpu"]])]
