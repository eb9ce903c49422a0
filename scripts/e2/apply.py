"""The pinned upstream with the series on top, one commit per patch (for e2 apply,
overlay, verify, test and rebase; the verb is commands/apply.py)."""

from __future__ import annotations

import difflib
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import git

from e2 import console
from e2.am import git_am_series
from e2.cachedamage import UnreadableObjects, cache_damage, refuse_damaged, unreadable_objects
from e2.errors import E2Error
from e2.export import format_patches
from e2.faults import checkpoint
from e2.fsio import (
    NoSpace,
    no_space,
    read_tree,
    recover_dir,
    remove_aside,
    space_named,
    staging_paths,
)
from e2.gitops import (
    DIFF_FLAGS,
    Hunk,
    clone_worktree,
    commit_diff,
    commit_summary,
    for_want_of_space,
    open_worktree,
    out_of_space,
    parse_hunks,
    patch_id,
    refs_not_from,
    require_clean,
    stable_git,
    touched_files,
    unseen_reflog_commits,
    worktree_base,
    write_record,
)
from e2.series import Patch, Project, Series
from e2.upstream import UpstreamCache

Status = Literal["clean", "offset", "merged"]


@dataclass
class PatchResult:
    patch: Patch
    status: Status
    commit: str
    notes: list[str] = field(default_factory=list)


@dataclass
class AppliedTree:
    path: Path
    repo: git.Repo
    base_tag: str
    base_commit: str
    results: list[PatchResult]

    @property
    def head(self) -> str:
        return self.repo.head.commit.hexsha

    def commit_of(self, patch_id: str) -> str:
        return next(r.commit for r in self.results if r.patch.id == patch_id)


@dataclass
class UpstreamOptions:
    """How to reach upstream; filled from the global CLI options."""

    cache: UpstreamCache
    source: str = "auto"
    local: Path | None = None

    def ensure(self, series: Series) -> str:
        return self.cache.ensure(series.upstream, source=self.source, local=self.local)


def select_patches(series: Series, through: str | None) -> list[Patch]:
    if through is None:
        return list(series.patches)
    series.by_id(through)  # a clear error for an unknown id
    selected = []
    for patch in series.patches:
        selected.append(patch)
        if patch.id == through:
            break
    return selected


def check_patch_file(project: Project, patch: Patch) -> str:
    """The patch's text, refused with its name when it is missing, empty or not a diff."""
    path = project.patch_path(patch)
    where = f"{project.patches_dir.name}/{patch.file} (patch {patch.id})"
    if not path.is_file():
        raise E2Error(f"series.yaml lists {patch.id} as {project.patches_dir.name}/"
                      f"{patch.file}, which does not exist",
                      hint="restore the file or remove the entry from series.yaml")
    data = path.read_bytes()
    if not data.strip():
        raise E2Error(f"{where} is empty", hint="restore it (git checkout -- patches/) or "
                      "re-export it from a worktree (e2 export)")
    text = data.decode("utf-8", errors="replace")
    try:
        files = touched_files(text)
    except Exception as exc:  # unidiff's parse errors carry the line that broke it
        raise E2Error(f"{where} is not a valid diff: {exc}",
                      hint="restore it (git checkout -- patches/) or re-export it") from None
    if not files:
        raise E2Error(f"{where} holds no diff (no file changes)",
                      hint="restore it (git checkout -- patches/) or re-export it")
    missing = _missing_mail_header(text)
    if missing:
        raise E2Error(f"{where} has no mail header: it is a plain diff, not git format-patch "
                      f"output (no {' and no '.join(missing)})",
                      hint="commit the change in a worktree (e2 apply) and export it "
                           "(e2 export), or write it with git format-patch")
    return text


def _missing_mail_header(text: str) -> list[str]:
    """What git am needs of the header git format-patch writes (the lines before the
    first blank one) and ``text`` lacks: its 'From <commit>' line, its Subject."""
    header = text.split("\n\n", 1)[0].splitlines()
    missing = [] if header and header[0].startswith("From ") else ["'From ' line"]
    if not any(line.startswith("Subject:") for line in header):
        missing.append("'Subject:'")
    return missing


