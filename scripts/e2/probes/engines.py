"""Where the serve probe's engines run: this host's test env, or containers of the images.

A runner's ``start(side, mode)`` is a context manager yielding an ``Engine``,
healthy, stopped and cleaned up when the block ends. Locally each engine is
``vllm serve``'s API server from the e2 env's venv in its own process group
(E2: the same python with the e2 view first on PYTHONPATH). With Docker it is
a container of the stock or E2 image on DOCKER_HOST, with no network: the
probe talks to it by ``docker exec`` of the stdlib client, so a remote host
needs nothing but its Docker daemon.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from e2.container import LABEL_PROBE, Container
from e2.dockerhost import pull_if_missing
from e2.errors import E2Error
from e2.probes.runtime import STUBS
from e2.probes.serve_client import client_source, http, post_all
from e2.probes.serve_gate import GATE_MODEL, GATE_MODES, gate_engine_args, has_vision
from e2.probes.serve_model import ensure_model_volume, volume_name
from e2.probes.serve_settings import (
    ALIGN_BATCHED_TOKENS,
    ALIGN_KV_CACHE_BYTES,
    ALIGN_MAX_MODEL_LEN,
    BOOT_TIMEOUT,
    GEOMETRY,
    KV_CACHE_BYTES,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    QUEUE_GAP_S,
    REQUEST_TIMEOUT,
    SEED,
    SERVED_NAME,
)
from e2.probes.tiny_model import GEOMETRIES
from e2.processes import ProcessGroup, free_port, started

if TYPE_CHECKING:
    from docker import DockerClient

API_SERVER = ["-m", "vllm.entrypoints.openai.api_server"]


def engine_args(model: str, port: int, mode: str, tp: int, kv_bytes: int = KV_CACHE_BYTES,
                prefix_caching: bool = True, eager: bool = True) -> list[str]:
    """``vllm serve``'s arguments for a mode. ``eager`` False lets the engine
    capture CUDA graphs (the align mode on a GPU: one run of the probe's engines
    as they are served by default)."""
    align = mode == "align"
    args = ["--model", model, "--served-model-name", SERVED_NAME, "--skip-tokenizer-init",
            "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", str(ALIGN_MAX_MODEL_LEN if align else MAX_MODEL_LEN),
            "--max-num-seqs", str(MAX_NUM_SEQS),
            "--kv-cache-memory-bytes", str(ALIGN_KV_CACHE_BYTES if align else kv_bytes),
            "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
            "--seed", str(SEED),
            "--async-scheduling" if mode == "async" else "--no-async-scheduling"]
    if align:
        args += ["--max-num-batched-tokens", str(ALIGN_BATCHED_TOKENS)]
    if eager:
        args += ["--enforce-eager"]
    if tp > 1:
        args += ["--tensor-parallel-size", str(tp)]
    return args


def engine_env() -> dict[str, str]:
    # VLLM_SERVER_DEV_MODE: /server_info, the resolved config. VLLM_CPU_KVCACHE_SPACE
    # is whole GiB (300k tokens here) and would override --kv-cache-memory-bytes.
    return {"HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1"}


class Engine(Protocol):
    """A started server: the probe's three ways to talk to it, and its boot time."""

    side: str
    mode: str
    prefix_caching: bool
    boot_s: float

    def get(self, path: str) -> str: ...

    def post_all(self, bodies: list[dict], hold: float = 0.0, poll: float = 0.0,
                 gap: float = QUEUE_GAP_S) -> dict:
        """serve_client.post_all's {"answers", "running"}, posted beside the engine."""
        ...

    def log(self) -> str: ...


class Runner(Protocol):
    """Where the engines run: LocalRunner (this host's venv) or DockerRunner (the images)."""

    kind: str
    on_cpu: bool
    kv_bytes: int

    def start(self, side: str, mode: str,
              prefix_caching: bool = True) -> AbstractContextManager[Engine]: ...

    def device(self, engine: Engine) -> str | None: ...

    def describe(self) -> dict: ...


def runs_eager(mode: str, on_cpu: bool) -> bool:
    """Every engine runs eager (--enforce-eager) but the align and gate modes' on a
    GPU, which capture CUDA graphs as a served engine does by default."""
    return on_cpu or mode not in ("align", *GATE_MODES)


def mode_args(model: str, port: int, mode: str, tp: int, kv_bytes: int,
              prefix_caching: bool, eager: bool, vision: bool = True) -> list[str]:
    """A mode's ``vllm serve`` arguments: the gate's (serve_gate) or the tiny model's."""
    if mode in GATE_MODES:
        return gate_engine_args(model, port, mode, tp, prefix_caching, eager, vision=vision)
    return engine_args(model, port, mode, tp, kv_bytes, prefix_caching, eager)


