"""Fixtures for the image tests: a real Docker engine and a fast stand-in base.

The engine is DOCKER_HOST when set; otherwise a private dockerd started here
through ci/dockerd.sh (state in the tests' cache, or $E2_DOCKERD_DIR, so
bases survive between runs) and stopped by pid at the end. With neither, the
tests that need Docker fail with a message saying how to get one.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from e2.cache import Cache
from e2.series import load_series
from e2.upstream import UpstreamCache

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERD_SCRIPT = REPO_ROOT / "ci" / "dockerd.sh"
SERIES = load_series(REPO_ROOT / "series.yaml")
VERSION = SERIES.upstream.version


@pytest.fixture(scope="session")
def docker_host(cache: Cache) -> str:
    """DOCKER_HOST for the session's engine (set in os.environ for `e2` in-process)."""
    import docker

    if os.environ.get("DOCKER_HOST"):
        try:
            docker.from_env().ping()
        except docker.errors.DockerException as exc:
            pytest.fail(f"DOCKER_HOST={os.environ['DOCKER_HOST']} does not answer: {exc}")
        yield os.environ["DOCKER_HOST"]
        return
    if not shutil.which("dockerd") or os.geteuid() != 0:
        pytest.fail("the image tests need a Docker engine: set DOCKER_HOST, or run as root "
                    "with dockerd installed (apt-get install docker.io) so the tests start "
                    "a private one (ci/dockerd.sh)")
    pidfile = cache.dockerd / "dockerd.pid"
    already = pidfile.is_file() and _alive(int(pidfile.read_text()))
    result = subprocess.run(["sh", str(DOCKERD_SCRIPT), "start"], capture_output=True,
                            text=True, env={**os.environ, "E2_DOCKERD_DIR": str(cache.dockerd)})
    if result.returncode != 0:
        pytest.fail(f"could not start a private dockerd:\n{result.stderr}")
    host = result.stdout.strip().split("=", 1)[1]
    os.environ["DOCKER_HOST"] = host
    try:
        yield host
    finally:
        del os.environ["DOCKER_HOST"]
        if not already:  # ours: stop it by the pid it wrote
            pid = int(pidfile.read_text())
            os.kill(pid, 15)
            for _ in range(120):
                if not _alive(pid):
                    break
                subprocess.run(["sleep", "0.5"])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Project:
    """A scratch copy of this checkout's series, overlay and image template."""

    PARTS = ("series.yaml", "patches", "overlay", "images/engine", "Dockerfile")

    def __init__(self, root: Path, cache: Cache):
        self.root, self.cache = root, cache
        for part in self.PARTS:
            source = REPO_ROOT / part
            if source.is_dir():
                shutil.copytree(source, root / part)
            else:
                (root / part).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(source, root / part)

    def e2(self, *args: str, expect: int | None = 0) -> subprocess.CompletedProcess:
        """Runs the e2 CLI as a process (so rich output and exit codes are the real ones)."""
        result = subprocess.run([sys.executable, "-m", "e2.cli", "--project", str(self.root),
                                 "--cache", str(self.cache.root), *args],
                                capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
        if expect is not None:
            assert result.returncode == expect, (f"e2 {' '.join(args)} exited "
                                                 f"{result.returncode}\n{result.stdout}\n"
                                                 f"{result.stderr}")
        return result


@pytest.fixture
def project(tmp_path: Path, upstream_cache: UpstreamCache) -> Project:
    return Project(tmp_path / "project", upstream_cache.cache)


@pytest.fixture(scope="session")
def docker_client(docker_host):
    import docker

    return docker.from_env(timeout=900)


# ---------------------------------------------------------------- stand-in base


def busybox_deb(debs: Path) -> Path:
    """busybox-static from Debian, downloaded once into the tests' cache (``debs``)."""
    debs.mkdir(parents=True, exist_ok=True)
    found = sorted(debs.glob("busybox-static_*.deb"))
    if not found:
        result = subprocess.run(["apt-get", "download", "busybox-static"], cwd=debs,
                                capture_output=True, text=True)
        found = sorted(debs.glob("busybox-static_*.deb"))
        if not found:
            pytest.fail(f"apt-get download busybox-static failed: {result.stderr}")
    return found[-1]


@dataclass(frozen=True)
class StandIn:
    tag: str
    site_packages: str


def standin_tar(work: Path, cache: Cache, site_packages: str, edit: dict[str, bytes]) -> Path:
    """busybox (sh, sha256sum, sed: all the Dockerfile's RUN steps use) + upstream vllm/."""
    unpacked = work / "busybox"
    subprocess.run(["dpkg", "-x", str(busybox_deb(cache.debs)), str(unpacked)], check=True)
    busybox = unpacked / "bin" / "busybox"
    applets = subprocess.run([str(busybox), "--list"], capture_output=True, text=True,
                             check=True).stdout.split()
    archive = subprocess.run(["git", "-C", str(cache.upstream_repo), "archive", "--format=tar",
                              f"refs/tags/{SERIES.upstream.tag}", "vllm/"],
                             capture_output=True, check=True).stdout
    prefix = site_packages.strip("/")
    out = work / "standin.tar"
    with tarfile.open(out, "w") as tar:
        def add(name: str, data: bytes | None = None, mode: int = 0o644,
                link: str | None = None) -> None:
            info = tarfile.TarInfo(name)
            if link is not None:
                info.type, info.linkname = tarfile.SYMTYPE, link
                tar.addfile(info)
            elif data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size, info.mode = len(data), mode
                tar.addfile(info, io.BytesIO(data))

        for folder in ("bin", "tmp", "dev", "proc", "sys", "etc", "dev/shm"):
            add(folder)
        add("bin/busybox", busybox.read_bytes(), 0o755)
        for applet in applets:
            if applet != "busybox":
                add(f"bin/{applet}", link="busybox")
        parts = prefix.split("/")
        for i in range(1, len(parts) + 1):
            add("/".join(parts[:i]))
        dist = f"{prefix}/vllm-{VERSION}.dist-info"
        add(dist)
        version = edit.get("version", VERSION.encode()).decode()
        add(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
            .encode())
        with tarfile.open(fileobj=io.BytesIO(archive)) as upstream:
            for member in upstream.getmembers():
                name = member.name
                data = upstream.extractfile(member).read() if member.isfile() else None
                if name in edit:
                    data = edit[name]
                if member.isdir():
                    add(f"{prefix}/{name.rstrip('/')}")
                elif data is not None:
                    add(f"{prefix}/{name}", data, member.mode & 0o755 | 0o644)
    return out


def import_standin(client, cache: Cache, tmp: Path, tag: str,
                   edit: dict[str, bytes]) -> StandIn:
    site = SERIES.image.site_packages
    tar = standin_tar(tmp, cache, site, edit)
    repository, _, name = tag.rpartition(":")
    client.api.import_image(src=str(tar), repository=repository, tag=name,
                            changes=["ENV PATH=/bin"])
    return StandIn(tag, site)


@pytest.fixture(scope="session")
def standin(docker_client, upstream_cache: UpstreamCache, tmp_path_factory) -> StandIn:
    """The pinned upstream vllm/ tree on busybox: no python, seconds to build."""
    return import_standin(docker_client, upstream_cache.cache,
                          tmp_path_factory.mktemp("standin"),
                          f"e2-standin:{VERSION}", {})


@pytest.fixture(scope="session")
def standin_other_release(docker_client, upstream_cache: UpstreamCache,
                          tmp_path_factory) -> StandIn:
    """Tagged as the pinned release, but vllm/envs.py (and the version) are another one."""
    repo = upstream_cache.repo_dir
    envs = subprocess.run(["git", "-C", str(repo), "show",
                           f"refs/tags/{SERIES.upstream.tag}:vllm/envs.py"],
                          capture_output=True, check=True).stdout
    return import_standin(docker_client, upstream_cache.cache,
                          tmp_path_factory.mktemp("standin-other"),
                          f"e2-standin-other:{VERSION}",
                          {"vllm/envs.py": envs + b"\n# changed in another release\n",
                           "version": b"0.30.9"})
