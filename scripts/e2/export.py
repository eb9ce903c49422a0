"""A worktree's commits back into patches/ and series.yaml (e2 export's work;
the verb is commands/export.py).

The reverse of ``e2 apply``: each commit on top of the pinned tag becomes
``patches/NNNN-slug.patch`` in git's stable format, and series.yaml gets the
matching entries. Metadata follows a patch by its title (then by position, for
a retitled patch); a new commit gets an entry whose switch, tests and drop
condition the author fills in (verify names what is missing).
"""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path

import git

from e2.errors import E2Error
from e2.faults import checkpoint
from e2.fsio import read_tree, recover_dir, replace_dir, write_atomic
from e2.gitops import (
    FORMAT_PATCH_FLAGS,
    commit_summary,
    has_record,
    history_patch_ids,
    open_worktree,
    patch_id,
    read_record,
    require_clean,
    stable_git,
    worktree_base,
    write_record,
)
from e2.series import Patch, Project, Series, slugify
from e2.series_yaml import render_series


@dataclass
class ExportResult:
    entries: list[dict]
    new: list[str]
    dropped: list[str]
    changed: bool


def format_patches(repo: git.Repo, base: str) -> list[tuple[git.Commit, bytes]]:
    """Each commit in ``base..HEAD`` with its patch text in the stable format."""
    merges = repo.git.rev_list("--merges", f"{base}..HEAD").split()
    if merges:
        raise E2Error(f"{repo.working_tree_dir}: merge commit {merges[0][:12]} on top of "
                      f"{base}; a series is a straight line of commits",
                      hint="rebase the branch onto the tag without merges")
    commits = [repo.commit(sha) for sha in
               repo.git.rev_list("--reverse", f"{base}..HEAD").split()]
    if not commits:
        return []
    with tempfile.TemporaryDirectory(prefix="e2-export-") as tmp:
        stable_git(repo, "format-patch", *FORMAT_PATCH_FLAGS, "-o", tmp, f"{base}..HEAD")
        texts = [p.read_bytes() for p in sorted(Path(tmp).iterdir())]
    # format-patch writes an empty commit as a 0-byte file (or skips it): neither applies.
    # Empty: its parent's tree (compared through git's persistent cat-file, where a
    # diff of each commit started a git process per commit)
    empty = [c for c in commits if c.tree.hexsha == c.parents[0].tree.hexsha]
    if empty or len(texts) != len(commits) or not all(t.strip() for t in texts):
        named = (", ".join(f"{c.hexsha[:12]} ({commit_summary(c)})" for c in empty)
                 or "one of them")
        raise E2Error(f"{repo.working_tree_dir}: commit {named} on {base} changes nothing; "
                      "a patch must change a file",
                      hint="drop it (git rebase -i) and export again")
    return list(zip(commits, texts))


def _placeholder(patch_id: str, title: str, file: str) -> dict:
    return {"id": patch_id, "file": file, "title": title,
            "switch": {"name": None, "default": None, "compiled": False, "doc": None},
            "upstream": [], "drop_when": None, "tests": []}


def match_metadata(series: Series, titles: list[str]) -> list[Patch | None]:
    """The old series entry each new title continues, or None for a new patch."""
    by_title = {p.title: p for p in series.patches}
    matched: list[Patch | None] = [by_title.get(t) for t in titles]
    used = {p.id for p in matched if p}
    for position in range(len(titles)):
        if matched[position] is None and position < len(series.patches):
            candidate = series.patches[position]
            if candidate.id not in used and candidate.title not in titles:
                matched[position] = candidate  # same slot, new title: a retitled patch
                used.add(candidate.id)
    return matched


