"""Where one rebase lives on disk (``.e2/rebase``), the guards around it, and
the backup of the files a rebase rewrites, which ``--abort`` puts back.

Kept outside ``.e2/rebase`` so that they outlive an abort: the recorded
resolutions (``.e2/rr-cache``) and the report of the last stop
(``.e2/rebase-reports``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import git

from e2.apply import UpstreamOptions
from e2.errors import E2Error
from e2.fsio import read_tree, replace_dir, write_atomic
from e2.rebase.state import Phase, RebaseState
from e2.series import Project, Series, load_series

GUARDED = ("series.yaml", "patches", "overlay", "Dockerfile")


class Rebase:
    """Paths and on-disk state of one rebase of one project."""

    def __init__(self, project: Project, upstream: UpstreamOptions | None):
        # upstream None: a Rebase that only reads the state (e2 status)
        self.project, self.upstream = project, upstream
        self.dir = project.state_dir / "rebase"
        self.state_file = self.dir / "state.json"
        self.backup = self.dir / "backup"
        self.backup_index = self.backup / "SAVED.json"
        self.work = self.dir / "work"
        self.rr_cache = project.state_dir / "rr-cache"
        self.resolutions = self.rr_cache / "e2-resolutions"
        self.reports = project.state_dir / "rebase-reports"

    @classmethod
    def scratch(cls, project: Project, upstream: UpstreamOptions, folder: Path) -> Rebase:
        """A rebase in ``folder`` (a dry run): its state and worktree there, the
        checkout's recorded resolutions only read."""
        rebase = cls(project, upstream)
        rebase.dir, rebase.state_file = folder, folder / "state.json"
        rebase.work = folder / "work"
        return rebase

    # -- guards

    def in_progress(self) -> bool:
        return self.state_file.is_file()

    def load(self) -> RebaseState:
        if not self.in_progress():
            raise E2Error("no rebase in progress", hint="start one with: e2 rebase --onto VERSION")
        return RebaseState.load(self.state_file)

    def repo(self) -> git.Repo:
        return git.Repo(self.work)

    def upstream_options(self) -> UpstreamOptions:
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

    # -- the backup --abort restores from

    def save_backup(self) -> None:
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

    def abort(self) -> list[str]:
        """Put the guarded files back as they were before the rebase; the names kept
        as a person edited them while it was stopped.

        The rebase writes them only once it finishes, so before that a file that
        differs from the backup holds edits made while it was stopped: kept. Once
        it was finishing (stopped by a failed verify, or killed while writing),
        the backup comes back, series.yaml with the edits --continue carried
        over; whatever else is overwritten is first copied to the reports."""
        self._check_backup()
        finishing = self._finishing()
        kept = []
        for name in GUARDED:
            saved, target = self.backup / name, self.project.root / name
            if not finishing and self._same(saved, target) is False:
                kept.append(name)
                continue
            if finishing and self._same(saved, target) is False:
                self._set_aside(target)
            if saved.is_dir():
                replace_dir(target, read_tree(saved))
            elif saved.is_file():
                write_atomic(target, saved.read_bytes())
            elif target.is_file():
                target.unlink()  # the rebase created it
            elif target.is_dir():
                shutil.rmtree(target)
        edited = self.dir / "series-while-stopped.yaml"
        if finishing and edited.is_file():
            write_atomic(self.project.series_file, edited.read_bytes())
            kept.append("series.yaml")
        shutil.rmtree(self.dir)
        return kept

    def _finishing(self) -> bool:
        """Whether the rebase got to writing the guarded files; a state that cannot
        be read counts as that (the backup then comes back, the rest set aside)."""
        try:
            return RebaseState.load(self.state_file).phase == Phase.FINISHING
        except (E2Error, OSError, ValueError):
            return True

    @staticmethod
    def _same(saved: Path, target: Path) -> bool | None:
        """Whether ``target`` is as the backup holds it; None where neither exists."""
        if not saved.exists() and not target.exists():
            return None
        if saved.is_dir() and target.is_dir():
            return read_tree(saved) == read_tree(target)
        if saved.is_file() and target.is_file():
            return saved.read_bytes() == target.read_bytes()
        return False

    def _set_aside(self, target: Path) -> None:
        """A copy of what --abort is about to overwrite, kept beside the reports."""
        aside = self.reports / "before-abort" / target.name
        shutil.rmtree(aside, ignore_errors=True)
        aside.parent.mkdir(parents=True, exist_ok=True)
        if target.is_dir():
            shutil.copytree(target, aside)
        elif target.is_file():
            shutil.copy2(target, aside)

    def done(self) -> None:
        shutil.rmtree(self.dir)


def widen(repo: git.Repo) -> None:
    """The whole release in the rebase's worktree. It is checked out sparse (the
    files the series touches) while the patches apply alone, which makes a rebase
    that never stops far cheaper to set up and clear away, and whole where a person
    (or a proposal, or a recorded resolution) needs the rest of the tree."""
    with repo.config_reader() as config:
        sparse = config.get_value("core", "sparseCheckout", False)
    if sparse:
        repo.git.sparse_checkout("disable")
