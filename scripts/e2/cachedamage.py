"""A release checkout whose cache objects git cannot read: finding them, naming them
by path, and the one error that tells the user to drop the cache."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import git

from e2.errors import E2Error

# git's words for an object it cannot read (damaged or missing), with its id
UNREADABLE_OBJECT = re.compile(
    r"(?:is corrupt|unable to (?:read|unpack)|cannot read object|inflate|bad object|"
    r"missing blob|"
    r"invalid object)[^\n]*?\b([0-9a-f]{40})\b|\b([0-9a-f]{40})\b[^\n]*?is corrupt")


def unreadable_objects(stderr: str) -> list[str]:
    """The object ids git's error output says it could not read."""
    found = dict.fromkeys(a or b for a, b in UNREADABLE_OBJECT.findall(stderr))
    return list(found)


class UnreadableObjects(Exception):
    """git could not read these objects of the cache's repo (damaged or missing)."""

    def __init__(self, shas: list[str]):
        super().__init__(", ".join(shas))
        self.shas = shas


def cache_damage(exc: BaseException, cache_repo: Path, tag: str) -> E2Error | None:
    """The damaged_cache error for a failed git command (or UnreadableObjects) that
    could not read objects of ``cache_repo``; None for any other failure."""
    unreadable = []
    if isinstance(exc, UnreadableObjects):
        unreadable = exc.shas
    elif isinstance(exc, git.GitCommandError):
        unreadable = unreadable_objects(f"{exc.stderr}\n{exc.stdout}")
    return damaged_cache(cache_repo, tag, paths_of(cache_repo, tag, unreadable)) \
        if unreadable else None


def refuse_damaged(repo: git.Repo, cache_repo: Path, tag: str) -> None:
    """Refuse a checkout whose files do not hash to their ids (corrupt_files)."""
    damaged = corrupt_files(repo)
    if damaged:
        raise damaged_cache(cache_repo, tag, damaged)


def paths_of(cache_repo: Path, tag: str, shas: list[str]) -> list[str]:
    """The release's files stored under ``shas`` (the ids where no path is known:
    the tree itself may be what is damaged)."""
    try:
        listing = git.Repo(cache_repo).git.ls_tree("-r", "-z", f"refs/tags/{tag}")
    except git.GitCommandError:
        return shas
    paths: dict[str, str] = {}
    for row in listing.split("\x00"):
        if row:
            info, path = row.split("\t", 1)
            paths.setdefault(info.split()[2], path)
    return [paths.get(sha, sha) for sha in shas]


def damaged_cache(cache_repo: Path, tag: str, names: list[str]) -> E2Error:
    """The one error for a cache repo whose objects for ``tag`` are damaged."""
    shown = ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
    return E2Error(f"the cache's upstream repo {cache_repo} is damaged: {shown} of {tag} "
                   "cannot be read or do not match their object ids",
                   hint=f"remove {cache_repo} and run the command again (the pinned "
                        "release is imported anew)")


def corrupt_files(repo: git.Repo) -> list[str]:
    """Checked-out files whose bytes do not hash to the blob id their tree names: a
    damaged object in the repo they came from (git does not check on checkout)."""
    assert repo.working_tree_dir is not None  # a worktree e2 just checked out
    entries = []
    for row in repo.git.ls_files("-s", "-z").split("\x00"):
        if row:
            info, path = row.split("\t", 1)
            mode, sha = info.split()[:2]
            # os.path on strings: a Path per entry of a release's ~7,400 cost 0.1 s
            if mode in ("100644", "100755") and os.path.isfile(f"{repo.working_tree_dir}/{path}"):
                entries.append((path, sha))
    if not entries:
        return []
    hashed = subprocess.run(["git", "hash-object", "--no-filters", "--stdin-paths"],
                            input="\n".join(p for p, _ in entries) + "\n", text=True,
                            cwd=repo.working_tree_dir, capture_output=True, check=True)
    return [path for (path, sha), got in zip(entries, hashed.stdout.split()) if got != sha]
