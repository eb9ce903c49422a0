"""The boot mode of the capacity probe: start the engine, read its KV line, stop it.

The engine boots on the model folder with dummy weights (config.json is all it
needs) and the probe's budget as ``--kv-cache-memory-bytes``, and logs
``KV cache size: N tokens`` once the KV cache is allocated; nothing is served.
Dummy weights still take the model's full size in memory, so on a CPU host
only the small models of the zoo boot.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from e2.container import LABEL_PROBE, Container
from e2.errors import E2Error
from e2.processes import free_port, started

if TYPE_CHECKING:
    from docker import DockerClient

KV_LINE = re.compile(r"(?:\w+ )?KV cache size: ([\d,]+) tokens[^\n]*")
GIB = 1 << 30
BOOT_TIMEOUT_S = 600
API_SERVER = ["-m", "vllm.entrypoints.openai.api_server"]


class Settings(Protocol):
    """What a boot reads of the capacity probe's settings (e2.probes.capacity.Settings, frozen)."""

    @property
    def budget_gib(self) -> float: ...

    @property
    def tp(self) -> int: ...

    @property
    def max_num_seqs(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def kv_dtype(self) -> str: ...

    @property
    def mamba_cache_mode(self) -> str: ...


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
    return [str(python), *API_SERVER, "--model", *engine_flags(model, str(model), settings),
            "--host", "127.0.0.1", "--port", str(free_port())]


def _kv_line(read_log: Callable[[], str], started_at: float) -> Callable[[], dict | None]:
    """The boot's answer once the log holds the KV cache size line: the line, its tokens
    and the seconds since ``started_at``."""
    def found() -> dict | None:
        match = KV_LINE.search(read_log())
        if match is None:
            return None
        return {"kv_line": match.group(0).strip(),
                "tokens": int(match.group(1).replace(",", "")),
                "seconds": round(time.monotonic() - started_at, 1)}
    return found


def read_boot_line_docker(client: DockerClient, image: str, model: Path, settings: Settings,
                          gpus: str | None, timeout_s: float = BOOT_TIMEOUT_S) -> dict:
    """The same boot in a container of ``image`` on the engine DOCKER_HOST names.

    The model folder travels into the container as an archive (a remote host
    cannot see this machine's paths); ``gpus`` is 'all' or comma-separated ids.
    """
    # an explicit entrypoint: vllm/vllm-openai's own is `vllm serve`, local bases have none
    box = Container(client, image, ["--model", *engine_flags(model, "/e2-model", settings)],
                    entrypoint=["python3", *API_SERVER], env={"HF_HUB_OFFLINE": "1"},
                    network="none", shm_size="1g", gpus=gpus,
                    labels={LABEL_PROBE: "capacity-boot"}, files={"/e2-model": model})
    with box:
        return box.wait_until(_kv_line(box.logs, time.monotonic()), timeout_s,
                              f"the engine in {image} booting {model.name}")


def read_boot_line(python: Path, model: Path, settings: Settings, env: dict[str, str],
                   timeout_s: float = BOOT_TIMEOUT_S) -> dict:
    """Boot once; the KV line and the tokens in it, or an E2Error with the log's tail."""
    if settings.tp != 1:
        raise E2Error("--boot runs one engine process on this host: use --tp 1 "
                      "(or --docker on the GPU host)")
    env = {k: v for k, v in env.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # would override
    with tempfile.TemporaryDirectory(prefix="e2-boot-") as scratch, \
            started(boot_command(python, model, settings), Path(scratch) / "engine.log",
                    env) as engine:
        return engine.wait_until(_kv_line(engine.log, time.monotonic()), timeout_s,
                                 f"the engine booting {model.name}")
