"""e2 image build on a real engine, with the python-less busybox stand-in base.

The stand-in has no python3, so the Dockerfile's byte-compile step skips (and
says so); everything else (guard, overlay layer, checks, ENV, labels) runs
exactly as on a real base.
"""

from __future__ import annotations

import json
import shutil

import pytest

from e2.container import run_to_end

from .conftest import REPO_ROOT, SERIES, VERSION

MANIFEST = json.loads((REPO_ROOT / "overlay" / "MANIFEST.json").read_text())


def _run(client, image: str, script: str) -> str:
    return run_to_end(client, image, ["sh", "-c", script], "the check", stderr=True)


def test_image_on_the_standin_carries_overlay_switches_and_labels(project, standin,
                                                                  docker_client):
    tag = "e2-test:standin"
    result = project.e2("image", "build", "--base", standin.tag, "--tag", tag)
    assert "E2: no python3 in the base, byte-compile skipped" in result.stderr
    assert "unpinned base" not in result.stderr  # an explicit --base is the user's pin
    image = docker_client.images.get(tag)
    site = standin.site_packages
    sums = _run(docker_client, tag, f"cd {site} && sha256sum "
                + " ".join(f["path"] for f in MANIFEST["files"]))
    got = {line.split()[1]: line.split()[0] for line in sums.splitlines()}
    assert got == {f["path"]: f["sha256"] for f in MANIFEST["files"]}
    if MANIFEST["deleted"]:
        gone = _run(docker_client, tag, f"cd {site} && for f in "
                    + " ".join(d["path"] for d in MANIFEST["deleted"])
                    + '; do [ -e "$f" ] && echo "present: $f"; done; true')
        assert gone == ""
    env = dict(e.split("=", 1) for e in image.attrs["Config"]["Env"])
    for patch in SERIES.patches:
        assert env[patch.switch.name] == patch.switch.default
    assert "PYTHONDONTWRITEBYTECODE" not in env and "TMPDIR" not in env
    labels = image.attrs["Config"]["Labels"]
    digest = MANIFEST["series_digest"]
    base = docker_client.images.get(standin.tag)
    assert labels["org.opencontainers.image.base.name"] == standin.tag
    assert labels["org.opencontainers.image.base.digest"] == base.id
    assert labels["org.opencontainers.image.revision"] == digest
    assert labels["org.opencontainers.image.version"] == f"{VERSION}-{digest[:12]}"
    assert labels["org.vllm-e2.upstream.version"] == VERSION
    assert labels["org.vllm-e2.patches"] == ",".join(p.id for p in SERIES.patches)
    assert labels["org.vllm-e2.site-packages"] == site
    assert labels["org.vllm-e2.base-kind"] == "other"  # neither the official nor the CPU base
    # The guard and the check wrote nothing (no python3 here to compile): the
    # engine records them as empty, and the overlay is the only new layer.
    base_layers = base.attrs["RootFS"]["Layers"]
    assert image.attrs["RootFS"]["Layers"][:-1] == base_layers
    assert f"overlay layer {image.attrs['RootFS']['Layers'][-1]}" in result.stdout


def test_default_tag_names_version_and_series(project, standin, docker_client):
    import docker

    tag = f"vllm-e2:{VERSION}-{MANIFEST['series_digest'][:12]}"
    try:
        docker_client.images.get(tag)
    except docker.errors.ImageNotFound:
        pass
    else:  # on the user's own engine (DOCKER_HOST) that name is their real image
        pytest.skip(f"{tag} exists on this engine and is not the test's to overwrite")
    try:
        result = project.e2("image", "build", "--base", standin.tag)
        assert f"built {tag} " in result.stdout
        docker_client.images.get(tag)
        # no entrypoint, not the CUDA base: vllm serve as the command, no --gpus
        [line] = [line.strip() for line in result.stdout.splitlines() if " docker run " in line]
        assert line == ('docker run --rm --network host --shm-size 1g -v "$MODEL":/model:ro '
                        f"{tag} vllm serve /model")  # DOCKER_HOST is the caller's: no prefix
    finally:  # the test removes what it made
        try:
            docker_client.images.remove(tag)
        except docker.errors.ImageNotFound:
            pass


def test_base_of_another_release_is_refused_by_the_guard(project, standin_other_release):
    result = project.e2("image", "build", "--base", standin_other_release.tag,
                        "--tag", "e2-test:other", expect=1)
    message = " ".join(result.stderr.split())
    assert f"the base was refused ({standin_other_release.tag}):" in message
    assert "E2 guard: vllm/envs.py differs from vLLM 0.31.0" in message
    assert f"this overlay is for vLLM {VERSION}, the base has vLLM 0.30.9" in message
    assert "core.py differs" not in message  # names exactly the file that differs


def test_overlay_layer_diff_id_is_the_same_across_builds(project, standin, docker_client):
    layers = []
    for attempt in range(2):
        shutil.rmtree(project.root / ".e2", ignore_errors=True)  # a fresh context each time
        result = project.e2("image", "build", "--base", standin.tag, "--no-cache",
                            "--tag", f"e2-test:repro{attempt}")
        assert "Using cache" not in result.stderr
        layers.append(_overlay_line(result.stdout))
    assert layers[0] == layers[1]
    assert layers[0].startswith("sha256:")


def _overlay_line(stdout: str) -> str:
    return next(line.split()[-1] for line in stdout.splitlines()
                if line.startswith("overlay layer"))


def test_explicit_base_that_cannot_be_pulled_is_not_replaced(project, docker_client):
    result = project.e2("image", "build", "--base", f"e2-absent/base:{VERSION}", expect=1)
    message = " ".join(result.stderr.split())
    assert f"cannot pull the base e2-absent/base:{VERSION}" in message
    assert f"leave out --base: make image then builds on the local CPU base " \
           f"e2-base-cpu:{VERSION}" in message
    assert "building on the CPU base" not in message  # an explicit base is never swapped


def test_no_fallback_refuses_an_unpullable_pinned_base_in_one_line(project, docker_client):
    series = project.root / "series.yaml"
    series.write_text(series.read_text().replace(f"base: {SERIES.image.base}",
                                                 f"base: e2-absent/vllm-openai:v{VERSION}"))
    result = project.e2("image", "build", "--no-fallback", expect=1)
    errors = [line for line in result.stderr.splitlines() if not line.startswith("warning:")]
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith(f"error: cannot pull the base e2-absent/vllm-openai:v{VERSION} (")
    assert errors[0].endswith("--no-fallback: not building on the CPU base")


def test_pin_without_a_registry_refuses_in_one_line(project, docker_client):
    series = project.root / "series.yaml"
    series.write_text(series.read_text().replace(f"base: {SERIES.image.base}",
                                                 f"base: e2-absent/vllm-openai:v{VERSION}"))
    before = series.read_bytes(), (project.root / "Dockerfile").read_bytes()
    result = project.e2("image", "pin", expect=1)
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"error: cannot pin e2-absent/vllm-openai:v{VERSION}: no "
                                    "digest from its registry (")
    assert (series.read_bytes(), (project.root / "Dockerfile").read_bytes()) == before
