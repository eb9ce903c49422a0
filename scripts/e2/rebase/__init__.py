"""e2 rebase: move the series onto a new upstream release, resumably.

Like git's own rebase, the work happens in steps that leave their state on
disk (``.e2/rebase/state.json``, written atomically after every step) and a
worktree (``.e2/rebase/work``) where conflicts are resolved by hand:

    e2 rebase --onto 0.32.0       # stops at a conflict, an obsolete patch, a missing name
    e2 rebase --continue          # after resolving and staging (git add)
    e2 rebase --skip --reason R   # drop the current patch
    e2 rebase --abort             # series.yaml, patches/, overlay/, Dockerfile as before
    e2 rebase --onto 0.33.0 --dry-run   # as far as it goes alone; a report; nothing written

series.yaml, patches/, overlay/ and the Dockerfile are only written at the
end, and the originals are kept in ``.e2/rebase/backup`` until the rebase is
done, so a process killed at any point loses nothing. Every stop writes a
report to ``.e2/rebase-reports`` (kept on --abort). Whole resolutions are
recorded in ``.e2/rr-cache/e2-resolutions``, outside the rebase, so they
replay on the next attempt.

The parts: ``state`` (the typed state.json), ``workspace`` (paths, backup,
abort), ``target`` (the pin rebased onto, e2 status's line), ``steps`` (the
step loop), ``conflicts`` (hunks and verdicts), ``hunks`` (each hunk
classified, with a proposal), ``moved`` (code upstream moved or deleted),
``proposals`` (--accept-proposals), ``replay`` (recorded whole resolutions),
``hotspots`` (what a clean apply may still break), ``resume`` (--continue,
--skip), ``result`` (the files written at the end), ``report`` (the reports)
and ``dryrun`` (--dry-run and e2 drift).
"""

from e2.rebase.target import rebase_in_progress, resolve_target

__all__ = ["rebase_in_progress", "resolve_target"]
