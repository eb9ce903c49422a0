"""Upstream sources: the index's simple API, sha256 pinning, git remotes, the locked cache."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import multiprocessing
import os
import tarfile
import threading
from pathlib import Path

import git
import pytest

from e2.cache import Cache
from e2.errors import E2Error
from e2.series import GitSource, Upstream
from e2.upstream import UpstreamCache, find_sdist, index_url

PINNED = "dde46f1efbe846e5bd0c5c4ec6ec71842c42254c7ff3d9bebb2a57028715d380"


def small_sdist(version: str = "9.9.0") -> bytes:
    """A tiny sdist-shaped tarball: one top folder holding a vllm package."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, text in {"PKG-INFO": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n",
                           "vllm/__init__.py": f"VERSION = '{version}'\n",
                           "vllm/envs.py": "X = 1\n", ".gitignore": "/vllm/envs.py\n"}.items():
            data = text.encode()
            info = tarfile.TarInfo(f"vllm-{version}/{name}")
            info.size, info.uid, info.mtime = len(data), 12345, 0
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def pin(data: bytes, version: str = "9.9.0", **extra) -> Upstream:
    return Upstream(version=version, tag=f"v{version}",
                    sdist_sha256=hashlib.sha256(data).hexdigest(), **extra)


class Index:
    """A PEP 691 simple index on loopback serving one project's files."""

    def __init__(self, files: dict[str, bytes], listed_sha: dict[str, str] | None = None):
        self.files, self.listed_sha = files, listed_sha or {}
        handler = self._handler()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/simple"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _handler(self):
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path == "/simple/vllm/":
                    body = json.dumps({"meta": {"api-version": "1.0"}, "name": "vllm", "files": [
                        {"filename": name, "url": f"http://127.0.0.1:{index.server.server_port}/f/{name}",
                         "hashes": {"sha256": index.listed_sha.get(
                             name, hashlib.sha256(data).hexdigest())}}
                        for name, data in index.files.items()]}).encode()
                    kind = "application/vnd.pypi.simple.v1+json"
                elif self.path.startswith("/f/") and self.path[3:] in index.files:
                    body, kind = index.files[self.path[3:]], "application/octet-stream"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()


