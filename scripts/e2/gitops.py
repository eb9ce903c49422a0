"""Git plumbing shared by the verbs: worktrees, stable diff options, patch parsing."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import git
from unidiff import PatchSet

from e2.cachedamage import cache_damage
from e2.errors import E2Error
from e2.fsio import NoSpace, nearly_full, write_atomic

# Diff options pinned in every command that writes or compares patches, so the
# output never depends on the user's git config (abbrev, renames, prefixes).
STABLE_CONFIG = (
    "core.abbrev=12",
    "diff.algorithm=myers",
    "diff.noprefix=false",
    "diff.mnemonicPrefix=false",
    "diff.relative=false",
    "diff.suppressBlankEmpty=false",
    "format.signature=",
    "format.numbered=false",
    "format.coverLetter=false",
    "core.quotePath=true",
    "core.autocrlf=false",
    "i18n.commitEncoding=UTF-8",
    "i18n.logOutputEncoding=UTF-8",
)
DIFF_FLAGS = ("-M", "--abbrev=12")
FORMAT_PATCH_FLAGS = ("--zero-commit", "--no-signature", "--no-numbered", "--stat=72",
                      *DIFF_FLAGS)

# Commits the driver makes (one per patch) get a fixed committer and the
# author's date, so the same series always yields the same commit ids.
COMMITTER_ENV = {
    "GIT_COMMITTER_NAME": "vLLM E2",
    "GIT_COMMITTER_EMAIL": "e2@vllm-e2.invalid",
}
BRANCH = "e2"
# git am's line when a patch did not apply as is and it merged three ways.
AM_FELL_BACK = "Falling back to patching base and 3-way merge"


GIT_MISSING = "git is not on PATH (e2 needs it)"
GIT_MISSING_HINT = "install git (apt-get install git, brew install git), or put it on PATH"


def require_git() -> None:
    """Refuse at once, in one line, when there is no git to run."""
    if shutil.which("git") is None:
        raise E2Error(GIT_MISSING, hint=GIT_MISSING_HINT)


# What git prints when a write fails for want of space: strerror(ENOSPC) and the
# words of its write_or_die.
_NO_SPACE = ("no space left on device", "out of diskspace")
# How git reports a failed write without saying why (a checkout's "unable to write
# file", an index's "unable to write new index file"): for want of space when the
# disk is nearly full.
_WRITE_FAILED = ("unable to write", "write error", "could not write", "failed to write",
                 "short write")


def out_of_space(git_output: str, where: Path) -> bool:
    """Whether a git command that wrote under ``where`` and said ``git_output`` failed
    because the disk is full (read before the command's leftovers are removed)."""
    # only git's own complaints: a commit subject ("Applying: ...") may say anything;
    # gitpython's GitCommandError puts "  stderr: '" before the first line
    lines = (line.strip().removeprefix("stderr: '").removeprefix("stdout: '")
             for line in git_output.lower().splitlines())
    text = "\n".join(line for line in lines if line.startswith(("error:", "fatal:")))
    if any(words in text for words in _NO_SPACE):
        return True
    return any(words in text for words in _WRITE_FAILED) and nearly_full(where)


def git_am(repo: git.Repo, patch_files: list[Path],
           on_line: Callable[[str], None] | None = None) -> tuple[int, list[str]]:
    """``git am --3way`` of ``patch_files`` in ``repo``'s worktree as the driver commits
    (its committer, the author's date); git's exit code and output lines (stdout and
    stderr together), each also given to ``on_line`` as it comes."""
    command = ["git", "am", "--3way", "--committer-date-is-author-date",
               *map(str, patch_files)]
    process = subprocess.Popen(command, cwd=repo.working_tree_dir,
                               env={**os.environ, **COMMITTER_ENV},
                               text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert process.stdout is not None
    output = []
    with process.stdout:
        for line in process.stdout:
            output.append(line.rstrip("\n"))
            if on_line is not None:
                on_line(output[-1])
    return process.wait(), output


def stable_git(repo: git.Repo, *args: str, **kwargs: Any) -> str:
    """Run ``git -c <stable config> args`` through gitpython's wrapper."""
    command = ["git"]
    for item in STABLE_CONFIG:
        command += ["-c", item]
    return repo.git.execute([*command, *args], **kwargs)


def clone_worktree(cache_repo: Path, dest: Path, tag: str,
                   sparse_paths: list[str] | None = None) -> git.Repo:
    """A working clone at ``tag`` on branch ``e2`` (objects shared with the cache).

    ``sparse_paths`` checks out only those files: enough for git am when they
    are the files the patches touch, and far cheaper than the whole tree.
    """
    # e2.base records the release the branch sits on; rerere replays resolutions
    # recorded once; parallel checkout halves the time to write the ~7,400 files.
    config = [f"e2.base={tag}", "rerere.enabled=true", "checkout.workers=0"]
    if sparse_paths is not None:  # only git writes there: no stat of each path per index read
        config.append("sparse.expectFilesOutsideOfPatterns=true")
    # allow_unsafe_options: gitpython guards --config against injected values;
    # these are the driver's own constants
    repo = git.Repo.clone_from(str(cache_repo), str(dest), shared=True, no_checkout=True,
                               quiet=True, multi_options=[f"--config={c}" for c in config],
                               allow_unsafe_options=True)
    if sparse_paths is not None:
        # the never-matching first pattern keeps an empty list from meaning "everything"
        repo.git.sparse_checkout("set", "--no-cone", "/.e2-none",
                                 *(f"/{path}" for path in sparse_paths))
    check_out_release(repo, cache_repo, tag, new_branch=True)
    return repo


def check_out_release(repo: git.Repo, cache_repo: Path, tag: str,
                      new_branch: bool = False) -> None:
    """Branch ``e2`` at release ``tag`` in ``repo`` (a clone sharing ``cache_repo``'s
    objects), created or moved there; a cache object git cannot read is named as a
    damaged cache."""
    try:
        repo.git.checkout("-q", "-b" if new_branch else "-B", BRANCH, f"refs/tags/{tag}")
    except git.GitCommandError as exc:
        damage = cache_damage(exc, cache_repo, tag)
        if damage is None:
            raise
        raise damage from None


def open_worktree(path: Path) -> git.Repo:
    if not path.exists():
        raise E2Error(f"no worktree at {path}", hint="create one with: e2 apply")
    try:
        repo = git.Repo(path)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        raise E2Error(f"{path} is not a git worktree made by e2 apply",
                      hint="create one with: e2 apply --out DIR") from None
    if repo.working_tree_dir is None or Path(repo.working_tree_dir).resolve() != path.resolve():
        raise E2Error(f"{path} is inside another repository, not an e2 worktree",
                      hint="create one with: e2 apply --out DIR")
    return repo


def worktree_base(repo: git.Repo) -> str:
    try:
        return repo.git.config("e2.base")
    except git.GitCommandError:
        raise E2Error(f"{repo.working_tree_dir} was not made by e2 apply (no e2.base)",
                      hint="create one with: e2 apply --out DIR") from None


def commit_summary(commit: git.Commit) -> str:
    """The commit's first line; gitpython leaves a message that fails to decode as bytes."""
    summary = commit.summary
    if isinstance(summary, bytes):
        return summary.decode(commit.encoding, errors="replace")
    return summary


def am_in_progress(repo: git.Repo) -> bool:
    return Path(repo.git_dir, "rebase-apply").exists()


# What git leaves in a repository's git dir while an operation is stopped (a
# conflict, an `edit` step, a bisection): the command that owns it, first match wins.
_STOPPED = (("rebase-apply/applying", "am"), ("rebase-apply", "rebase"),
            ("rebase-merge", "rebase"), ("CHERRY_PICK_HEAD", "cherry-pick"),
            ("REVERT_HEAD", "revert"), ("MERGE_HEAD", "merge"), ("sequencer", "cherry-pick"),
            ("BISECT_LOG", "bisect"))


def operation_in_progress(repo: git.Repo) -> str | None:
    """The git command stopped half-way in ``repo`` (am, rebase, cherry-pick, revert,
    merge, bisect), or None."""
    for name, command in _STOPPED:
        if Path(repo.git_dir, name).exists():
            return command
    return None


def require_clean(repo: git.Repo, why: str) -> None:
    command = operation_in_progress(repo)
    if command is not None:
        where = repo.working_tree_dir
        finish = ("end it: git -C {0} bisect reset" if command == "bisect" else
                  "finish it (git -C {0} {1} --continue) or drop it (git -C {0} {1} --abort)")
        raise E2Error(f"{where}: a git {command} is in progress (stopped half-way; "
                      "its commits are not all there yet)",
                      hint=finish.format(where, command) + ", then run this command again")
    if repo.is_dirty(untracked_files=True):
        changed = repo.git.status("--porcelain").splitlines()[:10]
        raise E2Error(f"{repo.working_tree_dir} has uncommitted changes ({why}):\n  "
                      + "\n  ".join(changed),
                      hint="commit them (one commit per patch) or stash them")


# What e2 last saw in a worktree, in its git dir: the tip of every reflog entry
# then (commits reset or amended away before it were exported or applied) and the
# sha256 of every patch file it applied or exported there.
RECORD = "e2-record.json"


def has_record(repo: git.Repo) -> bool:
    return Path(repo.git_dir, RECORD).is_file()


def history_patch_ids(repo: git.Repo, base: str) -> set[str]:
    """The patch ids of every commit on ``base`` that HEAD or a reflog reaches."""
    log = subprocess.run(["git", "log", "-p", "--format=commit %H", *DIFF_FLAGS, "--reflog",
                          "HEAD", "--not", f"refs/tags/{base}"],
                         cwd=repo.git_dir, capture_output=True, check=True).stdout
    ids = subprocess.run(["git", "patch-id", "--stable"], input=log, cwd=repo.git_dir,
                         capture_output=True, check=True).stdout
    return {line.split()[0] for line in ids.decode().splitlines() if line.strip()}


def read_record(repo: git.Repo) -> dict[str, list[str]]:
    try:
        data = json.loads(Path(repo.git_dir, RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {"reflog": [], "patch_files": []}  # made before the record: nothing seen
    return {key: [str(item) for item in data.get(key, [])] for key in ("reflog", "patch_files")}


def write_record(repo: git.Repo, patch_files: Iterable[bytes]) -> None:
    """Mark the worktree's reflogs as seen, and ``patch_files`` (with those seen before)."""
    hashes = set(read_record(repo)["patch_files"])
    hashes.update(hashlib.sha256(data).hexdigest() for data in patch_files)
    record = {"reflog": sorted(reflog_tips(repo)), "patch_files": sorted(hashes)}
    write_atomic(Path(repo.git_dir, RECORD), json.dumps(record, indent=1) + "\n")


def reflog_tips(repo: git.Repo) -> set[str]:
    """Every commit a reflog entry of ``repo`` moved a ref or HEAD to."""
    tips: set[str] = set()
    logs = Path(repo.git_dir, "logs")
    for log in (p for p in logs.rglob("*") if p.is_file()):
        for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
            fields = line.split(" ", 2)
            if len(fields) > 1 and fields[1].strip("0"):
                tips.add(fields[1])
    return tips


def unseen_reflog_commits(repo: git.Repo, base: str) -> list[str]:
    """Commits only reflogs reach (reset, amended or rebased away) whose entries came
    after e2 last applied or exported the worktree, oldest first."""
    seen = set(read_record(repo)["reflog"])
    new = sorted(reflog_tips(repo) - seen)
    if not new:
        return []
    kept = ["HEAD", f"refs/tags/{base}", *(t for t in seen if _exists(repo, t))]
    if _exists(repo, f"refs/heads/{BRANCH}"):
        kept.append(f"refs/heads/{BRANCH}")
    tips = [t for t in new if _exists(repo, t)]  # a pruned entry's commit may be gone
    return repo.git.rev_list("--reverse", *tips, "--not", *kept).split() if tips else []


def patch_id(repo: git.Repo, patch: bytes) -> str | None:
    """git's id for the change a patch makes (not its message, nor its line numbers)."""
    result = subprocess.run(["git", "patch-id", "--stable"], input=patch, cwd=repo.git_dir,
                            capture_output=True, check=True)
    return result.stdout.split()[0].decode() if result.stdout.strip() else None


def commit_diff(repo: git.Repo, commit: str) -> bytes:
    """The change ``commit`` makes, as a diff (enough for ``patch_id``)."""
    return subprocess.run(["git", "show", "--format=", *DIFF_FLAGS, commit],
                          cwd=repo.git_dir, capture_output=True, check=True).stdout


def _exists(repo: git.Repo, rev: str) -> bool:
    try:
        repo.git.rev_parse("-q", "--verify", f"{rev}^{{commit}}")
    except git.GitCommandError:
        return False
    return True


def refs_not_from(repo: git.Repo, upstream: Path) -> list[str]:
    """``repo``'s refs that are not the clone's own copy of ``upstream``'s (its tags,
    its branches as origin's) nor the checked-out e2 branch: branches, tags, stashes,
    notes someone made in the worktree."""
    def listing(where: git.Git) -> dict[str, str]:
        rows = where.for_each_ref("--format=%(refname) %(objectname)").splitlines()
        return dict(row.split(" ", 1) for row in rows)

    theirs = listing(git.Git(str(upstream)))
    head = repo.git.rev_parse("HEAD")
    mine = []
    for name, sha in listing(repo.git).items():
        origin = name.replace("refs/remotes/origin/", "refs/heads/", 1)
        if theirs.get(origin) == sha or name == "refs/remotes/origin/HEAD":
            continue
        if name == f"refs/heads/{BRANCH}" and sha == head:
            continue
        mine.append(name)
    return mine


@dataclass(frozen=True)
class Hunk:
    path: str
    index: int           # 1-based within its file
    source_start: int
    source_length: int
    header: str
    source_lines: tuple[str, ...]   # context and removed lines, as upstream must have them
    body: tuple[str, ...]           # every line with its +/-/space marker


def parse_hunks(patch_text: str) -> list[Hunk]:
    """Every hunk of a patch (mail headers and diffstat are skipped)."""
    hunks: list[Hunk] = []
    for patched_file in PatchSet(patch_text):
        path = patched_file.path
        for number, hunk in enumerate(patched_file, start=1):
            source = tuple(line.value.rstrip("\n") for line in hunk
                           if line.is_context or line.is_removed)
            body = tuple(str(line).rstrip("\n") for line in hunk)
            header = f"@@ -{hunk.source_start},{hunk.source_length} " \
                     f"+{hunk.target_start},{hunk.target_length} @@"
            hunks.append(Hunk(path, number, hunk.source_start, hunk.source_length,
                              header, source, body))
    return hunks


def touched_files(patch_text: str) -> list[tuple[str, str]]:
    """(path, kind) for each file a patch touches; kind is added/removed/modified."""
    result = []
    for patched_file in PatchSet(patch_text):
        kind = ("added" if patched_file.is_added_file else
                "removed" if patched_file.is_removed_file else "modified")
        result.append((patched_file.path, kind))
        if patched_file.is_rename:
            result.append((patched_file.source_file.removeprefix("a/"), "removed"))
    return result


def for_want_of_space(exc: BaseException, staging: Path) -> bool:
    """Whether building the worktree in ``staging`` failed because its disk is full
    (git seldom says so: a failed checkout or index write names no cause)."""
    if isinstance(exc, NoSpace):
        return True
    if isinstance(exc, OSError):
        return exc.errno == errno.ENOSPC
    if isinstance(exc, git.GitCommandError):
        return out_of_space(f"{exc.stderr}\n{exc.stdout}", staging)
    return False