def log_name(side: str, mode: str, prefix_caching: bool) -> str:
    return f"{side}-{mode}" + ("" if prefix_caching else "-no-prefix-caching")


# ---------------------------------------------------------------- local


class LocalEngine(Engine):
    def __init__(self, process: ProcessGroup, port: int, side: str, mode: str,
                 prefix_caching: bool = True):
        self.process, self.port, self.side, self.mode = process, port, side, mode
        self.prefix_caching = prefix_caching
        self.base = f"http://127.0.0.1:{port}"
        self.boot_s = 0.0

    def get(self, path: str) -> str:
        return http(self.base, path, timeout=60)

    def post_all(self, bodies: list[dict], hold: float = 0.0, poll: float = 0.0,
                 gap: float = QUEUE_GAP_S) -> dict:
        return post_all(self.base, bodies, REQUEST_TIMEOUT, hold, poll, gap)

    def log(self) -> str:
        return self.process.log()


class LocalRunner:
    """Engines from the e2 env's venv: stock, or E2 with the view first on PYTHONPATH."""

    kind = "local"
    on_cpu = True

    def __init__(self, python: Path, view: Path | None, run_env: dict[str, dict[str, str]],
                 models: dict[str, Path], logs: Path, tp: int = 1,
                 kv_bytes: int = KV_CACHE_BYTES):
        self.python, self.view, self.models, self.logs, self.tp = python, view, models, logs, tp
        self.run_env, self.kv_bytes = run_env, kv_bytes

    def command(self, side: str, mode: str, port: int, prefix_caching: bool = True) -> list[str]:
        model = GATE_MODEL if mode in GATE_MODES else self.models[GEOMETRY[mode]]
        return [str(self.python), *API_SERVER,
                *mode_args(str(model), port, mode, self.tp, self.kv_bytes, prefix_caching,
                           eager=True, vision=has_vision(model))]

    @contextlib.contextmanager
    def start(self, side: str, mode: str, prefix_caching: bool = True) -> Iterator[Engine]:
        port = free_port()
        env = {**self.run_env[side], **engine_env()}
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        if mode in GATE_MODES and not self._has_torchvision():
            # vLLM's Qwen3.5 module imports torchvision; the CPU env has none, and the
            # language model alone (--language-model-only) never calls into it
            env["PYTHONPATH"] = os.pathsep.join(
                [p for p in (env.get("PYTHONPATH"), str(STUBS)) if p])
        self.logs.mkdir(parents=True, exist_ok=True)
        command = self.command(side, mode, port, prefix_caching)
        with started(command, self.logs / f"{log_name(side, mode, prefix_caching)}.log", env,
                     cwd=self.logs, header=f"$ {shlex.join(command)}\n") as process:
            engine = LocalEngine(process, port, side, mode, prefix_caching)
            engine.boot_s = process.wait_http(f"{engine.base}/health", BOOT_TIMEOUT,
                                              f"{side} engine ({mode})")
            yield engine

    def _has_torchvision(self) -> bool:
        return any(self.python.parent.parent.glob("lib/python*/site-packages/torchvision"))

    def device(self, engine: Engine) -> str | None:
        return None  # the header names this host's CPU

    def describe(self) -> dict:
        return {"kind": self.kind, "python": str(self.python),
                "view": str(self.view) if self.view else None}


# ---------------------------------------------------------------- docker


