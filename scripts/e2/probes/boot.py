"""The boot mode of the capacity probe: start the engine, read its KV line, stop it.

The engine boots on the model folder with dummy weights (config.json is all it
needs) and the probe's budget as ``--kv-cache-memory-bytes``, and logs
``KV cache size: N tokens`` once the KV cache is allocated; nothing is served.
Dummy weights still take the model's full size in memory, so on a CPU host
only the small models of the zoo boot.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from e2.errors import E2Error

if TYPE_CHECKING:
    from docker import DockerClient

    from e2.probes.capacity import Settings

KV_LINE = re.compile(r"(?:\w+ )?KV cache size: ([\d,]+) tokens[^\n]*")
GIB = 1 << 30
BOOT_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def engine_flags(model: Path, served_as: str, settings: Settings) -> list[str]:
    """vllm serve flags for a config-only boot of ``model`` (seen by the engine as served_as)."""
    flags = [served_as, "--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager",
             "--max-model-len", str(settings.max_model_len),
             "--max-num-seqs", str(settings.max_num_seqs),
             "--kv-cache-memory-bytes", str(int(settings.budget_gib * GIB)),
             "--tensor-parallel-size", str(settings.tp)]
    if "vision_config" in json.loads((model / "config.json").read_text()):
        # the capacity question is the language model's; the vision processor would
        # also need a tokenizer, which a config-only folder does not have
        flags.append("--language-model-only")
    if settings.kv_dtype != "auto":
        flags += ["--kv-cache-dtype", settings.kv_dtype]
    if settings.mamba_cache_mode == "align":
        flags += ["--enable-prefix-caching", "--mamba-cache-mode", "align"]
    return flags


def boot_command(python: Path, model: Path, settings: Settings) -> list[str]:
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model",
            *engine_flags(model, str(model), settings),
            "--host", "127.0.0.1", "--port", str(_free_port())]


def _found(text: str, started: float) -> dict | None:
    match = KV_LINE.search(text)
    if match is None:
        return None
    return {"kv_line": match.group(0).strip(), "tokens": int(match.group(1).replace(",", "")),
            "seconds": round(time.monotonic() - started, 1)}


def _wait_for_kv_line(read_log: Callable[[], str], exited: Callable[[], bool], engine: str,
                      model: Path, timeout_s: float) -> dict:
    """Poll an engine's log until its KV cache size line, its exit, or the timeout."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        text = read_log()
        found = _found(text, started)
        if found:
            return found
        if exited():
            tail = "\n".join(text.splitlines()[-15:])
            raise E2Error(f"{engine} exited before logging its KV cache size for "
                          f"{model.name}:\n{tail}")
        time.sleep(1)
    raise E2Error(f"no KV cache size line from {engine} for {model.name} within "
                  f"{timeout_s:.0f} s")


def read_boot_line_docker(client: DockerClient, image: str, model: Path, settings: Settings,
                          gpus: str | None, timeout_s: float = BOOT_TIMEOUT_S) -> dict:
    """The same boot in a container of ``image`` on the engine DOCKER_HOST names.

    The model folder travels into the container as an archive (a remote host
    cannot see this machine's paths); ``gpus`` is 'all' or comma-separated ids.
    """
    import io
    import tarfile

    import docker

    requests = None
    if gpus:
        ids = None if gpus == "all" else gpus.split(",")
        requests = [docker.types.DeviceRequest(count=-1 if ids is None else None,
                                               device_ids=ids, capabilities=[["gpu"]])]
    # an explicit entrypoint: vllm/vllm-openai's own is `vllm serve`, local bases have none
    container = client.containers.create(
        image, ["--model", *engine_flags(model, "/e2-model", settings)],
        entrypoint=["python3", "-m", "vllm.entrypoints.openai.api_server"],
        environment={"HF_HUB_OFFLINE": "1"}, network_mode="none", shm_size="1g",
        device_requests=requests, labels={"org.vllm-e2.probe": "capacity-boot"})
    try:
        archive = io.BytesIO()
        with tarfile.open(fileobj=archive, mode="w") as tar:
            tar.add(model, arcname="e2-model")
        container.put_archive("/", archive.getvalue())
        container.start()

        def exited() -> bool:
            container.reload()
            return container.status == "exited"

        return _wait_for_kv_line(lambda: container.logs().decode(errors="replace"), exited,
                                 f"the engine in {image}", model, timeout_s)
    finally:
        container.remove(force=True)


def read_boot_line(python: Path, model: Path, settings: Settings, env: dict[str, str],
                   timeout_s: float = BOOT_TIMEOUT_S) -> dict:
    """Boot once; the KV line and the tokens in it, or an E2Error with the log's tail."""
    if settings.tp != 1:
        raise E2Error("--boot runs one engine process on this host: use --tp 1 "
                      "(or --docker on the GPU host)")
    env = {k: v for k, v in env.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # would override
    with tempfile.NamedTemporaryFile("w+", prefix="e2-boot-", suffix=".log") as log:
        process = subprocess.Popen(boot_command(python, model, settings), env=env,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return _wait_for_kv_line(lambda: Path(log.name).read_text(errors="replace"),
                                     lambda: process.poll() is not None, "the engine", model,
                                     timeout_s)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
