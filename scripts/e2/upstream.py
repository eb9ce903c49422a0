"""Upstream source: the pinned vLLM release as a tagged commit in a local cache repo.

Three ways in, one result (a commit tagged ``v<version>`` in the cache repo):

* ``sdist``: the release's sdist from the package index pip is configured
  with, read through the simple API (``pip download`` would try to build it),
  sha256 verified against series.yaml;
* ``git``: the tag fetched from a git remote (commit verified when pinned);
* a local tree or tarball (``--upstream PATH``) for machines that reach neither.

The cache repo lives under the XDG cache dir and every change to it happens
under a file lock, so two runs cannot corrupt it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import git
from filelock import FileLock

from e2 import console
from e2.errors import E2Error
from e2.series import Upstream

# Upstream commits made from a tree get fixed identity and dates, so the same
# sdist gives the same commit id on every machine.
IMPORT_ENV = {
    "GIT_AUTHOR_NAME": "vLLM upstream",
    "GIT_AUTHOR_EMAIL": "upstream@vllm-e2.invalid",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_NAME": "vLLM upstream",
    "GIT_COMMITTER_EMAIL": "upstream@vllm-e2.invalid",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
}
SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "vllm-e2"


def index_url() -> str:
    """The simple-API index pip is configured with (env, then pip config, then pip's default)."""
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"].split()[0].rstrip("/")
    try:
        listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"],
                                 capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        listing = ""
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        if key.split(".")[-1] == "index-url":
            return value.strip().strip("'\"").rstrip("/")
    from pip._internal.models.index import PyPI  # pip's own built-in default

    return PyPI.simple_url.rstrip("/")


@dataclass(frozen=True)
class SdistFile:
    filename: str
    url: str
    sha256: str | None


def find_sdist(project: str, version: str, index: str | None = None) -> SdistFile:
    import requests  # only the paths that reach the index pay for importing it

    index = index or index_url()
    page = f"{index}/{project}/"
    try:
        response = requests.get(page, headers={"Accept": SIMPLE_JSON}, timeout=60)
    except requests.RequestException as exc:
        raise E2Error(f"cannot reach the package index for {project}: {exc}",
                      hint="pass --upstream PATH with a local sdist or tree") from None
    if response.status_code != 200:
        raise E2Error(f"package index answered {response.status_code} for {project}")
    wanted = f"{project}-{version}.tar.gz"
    for entry in response.json().get("files", []):
        if entry["filename"] == wanted:
            return SdistFile(wanted, entry["url"], entry.get("hashes", {}).get("sha256"))
    raise E2Error(f"the package index has no {wanted}",
                  hint=f"check the version, or pass --upstream PATH")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download(url: str, dest: Path, expected_sha256: str) -> Path:
    """Stream ``url`` to ``dest``; the file only appears once its hash matches."""
    import requests

    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_suffix(dest.suffix + ".part")
    digest = hashlib.sha256()
    try:
        with requests.get(url, stream=True, timeout=120) as response:
            response.raise_for_status()
            total = int(response.headers.get("content-length", 0)) or None
            with console.progress() as progress, partial.open("wb") as handle:
                task = progress.add_task(f"download {dest.name}", total=total)
                for chunk in response.iter_content(1 << 20):
                    handle.write(chunk)
                    digest.update(chunk)
                    progress.advance(task, len(chunk))
    except requests.RequestException as exc:
        partial.unlink(missing_ok=True)
        raise E2Error(f"download of {url} failed: {exc}") from None
    if digest.hexdigest() != expected_sha256:
        partial.unlink(missing_ok=True)
        raise E2Error(f"sha256 mismatch for {dest.name}: got {digest.hexdigest()}, "
                      f"series.yaml pins {expected_sha256}",
                      hint="the index served another file than the pinned release; refusing it")
    partial.replace(dest)
    return dest


class UpstreamCache:
    """The local repo holding one tagged commit per upstream release."""

    def __init__(self, root: Path | None = None):
        self.root = root or default_cache_dir()
        self.repo_dir = self.root / "upstream.git"
        self.downloads = self.root / "downloads"
        self.lock = FileLock(str(self.root / "lock"))

    def _repo(self) -> git.Repo:
        self.root.mkdir(parents=True, exist_ok=True)
        if not (self.repo_dir / "HEAD").exists():
            repo = git.Repo.init(self.repo_dir, bare=True)
            repo.git.config("gc.auto", "0")
            return repo
        return git.Repo(self.repo_dir)

    def tag_commit(self, tag: str) -> str | None:
        if not (self.repo_dir / "HEAD").exists():
            return None
        try:
            return git.Repo(self.repo_dir).git.rev_parse(f"refs/tags/{tag}^{{commit}}")
        except git.GitCommandError:
            return None

    def ensure(self, upstream: Upstream, source: str = "auto",
               local: Path | None = None) -> str:
        """Make sure ``upstream.tag`` exists in the cache; return its commit id."""
        found = self.tag_commit(upstream.tag)
        if found:
            return found
        with self.lock:
            found = self.tag_commit(upstream.tag)  # another run may have won the race
            if found:
                return found
            repo = self._repo()
            if local is not None:
                return self._import_local(repo, upstream, local)
            if source == "git" or (source == "auto" and _sdist_unavailable(upstream)):
                return self._fetch_git(repo, upstream)
            return self._import_sdist(repo, upstream)

    # -- sources

    def sdist_path(self, upstream: Upstream) -> Path:
        return self.downloads / f"{upstream.project}-{upstream.version}.tar.gz"

    def fetch_sdist(self, upstream: Upstream) -> Path:
        target = self.sdist_path(upstream)
        if target.is_file() and sha256_file(target) == upstream.sdist_sha256:
            return target
        found = find_sdist(upstream.project, upstream.version)
        if found.sha256 and found.sha256 != upstream.sdist_sha256:
            raise E2Error(f"sha256 mismatch for {found.filename}: the index lists "
                          f"{found.sha256}, series.yaml pins {upstream.sdist_sha256}",
                          hint="refusing an sdist that is not the pinned release")
        return download(found.url, target, upstream.sdist_sha256)

    def _import_sdist(self, repo: git.Repo, upstream: Upstream) -> str:
        return self._import_tarball(repo, upstream, self.fetch_sdist(upstream), verify=True)

    def _import_local(self, repo: git.Repo, upstream: Upstream, local: Path) -> str:
        if local.is_dir():
            console.warn(f"importing {local} as {upstream.tag} without a hash check "
                         "(a tree cannot be verified against the sdist sha256)")
            return self._commit_tree(repo, upstream, local, f"{local.name} (local tree)")
        if local.is_file():
            return self._import_tarball(repo, upstream, local, verify=True)
        raise E2Error(f"--upstream {local}: no such file or directory")

    def _import_tarball(self, repo: git.Repo, upstream: Upstream, tarball: Path,
                        verify: bool) -> str:
        if verify:
            actual = sha256_file(tarball)
            if actual != upstream.sdist_sha256:
                raise E2Error(f"sha256 mismatch for {tarball}: got {actual}, series.yaml "
                              f"pins {upstream.sdist_sha256}",
                              hint="refusing a tarball that is not the pinned release")
        with tempfile.TemporaryDirectory(dir=self.root, prefix="extract-") as tmp:
            with console.status(f"extracting {tarball.name}"):
                with tarfile.open(tarball) as archive:
                    # 'data' resets owners, so git never sees a foreign-owned tree
                    archive.extractall(tmp, filter="data")
            entries = list(Path(tmp).iterdir())
            tree = entries[0] if len(entries) == 1 and entries[0].is_dir() else Path(tmp)
            return self._commit_tree(repo, upstream, tree, tarball.name)

    def _commit_tree(self, repo: git.Repo, upstream: Upstream, tree: Path, origin: str) -> str:
        index_file = self.root / f"index-{os.getpid()}"
        env = {**IMPORT_ENV, "GIT_INDEX_FILE": str(index_file), "GIT_WORK_TREE": str(tree)}
        try:
            with console.status(f"committing {origin} as {upstream.tag}"):
                with repo.git.custom_environment(**env):
                    # -f: an sdist ships files its own .gitignore names (_version.py)
                    repo.git.add("-A", "-f", ".")
                    tree_id = repo.git.write_tree()
                    commit = repo.git.commit_tree(
                        tree_id, m=f"{upstream.project} {upstream.version} ({origin})")
        finally:
            index_file.unlink(missing_ok=True)
        repo.git.tag(upstream.tag, commit)
        return commit

    def _fetch_git(self, repo: git.Repo, upstream: Upstream) -> str:
        if upstream.git is None:
            raise E2Error("series.yaml has no upstream.git.remote to fetch from")
        with console.status(f"fetching {upstream.tag} from {upstream.git.remote}"):
            try:
                repo.git.fetch("--depth", "1", upstream.git.remote,
                               f"refs/tags/{upstream.tag}:refs/tags/{upstream.tag}")
            except git.GitCommandError as exc:
                raise E2Error(f"cannot fetch {upstream.tag} from {upstream.git.remote}: "
                              f"{exc.stderr.strip()}") from None
        commit = repo.git.rev_parse(f"refs/tags/{upstream.tag}^{{commit}}")
        if upstream.git.commit and commit != upstream.git.commit:
            repo.git.tag("-d", upstream.tag)
            raise E2Error(f"{upstream.tag} at {upstream.git.remote} is {commit}, "
                          f"series.yaml pins {upstream.git.commit}")
        return commit


def _sdist_unavailable(upstream: Upstream) -> bool:
    # auto: prefer the sdist (it is what the wheel is built from); git only when
    # the index cannot give it and a remote is configured.
    if upstream.git is None:
        return False
    try:
        find_sdist(upstream.project, upstream.version)
        return False
    except E2Error:
        return True

