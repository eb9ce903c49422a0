"""The serve probe's models: tiny_model.py's seeded Qwen3-Next, written once per seed and geometry.

Local engines read it from the cache directory, written by the test env's
python; container engines read it from a Docker volume, written by the stock
image's own python (a remote host cannot see this machine's files).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from e2 import console
from e2.cache import Cache
from e2.container import LABEL_PROBE, run_to_end
from e2.errors import E2Error
from e2.probes.serve_settings import SEED
from e2.probes.tiny_model import DONE as MARKER

if TYPE_CHECKING:
    from docker import DockerClient

WRITER = Path(__file__).resolve().parent / "tiny_model.py"


def model_key(seed: int, geometry: str = "hybrid") -> str:
    return hashlib.sha256(WRITER.read_bytes() + f"seed={seed} {geometry}".encode()
                          ).hexdigest()[:12]


def ensure_model(python: Path, cache: Cache, seed: int = SEED, geometry: str = "hybrid") -> Path:
    """The tiny model in the cache, written once by ``python`` (torch + transformers)."""
    model = cache.models / f"tiny-qwen3-next-{geometry}-{model_key(seed, geometry)}"
    if (model / MARKER).is_file():
        return model
    model.parent.mkdir(parents=True, exist_ok=True)
    with Cache.lock(model):
        if (model / MARKER).is_file():
            return model
        with console.status(f"writing the tiny model ({geometry})"):
            done = subprocess.run([str(python), str(WRITER), str(model), "--seed", str(seed),
                                   "--geometry", geometry],
                                  capture_output=True, text=True, timeout=600,
                                  env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if done.returncode != 0:
            raise E2Error(f"writing the tiny model with {python} failed (exit "
                          f"{done.returncode}):\n{done.stderr.strip()[-2000:]}",
                          hint="that python needs torch and transformers (the e2 env has both)")
    for path in model.iterdir():
        path.chmod(0o644)  # safetensors writes 0600; a container user must read it
    return model


def volume_name(seed: int = SEED, geometry: str = "hybrid") -> str:
    return f"e2-serve-model-{geometry}-{model_key(seed, geometry)}"


def ensure_model_volume(client: DockerClient, image: str, mount: str,
                        seed: int = SEED, geometry: str = "hybrid") -> str:
    """The Docker volume holding a tiny model, written by ``image``'s own transformers."""
    volume = volume_name(seed, geometry)
    client.volumes.create(volume, labels={LABEL_PROBE: "serve"})  # an existing one is kept
    script = WRITER.read_text() + "\n"
    code = (f"import os, sys\nif os.path.isfile('{mount}/{MARKER}'):\n"
            f"    print('model present'); sys.exit(0)\n"
            "ns = {'__name__': 'tiny_model'}\n"
            "exec(compile(" + repr(script) + ", 'tiny_model.py', 'exec'), ns)\n"
            f"ns['write']('{mount}', {seed}, {geometry!r})\n")
    with console.status(f"writing the tiny model ({geometry}) into volume {volume}"):
        run_to_end(client, image, ["-c", code], "writing the tiny model",
                   entrypoint=["python3"], env={"HF_HUB_OFFLINE": "1"},
                   volumes={volume: {"bind": mount, "mode": "rw"}})
    return volume
