"""Upstream source: the pinned vLLM release as a tagged commit in a local cache repo.

Three ways in, one result (a commit tagged ``v<version>`` in the cache repo):

* ``sdist``: the release's sdist from the package index pip is configured
  with, read through the simple API (``pip download`` would try to build it),
  sha256 verified against series.yaml;
* ``git``: the tag fetched from a git remote (commit verified when pinned);
* a local tree or tarball (``--upstream PATH``) for machines that reach neither.

The cache repo lives in the cache directory (``e2.cache``) and every change to it happens
under a file lock, so two runs cannot corrupt it. Each tag is bound to the
sdist sha256 it was imported from (``e2-pins.json`` beside the refs), and
every use of a cached tag checks that binding against series.yaml: a pin
edited after the import is refused, not silently served the old tree.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import git
from pydantic import BaseModel, TypeAdapter, ValidationError

from e2 import console
from e2.cache import Cache
from e2.errors import E2Error
from e2.fsio import write_atomic
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
PINS_FILE = "e2-pins.json"


class Binding(BaseModel):
    """What a cached tag was imported from; ``sdist_sha256`` is None for a tree or git."""

    commit: str
    sdist_sha256: str | None
    source: Literal["sdist", "tarball", "tree", "git"]


_BINDINGS = TypeAdapter(dict[str, Binding])
_PKG_VERSION = re.compile(r"^Version:\s*(\S+)\s*$", re.MULTILINE)
# setuptools-scm writes: __version__ = version = '0.31.0'
_PY_VERSION = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""",
                         re.MULTILINE)


def _version_in(pkg_info: str | None, version_py: str | None) -> str | None:
    for text, pattern in ((pkg_info, _PKG_VERSION), (version_py, _PY_VERSION)):
        match = pattern.search(text or "")
        if match:
            return match.group(1)
    return None


def tree_version(tree: Path) -> str | None:
    """The vLLM version an unpacked sdist or tree says it is (PKG-INFO, vllm/_version.py)."""
    def read(name: str) -> str | None:
        path = tree / name
        return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else None
    return _version_in(read("PKG-INFO"), read("vllm/_version.py"))


def tarball_version(tarball: Path) -> str | None:
    """The same, read from the tarball's top folder without unpacking it."""
    found: dict[str, str] = {}
    try:
        with tarfile.open(tarball) as archive:
            for member in archive:
                parts = member.name.split("/")
                name = "/".join(parts[1:])
                if member.isfile() and name in ("PKG-INFO", "vllm/_version.py"):
                    handle = archive.extractfile(member)
                    found[name] = handle.read().decode("utf-8", "replace") if handle else ""
                    if len(found) == 2:
                        break
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise E2Error(f"{tarball}: not a readable sdist tarball: {exc}",
                      hint="pass the release's .tar.gz, or an unpacked tree") from None
    return _version_in(found.get("PKG-INFO"), found.get("vllm/_version.py"))


def local_version(local: Path) -> str | None:
    if local.is_dir():
        return tree_version(local)
    if local.is_file():
        return tarball_version(local)
    raise E2Error(f"--upstream {local}: no such file or directory")


def check_version(where: Path, found: str | None, upstream: Upstream) -> None:
    """A tree or tarball must be the release it is imported as."""
    if found is None:
        raise E2Error(f"{where}: cannot tell which vLLM release it is (no PKG-INFO or "
                      f"vllm/_version.py naming a version)",
                      hint="pass the release's sdist, or a tree unpacked from it")
    if found.split("+", 1)[0] != upstream.version:
        raise E2Error(f"{where} is vLLM {found}, series.yaml asks for {upstream.version}",
                      hint=f"pass the {upstream.version} sdist or tree")


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
    wanted = f"{project}-{version}.tar.gz"
    for entry in index_files(project, index):
        if entry["filename"] == wanted:
            return SdistFile(wanted, entry["url"], entry.get("hashes", {}).get("sha256"))
    raise E2Error(f"the package index has no {wanted}",
                  hint="check the version, or pass --upstream PATH")


