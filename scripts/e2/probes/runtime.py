"""The vLLM venv a probe's worker runs in: its python, the e2 view (the E2 side) and
what else goes on PYTHONPATH there (the torchvision stub, the engine image's
packages that vLLM's attention backend selection imports).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import git

from e2 import console
from e2.cache import Cache
from e2.errors import E2Error
from e2.options import GlobalOptions
from e2.testenv import clean_env, prepare

STUBS = Path(__file__).resolve().parent / "stubs"
# Packages of the CUDA engine image that vLLM's backend selection imports (FlashInfer
# and what it imports at load); pinned by the release's requirements/cuda.txt, the
# rest follows flashinfer's own requirements.
IMAGE_PACKAGES = ("flashinfer-python", "apache-tvm-ffi")
IMAGE_PACKAGES_UNPINNED = ("nvidia-ml-py",)


@dataclass(frozen=True)
class Runtime:
    """The venv python that runs the worker, and the e2 view (None: stock only)."""

    python: Path
    view: Path | None
    why_no_view: str | None
    needs_stub: bool
    image_packages: Path | None = None  # the engine image's packages the selection needs

    def env(self, side: str) -> dict[str, str]:
        env = clean_env()
        env["HF_HUB_OFFLINE"] = "1"
        paths = [str(self.view)] if side == "e2" and self.view else []
        if self.needs_stub:
            paths.append(str(STUBS))  # after the view: it must never shadow vllm
        if self.image_packages:
            paths.append(str(self.image_packages))  # holds no vllm either
        if paths:
            env["PYTHONPATH"] = os.pathsep.join(paths)
        return env


def image_requirements(options: GlobalOptions) -> list[str]:
    """The pins of IMAGE_PACKAGES in the pinned release's requirements/cuda.txt."""
    series = options.project.load()
    commit = options.upstream.ensure(series)
    text = git.Repo(options.cache.upstream_repo).git.show(f"{commit}:requirements/cuda.txt")
    pins = {}
    for line in text.splitlines():
        name, _, version = line.split("#")[0].strip().partition("==")
        if name in IMAGE_PACKAGES and version:
            pins[name] = f"{name}=={version.strip()}"
    missing = [name for name in IMAGE_PACKAGES if name not in pins]
    if missing:
        raise E2Error(f"requirements/cuda.txt of vLLM {series.upstream.version} pins no "
                      f"{', '.join(missing)}", hint="the CUDA backend selection cannot be "
                      "reproduced without them; update IMAGE_PACKAGES in e2/probes/runtime.py")
    return [pins[name] for name in IMAGE_PACKAGES] + list(IMAGE_PACKAGES_UNPINNED)


def ensure_image_packages(options: GlobalOptions, python: Path) -> Path:
    """A folder (made once, shared, locked) with the engine image's packages that
    vLLM's attention backend selection imports; --no-deps: only their import is used."""
    wanted = image_requirements(options)
    key = hashlib.sha256(json.dumps([str(python), wanted]).encode()).hexdigest()[:16]
    root = options.cache.probe_packages
    folder = root / key
    root.mkdir(parents=True, exist_ok=True)
    with Cache.lock(folder):
        if (folder / "e2-packages.json").is_file():
            return folder
        staging = root / f".{key}.new"
        shutil.rmtree(staging, ignore_errors=True)
        with console.status("installing " + ", ".join(wanted) + " for the backend selection"):
            done = subprocess.run([str(python), "-m", "pip", "install", "--no-input", "-q",
                                   "--no-deps", "--target", str(staging), *wanted],
                                  capture_output=True, text=True)
        if done.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            tail = "\n".join(done.stderr.splitlines()[-5:])
            raise E2Error(f"pip could not install {' '.join(wanted)}:\n{tail}",
                          hint="check the package index pip is configured with")
        (staging / "e2-packages.json").write_text(json.dumps(wanted) + "\n")
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
    return folder


def make_runtime(options: GlobalOptions, python_path: Path | None = None,
                 vllm_path: Path | None = None, stock_only: bool = False) -> Runtime:
    """The CPU test env (made or reused as by e2 env) and its e2 view, or --python
    (``python_path``) with --vllm-path as the E2 side."""
    if python_path:
        python, view = Path(python_path), None
        if not python.is_file():
            raise E2Error(f"{python}: no such python", hint="pass --python of a vLLM venv")
        if vllm_path is not None:
            if not (vllm_path / "vllm" / "__init__.py").is_file():
                raise E2Error(f"--vllm-path {vllm_path}: no vllm package in it")
            view = vllm_path.resolve()
        why = None if view or stock_only else "--python without --vllm-path: stock only"
    else:
        env, made = prepare(options.project, options.project.load(), options.cache,
                            "cpu", overlay=not stock_only)
        python, view, why = env.python, made.path if made else None, None
    if stock_only:
        view, why = None, "--stock-only"
    probe = subprocess.run(
        [str(python), "-c", "import importlib.util as u; print(u.find_spec('vllm') is not None,"
                            " u.find_spec('torchvision') is None)"],
        capture_output=True, text=True, timeout=120)
    if probe.returncode != 0 or not probe.stdout.startswith("True"):
        raise E2Error(f"{python} cannot import vllm", hint="pass --python of a vLLM venv")
    return Runtime(python, view, why, probe.stdout.split()[1] == "True",
                   ensure_image_packages(options, python))

