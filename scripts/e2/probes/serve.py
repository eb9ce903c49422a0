"""e2 probe serve: stock vs E2 engines serving the same tiny hybrid model, token for token.

A tiny random-weight Qwen3-Next-shaped model (3 Gated DeltaNet layers, 1 full
attention layer; ``tiny_model.py``) is written once, seeded, so both sides
serve the same weights. Each side runs ``vllm serve``'s API server on
127.0.0.1 only, prompts go in as token ids (``--skip-tokenizer-init``) to
/v1/completions, greedy, fixed ``max_tokens``, ``ignore_eos``.

The cases come from what the engine itself reports (its block size and KV
capacity, read from /metrics' ``vllm:cache_config_info`` and its log line
``KV cache size: N tokens``): prompts of block-1, block and block+1 tokens; two
requests sharing a long prefix (a prefix-cache hit, ``vllm:prefix_cache_hits``);
more concurrent requests than the KV pool holds (preemption and resume,
``vllm:num_preemptions``). Every case runs with sync scheduling and with
``--async-scheduling``; the resolved config (/server_info, dev mode) says
whether async scheduling is really on: vLLM's CPU platform turns it off, and
those cases are then reported as not run rather than passed.

Local: stock is the e2 env's venv python, E2 the same python with the e2
view first on PYTHONPATH. ``--docker``: the stock and E2 images through the
Docker SDK (DOCKER_HOST, ssh:// included); the model is written into a
Docker volume by the stock image, the engine runs with no network and the
probe talks to it with ``docker exec`` of the same stdlib client, so a remote
host needs nothing but its Docker daemon.

Output token ids are compared request by request; any mismatch, incomplete
request or case that did not exercise its path exits non-zero. Records: JSON
and Markdown (``serve-cpu`` or ``serve-docker``/``serve-gpu``) under
docs/validation/.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import inspect
import json
import math
import os
import platform
import random
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from rich.markup import escape
from rich.table import Table

from e2 import console
from e2.cache import Cache
from e2.errors import E2Error
from e2.fsio import write_atomic
from e2.series import Project, Series, series_digest

if TYPE_CHECKING:
    from docker import DockerClient
    from docker.models.containers import Container

    from e2.cli import GlobalOptions

HERE = Path(__file__).resolve().parent
WRITER = HERE / "tiny_model.py"
SEED = 0
SERVED_NAME = "tiny"
VOCAB = 512                        # tiny_model.CONFIG["vocab_size"]; ids 0-2 are special
MAX_MODEL_LEN = 1024
MAX_TOKENS = 16
KV_CACHE_BYTES = 12 << 20          # under 2k tokens for the tiny model: preemption
TP_SIZES = (1, 2, 4)               # what the tiny model's heads split into
MAX_NUM_SEQS = 32
BOOT_TIMEOUT = 600
HOLD_S = 2.0                       # a paused engine queues the concurrent requests this long
REQUEST_TIMEOUT = 600
MODES = ("sync", "async")
SIDES = ("stock", "e2")
CPU_ASYNC_SKIP = "not run on the CPU (the GPU host covers them)"
FORMAT = 1
_KV_LINE = re.compile(r"(\w+ KV cache size: [\d,]+ tokens, Maximum concurrency for [\d,]+ "
                      r"tokens per request: [\d.]+x)")
_KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")
_METRIC = re.compile(r"^(vllm:[a-z_]+)(\{[^}]*\})?\s+([0-9.eE+-]+)$", re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')
_E2_BANNER = re.compile(r"(vLLM E2 series \w+ .*)$", re.M)


# ---------------------------------------------------------------- the HTTP client
# Stdlib only: this source also runs inside an engine container (docker exec).


def http(base: str, path: str, body: dict | None = None, timeout: float = 600) -> str:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(base + path, data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read().decode()


def post_all(base: str, bodies: list, timeout: float = 600, hold: float = 0.0) -> list:
    """POST every body to /v1/completions at once (one thread each); answers in order.

    ``hold`` > 0: the engine is paused (dev mode's /pause?mode=keep queues new requests)
    while the bodies go in, a quarter second apart (so they queue in order), and resumed
    ``hold`` seconds after the last: its scheduler sees every request at once, in the
    same order, and runs the same schedule on every run.
    """
    import threading
    import time

    answers: list = [None] * len(bodies)

    def one(index: int) -> None:
        try:
            answers[index] = json.loads(http(base, "/v1/completions", bodies[index], timeout))
        except urllib.error.HTTPError as exc:
            answers[index] = {"error": f"HTTP {exc.code}: {exc.read()[:500]!r}"}
        except Exception as exc:  # noqa: BLE001 - reported per request
            answers[index] = {"error": f"{type(exc).__name__}: {exc}"}

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    if hold > 0:
        http(base, "/pause?mode=keep", {}, 60)
    try:
        for thread in threads:
            thread.start()
            if hold > 0:
                time.sleep(0.25)  # one at a time: the queue order is the prompts' order
        if hold > 0:
            time.sleep(hold)
    finally:
        if hold > 0:
            http(base, "/resume", {}, 60)
    for thread in threads:
        thread.join()
    return answers


def _client_main() -> None:
    """Inside a container: E2_SERVE_CALL holds {"op", "base", ...}; the answer goes to stdout."""
    call = json.loads(os.environ["E2_SERVE_CALL"])
    try:
        if call["op"] == "get":
            print(json.dumps({"ok": True, "text": http(call["base"], call["path"],
                                                       timeout=call["timeout"])}))
        else:
            print(json.dumps({"ok": True, "answers": post_all(
                call["base"], call["bodies"], call["timeout"], call["hold"])}))
    except Exception as exc:  # noqa: BLE001 - the probe decides what it means
        print(json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}))


def client_source() -> str:
    parts = ["from __future__ import annotations", "import json, os, urllib.error, "
             "urllib.request"]
    parts += [inspect.getsource(f) for f in (http, post_all, _client_main)]
    return "\n\n".join(parts) + "\n\n_client_main()\n"


# ---------------------------------------------------------------- the model


def model_key(seed: int) -> str:
    return hashlib.sha256(WRITER.read_bytes() + f"seed={seed}".encode()).hexdigest()[:12]


def ensure_model(python: Path, cache: Cache, seed: int = SEED) -> Path:
    """The tiny model in the cache, written once by ``python`` (torch + transformers)."""
    model = cache.models / f"tiny-qwen3-next-{model_key(seed)}"
    if (model / "e2-tiny-model.json").is_file():
        return model
    model.parent.mkdir(parents=True, exist_ok=True)
    with Cache.lock(model):
        if (model / "e2-tiny-model.json").is_file():
            return model
        with console.status("writing the tiny model"):
            done = subprocess.run([str(python), str(WRITER), str(model), "--seed", str(seed)],
                                  capture_output=True, text=True, timeout=600,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if done.returncode != 0:
            raise E2Error(f"writing the tiny model with {python} failed (exit "
                          f"{done.returncode}):\n{done.stderr.strip()[-2000:]}",
                          hint="that python needs torch and transformers (the e2 env has both)")
    for path in model.iterdir():
        path.chmod(0o644)  # safetensors writes 0600; a container user must read it
    return model


# ---------------------------------------------------------------- engines


def engine_args(model: str, port: int, mode: str, tp: int,
                kv_bytes: int = KV_CACHE_BYTES) -> list[str]:
    args = ["--model", model, "--served-model-name", SERVED_NAME, "--skip-tokenizer-init",
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-seqs", str(MAX_NUM_SEQS), "--kv-cache-memory-bytes", str(kv_bytes),
            "--enable-prefix-caching", "--enforce-eager", "--seed", str(SEED),
            "--async-scheduling" if mode == "async" else "--no-async-scheduling"]
    if tp > 1:
        args += ["--tensor-parallel-size", str(tp)]
    return args


def engine_env() -> dict[str, str]:
    # VLLM_SERVER_DEV_MODE: /server_info, the resolved config. VLLM_CPU_KVCACHE_SPACE
    # is whole GiB (300k tokens here) and would override --kv-cache-memory-bytes.
    return {"HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1"}


class Engine(Protocol):
    """A started server: the probe's three ways to talk to it."""

    side: str
    mode: str

    def get(self, path: str) -> str: ...

    def post_all(self, bodies: list[dict], hold: float = 0.0) -> list[dict]: ...

    def log(self) -> str: ...


class Runner(Protocol):
    """Where the engines run: LocalRunner (this host's venv) or DockerRunner (the images)."""

    kind: str
    on_cpu: bool
    kv_bytes: int

    def start(self, side: str, mode: str) -> AbstractContextManager[Engine]: ...

    def describe(self) -> dict: ...


class LocalEngine(Engine):
    def __init__(self, process: subprocess.Popen, port: int, log_path: Path, side: str,
                 mode: str):
        self.process, self.port, self.log_path = process, port, log_path
        self.side, self.mode = side, mode
        self.base = f"http://127.0.0.1:{port}"

    def get(self, path: str) -> str:
        return http(self.base, path, timeout=60)

    def post_all(self, bodies: list[dict], hold: float = 0.0) -> list[dict]:
        return post_all(self.base, bodies, REQUEST_TIMEOUT, hold)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalRunner:
    """Engines from the e2 env's venv: stock, or E2 with the view first on PYTHONPATH."""

    kind = "local"
    on_cpu = True

    def __init__(self, python: Path, view: Path | None, run_env: dict[str, dict[str, str]],
                 model: Path, logs: Path, tp: int = 1, kv_bytes: int = KV_CACHE_BYTES):
        self.python, self.view, self.model, self.logs, self.tp = python, view, model, logs, tp
        self.run_env, self.kv_bytes = run_env, kv_bytes

    def command(self, side: str, mode: str, port: int) -> list[str]:
        return [str(self.python), "-m", "vllm.entrypoints.openai.api_server",
                *engine_args(str(self.model), port, mode, self.tp, self.kv_bytes)]

    @contextlib.contextmanager
    def start(self, side: str, mode: str) -> Iterator[Engine]:
        port = free_port()
        env = {**self.run_env[side], **engine_env()}
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        self.logs.mkdir(parents=True, exist_ok=True)
        log_path = self.logs / f"{side}-{mode}.log"
        command = self.command(side, mode, port)
        with log_path.open("w") as handle:
            handle.write(f"$ {shlex.join(command)}\n")
            handle.flush()
            process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, env=env, cwd=self.logs,
                                       start_new_session=True)
        engine = LocalEngine(process, port, log_path, side, mode)
        try:
            _wait_healthy(engine, lambda: process.poll() is not None)
            yield engine
        finally:
            _stop_process(process)

    def describe(self) -> dict:
        return {"kind": self.kind, "python": str(self.python),
                "view": str(self.view) if self.view else None}


