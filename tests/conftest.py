"""Fixtures for the driver tests: a scratch project on the real vLLM sdist.

The tests have a cache of their own (the ``cache`` fixture), never the user's:
``$E2_TEST_CACHE`` when set (the Makefile's test targets keep it beside the
user's cache, so the pinned sdists and test venvs survive between runs), else a
folder under pytest's basetemp. The pinned sdist is downloaded once into it and
imported into its upstream repo; every test then gets its own project
directory and worktrees under tmp_path.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import git
import pytest
import yaml

from e2 import cli
from e2.cache import Cache
from e2.series import Project, dump_series, load_series
from e2.upstream import UpstreamCache

REPO_ROOT = Path(__file__).resolve().parents[1]
AUTHOR = {"user.name": "E2 Tester", "user.email": "tester@vllm-e2.invalid"}
TEST_CACHE_ENV = "E2_TEST_CACHE"
# The real series' seam tests a run on a machine without a GPU, (collected, skipped), as
# shipped (e2) and with the patch's switch flipped (control): the tests read the switch from
# the environment. 0001: the switch registry's tests over both switches; 0002: the state
# pool's, where the cases on CUDA tensors skip, and in the control the tests of slab pages
# and packed states, which exist only with the switch on.
# One home for the figures: a patch that adds a seam test moves this line and nothing else.
SEAM_TESTS_WITHOUT_GPU = {"0001": {"e2": (48, 0), "control": (48, 0)},
                          "0002": {"e2": (123, 7), "control": (123, 9)}}


@pytest.fixture(scope="session", autouse=True)
def no_user_cache() -> Iterator[None]:
    """An in-process e2 that would fall back to the user's cache fails the test instead:
    every call names the test cache (--cache)."""
    def refuse() -> Path:
        raise AssertionError("a test reached for the user's cache: pass --cache with the "
                             "`cache` fixture's root")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Cache, "default_root", staticmethod(refuse))
        yield


def state_listing(root: Path) -> dict[str, int]:
    """Every folder under ``root`` with its mtime: an entry made or removed in one shows."""
    if not root.is_dir():
        return {}
    return {str(p): p.stat().st_mtime_ns for p in [root, *root.rglob("*")]
            if p.is_dir() and not p.is_symlink()}


@pytest.fixture(scope="session", autouse=True)
def checkout_untouched() -> Iterator[None]:
    """No test writes into this checkout's .e2/ (results, logs, scratch): each gives e2 a
    project of its own under tmp_path, or --report/--results there."""
    before = state_listing(REPO_ROOT / ".e2")
    yield
    assert state_listing(REPO_ROOT / ".e2") == before, f"a test wrote under {REPO_ROOT}/.e2"


@pytest.fixture(scope="session")
def cache(tmp_path_factory) -> Cache:
    """The tests' own cache: $E2_TEST_CACHE, else a folder under pytest's basetemp."""
    root = os.environ.get(TEST_CACHE_ENV)
    return Cache(Path(root) if root else tmp_path_factory.getbasetemp() / "e2-cache")


@pytest.fixture(scope="session")
def upstream_cache(cache: Cache) -> UpstreamCache:
    upstream = UpstreamCache(cache)
    upstream.ensure(load_series(REPO_ROOT / "series.yaml").upstream)
    return upstream


class E2:
    """Runs `e2` in-process against one scratch project, capturing its output."""

    def __init__(self, root: Path, upstream_cache: UpstreamCache, capsys):
        self.root, self.upstream_cache, self.capsys = root, upstream_cache, capsys
        self.cache = upstream_cache.cache
        self.project = Project(root)

    def command(self, *verb: str) -> Callable[..., tuple[int, str, str]]:
        """``e2 VERB ARGS`` as a function of ARGS, returning the exit code unchecked
        (the caller asserts it): for a test module about one verb."""
        return functools.partial(self, *verb, expect=None)

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


def copy_checkout(dest: Path) -> Path:
    """This checkout's series, overlay and image files in ``dest``: a project for verbs
    that write under the project's .e2/ (logs, scratch), which must not be the checkout's."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("series.yaml", "patches", "overlay", "images", "Dockerfile"):
        source = REPO_ROOT / name
        if source.is_dir():
            shutil.copytree(source, dest / name)
        else:
            shutil.copy2(source, dest / name)
    return dest


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