class DockerEngine(Engine):
    PORT = 8000

    def __init__(self, box: Container, side: str, mode: str, prefix_caching: bool = True):
        self.box, self.side, self.mode = box, side, mode
        self.prefix_caching = prefix_caching
        self.base = f"http://127.0.0.1:{self.PORT}"
        self.boot_s = 0.0

    def _call(self, call: dict) -> dict:
        code, output = self.box.exec(["python3", "-c", client_source()],
                                     env={"E2_SERVE_CALL": json.dumps(call)})
        text = output.strip()
        try:
            answer = json.loads(text.splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            raise E2Error(f"the in-container client failed (exit {code}): "
                          f"{text[-1000:]}") from None
        if not answer["ok"]:
            raise E2Error(answer["error"])
        return answer

    def get(self, path: str) -> str:
        return self._call({"op": "get", "base": self.base, "path": path, "timeout": 60})["text"]

    def healthy(self) -> bool:
        import docker

        try:
            self.get("/health")
        except (E2Error, docker.errors.APIError):  # not listening yet; not running (exec)
            return False
        return True

    def post_all(self, bodies: list[dict], hold: float = 0.0, poll: float = 0.0,
                 gap: float = QUEUE_GAP_S) -> dict:
        answer = self._call({"op": "post", "base": self.base, "bodies": bodies,
                             "timeout": REQUEST_TIMEOUT, "hold": hold, "poll": poll,
                             "gap": gap})
        return {"answers": answer["answers"], "running": answer["running"]}

    def log(self) -> str:
        return self.box.logs()


class DockerRunner:
    """Engines in the stock and E2 images, through the Docker SDK (DOCKER_HOST honoured)."""

    kind = "docker"
    MOUNT = "/model"
    COMPILE_CACHE = "/e2-vllm-cache"

    def __init__(self, client: DockerClient, images: dict[str, str], gpus: str | None, tp: int,
                 logs: Path, seed: int = SEED, kv_bytes: int = KV_CACHE_BYTES):
        self.client, self.images, self.gpus, self.tp, self.logs = client, images, gpus, tp, logs
        self.kv_bytes, self.seed = kv_bytes, seed
        self.volumes = {geometry: volume_name(seed, geometry) for geometry in GEOMETRIES}
        self.on_cpu = not gpus
        info = client.info()
        self.host_info = {k: info.get(k) for k in ("Name", "NCPU", "OperatingSystem",
                                                   "ServerVersion")}
        self.image_ids = {side: self._image(ref) for side, ref in images.items()}

    def _image(self, ref: str) -> dict:
        image = pull_if_missing(self.client, ref)
        digests = image.attrs.get("RepoDigests") or []
        return {"ref": ref, "id": image.id, "digest": digests[0] if digests else None}

    def ensure_models(self, geometries: set[str]) -> list[str]:
        """The volumes holding the tiny models, written by the stock image's own transformers."""
        return [ensure_model_volume(self.client, self.images["stock"], self.MOUNT, self.seed,
                                    geometry) for geometry in sorted(geometries)]

    @contextlib.contextmanager
    def start(self, side: str, mode: str, prefix_caching: bool = True) -> Iterator[Engine]:
        command = mode_args(self.MOUNT, DockerEngine.PORT, mode, self.tp, self.kv_bytes,
                            prefix_caching, runs_eager(mode, self.on_cpu),
                            vision=has_vision(GATE_MODEL))
        env, volumes, files = engine_env(), {}, {}
        if mode in GATE_MODES:
            # the config folder is copied in; vLLM's compile cache is kept per side
            # in a volume, so a later run's engines skip torch.compile
            files = {self.MOUNT: GATE_MODEL}
            env["VLLM_CACHE_ROOT"] = self.COMPILE_CACHE
            volumes = {f"e2-gate-vllm-cache-{side}": {"bind": self.COMPILE_CACHE, "mode": "rw"}}
        else:
            volumes = {self.volumes[GEOMETRY[mode]]: {"bind": self.MOUNT, "mode": "ro"}}
        box = Container(self.client, self.images[side], command,
                        entrypoint=["python3", *API_SERVER], env=env, network="none",
                        shm_size="4g", gpus=self.gpus, labels={LABEL_PROBE: "serve"},
                        volumes=volumes, files=files)
        with box:
            engine = DockerEngine(box, side, mode, prefix_caching)
            try:
                booting = time.monotonic()
                box.wait_until(lambda: True if engine.healthy() else None, BOOT_TIMEOUT,
                               f"{side} engine ({mode})")
                engine.boot_s = round(time.monotonic() - booting, 1)
                yield engine
            finally:
                self.logs.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(OSError):  # never hides why the block ended
                    (self.logs / f"{log_name(side, mode, prefix_caching)}.log").write_text(
                        box.logs())

    def device(self, engine: Engine) -> str | None:
        if not self.gpus or not isinstance(engine, DockerEngine):
            return (f"CPU ({self.host_info['NCPU']} cores) on Docker host "
                    f"{self.host_info['Name']}")
        code, output = engine.box.exec(["nvidia-smi", "--query-gpu=name",
                                        "--format=csv,noheader"])
        names = output.strip().splitlines()
        return f"{len(names)}x {names[0]}" if code == 0 and names else "GPU"

    def describe(self) -> dict:
        return {"kind": self.kind, "docker_host": os.environ.get("DOCKER_HOST") or "default",
                "images": self.image_ids, "gpus": self.gpus, "tp": self.tp,
                "model_volumes": self.volumes, "docker_info": self.host_info}
