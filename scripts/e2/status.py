"""What e2 status shows (commands/status.py): what the series pins and whether
its generated files are in sync.

Cheap by design (no apply): it compares digests and file lists only; e2 verify
is the full check.
"""

from __future__ import annotations

from e2.dockerfile import dockerfile_drift, has_dockerfile
from e2.errors import E2Error
from e2.fsio import read_tree, set_aside
from e2.overlay import sync_problems, synced_manifest
from e2.rebase import rebase_in_progress
from e2.series import Project, Series, series_digest
from e2.upstream import UpstreamCache


def collect(project: Project, series: Series, cache: UpstreamCache) -> dict:
    problems: list[str] = []
    listed = {p.file for p in series.patches}
    on_disk = {p.name for p in project.patches_dir.glob("*.patch")}
    problems += [f"patches/{f} missing" for f in sorted(listed - on_disk)]
    problems += [f"patches/{f} not in series.yaml" for f in sorted(on_disk - listed)]
    digest = None
    if not problems:
        digest = series_digest(series, project.patches_dir)
    if not problems:  # the overlay's digest needs series.yaml and patches/ to agree
        problems += sync_problems(project, series)
    if not problems and has_dockerfile(project):
        try:
            problems += dockerfile_drift(project, series, synced_manifest(project, series))
        except E2Error as exc:
            problems.append(exc.message)
    overlay_files = [p for p in read_tree(project.overlay_dir) if p != "MANIFEST.json"]
    for target, verbs in ((project.default_worktree, "e2 apply or e2 export"),
                          (project.overlay_dir, "e2 overlay")):
        aside = set_aside(target)
        if aside:
            problems.append(f"{target.relative_to(project.root)} is missing: an interrupted "
                            f"replacement left it at {aside.relative_to(project.root)}, which "
                            f"the next {verbs} puts back")
    rebase = rebase_in_progress(project)
    if rebase:
        problems.append(rebase)
    return {
        "upstream": series.upstream.model_dump(mode="json"),
        "upstream_cached": cache.tag_commit(series.upstream.tag) is not None,
        "image": series.image.model_dump(mode="json"),
        "series_digest": digest,
        "patches": [{"id": p.id, "title": p.title, "file": p.file, "switch": p.switch.name,
                     "default": p.switch.default, "compiled": p.switch.compiled}
                    for p in series.patches],
        "overlay_files": len(overlay_files),
        "rebase": rebase,
        "in_sync": not problems,
        "problems": problems,
    }