def apply_series(project: Project, series: Series, dest: Path, upstream: UpstreamOptions,
                 through: str | None = None, exact: bool = False,
                 replace: bool = False, sparse: bool = False) -> AppliedTree:
    """Apply the series into ``dest``; ``sparse`` checks out only the files it touches.

    The worktree is built beside ``dest`` and moved into place complete, so an
    interrupted apply leaves ``dest`` as it was (and a staging dir the next
    apply removes).
    """
    patches = select_patches(series, through)
    for patch in patches:
        check_patch_file(project, patch)
    base_commit = upstream.ensure(series)
    _check_destination(project, dest, replace, upstream.cache.repo_dir)
    staging, _ = staging_paths(dest)
    with space_named(dest.parent):
        dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with console.status(f"checking out {series.upstream.tag} into {dest}"):
            repo = clone_worktree(upstream.cache.repo_dir, staging, series.upstream.tag,
                                  touched_paths(project, patches) if sparse else None)
        refuse_damaged(repo, upstream.cache.repo_dir, series.upstream.tag)
        checkpoint("apply-cloned")
        failed: E2Error | None = None
        try:
            merged = _apply_patches(repo, project, patches, series)
        except NoSpace:
            raise
        except E2Error as exc:  # the worktree stays at the last patch that applied, to fix it
            failed = exc
        write_record(repo, (project.patch_path(p).read_bytes() for p in patches))
        checkpoint("apply-applied")
    except BaseException as exc:  # interrupted or failed: leave the destination as it was
        # judged before the staging dir goes, which frees what the disk had left
        full = for_want_of_space(exc, staging)
        shutil.rmtree(staging, ignore_errors=True)
        if full:
            raise no_space(dest) from None
        damage = cache_damage(exc, upstream.cache.repo_dir, series.upstream.tag)
        if damage is not None:  # the cache's objects, not a patch
            raise damage from None
        raise
    _move_into_place(staging, dest)
    if failed is not None:
        raise failed
    repo = git.Repo(dest)
    commits = repo.git.rev_list("--reverse", f"{base_commit}..HEAD").split()
    results = [PatchResult(patch, "merged" if patch.id in merged else "clean", commit)
               for patch, commit in zip(patches, commits)]
    find_offsets(repo, project, results)
    if exact:
        _refuse_inexact(results, series.upstream.tag)
    return AppliedTree(dest, repo, series.upstream.tag, base_commit, results)


def _refuse_inexact(results: list[PatchResult], tag: str) -> None:
    """``apply --exact``: a patch that needed an offset or a 3-way merge is an error."""
    lines = [f"{r.patch.id} ({r.patch.file}): {r.status}: " + "; ".join(r.notes)
             for r in results if r.status != "clean"]
    if lines:
        raise E2Error(f"patches do not apply exactly on {tag}:\n  " + "\n  ".join(lines),
                      hint="re-export them from a worktree (e2 apply; e2 export) so their "
                           "context matches upstream")


def _check_destination(project: Project, dest: Path, replace: bool, cache_repo: Path) -> None:
    """Refuse a ``dest`` that is not a directory, or holds work and ``replace`` is
    not given or would lose some (after putting back an interrupted swap's old one)."""
    recover_dir(dest)  # an apply --force stopped between its two renames: the old one back
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise E2Error(f"{dest} exists and is not a directory",
                      hint="choose another --out, or move that file away")
    if dest.exists() and any(dest.iterdir()):
        if not replace:
            raise E2Error(f"{dest} already exists",
                          hint="export what you changed there (e2 export --from DIR), then "
                               "pass --force to replace it, or choose another --out")
        _check_replaceable(project, dest, cache_repo)


class ScratchTree:
    """``with ScratchTree(...) as tree:`` the series applied exactly into a temporary
    worktree under the project's state directory, removed when the block ends.

    ``sparse``: only the files the patches touch are checked out; read everything
    else from the commits (``tree.repo``), never from the working directory.
    Otherwise the checkout is full (tests and conftests included).
    """

    def __init__(self, project: Project, series: Series, upstream: UpstreamOptions,
                 sparse: bool = True, prefix: str = "scratch-"):
        self.project, self.series, self.upstream = project, series, upstream
        self.sparse, self.prefix = sparse, prefix
        self._tmp: tempfile.TemporaryDirectory | None = None

    def __enter__(self) -> AppliedTree:
        self.project.state_dir.mkdir(parents=True, exist_ok=True)
        self._tmp = tempfile.TemporaryDirectory(dir=self.project.state_dir, prefix=self.prefix)
        try:
            return apply_series(self.project, self.series, Path(self._tmp.name) / "tree",
                                self.upstream, exact=True, sparse=self.sparse)
        except BaseException:
            self._tmp.cleanup()
            raise

    def __exit__(self, *exc_info: object) -> None:
        assert self._tmp is not None
        self._tmp.cleanup()


