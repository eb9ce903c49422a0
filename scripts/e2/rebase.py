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
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import git
from pydantic import TypeAdapter, ValidationError

from e2 import console
from e2.apply import PatchResult, UpstreamOptions, apply_series, find_offsets
from e2.errors import E2Error
from e2.faults import checkpoint
from e2.fsio import read_tree, replace_dir, write_atomic
from e2.gitops import AM_FELL_BACK, COMMITTER_ENV, clone_worktree, commit_summary, git_am
from e2.series import (
    RELEASE_VERSION,
    Patch,
    Project,
    Series,
    Upstream,
    load_series,
    render_series,
    slugify,
)
from e2.verify import verify

VERDICTS = ("still-needed", "obsolete", "re-expressed", "dropped")
APPLIED = ("clean", "offset", "merged", "resolved")
DROPPED = ("obsolete", "dropped")
GUARDED = ("series.yaml", "patches", "overlay", "Dockerfile")


@dataclass
class Conflict:
    file: str
    hunks: list[dict]                    # {"line", "ours", "base", "theirs"}
    verdicts: list[dict] = field(default_factory=list)   # {"verdict", "reason"} per hunk


@dataclass
class PatchState:
    id: str
    title: str
    file: str
    status: str = "pending"   # pending applying clean offset merged resolved obsolete dropped conflict
    notes: list[str] = field(default_factory=list)
    reason: str | None = None
    old_commit: str | None = None
    new_commit: str | None = None
    conflicts: list[Conflict] = field(default_factory=list)
    replayed: bool = False    # resolved by a recorded resolution (rerere)


@dataclass
class RebaseState:
    source: dict              # the pin rebased from (Upstream as json)
    target: dict              # the pin rebased onto
    patches: list[PatchState]
    phase: str = "applying"   # applying | conflict | obsolete | finishing
    drop_obsolete: bool = False

    def current(self) -> PatchState | None:
        return next((p for p in self.patches if p.status not in APPLIED + DROPPED), None)

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


