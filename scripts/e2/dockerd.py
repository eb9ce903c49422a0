"""The project's private Docker daemon, started when no engine answers.

ci/dockerd.sh owns the daemon (its socket, data root and pid under
$E2_DOCKERD_DIR, which e2 sets to the cache's dockerd/); this module only
decides whether to start it for a command that needs an engine and what to
tell the user, so that a fresh machine needs no step of its own before
``make image``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from e2 import console
from e2.cache import DOCKERD_DIR_ENV
from e2.errors import E2Error

SCRIPT = "ci/dockerd.sh"


@dataclass(frozen=True)
class PrivateDaemon:
    host: str            # unix://<dir>/docker.sock
    started: bool        # False: it was already running
    stop_command: str    # the shell line that stops it

    @property
    def env_prefix(self) -> str:
        """What a shell without DOCKER_HOST puts before `docker ...` to reach it."""
        return f"DOCKER_HOST={shlex.quote(self.host)}"


def why_not_startable(root: Path) -> str | None:
    """None when the private daemon can be started here; else the reason it cannot."""
    if os.environ.get("DOCKER_HOST"):
        return "DOCKER_HOST is set"
    if not (root / SCRIPT).is_file():
        return f"no {SCRIPT} in {root}"
    if os.geteuid() != 0:
        return "not root"
    if not shutil.which("dockerd"):
        return "no dockerd installed"
    return None


def _script_command(root: Path, verb: str, state: Path) -> str:
    script = SCRIPT if Path.cwd().resolve() == root.resolve() else str(root / SCRIPT)
    # named in full: the script's own default is right only for the default cache
    return f"{DOCKERD_DIR_ENV}={shlex.quote(str(state))} sh {shlex.quote(script)} {verb}"


def start(root: Path, state: Path) -> PrivateDaemon:
    """Start (or find running) the private daemon whose state is in ``state`` (the
    cache's ``dockerd``); DOCKER_HOST is set for this process."""
    result = subprocess.run(["sh", str(root / SCRIPT), "start"], capture_output=True, text=True,
                            env={**os.environ, DOCKERD_DIR_ENV: str(state)})
    line = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    if result.returncode != 0 or not line.startswith("export DOCKER_HOST="):
        raise E2Error(f"no Docker daemon reachable, and {SCRIPT} start failed: "
                      + " ".join(result.stderr.split()),
                      hint="set DOCKER_HOST to a running engine (ssh://user@host works)")
    host = line.split("=", 1)[1]
    os.environ["DOCKER_HOST"] = host
    daemon = PrivateDaemon(host, started=bool(result.stderr.strip()),
                           stop_command=_script_command(root, "stop", state))
    verb = "started the project's private Docker daemon" if daemon.started \
        else "using the project's private Docker daemon"
    console.info(f"no Docker engine at the default socket: {verb} at {host}; it keeps running "
                 f"for docker run (stop it with: {daemon.stop_command})")
    return daemon