def _move_into_place(staging: Path, dest: Path) -> None:
    """Swap the new worktree in with two renames; the old one (checked by
    _check_replaceable: nothing in it is lost) is removed only once it is out of the
    way, so no interruption leaves a half-deleted worktree where a verb looks."""
    _, old = staging_paths(dest)
    if dest.exists():
        dest.rename(old)
    checkpoint("apply-swapping")
    staging.rename(dest)
    checkpoint("apply-swapped")
    problem = remove_aside(old)
    if problem is not None:
        console.warn(f"the old worktree, set aside at {old}, could not be removed "
                     f"({problem}); the new one is in place. Remove it by hand")


def touched_paths(project: Project, patches: list[Patch]) -> list[str]:
    paths: dict[str, None] = {}
    for patch in patches:
        text = project.patch_path(patch).read_text(encoding="utf-8", errors="replace")
        paths.update((path, None) for path, _ in touched_files(text))
    return list(paths)


def _check_replaceable(project: Project, dest: Path, upstream: Path) -> None:
    """--force replaces a worktree only when nothing in it would be lost: no change,
    untracked or ignored file, stopped git operation, ref of its own (branch, tag,
    stash, note), nor commit outside patches/ on HEAD or in a reflog entry made since
    e2 last applied or exported it."""
    repo = open_worktree(dest)
    require_clean(repo, "--force would delete them")
    # byte-compiled files come back by themselves; anything else ignored is the user's
    ignored = [line[3:] for line in
               repo.git.status("--porcelain", "--ignored=matching").splitlines()
               if line.startswith("!! ") and not line.rstrip("/").endswith(("__pycache__",
                                                                              ".pyc"))]
    if ignored:
        raise E2Error(f"{dest} holds git-ignored files that --force would delete: "
                      + ", ".join(ignored[:5]) + (" ..." if len(ignored) > 5 else ""),
                      hint="move them out of the worktree (or delete them), then run "
                           "e2 apply --force again")
    refs = refs_not_from(repo, upstream)
    if refs:
        raise E2Error(f"{dest} has refs of its own that --force would delete: "
                      + ", ".join(_describe_ref(repo, ref) for ref in refs[:5])
                      + (" ..." if len(refs) > 5 else ""),
                      hint="export what you want to keep (e2 export --from DIR), move the "
                           "rest elsewhere (git -C DIR push <repo> <ref>) and delete them "
                           "there (git branch -D, git tag -d, git stash clear), then run "
                           "e2 apply --force again")
    base = worktree_base(repo)
    exported = read_tree(project.patches_dir, "*.patch")
    for commit, text in format_patches(repo, f"refs/tags/{base}"):
        if text not in exported.values():
            raise E2Error(f"{dest} has commit {commit.hexsha[:12]} ({commit_summary(commit)}) "
                          "that is not in patches/; --force would lose it",
                          hint=f"export it first: e2 export --from {dest}")
    known = {patch_id(repo, text) for text in exported.values()}
    for sha in unseen_reflog_commits(repo, base):
        if patch_id(repo, commit_diff(repo, sha)) not in known:
            raise E2Error(f"{dest} has commit {sha[:12]} ({commit_summary(repo.commit(sha))}) "
                          "only in its reflog (reset, amended or rebased away since e2 last "
                          "applied or exported it), not in patches/; --force would lose it",
                          hint=f"keep it on a branch elsewhere, or, if it is not wanted, run "
                               f"e2 export --from {dest} (it records what the worktree holds "
                               "as seen), then e2 apply --force")


def _describe_ref(repo: git.Repo, ref: str) -> str:
    if ref == "refs/stash":
        count = len(repo.git.stash("list").splitlines())
        return f"the stash ({count} entr{'y' if count == 1 else 'ies'})"
    for prefix, kind in (("refs/heads/", "branch"), ("refs/tags/", "tag")):
        if ref.startswith(prefix):
            return f"{kind} {ref.removeprefix(prefix)}"
    return ref


