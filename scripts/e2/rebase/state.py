"""The typed state of one rebase: ``.e2/rebase/state.json`` and its model.

Statuses, phases, verdicts and hunk classes are enums of words (the JSON
keeps the same words); the file is written atomically after every step,
so a rebase killed at any point resumes from it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from e2.errors import E2Error
from e2.fsio import write_atomic


class Words(str, Enum):
    """An enum whose members are their words, in JSON, f-strings and templates alike."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class PatchStatus(Words):
    PENDING = "pending"
    APPLYING = "applying"
    CONFLICT = "conflict"
    CLEAN = "clean"
    OFFSET = "offset"
    MERGED = "merged"       # git am's 3-way fallback
    RESOLVED = "resolved"   # by hand, or a recorded resolution replayed
    OBSOLETE = "obsolete"
    DROPPED = "dropped"

    @property
    def applied(self) -> bool:
        return self in APPLIED

    @property
    def settled(self) -> bool:
        return self in APPLIED or self in DROPPED


APPLIED = (PatchStatus.CLEAN, PatchStatus.OFFSET, PatchStatus.MERGED, PatchStatus.RESOLVED)
DROPPED = (PatchStatus.OBSOLETE, PatchStatus.DROPPED)


class Phase(Words):
    APPLYING = "applying"
    CONFLICT = "conflict"     # stopped: conflicts to resolve
    OBSOLETE = "obsolete"     # stopped: the patch applies in reverse
    REPLAY = "replay"         # stopped: a recorded resolution no longer applies
    MISSING_NAME = "missing-name"  # stopped: the patch uses a vllm name the release lacks
    FINISHING = "finishing"   # writing patches/, series.yaml, overlay/, Dockerfile


class Verdict(Words):
    STILL_NEEDED = "still-needed"
    OBSOLETE = "obsolete"
    RE_EXPRESSED = "re-expressed"
    DROPPED = "dropped"


VERDICTS = tuple(str(v.value) for v in list(Verdict))


class HunkKind(Words):
    """What happened to a conflicting hunk between the two releases."""
    BOTH_ADDED = "both-added"                # both sides added lines at one place
    INSERT_BEFORE_REWRITE = "insert-before-rewrite"  # the patch inserts, upstream rewrote
    MOVED = "moved"                          # upstream moved the code to another file
    DELETED = "deleted"                      # upstream deleted the file or the code
    OVERLAP = "overlap"                      # both changed the same lines


@dataclass
class Proposal:
    """A proposed resolution, applied only when asked (--accept-proposals)."""
    summary: str
    file: str                                # where the lines go (another file for MOVED)
    lines: list[str] | None = None           # replaces the conflict hunk (same file)
    diff: str = ""                           # MOVED: the hunk trial-applied in ``file``


@dataclass
class Hunk:
    line: int
    ours: list[str]                          # upstream's new side
    base: list[str]                          # the merge base
    theirs: list[str]                        # the patch's side
    kind: HunkKind | None = None
    why: str = ""
    proposal: Proposal | None = None


@dataclass
class HunkVerdict:
    verdict: Verdict
    reason: str


@dataclass
class Conflict:
    file: str
    hunks: list[Hunk]
    verdicts: list[HunkVerdict] = field(default_factory=list)
    deleted_upstream: bool = False           # modify/delete: no markers, no hunks
    replaced_by: str | None = None           # for a deleted file: the likeliest successor
    patch_lines: int = 0                     # for a deleted file: the lines the patch adds there


@dataclass
class PatchState:
    id: str
    title: str
    file: str
    status: PatchStatus = PatchStatus.PENDING
    notes: list[str] = field(default_factory=list)
    reason: str | None = None
    old_commit: str | None = None
    new_commit: str | None = None
    conflicts: list[Conflict] = field(default_factory=list)
    replayed: bool = False    # resolved by a recorded whole resolution
    base_commit: str | None = None           # HEAD before this patch was applied


@dataclass
class RebaseState:
    source: dict              # the pin rebased from (Upstream as json)
    target: dict              # the pin rebased onto
    patches: list[PatchState]
    phase: Phase = Phase.APPLYING
    drop_obsolete: bool = False

    def current(self) -> PatchState | None:
        return next((p for p in self.patches if not p.status.settled), None)

    @classmethod
    def load(cls, path: Path) -> RebaseState:
        """The state file, checked against the dataclasses above as its schema."""
        hint = ("the rebase state is damaged: e2 rebase --abort puts everything back, "
                "then start again")
        try:
            return TypeAdapter(cls).validate_json(path.read_bytes())
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "(top level)"
            raise E2Error(f"{path}: {where}: {first['msg']}", hint=hint) from None

    def save(self, path: Path) -> None:
        write_atomic(path, json.dumps(asdict(self), indent=2) + "\n")
