"""The rebase's target pin, and the line e2 status shows for a rebase in progress."""

from __future__ import annotations

from e2 import console
from e2.apply import UpstreamOptions
from e2.errors import E2Error
from e2.rebase.state import Phase
from e2.rebase.workspace import Rebase
from e2.series import RELEASE_VERSION, Project, Upstream
from e2.upstream import find_sdist, local_version, sha256_file

# ---------------------------------------------------------------- target pin


def release_version(onto: str) -> str:
    """0.32.0 for --onto 0.32.0 or v0.32.0; refused unless it is a release version."""
    version = onto[1:] if onto.startswith("v") else onto
    if not RELEASE_VERSION.match(version):
        raise E2Error(f"--onto {onto!r} is not a release version like 0.32.0")
    return version


def resolve_target(onto: str, current: Upstream, upstream: UpstreamOptions) -> Upstream:
    """The pin to rebase onto: the index's own sha256 of that release.

    A local tarball (--upstream) must be that release: its version is checked
    when it is imported, and its hash against the index's where the index is
    reachable; only without an index is its own hash pinned (with a warning).
    """
    version = release_version(onto)
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


# Why a rebase stands at a patch, by its phase (a patch's own status says only
# "conflict" for each of these stops).
STOPPED_FOR = {Phase.CONFLICT: "conflicts to resolve",
               Phase.OBSOLETE: "it applies in reverse: already upstream?",
               Phase.REPLAY: "a recorded resolution no longer applies",
               Phase.MISSING_NAME: "it uses a vllm name the release lacks"}


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
    why = STOPPED_FOR.get(state.phase, current.status.value) if current else ""
    where = f"stopped at {current.id} {current.title} ({why})" if current else \
        "writing its result"
    return (f"a rebase from {state.source['tag']} onto {state.target['tag']} is in "
            f"progress, {where} (e2 rebase --continue, --skip or --abort)")
