"""The cache directory: everything e2 keeps between runs, and the one owner of its layout.

One folder, ``--cache DIR`` or ``$XDG_CACHE_HOME/vllm-e2`` (default
``~/.cache/vllm-e2``), holds the pinned sdists, the upstream repo, the test
venvs, the release's check tools, the CPU base's work dir, the offline model
stores, the probes' models and packages, the private Docker daemon's state and
the crash log. Every module asks a ``Cache`` for the path of its area; none
joins folder names onto the root itself, so the layout is written down here
once. The folder names are the ones e2 has always used, so an existing cache
stays valid.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from filelock import FileLock

# ci/dockerd.sh computes the same default for the daemon's state (without e2):
# ${E2_DOCKERD_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-e2/dockerd}
DOCKERD_DIR_ENV = "E2_DOCKERD_DIR"


class Cache:
    """The layout of one cache directory and its locks."""

    def __init__(self, root: Path):
        self.root = root.absolute()

    @classmethod
    def at(cls, root: Path | None) -> Cache:
        """The cache at ``root`` (``--cache DIR``), else the user's XDG cache."""
        return cls(root if root is not None else cls.default_root())

    @staticmethod
    def default_root() -> Path:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        return Path(base) / "vllm-e2"

    def __repr__(self) -> str:
        return f"Cache({str(self.root)!r})"

    # -- upstream: the pinned sdists and the repo they are imported into

    @property
    def downloads(self) -> Path:
        return self.root / "downloads"

    @property
    def upstream_repo(self) -> Path:
        return self.root / "upstream.git"

    @property
    def upstream_scratch(self) -> Path:
        """Where an import unpacks (``extract-*``) and stages (``index-*``): the top level."""
        return self.root

    @functools.cached_property
    def upstream_lock(self) -> FileLock:
        """Held while the upstream repo or the downloads change. One object per cache,
        so a holder can take it again (a second FileLock on the file would wait on it)."""
        return FileLock(str(self.root / "lock"))

    # -- what the tests and probes run on

    def venv(self, name: str) -> Path:
        """The test venv ``name`` (``<target>-<version>``)."""
        return self.root / "venvs" / name

    def tools_venv(self, name: str) -> Path:
        """A venv of the pinned release's check tools (ruff at its pin), one per
        requirement set (``checks-<digest>``)."""
        return self.root / "tools" / name

    @property
    def stock_findings(self) -> Path:
        """What those checks find in stock's files, one JSON file per release, tool set
        and file list (stock never changes, so it is checked once)."""
        return self.root / "tools" / "stock-findings"

    @property
    def hub_stores(self) -> Path:
        """The offline model stores, one folder per digest of their inputs."""
        return self.root / "hub-stores"

    @property
    def models(self) -> Path:
        """Models the probes write (random weights, made once)."""
        return self.root / "models"

    @property
    def probe_packages(self) -> Path:
        """Packages of the engine image that the capacity probe's planner imports."""
        return self.root / "probe-packages"

    # -- images

    @property
    def base_cpu(self) -> Path:
        """The CPU base's work dir: wheelhouse, root filesystem tar, build log."""
        return self.root / "base-cpu"

    @property
    def debs(self) -> Path:
        """Debian packages fetched once (the image tests' busybox stand-in)."""
        return self.root / "debs"

    @property
    def dockerd(self) -> Path:
        """The private Docker daemon's state (socket, data root, pid, log), as
        ci/dockerd.sh places it: ``$E2_DOCKERD_DIR`` when set, else in the cache."""
        override = os.environ.get(DOCKERD_DIR_ENV)
        return Path(override).absolute() if override else self.root / "dockerd"

    # -- the driver itself

    @property
    def crash_log(self) -> Path:
        return self.root / "crash.log"

    @staticmethod
    def lock(entry: Path) -> FileLock:
        """The lock of one entry that is made once and shared (a venv, a store, a
        model): a file beside it, so the entry itself is only ever complete."""
        return FileLock(str(entry.with_name(entry.name + ".lock")))
