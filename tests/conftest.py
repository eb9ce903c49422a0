"""Fixtures for the driver tests: a scratch project on the real vLLM sdist.

The pinned sdist is downloaded once into the XDG cache (the same one `e2` uses,
so CI machines keep it between runs) and imported into the upstream cache repo;
every test then gets its own project directory and worktrees under tmp_path.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import git
import pytest
import yaml

from e2 import cli
from e2.series import Project, dump_series, load_series
from e2.upstream import UpstreamCache

REPO_ROOT = Path(__file__).resolve().parents[1]
AUTHOR = {"user.name": "E2 Tester", "user.email": "tester@vllm-e2.invalid"}


@pytest.fixture(scope="session")
def upstream_cache() -> UpstreamCache:
    cache = UpstreamCache()
    cache.ensure(load_series(REPO_ROOT / "series.yaml").upstream)
    return cache


class E2:
    """Runs `e2` in-process against one scratch project, capturing its output."""

    def __init__(self, root: Path, cache: UpstreamCache, capsys):
        self.root, self.cache, self.capsys = root, cache, capsys
        self.project = Project(root)

    def __call__(self, *args: str, expect: int | None = 0) -> tuple[int, str, str]:
        self.capsys.readouterr()
        code = cli.main(["--project", str(self.root), "--cache", str(self.cache.root), *args])
        out, err = self.capsys.readouterr()
        if expect is not None:
            assert code == expect, f"e2 {' '.join(args)} exited {code}\n{out}\n{err}"
        return code, out, err

    @property
    def work(self) -> Path:
        return self.project.default_worktree

    def worktree(self) -> git.Repo:
        repo = git.Repo(self.work)
        with repo.config_writer() as config:
            for key, value in AUTHOR.items():
                config.set_value(*key.split("."), value)
        return repo

    def commit_edit(self, path: str, old: str, new: str, message: str,
                    count: int = 1) -> None:
        """Edit one file in the worktree (exact text replacement) and commit it."""
        target = self.work / path
        text = target.read_text()
        assert text.count(old) >= count, f"{old!r} not in {path}"
        target.write_text(text.replace(old, new, count))
        repo = self.worktree()
        repo.git.add(path)
        repo.git.commit("-q", "-m", message)

    def series_text(self) -> str:
        return self.project.series_file.read_text()

    def fill_metadata(self, patch_id: str | None, switch: str,
                      tests: str = "tests/test_envs.py") -> None:
        """Give a freshly exported patch (by id, or the first new one) its metadata."""
        data = yaml.safe_load(self.series_text())
        for entry in data["patches"]:
            if entry["id"] == patch_id or (patch_id is None and entry["switch"]["name"] is None):
                entry["switch"] = {"name": switch, "default": "1", "compiled": False,
                                   "doc": f"{switch} test switch"}
                entry["drop_when"] = "never"
                entry["tests"] = [tests]
                break
        self.project.series_file.write_text(dump_series(data))


@pytest.fixture
def e2(tmp_path: Path, upstream_cache: UpstreamCache, capsys) -> E2:
    root = tmp_path / "project"
    root.mkdir()
    series = (REPO_ROOT / "series.yaml").read_text()
    series = series[:series.index("patches:")] + "patches: []\n"
    (root / "series.yaml").write_text(series)
    (root / "patches").mkdir()
    return E2(root, upstream_cache, capsys)


def copy_real_patches(e2: E2, through: str | None = None) -> None:
    """The project's own series (patches and metadata) in the scratch project;
    with ``through``, only its patches up to that id (in canonical form)."""
    if through is None:
        shutil.copytree(REPO_ROOT / "patches", e2.project.patches_dir, dirs_exist_ok=True)
        shutil.copy(REPO_ROOT / "series.yaml", e2.project.series_file)
        return
    data = load_series(REPO_ROOT / "series.yaml").model_dump(mode="json")
    ids = [patch["id"] for patch in data["patches"]]
    data["patches"] = data["patches"][:ids.index(through) + 1]
    e2.project.patches_dir.mkdir(exist_ok=True)
    for patch in data["patches"]:
        shutil.copy(REPO_ROOT / "patches" / patch["file"], e2.project.patches_dir)
    e2.project.series_file.write_text(dump_series(data))