class Rebase:
    """Paths and steps of one rebase of one project."""

    def __init__(self, project: Project, upstream: UpstreamOptions | None):
        # upstream None: a Rebase that only reads the state (e2 status)
        self.project, self.upstream = project, upstream
        self.dir = project.state_dir / "rebase"
        self.state_file = self.dir / "state.json"
        self.backup = self.dir / "backup"
        self.backup_index = self.backup / "SAVED.json"
        self.work = self.dir / "work"
        self.rr_cache = project.state_dir / "rr-cache"
        self.verdict_memory = self.rr_cache / "e2-verdicts.json"

    # -- guards

    def in_progress(self) -> bool:
        return self.state_file.is_file()

    def load(self) -> RebaseState:
        if not self.in_progress():
            raise E2Error("no rebase in progress", hint="start one with: e2 rebase --onto VERSION")
        return RebaseState.load(self.state_file)

    def repo(self) -> git.Repo:
        return git.Repo(self.work)

    def _upstream(self) -> UpstreamOptions:
        assert self.upstream is not None, "this Rebase was made to read the state only"
        return self.upstream

    def backup_series(self) -> Series:
        """The series as it was when the rebase started (its metadata rides along)."""
        return load_series(self.backup / "series.yaml")

    def require_committed(self) -> None:
        try:
            repo = git.Repo(self.project.root)
        except git.InvalidGitRepositoryError:
            return  # not a git checkout: nothing to compare against
        dirty = repo.git.status("--porcelain", "--", *GUARDED).splitlines()
        if dirty:
            raise E2Error("uncommitted changes to the series:\n  " + "\n  ".join(dirty),
                          hint="commit or stash them first: a rebase rewrites these files")

    # -- start

    def start(self, series: Series, target: Upstream, drop_obsolete: bool) -> RebaseState:
        if self.in_progress():
            raise E2Error(f"a rebase is already in progress ({self.state_file})",
                          hint="e2 rebase --continue, --skip or --abort")
        self.require_committed()
        if target.tag == series.upstream.tag:
            raise E2Error(f"the series is already on {target.tag}")
        upstream = self._upstream()
        upstream.cache.ensure(target, source=upstream.source, local=upstream.local)
        shutil.rmtree(self.dir, ignore_errors=True)  # leftovers of a start killed before state
        self.dir.mkdir(parents=True)
        self._backup()
        old = apply_series(self.project, series, self.dir / "old", upstream, sparse=True)
        repo = clone_worktree(upstream.cache.repo_dir, self.work, target.tag)
        repo.git.fetch("-q", str(old.path), "e2:refs/e2/old")
        shutil.rmtree(old.path)
        self.rr_cache.mkdir(parents=True, exist_ok=True)
        os.symlink(self.rr_cache.resolve(), Path(repo.git_dir) / "rr-cache")
        with repo.config_writer() as config:
            config.set_value("rerere", "autoUpdate", "true")
            config.set_value("merge", "conflictStyle", "diff3")
        state = RebaseState(
            source=series.upstream.model_dump(mode="json"),
            target=target.model_dump(mode="json"),
            patches=[PatchState(p.id, p.title, p.file, old_commit=r.commit)
                     for p, r in zip(series.patches, old.results)],
            drop_obsolete=drop_obsolete)
        state.save(self.state_file)
        return state

    def _backup(self) -> None:
        self.backup.mkdir(parents=True, exist_ok=True)
        saved = []
        for name in GUARDED:
            source = self.project.root / name
            if source.is_dir():
                shutil.copytree(source, self.backup / name)
            elif source.is_file():
                shutil.copy2(source, self.backup / name)
            else:
                continue
            saved.append(name)
        # written last: --abort restores only from a backup that says it is whole
        write_atomic(self.backup_index, json.dumps(saved) + "\n")

    def _check_backup(self) -> list[str]:
        """The names the backup holds; refused unless every one of them is there."""
        hint = (f"restore them from git instead (git checkout -- {' '.join(GUARDED)}), "
                f"then remove {self.dir}")
        try:
            saved = json.loads(self.backup_index.read_text())
        except (OSError, ValueError):
            raise E2Error(f"the rebase backup in {self.backup} is incomplete (no "
                          f"{self.backup_index.name}); --abort would not put everything back",
                          hint=hint) from None
        missing = [name for name in saved if not (self.backup / name).exists()]
        if "series.yaml" not in saved or missing:
            raise E2Error(f"the rebase backup in {self.backup} is incomplete (missing: "
                          f"{', '.join(missing) or 'series.yaml'}); --abort would not put "
                          "everything back", hint=hint)
        return saved

    # -- the loop

    def run(self, state: RebaseState, series: Series) -> bool:
        """Apply the remaining patches; False when stopped for the user."""
        repo = self.repo()
        by_id = {p.id: p for p in series.patches}
        while (current := state.current()) is not None:
            patch = by_id[current.id]
            patch_file = self.project.patch_path(patch)
            if current.status == "pending" and _applies_in_reverse(repo, patch_file):
                if not state.drop_obsolete:
                    current.status, state.phase = "conflict", "obsolete"
                    current.notes = [f"already in {state.target['tag']}: applies in reverse"]
                    state.save(self.state_file)
                    return False
                current.status = "obsolete"
                current.reason = f"already in upstream {state.target['tag']} (dropped by --drop-obsolete)"
                state.save(self.state_file)
                continue
            current.status = "applying"
            state.save(self.state_file)
            checkpoint("before-am")
            ok, fell_back = _am(repo, patch_file)
            checkpoint("after-am")
            if ok:
                self._record_applied(repo, current, patch, "merged" if fell_back else None)
            elif not _unmerged(repo):
                # rerere replayed a recorded resolution for every conflicted file
                current.conflicts = self._remembered(current)
                current.replayed = True
                self._commit_resolution(repo, current)
            else:
                current.conflicts = _capture_conflicts(repo)
                current.status, state.phase = "conflict", "conflict"
                state.save(self.state_file)
                return False
            state.phase = "applying"
            state.save(self.state_file)
        return True

    def _record_applied(self, repo: git.Repo, current: PatchState, patch: Patch,
                        status: str | None) -> None:
        current.new_commit = repo.head.commit.hexsha
        result = PatchResult(patch, "merged" if status == "merged" else "clean",
                             current.new_commit)
        find_offsets(repo, self.project, [result])
        current.status, current.notes = result.status, result.notes

    def _commit_resolution(self, repo: git.Repo, current: PatchState) -> None:
        env = {**os.environ, **COMMITTER_ENV, "GIT_EDITOR": "true"}
        if not Path(repo.git_dir, "rebase-apply").exists():
            # killed after git am --continue committed, before the state was saved
            current.status, current.new_commit = "resolved", repo.head.commit.hexsha
            self._remember(current)
            return
        result = subprocess.run(["git", "am", "--continue"], cwd=self.work, env=env,
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise E2Error(f"git am --continue failed for {current.id}: "
                          f"{(result.stdout + result.stderr).strip()}",
                          hint="if the resolution drops the whole patch, use e2 rebase --skip")
        current.status = "resolved"
        current.new_commit = repo.head.commit.hexsha
        self._remember(current)

    # -- verdicts remembered beside rerere's resolutions

    def _remember(self, current: PatchState) -> None:
        memory = json.loads(self.verdict_memory.read_text()) if self.verdict_memory.is_file() else {}
        memory[current.title] = [asdict(c) for c in current.conflicts]
        write_atomic(self.verdict_memory, json.dumps(memory, indent=2, sort_keys=True) + "\n")

    def _remembered(self, current: PatchState) -> list[Conflict]:
        if not self.verdict_memory.is_file():
            return []
        memory = json.loads(self.verdict_memory.read_text())
        return [Conflict(**c) for c in memory.get(current.title, [])]

    # -- user steps

    def continue_(self, state: RebaseState, verdict: str | None, reason: str | None) -> None:
        current = state.current()
        repo = self.repo()
        if state.phase == "obsolete" and current is not None:
            # keep the patch although it applies in reverse: try it forwards
            current.status, current.notes = "applying", []
            state.phase = "applying"
            ok, fell_back = _am(repo, self.project.patches_dir / current.file)
            if not ok:
                current.conflicts = _capture_conflicts(repo)
                current.status, state.phase = "conflict", "conflict"
                state.save(self.state_file)
                raise E2Error(f"{current.id} conflicts when kept", hint="resolve, git add, "
                              "then e2 rebase --continue; or e2 rebase --skip")
            patch = self.backup_series().by_id(current.id)
            self._record_applied(repo, current, patch, "merged" if fell_back else None)
        elif state.phase == "conflict" and current is not None:
            unmerged = _unmerged(repo)
            marked = [c.file for c in current.conflicts if _has_markers(self.work / c.file)]
            if unmerged or marked:
                raise E2Error("still conflicted: " + ", ".join(sorted(set(unmerged + marked))),
                              hint=f"resolve the conflict markers in {self.work}, git add the "
                                   "files, then e2 rebase --continue")
            for conflict in current.conflicts:
                conflict.verdicts = [_ask_verdict(conflict.file, number, hunk, verdict, reason)
                                     for number, hunk in enumerate(conflict.hunks, start=1)]
            self._commit_resolution(repo, current)
        elif state.phase == "applying" and current is not None and current.status == "applying":
            self._reconcile(repo, state, current)
        state.phase = "applying" if state.phase != "finishing" else "finishing"
        state.save(self.state_file)

    def _reconcile(self, repo: git.Repo, state: RebaseState, current: PatchState) -> None:
        """The process died around git am: find out how far that patch got."""
        applied = [p for p in state.patches if p.status in APPLIED]
        commits = repo.git.rev_list("--reverse", f"refs/tags/{state.target['tag']}..HEAD").split()
        if Path(repo.git_dir, "rebase-apply").exists():
            subprocess.run(["git", "am", "--abort"], cwd=self.work, capture_output=True)
            current.status = "pending"
        elif len(commits) > len(applied):
            patch = self.backup_series().by_id(current.id)
            self._record_applied(repo, current, patch, None)
        else:
            current.status = "pending"

    def skip(self, state: RebaseState, reason: str | None) -> None:
        current = state.current()
        if current is None or state.phase not in ("conflict", "obsolete"):
            raise E2Error("nothing to skip: the rebase is not stopped at a patch")
        if Path(self.repo().git_dir, "rebase-apply").exists():
            subprocess.run(["git", "am", "--skip"], cwd=self.work, capture_output=True, check=True)
        if state.phase == "obsolete":
            current.status = "obsolete"
            current.reason = reason or f"already in upstream {state.target['tag']}"
        else:
            current.status = "dropped"
            current.reason = reason or _ask("why is this patch dropped? ")
        state.phase = "applying"
        state.save(self.state_file)

    def abort(self) -> None:
        self._check_backup()
        for name in GUARDED:
            saved, target = self.backup / name, self.project.root / name
            if saved.is_dir():
                replace_dir(target, read_tree(saved))
            elif saved.is_file():
                write_atomic(target, saved.read_bytes())
            elif target.is_file():
                target.unlink()  # the rebase created it
            elif target.is_dir():
                shutil.rmtree(target)
        shutil.rmtree(self.dir)

    # -- the end

    def finish(self, state: RebaseState, series: Series) -> Series:
        """Write the rebased series, overlay and Dockerfile; return the new series."""
        from e2.apply import ScratchTree
        from e2.export import format_patches
        from e2.overlay import plan_overlay, write_overlay

        state.phase = "finishing"
        state.save(self.state_file)
        repo = self.repo()
        target = Upstream.model_validate(state.target)
        formatted = format_patches(repo, f"refs/tags/{target.tag}")
        kept = [p for p in state.patches if p.status in APPLIED]
        if len(formatted) != len(kept):
            raise E2Error(f"{self.work} has {len(formatted)} commits on {target.tag}, the "
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
        replace_dir(self.project.patches_dir, contents)
        previous = (self.backup / "series.yaml").read_text(encoding="utf-8")
        write_atomic(self.project.series_file,
                     render_series(new_series.model_dump(mode="json"), previous))
        checkpoint("after-series")
        with ScratchTree(self.project, new_series, self._upstream()) as tree:
            plan = plan_overlay(new_series, self.project, tree)
        write_overlay(self.project, plan)
        _write_dockerfile(self.project, new_series, plan.manifest)
        return new_series

    def done(self) -> None:
        shutil.rmtree(self.dir)


def retag_base(base: str, tag: str) -> str:
    """vllm/vllm-openai:v0.31.0 -> vllm/vllm-openai:v0.32.0 (digest dropped)."""
    name = base.split("@", 1)[0]
    repository = name.rsplit(":", 1)[0] if ":" in name.rsplit("/", 1)[-1] else name
    return f"{repository}:{tag}"


def _write_dockerfile(project: Project, series: Series, manifest: dict) -> None:
    try:
        from e2.dockerfile import render_dockerfile
    except ImportError:  # a checkout without the image half
        return
    if (project.root / "images").is_dir():
        write_atomic(project.root / "Dockerfile", render_dockerfile(project, series, manifest))


# ---------------------------------------------------------------- git steps


def _applies_in_reverse(repo: git.Repo, patch_file: Path) -> bool:
    try:
        repo.git.apply("--reverse", "--check", str(patch_file))
        return True
    except git.GitCommandError:
        return False


def _am(repo: git.Repo, patch_file: Path) -> tuple[bool, bool]:
    """git am --3way one patch: (applied, needed the 3-way fallback)."""
    returncode, output = git_am(repo, [patch_file])
    return returncode == 0, any(AM_FELL_BACK in line for line in output)


def _unmerged(repo: git.Repo) -> list[str]:
    return sorted(set(repo.git.diff("--name-only", "--diff-filter=U").split()))


_MARKER = re.compile(r"^(<<<<<<<|\|\|\|\|\|\|\||=======|>>>>>>>)( |$)")


def _has_markers(path: Path) -> bool:
    if not path.is_file():
        return False
    return any(_MARKER.match(line) for line in path.read_text(errors="replace").splitlines())


def _capture_conflicts(repo: git.Repo) -> list[Conflict]:
    """Each conflicted file's hunks: upstream's side, the merge base, the patch's side."""
    conflicts = []
    for path in _unmerged(repo):
        assert repo.working_tree_dir is not None  # the rebase's worktree, never bare
        lines = (Path(repo.working_tree_dir) / path).read_text(errors="replace").splitlines()
        hunks: list[dict] = []
        current: dict[str, Any] | None = None  # the hunk being read
        part = "ours"  # the side of it the next line belongs to
        for number, line in enumerate(lines, start=1):
            if line.startswith("<<<<<<<"):
                current, part = {"line": number, "ours": [], "base": [], "theirs": []}, "ours"
            elif current is not None and line.startswith("|||||||"):
                part = "base"
            elif current is not None and line == "=======":
                part = "theirs"
            elif current is not None and line.startswith(">>>>>>>"):
                hunks.append(current)
                current = None
            elif current is not None:
                current[part].append(line)
        conflicts.append(Conflict(path, hunks))
    return conflicts


def _ask(prompt: str) -> str:
    if not sys.stdin.isatty():
        raise E2Error("a reason is needed and there is no terminal to ask on",
                      hint="pass --reason TEXT")
    answer = input(prompt).strip()
    if not answer:
        raise E2Error("a reason is needed")
    return answer


def _ask_verdict(file: str, number: int, hunk: dict, verdict: str | None,
                 reason: str | None) -> dict:
    if verdict is None:
        if not sys.stdin.isatty():
            raise E2Error(f"{file} hunk {number} (line {hunk['line']}) needs a verdict and "
                          "there is no terminal to ask on",
                          hint=f"pass --verdict ({' / '.join(VERDICTS)}) --reason TEXT")
        console.info(f"{file} hunk {number} (line {hunk['line']}):")
        verdict = _ask(f"  verdict ({' / '.join(VERDICTS)}): ")
        if verdict not in VERDICTS:
            raise E2Error(f"verdict must be one of {', '.join(VERDICTS)}")
    if reason is None:
        reason = _ask("  reason: ")
    return {"verdict": verdict, "reason": reason}


# ---------------------------------------------------------------- target pin


def resolve_target(onto: str, current: Upstream, upstream: UpstreamOptions) -> Upstream:
    """The pin to rebase onto: the index's own sha256 of that release.

    A local tarball (--upstream) must be that release: its version is checked
    when it is imported, and its hash against the index's where the index is
    reachable; only without an index is its own hash pinned (with a warning).
    """
    from e2.upstream import find_sdist, local_version, sha256_file

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


# ---------------------------------------------------------------- command


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "rebase", help="move the series onto a new upstream release, with a conflict report",
        description="Forward-port every patch onto another upstream release (git am --3way, "
                    "rerere on). Stops at a conflict or at a patch upstream already has; "
                    "resume with --continue, --skip or --abort. Writes "
                    "docs/rebases/<from>-to-<to>.md and .json at the end.")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--onto", metavar="VERSION", help="release to move to (0.32.0 or v0.32.0)")
    action.add_argument("--continue", dest="resume", action="store_true",
                        help="go on after resolving and staging a conflict")
    action.add_argument("--skip", action="store_true", help="drop the patch the rebase stopped at")
    action.add_argument("--abort", action="store_true",
                        help="put series.yaml, patches/, overlay/ and Dockerfile back as before")
    parser.add_argument("--drop-obsolete", action="store_true",
                        help="drop patches that upstream already has without stopping")
    parser.add_argument("--verdict", choices=VERDICTS,
                        help="with --continue: the verdict for every conflicted hunk")
    parser.add_argument("--reason", help="with --continue or --skip: why")
    parser.add_argument("--validate", action="store_true",
                        help="run the seam tests and the upstream delta at the end")
    parser.add_argument("--validate-suite", action="append", metavar="PATH",
                        help="with --validate: the upstream suites to run (repeatable; "
                             "default: e2 test upstream's)")
    parser.set_defaults(run=run)


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


def run(args: argparse.Namespace) -> int:
    from e2 import rebase_report

    rebase = Rebase(args.project, args.upstream)
    with args.project.changing():
        return _run_locked(args, rebase, rebase_report)


def _run_locked(args: argparse.Namespace, rebase: Rebase, rebase_report: ModuleType) -> int:
    # rebase_report: the module e2.rebase_report, which run() imports late
    if args.validate_suite and not args.validate:
        raise E2Error("--validate-suite needs --validate")
    if args.abort:
        if not rebase.in_progress():
            rebase.load()  # raises "no rebase in progress"
        rebase.abort()
        console.out.print("rebase aborted: series.yaml, patches/, overlay/ and Dockerfile "
                          "are as before", markup=False)
        return 0
    if args.onto is not None:
        series = args.project.load()
        target = resolve_target(args.onto, series.upstream, args.upstream)
        state = rebase.start(series, target, args.drop_obsolete)
    else:
        state = rebase.load()
        series = rebase.backup_series()
        if args.skip:
            rebase.skip(state, args.reason)
        else:
            rebase.continue_(state, args.verdict, args.reason)
    if state.phase != "finishing" and not rebase.run(state, series):
        _print_stop(rebase, state)
        return 1
    new_series = rebase.finish(state, series)
    checks = verify(args.project, new_series, args.upstream)
    failed = [c for c in checks if not c.ok]
    if failed:
        raise E2Error("the rebased series does not verify:\n  " + "\n  ".join(
            f"{c.name}: {p}" for c in failed for p in c.problems),
            hint="fix it in .e2/rebase/work and run e2 rebase --continue, or e2 rebase --abort")
    if args.validate:
        checks += validation_checks(args)
    report = rebase_report.write(rebase, state, series, new_series, checks)
    rebase.done()
    _print_summary(state, report)
    return 0


def validation_checks(args: argparse.Namespace) -> list:
    """The seam tests and the upstream delta, as report lines (--validate)."""
    from e2.verify import Check

    checks = []
    suites = [arg for suite in args.validate_suite or () for arg in ("--suite", suite)]
    for verb in (["test", "seam"], ["test", "upstream", *suites]):
        command = [sys.executable, "-m", "e2.cli", "--project", str(args.project.root), *verb]
        result = subprocess.run(command, capture_output=True, text=True)
        check = Check("e2 " + " ".join(verb[:2]))
        if result.returncode != 0:
            check.problems.append((result.stdout + result.stderr).strip()[-2000:])
        checks.append(check)
    return checks


def _print_stop(rebase: Rebase, state: RebaseState) -> None:
    current = state.current()
    assert current is not None
    if state.phase == "obsolete":
        console.out.print(f"{current.id} {current.title}: already in {state.target['tag']} "
                          "(applies in reverse)", markup=False)
        console.out.print("  drop it: e2 rebase --skip   keep it: e2 rebase --continue   "
                          "give up: e2 rebase --abort", markup=False)
        return
    console.out.print(f"conflict in {current.id} {current.title} "
                      f"(worktree {rebase.work}):", markup=False)
    for conflict in current.conflicts:
        console.out.print(f"  {conflict.file}: {len(conflict.hunks)} hunk(s) at line(s) "
                          + ", ".join(str(h["line"]) for h in conflict.hunks), markup=False)
    console.out.print(f"  resolve the files in {rebase.work}, git add them, then\n"
                      "  e2 rebase --continue [--verdict V --reason R]   (or --skip, --abort)",
                      markup=False)


def _print_summary(state: RebaseState, report: Path) -> None:
    for patch in state.patches:
        extra = f" ({patch.reason})" if patch.reason else ""
        console.out.print(f"{patch.status:9} {patch.id} {patch.title}{extra}", markup=False)
    console.out.print(f"rebased onto {state.target['tag']}; report {report}", markup=False)