def index_files(project: str, index: str | None = None) -> list[dict]:
    """The files the index lists for ``project`` (its simple API, JSON form)."""
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
    return list(response.json().get("files", []))


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
    """The local repo holding one tagged commit per upstream release, in ``cache``."""

    def __init__(self, cache: Cache):
        self.cache = cache
        self.repo_dir = cache.upstream_repo
        self.downloads = cache.downloads
        self.scratch = cache.upstream_scratch
        self.lock = cache.upstream_lock

    def _repo(self) -> git.Repo:
        self.scratch.mkdir(parents=True, exist_ok=True)
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
        """Make sure ``upstream.tag`` exists in the cache; return its commit id.

        A cached tag is used only when it is bound to the pinned sdist sha256.
        """
        if local is not None and not (local.is_dir() or local.is_file()):
            raise E2Error(f"--upstream {local}: no such file or directory")
        found = self.tag_commit(upstream.tag)
        if found:
            self._check_binding(upstream, found, local)
            return found
        with self.lock:
            self._remove_leftovers()
            found = self.tag_commit(upstream.tag)  # another run may have won the race
            if found:
                self._check_binding(upstream, found, local)
                return found
            repo = self._repo()
            if local is not None:
                return self._import_local(repo, upstream, local)
            if source == "git":
                return self._fetch_git(repo, upstream)
            if source == "sdist" or upstream.git is None:
                return self._import_sdist(repo, upstream)
            # auto: the sdist (what the wheel is built from), else the git remote
            try:
                return self._import_sdist(repo, upstream)
            except E2Error as sdist_error:
                if "sha256 mismatch" in sdist_error.message:
                    raise  # a wrong pin is never papered over by another source
                try:
                    return self._fetch_git(repo, upstream)
                except E2Error as git_error:
                    raise E2Error(f"{sdist_error.message}; and from git: {git_error.message}",
                                  hint=sdist_error.hint) from None

    # -- the binding of each tag to what it was imported from

    @property
    def pins_file(self) -> Path:
        return self.repo_dir / PINS_FILE

    def bindings(self) -> dict[str, Binding]:
        if not self.pins_file.is_file():
            return {}
        try:
            return _BINDINGS.validate_json(self.pins_file.read_bytes())
        except ValidationError:
            return {}  # damaged: every tag is re-verified (and rebound) on its next use

    def _bind(self, tag: str, binding: Binding) -> None:
        bindings = self.bindings()
        bindings[tag] = binding
        write_atomic(self.pins_file, _BINDINGS.dump_json(bindings, indent=2) + b"\n")

    def _check_binding(self, upstream: Upstream, commit: str, local: Path | None) -> None:
        binding = self.bindings().get(upstream.tag)
        if binding is None or binding.commit != commit:
            with self.lock:
                binding = self._rebind(upstream, commit)
        if binding.sdist_sha256 is not None and binding.sdist_sha256 != upstream.sdist_sha256:
            raise E2Error(f"series.yaml pins {upstream.tag} to sdist sha256 "
                          f"{upstream.sdist_sha256}, but the cached {upstream.tag} was "
                          f"imported from sha256 {binding.sdist_sha256}",
                          hint="correct upstream.sdist_sha256 in series.yaml (the package "
                               "index lists each release's sha256); a pin that does not "
                               "match its source is never used")
        if binding.sdist_sha256 is None and not (
                binding.source == "git" and upstream.git and upstream.git.commit == commit):
            console.warn(f"the cached {upstream.tag} was imported from a {binding.source}, "
                         "which cannot be checked against upstream.sdist_sha256")
        if local is not None and local.is_file():
            self._check_tarball_hash(local, upstream)

    def _rebind(self, upstream: Upstream, commit: str) -> Binding:
        """A tag cached without a binding (an older e2): verify it against the pin once.

        The pinned sdist is fetched (checked against the pin and the index) and
        imported again; imports are deterministic, so the same sdist gives the
        same commit. Only then is the tag bound to the pin.
        """
        binding = self.bindings().get(upstream.tag)
        if binding is not None and binding.commit == commit:
            return binding  # another run bound it meanwhile
        repo = self._repo()
        tarball = self.fetch_sdist(upstream)
        with console.status(f"verifying the cached {upstream.tag} against {tarball.name}"):
            fresh = self._tarball_commit(repo, upstream, tarball)
        if fresh != commit:
            raise E2Error(f"the cached {upstream.tag} ({commit[:12]}) is not the pinned sdist "
                          f"{tarball.name} ({fresh[:12]})",
                          hint=f"delete it (git -C {self.repo_dir} tag -d {upstream.tag}) so "
                               "the pinned release is imported again")
        binding = Binding(commit=commit, sdist_sha256=upstream.sdist_sha256, source="sdist")
        self._bind(upstream.tag, binding)
        return binding

    def _remove_leftovers(self) -> None:
        """Scratch of an import that was killed (held under the lock: none is running)."""
        for leftover in self.scratch.glob("extract-*"):
            shutil.rmtree(leftover, ignore_errors=True)
        for leftover in [*self.scratch.glob("index-*"), *self.downloads.glob("*.part")]:
            leftover.unlink(missing_ok=True)

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
        return self._import_tarball(repo, upstream, self.fetch_sdist(upstream), "sdist")

    def _import_local(self, repo: git.Repo, upstream: Upstream, local: Path) -> str:
        if local.is_dir():
            check_version(local, tree_version(local), upstream)
            console.warn(f"importing {local} as {upstream.tag} without a hash check "
                         "(a tree cannot be verified against the sdist sha256)")
            commit = self._commit_tree(repo, upstream, local, f"{local.name} (local tree)")
            return self._tag(repo, upstream, commit, Binding(commit=commit, sdist_sha256=None,
                                                             source="tree"))
        return self._import_tarball(repo, upstream, local, "tarball")

    def _check_tarball_hash(self, tarball: Path, upstream: Upstream) -> None:
        actual = sha256_file(tarball)
        if actual != upstream.sdist_sha256:
            raise E2Error(f"sha256 mismatch for {tarball}: got {actual}, series.yaml "
                          f"pins {upstream.sdist_sha256}",
                          hint="refusing a tarball that is not the pinned release")

    def _import_tarball(self, repo: git.Repo, upstream: Upstream, tarball: Path,
                        source: Literal["sdist", "tarball"]) -> str:
        self._check_tarball_hash(tarball, upstream)
        commit = self._tarball_commit(repo, upstream, tarball)
        return self._tag(repo, upstream, commit, Binding(
            commit=commit, sdist_sha256=upstream.sdist_sha256, source=source))

    def _tarball_commit(self, repo: git.Repo, upstream: Upstream, tarball: Path) -> str:
        """The commit of an sdist's tree (untagged), once it is shown to be that release."""
        with tempfile.TemporaryDirectory(dir=self.scratch, prefix="extract-") as tmp:
            with console.status(f"extracting {tarball.name}"):
                try:
                    with tarfile.open(tarball) as archive:
                        # 'data' resets owners, so git never sees a foreign-owned tree
                        archive.extractall(tmp, filter="data")
                except (tarfile.TarError, EOFError) as exc:
                    raise E2Error(f"{tarball}: not a readable sdist tarball: {exc}") from None
            entries = list(Path(tmp).iterdir())
            tree = entries[0] if len(entries) == 1 and entries[0].is_dir() else Path(tmp)
            check_version(tarball, tree_version(tree), upstream)
            return self._commit_tree(repo, upstream, tree, tarball.name)

    def _tag(self, repo: git.Repo, upstream: Upstream, commit: str, binding: Binding) -> str:
        self._bind(upstream.tag, binding)  # first: a tag is never without its binding
        repo.git.tag("-f", upstream.tag, commit)
        return commit

    def _commit_tree(self, repo: git.Repo, upstream: Upstream, tree: Path, origin: str) -> str:
        index_file = self.scratch / f"index-{os.getpid()}"
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
        self._bind(upstream.tag, Binding(commit=commit, sdist_sha256=None, source="git"))
        return commit