def test_index_url_follows_pip_configuration(monkeypatch, tmp_path):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple/")
    assert index_url() == "http://127.0.0.1:9/simple"
    # Without the variable: pip's configuration file (loaded last, so it wins)...
    monkeypatch.delenv("PIP_INDEX_URL")
    config = tmp_path / "pip.conf"
    config.write_text("[global]\nindex-url = http://127.0.0.1:9/from-config/\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(config))
    assert index_url() == "http://127.0.0.1:9/from-config"
    # ...and with no configuration at all, pip's own default.
    from pip._internal.models.index import PyPI

    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    assert index_url() == PyPI.simple_url.rstrip("/")


def test_the_real_index_lists_the_pinned_sdist():
    found = find_sdist("vllm", "0.31.0")
    assert found.filename == "vllm-0.31.0.tar.gz"
    assert found.sha256 == PINNED


def test_sdist_is_downloaded_verified_and_committed(tmp_path, monkeypatch):
    data = small_sdist()
    with Index({"vllm-9.9.0.tar.gz": data}) as index:
        monkeypatch.setenv("PIP_INDEX_URL", index.url)
        cache = UpstreamCache(Cache(tmp_path / "cache"))
        commit = cache.ensure(pin(data))
    repo = git.Repo(cache.repo_dir)
    assert repo.git.rev_parse("refs/tags/v9.9.0^{commit}") == commit
    # the sdist's own .gitignore must not drop files it ships
    assert sorted(repo.git.ls_tree("-r", "--name-only", commit).split()) == [
        ".gitignore", "PKG-INFO", "vllm/__init__.py", "vllm/envs.py"]
    assert (cache.downloads / "vllm-9.9.0.tar.gz").read_bytes() == data
    # importing is deterministic: the same sdist gives the same commit anywhere
    other = UpstreamCache(Cache(tmp_path / "other"))
    assert other.ensure(pin(data), local=cache.downloads / "vllm-9.9.0.tar.gz") == commit


def test_index_listing_another_hash_is_refused_before_download(tmp_path, monkeypatch):
    data = small_sdist()
    with Index({"vllm-9.9.0.tar.gz": data}, listed_sha={"vllm-9.9.0.tar.gz": "0" * 64}) as index:
        monkeypatch.setenv("PIP_INDEX_URL", index.url)
        cache = UpstreamCache(Cache(tmp_path / "cache"))
        with pytest.raises(E2Error, match=r"sha256 mismatch for vllm-9.9.0.tar.gz: the index "
                                          r"lists 0{64}, series.yaml pins [0-9a-f]{64}"):
            cache.ensure(pin(data))
    assert cache.tag_commit("v9.9.0") is None
    assert list(cache.downloads.glob("*")) == []


def test_downloaded_bytes_with_another_hash_are_refused(tmp_path, monkeypatch):
    served = small_sdist()
    tampered = served + b"\0"
    # the listing carries no hash, so only the downloaded bytes can be checked
    with Index({"vllm-9.9.0.tar.gz": tampered}, listed_sha={}) as index:
        index.listed_sha["vllm-9.9.0.tar.gz"] = None
        monkeypatch.setenv("PIP_INDEX_URL", index.url)
        cache = UpstreamCache(Cache(tmp_path / "cache"))
        with pytest.raises(E2Error, match="sha256 mismatch for vllm-9.9.0.tar.gz: got"):
            cache.ensure(pin(served))
    assert cache.tag_commit("v9.9.0") is None
    assert list(cache.downloads.glob("*")) == []  # no .part file left behind


def test_missing_release_is_named(tmp_path, monkeypatch):
    with Index({}) as index:
        monkeypatch.setenv("PIP_INDEX_URL", index.url)
        with pytest.raises(E2Error, match="the package index has no vllm-9.9.0.tar.gz"):
            UpstreamCache(Cache(tmp_path / "cache")).ensure(pin(small_sdist()))


def test_local_tarball_with_wrong_hash_is_refused(tmp_path):
    data = small_sdist()
    tarball = tmp_path / "vllm-9.9.0.tar.gz"
    tarball.write_bytes(data + b"x")
    with pytest.raises(E2Error, match=f"sha256 mismatch for {tarball}"):
        UpstreamCache(Cache(tmp_path / "cache")).ensure(pin(data), local=tarball)


def test_local_tree_is_imported_with_a_warning(tmp_path, capsys):
    tree = tmp_path / "tree" / "vllm"
    tree.mkdir(parents=True)
    (tree / "__init__.py").write_text("\n")
    (tree / "_version.py").write_text("__version__ = version = '9.9.0'\n")
    cache = UpstreamCache(Cache(tmp_path / "cache"))
    commit = cache.ensure(pin(b"unused"), local=tree.parent)
    assert "without a hash check" in capsys.readouterr().err
    assert git.Repo(cache.repo_dir).git.ls_tree("-r", "--name-only", commit).split() == [
        "vllm/__init__.py", "vllm/_version.py"]


def remote_with_tag(tmp_path: Path, version: str) -> tuple[Path, str]:
    remote = tmp_path / "remote"
    repo = git.Repo.init(remote)
    (remote / "vllm").mkdir()
    (remote / "vllm" / "__init__.py").write_text("# from git\n")
    repo.git.add("-A")
    repo.git.commit("-q", "-m", "release", author="Upstream <u@vllm-e2.invalid>",
                    env={"GIT_COMMITTER_NAME": "u", "GIT_COMMITTER_EMAIL": "u@vllm-e2.invalid"})
    repo.git.tag(f"v{version}")
    return remote, repo.head.commit.hexsha


def test_git_remote_source_fetches_the_tag_and_checks_the_pinned_commit(tmp_path):
    remote, commit = remote_with_tag(tmp_path, "9.9.0")
    cache = UpstreamCache(Cache(tmp_path / "cache"))
    upstream = pin(b"x", git=GitSource(remote=str(remote), commit=commit))
    assert cache.ensure(upstream, source="git") == commit

    wrong = pin(b"x", git=GitSource(remote=str(remote), commit="1" * 40))
    other = UpstreamCache(Cache(tmp_path / "other"))
    with pytest.raises(E2Error, match=f"v9.9.0 at {remote} is {commit}, series.yaml pins 1{{40}}"):
        other.ensure(wrong, source="git")
    assert other.tag_commit("v9.9.0") is None


def test_unreachable_git_remote_is_named(tmp_path):
    upstream = pin(b"x", git=GitSource(remote=str(tmp_path / "nowhere")))
    with pytest.raises(E2Error, match="cannot fetch v9.9.0 from"):
        UpstreamCache(Cache(tmp_path / "cache")).ensure(upstream, source="git")


def _ensure_in_process(cache_root: str, tarball: str, sha: str, queue) -> None:
    upstream = Upstream(version="9.9.0", tag="v9.9.0", sdist_sha256=sha)
    queue.put(UpstreamCache(Cache(Path(cache_root))).ensure(upstream, local=Path(tarball)))


def test_two_runs_at_once_share_one_import(tmp_path):
    data = small_sdist()
    tarball = tmp_path / "vllm-9.9.0.tar.gz"
    tarball.write_bytes(data)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    workers = [context.Process(target=_ensure_in_process,
                               args=(str(tmp_path / "cache"), str(tarball),
                                     hashlib.sha256(data).hexdigest(), queue))
               for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(300)  # generous: spawned interpreters start slowly on a loaded machine
        assert worker.exitcode == 0
    first, second = queue.get(), queue.get()
    assert first == second
    repo = git.Repo(tmp_path / "cache" / "upstream.git")
    assert repo.git.tag("--list").split() == ["v9.9.0"]
    assert len(repo.git.rev_list("--all").split()) == 1
