"""e2 image without an engine: rendering, drift, refusals before any daemon is asked."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from e2.dockerfile import (
    DOCKERFILE,
    OVERLAY_TAR,
    dockerfile_drift,
    render_dockerfile,
    reproducible_tar,
)
from e2.errors import E2Error
from e2.image import base_kind, check_base_ref, default_tag, pin_base, tag_version
from e2.imagebase import apt_mirror
from e2.overlay import synced_manifest
from e2.series import Project as SeriesProject

from .conftest import REPO_ROOT, SERIES, VERSION

NO_DAEMON = "unix:///nonexistent/e2-no-docker.sock"


def test_committed_dockerfile_is_what_the_series_renders():
    project = SeriesProject(REPO_ROOT)
    series = project.load()
    assert dockerfile_drift(project, series, synced_manifest(project, series)) == []


def test_dockerfile_carries_guard_overlay_switches_and_labels():
    manifest = json.loads((REPO_ROOT / "overlay" / "MANIFEST.json").read_text())
    text = render_dockerfile(SeriesProject(REPO_ROOT), SERIES, manifest)
    for entry in manifest["files"]:
        assert f'"{entry["sha256"]}  {entry["path"]}"' in text
        if entry["upstream_sha256"]:
            assert f'"{entry["upstream_sha256"]}  {entry["path"]}"' in text
    assert "ADD overlay.tar /" in text and "COPY" not in text
    for patch in SERIES.patches:
        assert f"ENV {patch.switch.name}={patch.switch.default}" in text
    digest = manifest["series_digest"]
    for label in ("org.opencontainers.image.base.name", "org.opencontainers.image.base.digest",
                  f'org.opencontainers.image.revision="{digest}"',
                  "org.opencontainers.image.source", "org.opencontainers.image.version",
                  f'org.vllm-e2.upstream.version="{VERSION}"', "org.vllm-e2.patches="):
        assert label in text
    assert text.startswith("# vLLM E2 engine image")


def test_render_writes_and_verify_names_a_drifted_dockerfile(project):
    (project.root / DOCKERFILE).unlink()
    assert "written" in project.e2("image", "render").stdout
    assert "up to date" in project.e2("image", "render").stdout
    with (project.root / DOCKERFILE).open("a") as handle:
        handle.write("RUN echo hand-edited\n")
    result = project.e2("verify", expect=1)
    assert "Dockerfile differs from what images/engine/Dockerfile.j2 renders" in result.stdout
    assert "run e2 image render" in result.stdout
    project.e2("image", "render")
    project.e2("verify")


def test_overlay_out_of_sync_is_refused(project):
    patch = next((project.root / "patches").glob("*.patch"))
    patch.write_text(patch.read_text() + "\n")  # the series digest changes
    for args in (("image", "render"), ("image", "build", "--base", f"x:{VERSION}")):
        result = project.e2(*args, expect=1)
        assert "out of sync" in result.stderr and "run e2 overlay" in result.stderr


def test_hand_edited_overlay_file_is_refused(project):
    target = project.root / "overlay" / "vllm" / "envs.py"
    target.write_text(target.read_text() + "# edited\n")
    result = project.e2("image", "build", expect=1)
    assert "overlay/vllm/envs.py does not match overlay/MANIFEST.json" in result.stderr


@pytest.mark.parametrize("ref", ["vllm/vllm-openai:v0.30.0", "vllm/vllm-openai:0.30.0-cu128",
                                 "registry:5000/vllm/vllm-openai:v0.32.1@sha256:" + "0" * 64])
def test_base_of_another_release_is_refused(project, ref, monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", NO_DAEMON)
    result = project.e2("image", "build", "--base", ref, expect=1)
    assert f"this overlay is for vLLM {VERSION} only" in result.stderr
    assert "no Docker daemon" not in result.stderr  # refused before any daemon is asked


def test_tag_versions():
    assert tag_version("vllm/vllm-openai:v0.31.0") == "0.31.0"
    assert tag_version("e2-base-cpu:0.31.0") == "0.31.0"
    assert tag_version("localhost:5000/vllm") is None
    assert tag_version("vllm/vllm-openai:latest") is None
    assert tag_version("vllm/vllm-openai@sha256:" + "a" * 64) is None
    check_base_ref("vllm/vllm-openai:latest", SERIES)
    with pytest.raises(E2Error):
        check_base_ref("vllm/vllm-openai:v0.30.0", SERIES)


def test_no_daemon_leaves_the_context_ready(project, monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", NO_DAEMON)
    result = project.e2("image", "build", expect=1)
    assert "warning: unpinned base" in result.stderr
    assert f"no Docker daemon reachable at {NO_DAEMON}" in result.stderr
    context = project.root / ".e2" / "image"
    assert f"build context is ready at {context}" in " ".join(result.stderr.split())
    assert (context / DOCKERFILE).read_text() == (project.root / DOCKERFILE).read_text()
    manifest = json.loads((project.root / "overlay" / "MANIFEST.json").read_text())
    with tarfile.open(context / OVERLAY_TAR) as tar:
        names = tar.getnames()
        for entry in manifest["files"]:
            member = f"{SERIES.image.site_packages.strip('/')}/{entry['path']}"
            assert hashlib.sha256(tar.extractfile(member).read()).hexdigest() == entry["sha256"]
        assert all(m.mtime == 0 and m.uid == 0 and m.gid == 0 for m in tar.getmembers())
    assert names == sorted(names) and "usr" in names


def test_switch_default_other_than_0_or_1_is_refused(project):
    series = project.root / "series.yaml"
    series.write_text(series.read_text().replace("default: '1'", "default: '2'", 1))
    result = project.e2("image", "render", expect=1)
    assert "series.yaml:" in result.stderr and "switch.default" in result.stderr


def test_reproducible_tar_bytes_depend_on_content_only(tmp_path: Path):
    files = {"a/b/c.py": b"x = 1\n", "a/d.py": b"y = 2\n"}
    reproducible_tar(tmp_path / "one.tar", files)
    reproducible_tar(tmp_path / "two.tar", dict(reversed(list(files.items()))))
    assert (tmp_path / "one.tar").read_bytes() == (tmp_path / "two.tar").read_bytes()
    with tarfile.open(fileobj=io.BytesIO((tmp_path / "one.tar").read_bytes())) as tar:
        assert tar.getnames() == ["a", "a/b", "a/b/c.py", "a/d.py"]
        assert {m.name: m.mode for m in tar.getmembers()} == {
            "a": 0o755, "a/b": 0o755, "a/b/c.py": 0o644, "a/d.py": 0o644}


def test_apt_mirror_comes_from_the_apt_sources(tmp_path: Path):
    sources = tmp_path / "sources.list.d"
    sources.mkdir()
    (sources / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n\n"
        "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm\n")
    assert apt_mirror((sources,)) == "http://mirror.example/debian"
    legacy = tmp_path / "sources.list"
    legacy.write_text("deb [arch=amd64] http://old.example/debian bookworm main\n")
    assert apt_mirror((tmp_path / "none", legacy)) == "http://old.example/debian"
    with pytest.raises(E2Error, match="no Debian mirror"):
        apt_mirror((tmp_path / "none",))


def test_pin_writes_the_digest_and_keeps_every_other_byte(project):
    series_file, dockerfile = project.root / "series.yaml", project.root / DOCKERFILE
    before = series_file.read_text().splitlines()
    digest = "sha256:" + "ab" * 32
    pin_base(SeriesProject(project.root), digest)
    after = series_file.read_text().splitlines()
    changed = [(old, new) for old, new in zip(before, after) if old != new]
    assert len(before) == len(after) and changed == [("  digest: null", f"  digest: {digest}")]
    assert f"ARG BASE={SERIES.image.base}@{digest}" in dockerfile.read_text()
    assert f"ARG BASE_DIGEST={digest}" in dockerfile.read_text()
    project.e2("verify")  # series.yaml and the Dockerfile agree


def test_pin_refuses_what_is_not_a_digest(project):
    before = (project.root / "series.yaml").read_bytes()
    with pytest.raises(E2Error, match="not a digest"):
        pin_base(SeriesProject(project.root), "latest")
    assert (project.root / "series.yaml").read_bytes() == before


def test_cpu_base_tags_cannot_pass_for_the_gpu_image():
    digest = "0123456789ab" + "0" * 52
    assert default_tag(SERIES, digest) == f"vllm-e2:{VERSION}-0123456789ab"
    assert default_tag(SERIES, digest, "cpu") == f"vllm-e2:{VERSION}-0123456789ab-cpu"
    assert base_kind(SERIES.image.base, {}, SERIES) == "cuda"
    assert base_kind(f"{SERIES.image.base.split(':')[0]}@sha256:" + "1" * 64, {}, SERIES) == "cuda"
    assert base_kind(f"e2-base-cpu:{VERSION}", {"org.vllm-e2.base-recipe": "x"}, SERIES) == "cpu"
    assert base_kind(f"e2-standin:{VERSION}", {}, SERIES) == "other"
