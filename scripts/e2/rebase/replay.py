"""Recorded resolutions, whole: every file the resolved commit touches, not only
the conflicted hunks (git rerere replays only those, and silently drops what a
resolution changed outside them).

A resolution is recorded when a conflicting patch is committed, under
``.e2/rr-cache/e2-resolutions/<patch-id>-<tag>.json``: the commit's whole diff,
its message, the hunks and verdicts (so its reasons stay tied to it), and the
upstream base it was made on (the blob of every file it touches). On the next
attempt it is replayed only where it applies exactly; otherwise the rebase
stops and says which files changed since.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import asdict
from enum import Enum
from pathlib import Path

import git
from pydantic import TypeAdapter, ValidationError

from e2.fsio import write_atomic
from e2.gitops import COMMITTER_ENV
from e2.rebase.state import Conflict, PatchState, PatchStatus
from e2.rebase.workspace import widen


class Outcome(Enum):
    NONE = "none"           # nothing recorded for this patch on this release
    REPLAYED = "replayed"   # committed from the record
    STALE = "stale"         # recorded, but no longer applies: the patch goes through git am


def patch_id(patch_file: Path) -> str:
    """git's stable patch id: the same for the same change, whatever its line numbers."""
    result = subprocess.run(["git", "patch-id", "--stable"], input=patch_file.read_bytes(),
                            capture_output=True, check=True)
    return result.stdout.decode().split()[0] if result.stdout.strip() else "empty"


def record_path(store: Path, patch_file: Path, target_tag: str) -> Path:
    return store / f"{patch_id(patch_file)}-{target_tag}.json"


def record(repo: git.Repo, store: Path, patch_file: Path, current: PatchState,
           target_tag: str) -> None:
    """Keep the resolved commit HEAD whole, with the base it was made on."""
    head = repo.head.commit
    parent = head.parents[0]
    files = repo.git.diff("--name-only", "--no-renames", parent.hexsha, head.hexsha).split()
    entry = {
        "title": current.title,
        "target": target_tag,
        "message": head.message,
        "author": [head.author.name, head.author.email, str(head.authored_date)
                   + " " + _offset(int(head.author_tz_offset))],
        "diff": repo.git.diff("--binary", "--no-renames", "--full-index", parent.hexsha,
                              head.hexsha) + "\n",
        "base": {name: _blob(parent, name) for name in files},
        "conflicts": [asdict(c) for c in current.conflicts],
    }
    write_atomic(record_path(store, patch_file, target_tag),
                 json.dumps(entry, indent=2, sort_keys=True) + "\n")


def try_replay(repo: git.Repo, store: Path, patch_file: Path, current: PatchState,
               target_tag: str) -> Outcome:
    """Commit the recorded resolution of this patch when it applies exactly on HEAD."""
    path = record_path(store, patch_file, target_tag)
    if not path.is_file():
        return Outcome.NONE
    widen(repo)  # the resolution may touch files outside the series'
    entry = json.loads(path.read_text())
    changed = [name for name, blob in entry["base"].items()
               if _blob(repo.head.commit, name) != blob]
    applied = subprocess.run(["git", "apply", "--index", "--binary", "-"],
                             cwd=repo.working_tree_dir, input=entry["diff"].encode(),
                             capture_output=True)
    if applied.returncode != 0:
        current.notes = [f"a recorded resolution ({path.name}) no longer applies: upstream "
                         f"or an earlier patch changed {', '.join(changed) or 'its files'} "
                         "since it was made; resolve again (the record shows what it did)"]
        return Outcome.STALE
    name, email, date = entry["author"]
    env = {**os.environ, **COMMITTER_ENV, "GIT_AUTHOR_NAME": name,
           "GIT_AUTHOR_EMAIL": email, "GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date}
    subprocess.run(["git", "commit", "-q", "--no-verify", "-F", "-"], cwd=repo.working_tree_dir,
                   input=entry["message"], text=True, env=env, check=True)
    current.status, current.replayed = PatchStatus.RESOLVED, True
    current.new_commit = repo.head.commit.hexsha
    current.conflicts = _conflicts(entry["conflicts"])
    current.notes = ([f"recorded resolution replayed whole; {', '.join(changed)} changed "
                      "since it was made (it still applies exactly)"] if changed else [])
    return Outcome.REPLAYED


def _conflicts(data: list) -> list[Conflict]:
    try:
        return TypeAdapter(list[Conflict]).validate_python(data)
    except ValidationError:
        return []  # a record from another version of e2: its hunks are not essential


def _blob(commit: git.Commit, name: str) -> str | None:
    try:
        return commit.tree[name].hexsha
    except KeyError:
        return None


def _offset(seconds_west: int) -> str:
    east = -seconds_west
    sign = "+" if east >= 0 else "-"
    return f"{sign}{abs(east) // 3600:02d}{abs(east) % 3600 // 60:02d}"
