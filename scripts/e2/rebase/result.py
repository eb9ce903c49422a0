"""The end of a rebase: the rebased commits written back as ``patches/``,
``series.yaml`` pinned to the new release (the base image tag moved with it,
its digest unpinned), ``overlay/`` and the ``Dockerfile`` regenerated.
"""

from __future__ import annotations

from pathlib import Path

from e2.apply import AppliedTree, PatchResult
from e2.dockerfile import render_dockerfile
from e2.errors import E2Error
from e2.export import format_patches
from e2.faults import checkpoint
from e2.fsio import read_tree, replace_dir, write_atomic
from e2.gitops import commit_summary
from e2.overlay import plan_overlay, write_overlay
from e2.rebase.state import Phase, RebaseState
from e2.rebase.workspace import Rebase
from e2.series import Project, Series, Upstream, load_series, slugify
from e2.series_yaml import render_series


def finish(rebase: Rebase, state: RebaseState, series: Series) -> Series:
    """Write the rebased series, overlay and Dockerfile; return the new series."""
    edited = rebase.dir / "series-while-stopped.yaml"
    if state.phase != Phase.FINISHING:
        _keep_edits_made_while_stopped(rebase, series, edited)
        state.phase = Phase.FINISHING
        state.save(rebase.state_file)
    if edited.is_file():
        series = load_series(edited)
    repo = rebase.repo()
    target = Upstream.model_validate(state.target)
    formatted = format_patches(repo, f"refs/tags/{target.tag}")
    kept = [p for p in state.patches if p.status.applied]
    if len(formatted) != len(kept):
        raise E2Error(f"{rebase.work} has {len(formatted)} commits on {target.tag}, the "
                      f"rebase applied {len(kept)} patches",
                      hint="e2 rebase --abort, then start again")
    old_entries = {p.id: p for p in series.patches}
    entries, contents = [], {}
    for number, (patch_state, (commit, text)) in enumerate(zip(kept, formatted), start=1):
        entry = old_entries[patch_state.id].model_dump(mode="json")
        entry["id"] = f"{number:04d}"
        entry["title"] = commit_summary(commit)
        entry["file"] = f"{entry['id']}-{slugify(entry['title'])}.patch"
        contents[entry["file"]] = text
        entries.append(entry)
    data = series.model_dump(mode="json")
    data["upstream"] = {**state.target, "git": (
        {"remote": series.upstream.git.remote, "commit": None} if series.upstream.git else None)}
    data["image"]["base"] = retag_base(series.image.base, target.tag)
    data["image"]["digest"] = None  # unpinned until someone pins the new base
    data["patches"] = entries
    new_series = Series.model_validate(data)
    checkpoint("before-write")
    replace_dir(rebase.project.patches_dir, contents)
    previous = (edited if edited.is_file() else rebase.backup / "series.yaml").read_text(
        encoding="utf-8")
    write_atomic(rebase.project.series_file,
                 render_series(new_series.model_dump(mode="json"), previous))
    checkpoint("after-series")
    plan = plan_overlay(new_series, rebase.project, _rebased_tree(rebase, target, new_series))
    write_overlay(rebase.project, plan)
    _write_dockerfile(rebase.project, new_series, plan.manifest)
    return new_series


def _rebased_tree(rebase: Rebase, target: Upstream, series: Series) -> AppliedTree:
    """The rebase's own worktree as the applied series the overlay is planned from:
    its commits are the ones just exported (e2 verify then checks that the patches
    apply exactly and that overlay/ equals what they generate)."""
    repo = rebase.repo()
    base = repo.commit(f"refs/tags/{target.tag}").hexsha
    commits = repo.git.rev_list("--reverse", f"{base}..HEAD").split()
    results = [PatchResult(patch, "clean", commit)  # the overlay reads commits and ids
               for patch, commit in zip(series.patches, commits)]
    return AppliedTree(rebase.work, repo, target.tag, base, results)


def retag_base(base: str, tag: str) -> str:
    """vllm/vllm-openai:v0.31.0 -> vllm/vllm-openai:v0.32.0 (digest dropped)."""
    name = base.split("@", 1)[0]
    repository = name.rsplit(":", 1)[0] if ":" in name.rsplit("/", 1)[-1] else name
    return f"{repository}:{tag}"


def _write_dockerfile(project: Project, series: Series, manifest: dict) -> None:
    if (project.root / "images").is_dir():
        write_atomic(project.root / "Dockerfile", render_dockerfile(project, series, manifest))


def _keep_edits_made_while_stopped(rebase: Rebase, series: Series, edited: Path) -> None:
    """series.yaml edited while the rebase was stopped: its edits are kept (the
    rebase rewrites only the pin and the patch entries' ids, titles and files),
    or refused where they touch what the rebase rewrites; patches/ must be as it was."""
    backup_text = (rebase.backup / "series.yaml").read_bytes()
    current_text = rebase.project.series_file.read_bytes()
    saved, now = read_tree(rebase.backup / "patches"), read_tree(rebase.project.patches_dir)
    changed = sorted(name for name in set(saved) | set(now) if saved.get(name) != now.get(name))
    if changed:
        raise E2Error(f"patches/ was changed while the rebase was stopped ({', '.join(changed)});"
                      " the rebase rewrites patches/ from its worktree",
                      hint=f"make the change in {rebase.work} (commit --amend), restore "
                           "patches/ (git checkout -- patches), then e2 rebase --continue")
    if current_text == backup_text:
        return
    current = load_series(rebase.project.series_file)
    clashes = []
    if current.upstream != series.upstream:
        clashes.append("upstream")
    if [(p.id, p.file) for p in current.patches] != [(p.id, p.file) for p in series.patches]:
        clashes.append("the patches' ids or files")
    if clashes:
        raise E2Error(f"{rebase.project.series_file} was edited while the rebase was stopped, "
                      f"in what the rebase rewrites: {', '.join(clashes)}",
                      hint="undo those edits (the others are kept), then e2 rebase --continue;"
                           " or e2 rebase --abort")
    write_atomic(edited, current_text)