def export_series(project: Project, series: Series, source: Path) -> ExportResult:
    recover_dir(source)  # an apply --force stopped between its two renames: the old one back
    repo = open_worktree(source)
    require_clean(repo, "export reads commits only")
    base = worktree_base(repo)
    if base != series.upstream.tag:
        raise E2Error(f"{source} is on {base}, series.yaml pins {series.upstream.tag}",
                      hint="apply the series again (e2 apply --force) or rebase it")
    try:
        repo.git.merge_base("--is-ancestor", f"refs/tags/{base}", "HEAD")
    except git.GitCommandError:
        raise E2Error(f"{source}: HEAD does not descend from {base}",
                      hint="rebase the branch onto the tag") from None
    formatted = format_patches(repo, f"refs/tags/{base}")
    if not formatted and series.patches:
        raise E2Error(f"{source} has no commits on top of {base}; exporting it would drop "
                      f"all {len(series.patches)} patches of series.yaml",
                      hint="recreate the worktree with e2 apply --force (or remove the "
                           "patches from series.yaml by hand if that is what you want)")
    titles = [commit_summary(commit) for commit, _ in formatted]
    matched = match_metadata(series, titles)

    entries, contents, new = [], {}, []
    for number, ((_, patch_text), old, title) in enumerate(zip(formatted, matched, titles),
                                                            start=1):
        patch_id = f"{number:04d}"
        file = f"{patch_id}-{slugify(title)}.patch"
        contents[file] = patch_text
        if old is None:
            entries.append(_placeholder(patch_id, title, file))
            new.append(patch_id)
        else:
            entry = old.model_dump(mode="json")
            entry.update(id=patch_id, file=file, title=title)
            entries.append(entry)
    kept = {p.id for p in matched if p}
    dropped = [f"{p.id} {p.title}" for p in series.patches if p.id not in kept]

    data = series.model_dump(mode="json")
    data["patches"] = entries
    changed = _write(project, series, repo, base, render_series(data, _previous(project)),
                     contents)
    return ExportResult(entries, new, dropped, changed)


def _previous(project: Project) -> str:
    return project.series_file.read_text(encoding="utf-8")


def _write(project: Project, series: Series, repo: git.Repo, base: str, text: str,
           exported: dict[str, bytes]) -> bool:
    """patches/ and series.yaml as exported (the user's comments kept in ``text``); True
    when either changed."""
    old_patches = read_tree(project.patches_dir)
    # files series.yaml does not list (notes, a patch not in the series yet) are the user's
    users = {name: blob for name, blob in old_patches.items()
             if name not in {p.file for p in series.patches}}
    _refuse_losses(repo, series, base, old_patches, users, exported)
    contents = {**users, **exported}
    changed = old_patches != contents or _previous(project) != text
    if changed:
        # Interrupted between the two writes, patches/ is put back; killed there,
        # a second export finishes the job (the commits are still in the worktree).
        replace_dir(project.patches_dir, contents)
        try:
            checkpoint("export-patches-written")
            write_atomic(project.series_file, text)
        except BaseException:
            replace_dir(project.patches_dir, old_patches)
            raise
    write_record(repo, exported.values())  # what was there is now in patches/ or dropped
    return changed


def _refuse_losses(repo: git.Repo, series: Series, base: str, on_disk: dict[str, bytes],
                   kept: dict[str, bytes], contents: dict[str, bytes]) -> None:
    """Export rewrites only what e2 wrote: a file it does not list that an exported
    patch would replace, or a listed patch file edited by hand since e2 last applied
    or exported this worktree (when it would change or go), is refused by name."""
    clash = sorted(name for name in kept if contents.get(name, kept[name]) != kept[name])
    if clash:
        raise E2Error(f"patches/{clash[0]} is not in series.yaml, and export would "
                      "overwrite it with the worktree's patch of that name",
                      hint="move it out of patches/, then export again")
    at_risk = [p.file for p in series.patches
               if p.file in on_disk and contents.get(p.file) != on_disk[p.file]]
    seen = set(read_record(repo)["patch_files"])
    ids = None if has_record(repo) else history_patch_ids(repo, base)
    edited = [name for name in at_risk
              if hashlib.sha256(on_disk[name]).hexdigest() not in seen
              and on_disk[name] not in contents.values()
              and (ids is None or patch_id(repo, on_disk[name]) not in ids)]
    if edited:
        names = ", ".join(f"patches/{name}" for name in edited)
        raise E2Error(f"{names} changed since e2 last applied or exported {repo.working_tree_dir} "
                      "(edited by hand, or another checkout's); export would overwrite "
                      f"{'them' if len(edited) > 1 else 'it'}",
                      hint="to keep the edit, make it in the worktree's commit for that "
                           "patch; to drop it, git checkout -- (or move away) the file; "
                           "then export again")