def _stop_process(process: subprocess.Popen) -> None:
    """SIGTERM the server's process group (API server, engine core, workers), then SIGKILL."""
    import signal

    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)  # workers left in the group


def _wait_healthy(engine: Engine, exited: Callable[[], bool],
                  deadline_s: float = BOOT_TIMEOUT) -> None:
    started = time.monotonic()
    while time.monotonic() - started < deadline_s:
        if exited():
            raise E2Error(f"{engine.side} engine ({engine.mode}) exited while starting:\n"
                          + _tail(engine.log()))
        try:
            engine.get("/health")
            engine.boot_s = round(time.monotonic() - started, 1)  # type: ignore[attr-defined]
            return
        except (OSError, E2Error):
            time.sleep(1)
    raise E2Error(f"{engine.side} engine ({engine.mode}) not healthy within {deadline_s:.0f}s:\n"
                  + _tail(engine.log()))


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.splitlines()[-lines:])


# ---------------------------------------------------------------- docker


class DockerEngine(Engine):
    PORT = 8000

    def __init__(self, container: Container, side: str, mode: str):
        self.container, self.side, self.mode = container, side, mode
        self.base = f"http://127.0.0.1:{self.PORT}"

    def _call(self, call: dict) -> dict:
        result = self.container.exec_run(["python3", "-c", client_source()],
                                         environment={"E2_SERVE_CALL": json.dumps(call)})
        text = result.output.decode(errors="replace").strip()
        try:
            answer = json.loads(text.splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            raise E2Error(f"the in-container client failed (exit {result.exit_code}): "
                          f"{text[-1000:]}") from None
        if not answer["ok"]:
            raise E2Error(answer["error"])
        return answer

    def get(self, path: str) -> str:
        return self._call({"op": "get", "base": self.base, "path": path, "timeout": 60})["text"]

    def post_all(self, bodies: list[dict], hold: float = 0.0) -> list[dict]:
        return self._call({"op": "post", "base": self.base, "bodies": bodies,
                           "timeout": REQUEST_TIMEOUT, "hold": hold})["answers"]

    def log(self) -> str:
        return self.container.logs().decode(errors="replace")


class DockerRunner:
    """Engines in the stock and E2 images, through the Docker SDK (DOCKER_HOST honoured)."""

    kind = "docker"
    MOUNT = "/model"

    def __init__(self, client: DockerClient, images: dict[str, str], gpus: str | None, tp: int,
                 logs: Path, seed: int = SEED, kv_bytes: int = KV_CACHE_BYTES):
        self.client, self.images, self.gpus, self.tp, self.logs = client, images, gpus, tp, logs
        self.kv_bytes = kv_bytes
        self.volume = f"e2-serve-model-{model_key(seed)}"
        self.seed = seed
        self.on_cpu = not gpus
        info = client.info()
        self.host_info = {k: info.get(k) for k in ("Name", "NCPU", "OperatingSystem",
                                                   "ServerVersion")}
        self.image_ids = {side: self._image(ref) for side, ref in images.items()}

    def _image(self, ref: str) -> dict:
        import docker

        try:
            image = self.client.images.get(ref)
        except docker.errors.ImageNotFound:
            try:
                with console.status(f"pulling {ref}"):
                    image = self.client.images.pull(ref)
            except docker.errors.DockerException as exc:
                raise E2Error(f"image {ref}: not on the Docker host and cannot be pulled: "
                              f"{exc}", hint="build it (e2 image build) or pull it there") from None
        digests = image.attrs.get("RepoDigests") or []
        return {"ref": ref, "id": image.id, "digest": digests[0] if digests else None}

    def _device_requests(self) -> list:
        import docker

        if not self.gpus:
            return []
        if self.gpus == "all":
            return [docker.types.DeviceRequest(count=-1, capabilities=[["gpu"]])]
        return [docker.types.DeviceRequest(device_ids=self.gpus.split(","),
                                           capabilities=[["gpu"]])]

    def ensure_model(self) -> str:
        """The volume holding the tiny model, written by the stock image's own transformers."""
        import docker

        with contextlib.suppress(docker.errors.NotFound):
            self.client.volumes.get(self.volume)
        self.client.volumes.create(self.volume, labels={"org.vllm-e2.probe": "serve"})
        script = WRITER.read_text() + "\n"
        code = (f"import os, sys\nif os.path.isfile('{self.MOUNT}/e2-tiny-model.json'):\n"
                f"    print('model present'); sys.exit(0)\n"
                "ns = {'__name__': 'tiny_model'}\n"
                "exec(compile(" + repr(script) + ", 'tiny_model.py', 'exec'), ns)\n"
                f"ns['write']('{self.MOUNT}', {self.seed})\n")
        with console.status(f"writing the tiny model into volume {self.volume}"):
            try:
                self.client.containers.run(
                    self.images["stock"], ["-c", code], entrypoint=["python3"], remove=True,
                    network_mode="none", environment={"HF_HUB_OFFLINE": "1"},
                    volumes={self.volume: {"bind": self.MOUNT, "mode": "rw"}})
            except docker.errors.ContainerError as exc:
                raise E2Error(f"writing the tiny model in {self.images['stock']} failed: "
                              f"{(exc.stderr or b'').decode(errors='replace')[-2000:]}") from None
        return self.volume

    @contextlib.contextmanager
    def start(self, side: str, mode: str) -> Iterator[Engine]:
        import docker

        command = engine_args(self.MOUNT, DockerEngine.PORT, mode, self.tp, self.kv_bytes)
        try:
            container = self.client.containers.run(
                self.images[side], command,
                entrypoint=["python3", "-m", "vllm.entrypoints.openai.api_server"],
                detach=True, network_mode="none", shm_size="4g", environment=engine_env(),
                device_requests=self._device_requests(),
                volumes={self.volume: {"bind": self.MOUNT, "mode": "ro"}},
                labels={"org.vllm-e2.probe": "serve"})
        except docker.errors.DockerException as exc:
            raise E2Error(f"starting {self.images[side]} failed: {exc}",
                          hint="--gpus needs the NVIDIA container toolkit on the Docker host"
                          if self.gpus else None) from None
        engine = DockerEngine(container, side, mode)

        def exited() -> bool:
            container.reload()
            return container.status in ("exited", "dead")

        try:
            _wait_healthy(engine, exited)
            yield engine
        finally:
            self.logs.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(Exception):
                (self.logs / f"{side}-{mode}.log").write_text(engine.log())
            with contextlib.suppress(docker.errors.DockerException):
                container.remove(force=True)

    def device(self, engine: Engine) -> str:
        if not self.gpus or not isinstance(engine, DockerEngine):
            return (f"CPU ({self.host_info['NCPU']} cores) on Docker host "
                    f"{self.host_info['Name']}")
        result = engine.container.exec_run(["nvidia-smi", "--query-gpu=name",
                                            "--format=csv,noheader"])
        names = result.output.decode(errors="replace").strip().splitlines()
        return f"{len(names)}x {names[0]}" if result.exit_code == 0 and names else "GPU"

    def describe(self) -> dict:
        return {"kind": self.kind, "docker_host": os.environ.get("DOCKER_HOST") or "default",
                "images": self.image_ids, "gpus": self.gpus, "tp": self.tp,
                "model_volume": self.volume, "docker_info": self.host_info}


# ---------------------------------------------------------------- what the engine reports


def metrics(engine: Engine) -> dict[str, float]:
    """Counters summed over engines, and cache_config_info's labels as ``info.<label>``."""
    text = engine.get("/metrics")
    values: dict[str, float] = {}
    for name, labels, value in _METRIC.findall(text):
        if name == "vllm:cache_config_info":
            for key, label in _LABEL.findall(labels):
                values[f"info.{key}"] = label  # the label's text, not a number
            continue
        values[name] = values.get(name, 0.0) + float(value)
    return values


@dataclass
class EngineInfo:
    side: str
    mode: str
    boot_s: float
    block_size: int
    num_blocks: int | None
    kv_capacity_tokens: int
    kv_line: str
    async_requested: bool
    async_resolved: bool | None
    enable_prefix_caching: bool | None
    mamba_cache_mode: str | None
    e2_banner: str | None               # E2's boot report line: present on E2 only


def inspect_engine(engine: Engine) -> EngineInfo:
    log = engine.log()
    line = _KV_LINE.search(log)
    found = metrics(engine)
    if line is None:
        raise E2Error(f"{engine.side} engine ({engine.mode}): no 'KV cache size' line in its "
                      "log", hint="the engine's log format changed: update _KV_LINE")
    tokens_found = _KV_TOKENS.search(line.group(1))
    assert tokens_found is not None  # _KV_LINE's group holds "KV cache size: N tokens"
    tokens = int(tokens_found.group(1).replace(",", ""))
    block = found.get("info.block_size")
    if block is None:
        raise E2Error(f"{engine.side} engine ({engine.mode}): no vllm:cache_config_info "
                      "block_size in /metrics")
    try:
        config = json.loads(engine.get("/server_info?config_format=json"))["vllm_config"]
        resolved = config["scheduler_config"].get("async_scheduling")
        cache = config["cache_config"]
    except (OSError, E2Error, KeyError, json.JSONDecodeError) as exc:
        console.warn(f"{engine.side} ({engine.mode}): no resolved config from /server_info "
                     f"({exc}); async scheduling state unknown")
        resolved, cache = None, {}
    blocks = found.get("info.num_gpu_blocks")
    banner = _E2_BANNER.search(log)
    return EngineInfo(
        engine.side, engine.mode, getattr(engine, "boot_s", 0.0), int(block),
        int(blocks) if blocks not in (None, "None") else None, tokens, line.group(1),
        engine.mode == "async", resolved, cache.get("enable_prefix_caching"),
        cache.get("mamba_cache_mode"), banner.group(1) if banner else None)


# ---------------------------------------------------------------- cases


@dataclass
class Case:
    name: str
    what: str
    prompts: list[list[int]]
    max_tokens: int
    concurrent: bool = False
    expect: str | None = None           # prefix_hits | preemptions: the path it must take


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def edge_blocks(block: int) -> list[int]:
    """The block sizes whose edges the cases probe: the engine's, and the kernel
    block sizes below it (powers of two from 256 down to 16), where E2's
    natural attention block lies (16 with FlashAttention, 32 on the CPU)."""
    return [block] + [size for size in (256, 128, 64, 32, 16) if size < block]


def build_cases(block: int, capacity: int, max_model_len: int = MAX_MODEL_LEN,
                seed: int = SEED) -> list[Case]:
    """The cases for a stock engine with this block size and KV capacity (tokens);
    both sides run the same ones."""
    rng = random.Random(seed)
    cases = []
    for edge in edge_blocks(block):
        name = "len-block" if edge == block else f"len-{edge}"
        cases += [Case(f"{name}{d:+d}".replace("+0", ""), f"one prompt of {edge + d} tokens "
                       f"(block {edge}{d:+d})".replace("+0)", ")"), [_tokens(rng, edge + d)],
                       MAX_TOKENS) for d in (-1, 0, 1)]
    prefix_len = min(3 * block, max_model_len // 2)
    prefix = _tokens(rng, prefix_len)
    cases.append(Case("shared-prefix", f"two requests, one after the other, sharing a "
                      f"{prefix_len}-token prefix", [prefix + _tokens(rng, 7),
                                                     prefix + _tokens(rng, 9)],
                      MAX_TOKENS, expect="prefix_hits"))
    # Outputs of half a block: stock and E2 batch these requests differently (E2
    # preempts less), and a long bf16 greedy decode can flip a near-tie token
    # with the batch it ran in.
    prompt = min(block, max_model_len // 4)
    out = min(block // 2, max_model_len // 2)
    # Four times the pool, so stock preempts and resumes.
    count = min(MAX_NUM_SEQS, max(4, math.ceil(4 * capacity / (prompt + out)) + 1))
    cases.append(Case("oversubscribed", f"{count} concurrent requests of {prompt}+{out} tokens "
                      f"against a {capacity}-token KV pool", [_tokens(rng, prompt)
                                                              for _ in range(count)],
                      out, concurrent=True, expect="preemptions"))
    return cases


def _body(prompt: list[int] | list[list[int]], max_tokens: int) -> dict:
    return {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}


def run_case(engine: Engine, case: Case) -> dict:
    before = metrics(engine)
    started = time.monotonic()
    if case.concurrent:
        # Concurrent requests, held at a paused engine until all are queued: otherwise
        # they land in the engine's steps by timing, the schedule (and with it the
        # preemptions) differs from run to run, and bf16 numerics follow the batch.
        answers = engine.post_all([_body(p, case.max_tokens) for p in case.prompts],
                                  hold=HOLD_S)
        pairs = [(a, (a.get("choices") or [{}])[0]) for a in answers]
    else:
        pairs = []
        for prompt in case.prompts:
            answer = engine.post_all([_body(prompt, case.max_tokens)])[0]
            pairs.append((answer, (answer.get("choices") or [{}])[0]))
    seconds = round(time.monotonic() - started, 2)
    after = metrics(engine)
    requests = []
    for prompt, (answer, choice) in zip(case.prompts, pairs):
        ids = choice.get("token_ids")
        requests.append({"prompt_tokens": len(prompt), "token_ids": ids,
                         "finish_reason": choice.get("finish_reason"),
                         "error": answer.get("error") or (None if ids is not None
                                                          else "no token_ids in the answer")})

    def delta(name: str) -> int:
        return int(after.get(name, 0.0) - before.get(name, 0.0))

    return {"case": case.name, "seconds": seconds, "requests": requests,
            "prefix_cache_hits": delta("vllm:prefix_cache_hits_total"),
            "prefix_cache_queries": delta("vllm:prefix_cache_queries_total"),
            "preemptions": delta("vllm:num_preemptions_total")}


def complete(request: dict, max_tokens: int) -> bool:
    ids = request.get("token_ids")
    return request.get("error") is None and isinstance(ids, list) and len(ids) == max_tokens


# ---------------------------------------------------------------- a side


def run_side(runner: Runner, side: str, plan: dict[str, int],
             modes: tuple[str, ...] = MODES) -> dict:
    """The modes asked for (both by default) on one side: its engines' reports and
    each case's outputs.

    ``plan`` holds the block size and KV capacity the cases are built for: the
    first engine started fills it, so both sides run the same prompts even
    where E2's blocks differ from stock's."""
    result: dict = {"modes": {}}
    for mode in modes:
        with contextlib.ExitStack() as stack:
            with console.status(f"{side}: starting the engine ({mode} scheduling)"):
                engine = stack.enter_context(runner.start(side, mode))
            info = inspect_engine(engine)
            console.info(f"{side} {mode}: healthy in {info.boot_s:.0f}s; block {info.block_size}"
                         f", {info.kv_line}; async scheduling resolved: {info.async_resolved}")
            entry: dict = {"engine": asdict(info)}
            if "device" not in result and hasattr(runner, "device"):
                result["device"] = runner.device(engine)
            if mode == "async" and info.async_resolved is not True:
                if info.async_resolved is None:
                    why = "not run: the engine's resolved config could not be read"
                elif runner.on_cpu:
                    why = CPU_ASYNC_SKIP
                else:
                    why = "not run: the engine turned async scheduling off"
                entry["skipped"] = why
                console.info(f"{side} async: the engine resolved async_scheduling="
                             f"{info.async_resolved}; async cases {why}")
            else:
                plan.setdefault("block", info.block_size)
                plan.setdefault("capacity", info.kv_capacity_tokens)
                cases = build_cases(plan["block"], plan["capacity"])
                entry["cases"] = {}
                for case in cases:
                    with console.status(f"{side} {mode}: {case.name}"):
                        entry["cases"][case.name] = {**run_case(engine, case),
                                                     "what": case.what,
                                                     "max_tokens": case.max_tokens,
                                                     "expect": case.expect}
            result["modes"][mode] = entry
    return result


# ---------------------------------------------------------------- comparison


@dataclass
class Row:
    mode: str
    case: str
    requests: int
    complete: dict[str, int]                    # side -> complete requests
    output_tokens: dict[str, int]
    matched: int                                # requests whose token ids agree exactly
    exercised: dict[str, str]                   # side -> what the path counters say
    kv_lines: dict[str, str]
    skipped: str | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.skipped is not None or not self.problems

    @property
    def verdict(self) -> str:
        return "skipped" if self.skipped else ("ok" if self.ok else "FAIL")


def compare(stock: dict, e2: dict) -> list[Row]:
    """Request-by-request, per mode and case; a row's problems make the probe fail."""
    rows = []
    for mode in (m for m in MODES if m in stock["modes"] or m in e2["modes"]):
        s_mode, e_mode = stock["modes"].get(mode, {}), e2["modes"].get(mode, {})
        kv = {side: m.get("engine", {}).get("kv_line", "") for side, m in
              (("stock", s_mode), ("e2", e_mode))}
        problems = _identity(mode, s_mode, e_mode)
        skipped = s_mode.get("skipped") or e_mode.get("skipped")
        if skipped:
            if bool(s_mode.get("skipped")) != bool(e_mode.get("skipped")):
                problems.append("one side ran async scheduling, the other did not")
            rows.append(Row(mode, "(all)", 0, {}, {}, 0, {}, kv, skipped, problems))
            continue
        names = list(dict.fromkeys([*s_mode.get("cases", {}), *e_mode.get("cases", {})]))
        for name in names:
            s_case, e_case = s_mode["cases"].get(name), e_mode["cases"].get(name)
            if s_case is None or e_case is None:
                rows.append(Row(mode, name, 0, {}, {}, 0, {}, kv, None,
                                [f"only on {'stock' if e_case is None else 'e2'}"]))
                continue
            row = _compare_case(mode, name, s_case, e_case, kv)
            row.problems[:0], problems = problems, []  # identity problems once per mode
            rows.append(row)
        if problems:
            rows.append(Row(mode, "(engines)", 0, {}, {}, 0, {}, kv, None, problems))
    return rows


def _identity(mode: str, s_mode: dict, e_mode: dict) -> list[str]:
    """E2 must really be E2 (its boot report in the log), stock must not."""
    problems = []
    if s_mode.get("engine", {}).get("e2_banner"):
        problems.append("the stock engine logged E2's boot report: it is not stock vLLM")
    if e_mode and not e_mode.get("engine", {}).get("e2_banner"):
        problems.append("the E2 engine did not log E2's boot report (vLLM E2 series ...): "
                        "the overlay is not in effect")
    return problems


def _compare_case(mode: str, name: str, s_case: dict, e_case: dict, kv: dict) -> Row:
    problems = []
    sides = {"stock": s_case, "e2": e_case}
    n = len(s_case["requests"])
    if len(e_case["requests"]) != n:
        problems.append(f"{n} requests on stock, {len(e_case['requests'])} on e2")
    done = {side: sum(complete(r, c["max_tokens"]) for r in c["requests"])
            for side, c in sides.items()}
    tokens = {side: sum(len(r.get("token_ids") or []) for r in c["requests"])
              for side, c in sides.items()}
    for side, case in sides.items():
        if done[side] != len(case["requests"]):
            errors = {r.get("error") for r in case["requests"] if r.get("error")}
            problems.append(f"{side}: {done[side]}/{len(case['requests'])} complete"
                            + (f" ({'; '.join(sorted(errors))[:300]})" if errors else ""))
    matched = 0
    for index, (s_req, e_req) in enumerate(zip(s_case["requests"], e_case["requests"])):
        if s_req.get("token_ids") is not None and s_req.get("token_ids") == e_req.get("token_ids"):
            matched += 1
        else:
            first = _first_difference(s_req.get("token_ids") or [], e_req.get("token_ids") or [])
            problems.append(f"request {index}: token ids differ from position {first}")
    exercised = {}
    for side, case in sides.items():
        expect = case.get("expect")
        if expect == "prefix_hits":
            exercised[side] = f"{case['prefix_cache_hits']} prefix-cache hit tokens"
            if case["prefix_cache_hits"] <= 0:
                problems.append(f"{side}: no prefix-cache hit (vllm:prefix_cache_hits)")
        elif expect == "preemptions":
            # Stock must preempt and resume; E2, which admits with the room its
            # requests will take, must not preempt more often.
            exercised[side] = f"{case['preemptions']} preemptions"
            if side == "stock" and case["preemptions"] <= 0:
                problems.append("stock: no preemption (vllm:num_preemptions)")
            if side == "e2" and case["preemptions"] > s_case["preemptions"]:
                problems.append(f"e2 preempted {case['preemptions']} times, stock "
                                f"{s_case['preemptions']}")
    return Row(mode, name, n, done, tokens, matched, exercised, kv, None, problems)


def _first_difference(a: list, b: list) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


# ---------------------------------------------------------------- report


def markdown(record: dict, rows: list[Row]) -> str:
    h = record["header"]
    lines = [f"# Serving parity: stock vs E2 on vLLM {h['upstream_version']} ({h['runner']})", "",
             f"- upstream: {h['upstream_tag']}", f"- series digest: `{h['series_digest']}`",
             f"- host: {h['host']}", f"- device: {h['device']}",
             f"- runner: {json.dumps(h['runner_detail'], sort_keys=True)}",
             f"- model: {h['model']}",
             f"- command: `{h['command']}`", f"- run: {h['date']}, {h['seconds']:.0f}s", ""]
    lines += ["| side | scheduling | boot s | block | KV capacity (engine log) | async resolved "
              "| E2 boot report |", "|---|---|---|---|---|---|---|"]
    for side in SIDES:
        for mode, entry in record["sides"][side]["modes"].items():
            e = entry["engine"]
            banner = e.get("e2_banner") or "—"
            lines.append(f"| {side} | {mode} | {e['boot_s']:.0f} | {e['block_size']} | "
                         f"{e['kv_line']} | {e['async_resolved']} | {banner} |")
    lines += ["", "| scheduling | case | requests complete (stock / E2) | output tokens "
              "(stock / E2) | exact match | path taken (stock / E2) | verdict |",
              "|---|---|---|---|---|---|---|"]
    whats = {n: c.get("what", "") for m in record["sides"]["stock"]["modes"].values()
             for n, c in m.get("cases", {}).items()}
    for row in rows:
        if row.skipped:
            lines.append(f"| {row.mode} | all cases | — | — | — | — | {row.skipped} |")
            continue
        path = " / ".join(row.exercised.get(s, "") for s in SIDES) if row.exercised else ""
        lines.append(f"| {row.mode} | {row.case}: {whats.get(row.case, '')} | "
                     f"{row.complete.get('stock', 0)}/{row.requests}"
                     f" / {row.complete.get('e2', 0)}/{row.requests} | "
                     f"{row.output_tokens.get('stock', 0)} / {row.output_tokens.get('e2', 0)} | "
                     f"{row.matched}/{row.requests} | {path} | {row.verdict} |")
    problems = [f"- {r.mode} {r.case}: {p}" for r in rows for p in r.problems]
    lines += ["", "**" + ("all cases match" if not problems else
                          f"{len(problems)} problems") + "**", ""]
    if problems:
        lines += problems + [""]
    lines += ["Greedy decoding (temperature 0, ignore_eos, fixed max_tokens); prompts are token "
              "ids. Cases come from the engine's own block size and KV capacity.", ""]
    return "\n".join(lines)


def conclude(record: dict, report_dir: Path | None, name: str) -> int:
    """Compare the sides of a record, print the table, write the record; the exit code."""
    rows = compare(record["sides"]["stock"], record["sides"]["e2"])
    record["rows"] = [{**asdict(r), "ok": r.ok, "verdict": r.verdict} for r in rows]
    record["ok"] = all(r.ok for r in rows)
    table = Table("sched", "case", "complete s/e2", "tokens s/e2", "match", "path s/e2",
                  "verdict", title="serving parity: stock vs E2")
    for row in rows:
        if row.skipped:
            table.add_row(row.mode, "all", "", "", "", "", escape(row.skipped))
            continue
        colour = "green" if row.ok else "red"
        table.add_row(row.mode, row.case,
                      f"{row.complete.get('stock', 0)}/{row.complete.get('e2', 0)} of "
                      f"{row.requests}",
                      f"{row.output_tokens.get('stock', 0)}/{row.output_tokens.get('e2', 0)}",
                      f"{row.matched}/{row.requests}",
                      escape(" / ".join(row.exercised.get(s, "") for s in SIDES)),
                      f"[{colour}]{row.verdict}[/]")
    console.out.print(table)
    for side in SIDES:
        for mode, entry in record["sides"][side]["modes"].items():
            console.out.print(f"{side} {mode}: {entry['engine']['kv_line']} (block "
                              f"{entry['engine']['block_size']})", markup=False)
    for row in rows:
        for problem in row.problems:
            console.error(f"{row.mode} {row.case}: {problem}")
    if report_dir is not None:
        write_atomic(report_dir / f"{name}.json",
                     json.dumps(record, indent=2, sort_keys=True) + "\n")
        write_atomic(report_dir / f"{name}.md", markdown(record, rows))
        console.info(f"records: {report_dir / name}.json, {report_dir / name}.md")
    return 0 if record["ok"] else 1


# ---------------------------------------------------------------- command


def add_engine_image_arguments(parser: argparse.ArgumentParser) -> None:
    """The stock/E2 image pair and GPUs of the probes' --docker paths (the GPU host)."""
    parser.add_argument("--stock-image", metavar="REF",
                        help="stock engine image (--docker; default: image.base of series.yaml)")
    parser.add_argument("--e2-image", metavar="REF",
                        help="E2 engine image (--docker; default: vllm-e2:<version>-<digest12>)")
    parser.add_argument("--gpus", metavar="all|IDS", help="--docker: GPUs for the engines "
                        "(docker run --gpus; 'all' or comma-separated ids)")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--docker", action="store_true",
                        help="run the engines in images through the Docker SDK (DOCKER_HOST, "
                             "ssh:// included) instead of the local e2 env")
    add_engine_image_arguments(parser)
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size (default 1)")
    parser.add_argument("--kv-cache-bytes", type=int, default=KV_CACHE_BYTES, metavar="N",
                        help="each engine's KV cache (--kv-cache-memory-bytes; default "
                             f"{KV_CACHE_BYTES}: small, so the oversubscribed case preempts; "
                             f"must hold {MAX_MODEL_LEN} tokens)")
    parser.add_argument("--mode", action="append", choices=MODES, dest="modes",
                        help="scheduling mode to run (repeatable; default both: the CPU "
                             "engine turns async off, so there its boot only confirms that)")
    parser.add_argument("--report", type=Path, metavar="DIR",
                        help="where the JSON and Markdown go (default docs/validation)")
    parser.add_argument("--no-record", action="store_true", help="print only")
    parser.set_defaults(run=run_serve)


def run_serve(options: GlobalOptions, args: argparse.Namespace) -> int:
    project = options.project
    series = project.load()
    started = time.monotonic()
    if args.tp not in TP_SIZES:
        raise E2Error(f"--tp {args.tp}: the tiny model's heads split over "
                      + ", ".join(map(str, TP_SIZES)) + " GPUs only")
    if not args.docker and (args.stock_image or args.e2_image or args.gpus):
        raise E2Error("--stock-image, --e2-image and --gpus go with --docker")
    logs = project.state_dir / "logs" / "serve"
    runner: Runner
    if args.docker:
        runner, model, name = _docker_runner(args, project, series, logs)
    else:
        runner, model, name = _local_runner(args, options.cache, project, series, logs)
    plan: dict[str, int] = {}
    modes = tuple(m for m in MODES if m in (args.modes or MODES))
    sides = {side: run_side(runner, side, plan, modes) for side in SIDES}
    device = sides["stock"].get("device") or _cpu_name()
    record = {"format": FORMAT, "header": _header(project, series, runner, model, device, modes,
                                                 time.monotonic() - started),
              "sides": sides}
    report = None if args.no_record else (args.report or project.root / "docs" / "validation")
    return conclude(record, report, name)


def _local_runner(args: argparse.Namespace, cache: Cache, project: Project, series: Series,
                  logs: Path) -> tuple[LocalRunner, str, str]:
    from e2.testenv import prepare

    if args.tp != 1:
        raise E2Error("--tp above 1 needs --docker (the local CPU engine runs one worker)")
    env, view = prepare(project, series, cache, "cpu", overlay=True)
    assert view is not None
    model = ensure_model(env.python, cache)
    run_env = {"stock": env.run_env(None), "e2": env.run_env(view.path)}
    runner = LocalRunner(env.python, view.path, run_env, model, logs, 1, args.kv_cache_bytes)
    return runner, str(model), "serve-cpu"


def _docker_runner(args: argparse.Namespace, project: Project, series: Series,
                   logs: Path) -> tuple[DockerRunner, str, str]:
    from e2.image import connect, engine_images

    client = connect()  # first: an unreachable DOCKER_HOST fails before anything else
    images = engine_images(project, series, args.stock_image, args.e2_image)
    runner = DockerRunner(client, images, args.gpus, args.tp, logs, SEED, args.kv_cache_bytes)
    volume = runner.ensure_model()
    return runner, f"docker volume {volume}", "serve-gpu" if args.gpus else "serve-docker"


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU: {line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    return f"CPU: {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def _header(project: Project, series: Series, runner: Runner, model: str, device: str,
            modes: tuple[str, ...], seconds: float) -> dict:
    detail = runner.describe()
    return {"upstream_version": series.upstream.version, "upstream_tag": series.upstream.tag,
            "series_digest": series_digest(series, project.patches_dir),
            "runner": runner.kind, "runner_detail": detail,
            "image_digests": ({s: i["digest"] or i["id"] for s, i in detail["images"].items()}
                              if "images" in detail else None),
            "host": f"{platform.node()} ({platform.system()} {platform.machine()}, "
                    f"python {platform.python_version()})",
            "device": device, "model": f"{model} (tiny Qwen3-Next, seed {SEED}, "
                                       f"{model_key(SEED)})",
            "settings": {"max_model_len": MAX_MODEL_LEN, "max_tokens": MAX_TOKENS,
                         "kv_cache_memory_bytes": runner.kv_bytes, "max_num_seqs": MAX_NUM_SEQS,
                         "seed": SEED, "modes": list(modes)},
            "command": _command_line(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(seconds, 1)}


def _command_line() -> str:
    if Path(sys.argv[0]).name == "e2":
        return "e2 " + shlex.join(sys.argv[1:])
    return shlex.join(sys.argv)
