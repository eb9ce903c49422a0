"""git am of several patches, following which of them git is at (for e2 apply and
the rebase's step loop)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import git

from e2.gitops import AM_FELL_BACK, git_am


@dataclass
class AmRun:
    returncode: int
    output: list[str]
    started: int            # the patches git am started (with a failure, the last failed)
    fell_back: set[int]     # the indexes of those that needed the 3-way merge


def git_am_series(repo: git.Repo, patch_files: list[Path],
                  on_start: Callable[[int], None] | None = None) -> AmRun:
    """git_am of several patches, following which of them git is at: ``on_start`` gets
    each one's index as git starts it."""
    started, fell_back = 0, set()

    def follow(line: str) -> None:
        nonlocal started
        if line.startswith("Applying: "):
            started += 1
            if on_start is not None:
                on_start(started - 1)
        elif line.startswith(AM_FELL_BACK):
            fell_back.add(started - 1)

    returncode, output = git_am(repo, patch_files, follow)
    return AmRun(returncode, output, started, fell_back)
