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
from pathlib import Path

from e2.errors import E2Error

KV_LINE = re.compile(r"(?:\w+ )?KV cache size: ([\d,]+) tokens[^\n]*")
GIB = 1 << 30
BOOT_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def boot_command(python: Path, model: Path, settings) -> list[str]:
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager",
               "--max-model-len", str(settings.max_model_len),
               "--max-num-seqs", str(settings.max_num_seqs),
               "--kv-cache-memory-bytes", str(int(settings.budget_gib * GIB)),
               "--host", "127.0.0.1", "--port", str(_free_port())]
    if "vision_config" in json.loads((model / "config.json").read_text()):
        # the capacity question is the language model's; the vision processor would
        # also need a tokenizer, which a config-only folder does not have
        command.append("--language-model-only")
    if settings.kv_dtype != "auto":
        command += ["--kv-cache-dtype", settings.kv_dtype]
    if settings.mamba_cache_mode == "align":
        command += ["--enable-prefix-caching", "--mamba-cache-mode", "align"]
    return command


def read_boot_line(python: Path, model: Path, settings, env: dict[str, str],
                   timeout_s: float = BOOT_TIMEOUT_S) -> dict:
    """Boot once; the KV line and the tokens in it, or an E2Error with the log's tail."""
    if settings.tp != 1:
        raise E2Error("--boot runs one engine process on this host: use --tp 1")
    env = {k: v for k, v in env.items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # would override
    started = time.monotonic()
    with tempfile.NamedTemporaryFile("w+", prefix="e2-boot-", suffix=".log") as log:
        process = subprocess.Popen(boot_command(python, model, settings), env=env,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while time.monotonic() - started < timeout_s:
                text = Path(log.name).read_text(errors="replace")
                found = KV_LINE.search(text)
                if found:
                    return {"kv_line": found.group(0).strip(),
                            "tokens": int(found.group(1).replace(",", "")),
                            "seconds": round(time.monotonic() - started, 1)}
                if process.poll() is not None:
                    tail = "\n".join(text.splitlines()[-15:])
                    raise E2Error(f"the engine exited ({process.returncode}) before logging its "
                                  f"KV cache size for {model.name}:\n{tail}")
                time.sleep(1)
            raise E2Error(f"no KV cache size line from {model.name} within {timeout_s:.0f} s")
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