def _apply_patches(repo: git.Repo, project: Project, patches: list[Patch],
                   series: Series) -> set[str]:
    """Apply ``patches`` with one git am; return the ids that needed a 3-way merge."""
    if not patches:
        return set()
    with console.progress(count=True) as progress:
        task = progress.add_task(f"applying {len(patches)} patches", total=len(patches))

        def started(index: int) -> None:
            progress.update(task, completed=index, description=f"applying {patches[index].id}")

        run = git_am_series(repo, [project.patch_path(p) for p in patches], started)
        returncode, output, current = run.returncode, run.output, run.started - 1
        progress.update(task, completed=current + 1 if returncode == 0 else current)
    merged = {patches[index].id for index in run.fell_back}
    if returncode != 0:
        if out_of_space("\n".join(output), Path(repo.git_dir)):
            # a write that failed, not a patch: nothing to describe or keep
            raise no_space(str(repo.working_tree_dir))
        unreadable = unreadable_objects("\n".join(output))
        if unreadable:
            raise UnreadableObjects(unreadable)
        failed = patches[max(current, 0)]
        repo.git.am("--quit")
        repo.git.reset("-q", "--hard", "HEAD")
        applied = [p.id for p in patches[:max(current, 0)]]
        raise E2Error(describe_failure(repo, project, failed, series, applied, output))
    return merged


def describe_failure(repo: git.Repo, project: Project, patch: Patch, series: Series,
                     applied: list[str], git_output: list[str]) -> str:
    """Name the patch, file and hunk that failed, with the upstream lines it expected."""
    base = series.upstream.tag + (f" + {applied[0]}..{applied[-1]}" if applied else "")
    head = f"patch {patch.id} ({project.patches_dir.name}/{patch.file}) does not apply on {base}"
    assert repo.working_tree_dir is not None  # a worktree made by e2 apply, never bare
    worktree = Path(repo.working_tree_dir)
    text = project.patch_path(patch).read_text(encoding="utf-8", errors="replace")
    for hunk in parse_hunks(text):
        target = worktree / hunk.path
        if not hunk.source_lines:
            if target.exists() and hunk.source_start == 0:
                return f"{head}\n  file {hunk.path}: the patch creates it, but it already exists"
            continue
        if not target.exists():
            return f"{head}\n  file {hunk.path}: does not exist upstream (hunk {hunk.index} {hunk.header})"
        lines = target.read_text(encoding="utf-8", errors="replace").splitlines()
        if _find_block(lines, hunk.source_lines) is not None:
            continue
        return head + "\n" + _hunk_mismatch(hunk, lines)
    git_says = "\n    ".join(line for line in git_output if line.strip())
    return f"{head}\n  git am said:\n    {git_says}"


def _find_block(lines: list[str], block: tuple[str, ...]) -> int | None:
    size = len(block)
    for start in range(len(lines) - size + 1):
        if tuple(lines[start:start + size]) == block:
            return start
    return None


def _closest_start(lines: list[str], block: tuple[str, ...], hint: int) -> int:
    """Where upstream looks most like the block (ties go to the patch's own line)."""
    def score(start: int) -> tuple[int, int]:
        same = sum(a == b for a, b in zip(lines[start:start + len(block)], block))
        return same, -abs(start - hint)
    return max(range(max(len(lines) - len(block) + 1, 1)), key=score)


def _hunk_mismatch(hunk: Hunk, lines: list[str]) -> str:
    start = _closest_start(lines, hunk.source_lines, max(hunk.source_start - 1, 0))
    found = lines[start:start + len(hunk.source_lines)]
    diff = difflib.unified_diff(list(hunk.source_lines), found, "patch expects",
                                f"upstream has (lines {start + 1}-{start + len(found)})",
                                lineterm="", n=1)
    return (f"  file {hunk.path}, hunk {hunk.index} {hunk.header}: the upstream lines "
            f"it expects are not there\n    " + "\n    ".join(diff))


def find_offsets(repo: git.Repo, project: Project, results: list[PatchResult]) -> None:
    """Mark patches whose hunks landed on other lines than the patch file says."""
    if not results:
        return
    log = stable_git(repo, "log", "--reverse", "--format=%x00%H", "-p", *DIFF_FLAGS,
                     f"{results[0].commit}~1..{results[-1].commit}")
    regenerated = {}
    for chunk in log.split("\x00")[1:]:
        commit, _, diff = chunk.partition("\n")
        regenerated[commit.strip()] = diff
    for result in results:
        fresh = {(h.path, h.body): h for h in parse_hunks(regenerated.get(result.commit, ""))}
        original = project.patch_path(result.patch).read_text(encoding="utf-8", errors="replace")
        for hunk in parse_hunks(original):
            landed = fresh.get((hunk.path, hunk.body))
            if landed is not None and landed.source_start != hunk.source_start:
                delta = landed.source_start - hunk.source_start
                result.notes.append(f"{hunk.path} hunk {hunk.index} at offset {delta:+d} lines")
        if result.notes and result.status == "clean":
            result.status = "offset"
        if result.status == "merged":
            result.notes.insert(0, "needed a 3-way merge (context differs from upstream)")
