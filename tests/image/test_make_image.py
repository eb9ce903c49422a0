"""`make image` on a clean clone of this repository, with no Docker engine running
and no registry reachable: the README's first command alone must end with an
image that serves a model through the `docker run` line it prints.

The clone gets its own venv, the tests' cache (make's E2 passes --cache) and
its own private daemon: E2_DOCKERD_DIR points
at state this test owns (so the shared daemon is neither seen nor stopped),
which is stopped before and after the test, so `make image` always finds no
daemon running. That state is kept between runs, like the shared daemon's: the
first run fills it with the CPU base (imported from the root filesystem tar
`e2 image base --cpu` keeps, or built once when there is none); later runs
find the base there instead of importing and deleting 3.6 GB each time. The
E2 image the clone builds is removed at the end. The clone is of the
committed HEAD.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock

from e2.container import run_to_end
from e2.processes import free_port, poll_until

from .conftest import REPO_ROOT, SERIES, VERSION

pytestmark = pytest.mark.docker_e2e

PINNED = f"{SERIES.image.base}@{SERIES.image.digest}" if SERIES.image.digest \
    else SERIES.image.base
TINY_MODEL = (REPO_ROOT / "scripts/e2/probes/tiny_model.py").read_text()
WARM_LIMIT_S = 15


@dataclass
class Clone:
    root: Path
    env: dict[str, str]
    make_args: list[str]
    dockerd_dir: Path

    def make(self, *targets: str) -> tuple[subprocess.CompletedProcess, float]:
        started = time.monotonic()
        result = subprocess.run(["make", *targets, *self.make_args], cwd=self.root, env=self.env,
                                capture_output=True, text=True, timeout=1800)
        return result, time.monotonic() - started

    def client(self):
        import docker

        return docker.DockerClient(base_url=f"unix://{self.dockerd_dir}/docker.sock",
                                   timeout=900)


@dataclass
class Built:
    result: subprocess.CompletedProcess
    seconds: float
    tag: str
    run_line: str


def _default_socket_answers() -> bool:
    import docker

    try:
        docker.DockerClient(base_url="unix:///var/run/docker.sock", timeout=5).ping()
    except docker.errors.DockerException:
        return False
    return True


@pytest.fixture(scope="module")
def clone(tmp_path_factory, docker_client, cache) -> Clone:
    import docker

    if _default_socket_answers():
        pytest.skip("a Docker engine answers at the default socket: this test is for a "
                    "machine with none")
    try:
        docker_client.images.get_registry_data(PINNED)
        pytest.skip(f"a registry answers for {PINNED}: this test is for a machine without one")
    except docker.errors.DockerException:
        pass
    state = cache.root / "test-clean-clone"
    state.mkdir(parents=True, exist_ok=True)
    work = tmp_path_factory.mktemp("clean-clone")
    root = work / "repo"
    env = {k: v for k, v in os.environ.items() if k != "DOCKER_HOST"}
    env.update(E2_DOCKERD_DIR=str(state / "dockerd"), HF_HUB_OFFLINE="1")
    with FileLock(str(state / "lock")):  # one run at a time owns this daemon
        _stop_daemon(env)  # left running by a run that was killed
        subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO_ROOT), str(root)],
                       check=True)
        venv = work / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"
        made = Clone(root, env,
                     [f"PYTHON={venv / 'bin' / 'python'}",
                      f"E2={venv / 'bin' / 'e2'} --cache {cache.root}"],
                     state / "dockerd")
        try:
            yield made
        finally:
            _remove_e2_images(made)
            _stop_daemon(env)
            shutil.rmtree(work, ignore_errors=True)


def _stop_daemon(env: dict[str, str]) -> None:
    stopped = subprocess.run(["sh", str(REPO_ROOT / "ci" / "dockerd.sh"), "stop"], env=env,
                             capture_output=True, text=True)
    assert stopped.returncode == 0, stopped.stderr


def _remove_e2_images(clone: Clone) -> None:
    """What make image built here; the CPU base stays as this daemon's cache."""
    import docker

    try:
        client = clone.client()
        for image in client.images.list(name="vllm-e2"):
            client.images.remove(image.id, force=True)
        client.images.prune(filters={"dangling": True})
    except docker.errors.DockerException:
        pass  # no daemon came up: nothing was built


def _built(result: subprocess.CompletedProcess, seconds: float) -> Built:
    assert result.returncode == 0, f"make image failed\n{result.stdout}\n{result.stderr}"
    # the E2 image's line ("built TAG (ID) on BASE"), not the CPU base's ("built TAG in N s"),
    # which a cold cache prints first when it has to build the base
    tag = re.search(r"^built (\S+) \(\S+\) on ", result.stdout, re.M).group(1)
    [run_line] = [line.strip() for line in result.stdout.splitlines() if " docker run " in line]
    return Built(result, seconds, tag, run_line)


