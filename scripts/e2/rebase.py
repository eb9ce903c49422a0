"""e2 rebase: move the series onto a new upstream release, resumably.

Like git's own rebase, the work happens in steps that leave their state on
disk (``.e2/rebase/state.json``, written atomically after every step) and a
worktree (``.e2/rebase/work``) where conflicts are resolved by hand:

    e2 rebase --onto 0.32.0       # stops at a conflict or an obsolete patch
    e2 rebase --continue          # after resolving and staging (git add)
    e2 rebase --skip --reason R   # drop the current patch
    e2 rebase --abort             # series.yaml, patches/, overlay/, Dockerfile as before

series.yaml, patches/, overlay/ and the Dockerfile are only written at the
end, and the originals are kept in ``.e2/rebase/backup`` until the rebase is
done, so a process killed at any point loses nothing. Recorded resolutions
live in ``.e2/rr-cache`` (git rerere), outside the rebase, so they replay on
the next attempt.

This module holds the rebase's target pin and the line e2 status shows for a
rebase in progress; the verb (commands/rebase.py) drives the parts:
``rebase_state`` (state.json, paths, backup), ``rebase_steps`` (the step loop),
``rebase_conflicts`` (hunks and verdicts), ``rebase_resume`` (--continue,
--skip), ``rebase_result`` (the files written at the end) and
``rebase_report`` (the report).
"""

from __future__ import annotations

from e2 import console
from e2.apply import UpstreamOptions
from e2.errors import E2Error
from e2.rebase_state import Rebase
from e2.series import RELEASE_VERSION, Project, Upstream
from e2.upstream import find_sdist, local_version, sha256_file

# ---------------------------------------------------------------- target pin


def resolve_target(onto: str, current: Upstream, upstream: UpstreamOptions) -> Upstream:
    """The pin to rebase onto: the index's own sha256 of that release.

    A local tarball (--upstream) must be that release: its version is checked
    when it is imported, and its hash against the index's where the index is
    reachable; only without an index is its own hash pinned (with a warning).
    """
    version = onto[1:] if onto.startswith("v") else onto
    if not RELEASE_VERSION.match(version):
        raise E2Error(f"--onto {onto!r} is not a release version like 0.32.0")
    local = upstream.local
    if local is not None:
        found_version = local_version(local)
        if found_version != version:
            raise E2Error(f"--upstream {local} is vLLM {found_version}, not {version}",
                          hint=f"pass the {version} sdist or tree")
    try:
        found = find_sdist(current.project, version)
    except E2Error as exc:
        if local is None or not local.is_file():
            raise
        console.warn(f"{exc.message}: pinning {local.name} by its own sha256, unchecked "
                     "against the release")
        sha = sha256_file(local)
    else:
        if not found.sha256:
            raise E2Error(f"the index lists no sha256 for {found.filename}")
        sha = found.sha256
    return Upstream(project=current.project, version=version, tag=f"v{version}",
                    sdist_sha256=sha, git=current.git.model_copy(update={"commit": None})
                    if current.git else None)


def rebase_in_progress(project: Project) -> str | None:
    """One line for e2 status when a rebase is stopped (or was killed) half way."""
    rebase = Rebase(project, None)
    if not rebase.in_progress():
        return None
    try:
        state = rebase.load()
    except E2Error as exc:
        return f"a rebase is in progress, its state is damaged: {exc.message}"
    current = state.current()
    where = (f"stopped at {current.id} {current.title} ({current.status})" if current
             else "writing its result")
    return (f"a rebase from {state.source['tag']} onto {state.target['tag']} is in "
            f"progress, {where} (e2 rebase --continue, --skip or --abort)")