@pytest.fixture(scope="module")
def cold(clone: Clone) -> Built:
    result, seconds = clone.make("image")
    print(f"make image, cold: {seconds:.1f} s")
    return _built(result, seconds)


def test_cold_make_image_starts_the_daemon_and_falls_back_to_the_cpu_base(clone, cold):
    err = " ".join(cold.result.stderr.split())
    sock = f"unix://{clone.dockerd_dir}/docker.sock"
    assert f"started the project's private Docker daemon at {sock}" in err
    assert f"E2_DOCKERD_DIR={clone.dockerd_dir} sh ci/dockerd.sh stop" in err
    assert f"warning: cannot pull the base {PINNED} (" in err
    assert f"building on the CPU base e2-base-cpu:{VERSION} instead" in err
    digest = json.loads((clone.root / "overlay/MANIFEST.json").read_text())["series_digest"]
    assert cold.tag == f"vllm-e2:{VERSION}-{digest[:12]}-cpu"
    assert f"on e2-base-cpu:{VERSION} (cpu base)" in cold.result.stdout
    labels = clone.client().images.get(cold.tag).attrs["Config"]["Labels"]
    assert labels["org.vllm-e2.base-kind"] == "cpu"
    assert labels["org.opencontainers.image.base.name"] == f"e2-base-cpu:{VERSION}"
    # the daemon is left running for the docker run that follows
    assert cold.run_line.startswith(f"DOCKER_HOST={sock} docker run ")


def test_the_printed_docker_run_line_serves_the_tiny_hybrid_model(clone, cold, tmp_path):
    client = clone.client()
    model = tmp_path / "model"
    model.mkdir()
    run_to_end(client, cold.tag, ["python3", "-c", TINY_MODEL, "/model"],
               "writing the tiny model", volumes={str(model): {"bind": "/model", "mode": "rw"}})
    port = free_port()
    # The printed line, with the options this tokenizer-less, tiny model needs appended
    # (vllm serve's own flags) and a free port, since --network host shares the machine's.
    line = (f"{cold.run_line} --skip-tokenizer-init --max-model-len 128 --max-num-seqs 2 "
            f"--kv-cache-memory-bytes {2**30} --port {port}")
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        server = subprocess.Popen(["bash", "-c", line], env={**clone.env, "MODEL": str(model)},
                                  stdout=out, stderr=subprocess.STDOUT, cwd=clone.root)
    try:
        answer = _complete(server, port, log)
        assert answer["usage"]["completion_tokens"] >= 1
        digest12 = cold.tag.rsplit("-", 2)[-2]
        text = log.read_text(errors="replace")
        banner = f"vLLM E2 series {digest12} ({len(SERIES.patches)} patches on vLLM {VERSION})"
        assert banner in text, text[-3000:]
    finally:
        for container in client.containers.list(all=True, filters={"ancestor": cold.tag}):
            container.remove(force=True)
        server.kill()
        server.wait()


def test_warm_make_image_reuses_the_cached_base_quickly(clone, cold):
    warm, seconds = clone.make("image")
    built = _built(warm, seconds)
    print(f"make image, cold: {cold.seconds:.1f} s, warm: {seconds:.1f} s")
    assert built.tag == cold.tag and built.run_line == cold.run_line
    assert f"e2-base-cpu:{VERSION} is up to date" in warm.stdout
    assert "using the project's private Docker daemon" in warm.stderr
    assert seconds < WARM_LIMIT_S, f"warm make image took {seconds:.1f} s\n{warm.stderr}"


def test_strict_make_image_refuses_in_one_line(clone, cold):
    result, _ = clone.make("image", "STRICT=1")
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    e2_errors = [line for line in errors if line.startswith("error:")]
    assert len(e2_errors) == 1, result.stderr
    assert e2_errors[0].startswith(f"error: cannot pull the base {PINNED} (")
    assert "--no-fallback" in e2_errors[0] and "hint:" not in result.stderr
    assert f"building on the CPU base e2-base-cpu:{VERSION} instead" not in result.stderr


def _complete(server: subprocess.Popen, port: int, log: Path, deadline_s: float = 600) -> dict:
    body = json.dumps({"model": "/model", "prompt": [1, 17, 42, 99], "max_tokens": 4,
                       "temperature": 0}).encode()

    def answer() -> dict | None:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            pytest.fail(f"/v1/completions answered {exc.code}: {exc.read()[:2000]!r}\n"
                        + log.read_text(errors="replace")[-4000:])
        except OSError:  # not listening yet
            return None

    return poll_until(answer, lambda: server.poll() is not None, deadline_s,
                      f"docker run (127.0.0.1:{port})",
                      lambda: log.read_text(errors="replace"), interval_s=2)
