"""The pin cannot lie: the cached tree is bound to the sdist it came from, tag and
version agree, and a local tree or tarball must be the release it is used as."""

from __future__ import annotations

import hashlib
import io
import tarfile

import git
import pytest
import yaml
from pydantic import ValidationError
from test_upstream import Index, pin, small_sdist

from conftest import copy_real_patches
from e2.apply import UpstreamOptions
from e2.cache import Cache
from e2.errors import E2Error
from e2.rebase import resolve_target
from e2.series import Upstream
from e2.upstream import PINS_FILE, UpstreamCache

PINNED = "dde46f1efbe846e5bd0c5c4ec6ec71842c42254c7ff3d9bebb2a57028715d380"


def test_a_hash_edited_after_the_import_is_refused_by_every_command(e2):
    copy_real_patches(e2)
    e2("overlay")
    bogus = "ab" * 32
    e2.project.series_file.write_text(e2.series_text().replace(PINNED, bogus))
    for verb in ("apply", "overlay"):
        _, _, err = e2(verb, expect=1)
        message = " ".join(err.split())
        assert (f"series.yaml pins v0.31.0 to sdist sha256 {bogus}, but the cached v0.31.0 "
                f"was imported from sha256 {PINNED}") in message
    _, out, _ = e2("verify", expect=1)
    assert "FAIL every patch applies exactly" in out and f"sdist sha256 {bogus}" in out
    _, out, _ = e2("status", expect=1)   # the overlay on disk was made for the real pin
    assert "overlay/ was made for vLLM 0.31.0 (dde46f1efbe8), series.yaml pins 0.31.0 " \
           "(abababababab)" in out
    assert not (e2.root / ".e2" / "work").exists()


def test_version_and_tag_must_agree(e2):
    with pytest.raises(ValidationError, match="'v0.31.0' disagrees with version '0.32.0'"):
        Upstream(version="0.32.0", tag="v0.31.0", sdist_sha256=PINNED)
    e2.project.series_file.write_text(e2.series_text().replace("version: 0.31.0",
                                                               "version: 0.32.0"))
    _, _, err = e2("verify", expect=1)
    assert f"{e2.project.series_file}:7:3: upstream.tag: Value error, 'v0.31.0' disagrees " \
           "with version '0.32.0'" in err


def test_rebase_with_a_tarball_of_another_release_is_refused(e2, upstream_cache, tmp_path):
    sdist = upstream_cache.sdist_path(e2.project.load().upstream)
    assert sdist.is_file()
    before = e2.series_text()
    cold = tmp_path / "cold-cache"
    _, _, err = e2("--cache", str(cold), "--upstream", str(sdist), "rebase", "--onto", "0.32.0",
                   expect=1)
    assert f"--upstream {sdist} is vLLM 0.31.0, not 0.32.0" in " ".join(err.split())
    assert e2.series_text() == before
    assert UpstreamCache(Cache(cold)).tag_commit("v0.32.0") is None


def _sdist_with(version: str, extra: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, text in {"PKG-INFO": f"Version: {version}\n", "vllm/__init__.py": extra}.items():
            info = tarfile.TarInfo(f"vllm-{version}/{name}")
            info.size = len(text.encode())
            archive.addfile(info, io.BytesIO(text.encode()))
    return buffer.getvalue()


def test_a_local_tarball_must_be_the_index_release(tmp_path, monkeypatch):
    released, local_build = _sdist_with("9.9.0", "# released\n"), _sdist_with("9.9.0", "# mine\n")
    tarball = tmp_path / "vllm-9.9.0.tar.gz"
    tarball.write_bytes(local_build)
    cache = UpstreamCache(Cache(tmp_path / "cache"))
    current = pin(b"x", version="9.8.0")
    with Index({"vllm-9.9.0.tar.gz": released}) as index:
        monkeypatch.setenv("PIP_INDEX_URL", index.url)
        target = resolve_target("9.9.0", current, UpstreamOptions(cache, local=tarball))
    assert target.sdist_sha256 == hashlib.sha256(released).hexdigest()  # the index's
    with pytest.raises(E2Error, match=f"sha256 mismatch for {tarball}"):
        cache.ensure(target, local=tarball)
    assert cache.tag_commit("v9.9.0") is None


def test_without_an_index_a_local_tarball_is_pinned_by_its_own_hash(tmp_path, monkeypatch,
                                                                    capsys):
    data = _sdist_with("9.9.0", "# offline\n")
    tarball = tmp_path / "vllm-9.9.0.tar.gz"
    tarball.write_bytes(data)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    options = UpstreamOptions(UpstreamCache(Cache(tmp_path / "cache")), local=tarball)
    target = resolve_target("v9.9.0", pin(b"x", version="9.8.0"), options)
    assert target.sdist_sha256 == hashlib.sha256(data).hexdigest()
    assert "unchecked against the release" in capsys.readouterr().err


def test_a_tag_cached_without_a_binding_is_verified_once(tmp_path):
    data = small_sdist()
    tarball = tmp_path / "vllm-9.9.0.tar.gz"
    tarball.write_bytes(data)
    cache = UpstreamCache(Cache(tmp_path / "cache"))
    commit = cache.ensure(pin(data), local=tarball)
    assert cache.bindings()["v9.9.0"].sdist_sha256 == pin(data).sdist_sha256
    # as an older e2 left it: the tag without its binding, the sdist in downloads/
    cache.pins_file.unlink()
    cache.downloads.mkdir(parents=True)
    (cache.downloads / tarball.name).write_bytes(data)
    assert cache.ensure(pin(data)) == commit
    assert cache.bindings()["v9.9.0"].commit == commit
    # a tag that is not the pinned sdist is refused, not bound
    repo = git.Repo(cache.repo_dir)
    other = repo.git.commit_tree(f"{commit}^{{tree}}", m="not the release")
    repo.git.tag("-f", "v9.9.0", other)
    cache.pins_file.unlink()
    with pytest.raises(E2Error, match=r"the cached v9.9.0 \([0-9a-f]{12}\) is not the pinned "
                                      r"sdist vllm-9.9.0.tar.gz"):
        cache.ensure(pin(data))
    assert not cache.pins_file.exists() or "v9.9.0" not in cache.bindings()


def test_a_killed_import_leaves_nothing_behind_for_long(tmp_path):
    data = small_sdist()
    tarball = tmp_path / "vllm-9.9.0.tar.gz"
    tarball.write_bytes(data)
    root = tmp_path / "cache"
    cache = UpstreamCache(Cache(root))
    (root / "extract-killed" / "vllm-9.9.0").mkdir(parents=True)
    (root / "index-4242").write_text("stale index")
    cache.downloads.mkdir()
    (cache.downloads / "vllm-9.8.0.tar.gz.part").write_bytes(b"half")
    cache.ensure(pin(data), local=tarball)
    assert sorted(p.name for p in root.iterdir()) == ["downloads", "lock", "upstream.git"]
    assert list(cache.downloads.iterdir()) == []


def test_pins_file_is_the_binding_of_each_tag(tmp_path):
    data = small_sdist()
    tarball = tmp_path / "vllm-9.9.0.tar.gz"
    tarball.write_bytes(data)
    cache = UpstreamCache(Cache(tmp_path / "cache"))
    commit = cache.ensure(pin(data), local=tarball)
    pins = yaml.safe_load((cache.repo_dir / PINS_FILE).read_text())
    assert pins == {"v9.9.0": {"commit": commit, "sdist_sha256": pin(data).sdist_sha256,
                               "source": "tarball"}}


def test_a_release_missing_on_the_index_is_named_before_the_git_fallback(tmp_path,
                                                                          monkeypatch):
    from e2.series import GitSource

    upstream = pin(b"x", git=GitSource(remote=str(tmp_path / "nowhere")))
    with Index({}) as index:
        monkeypatch.setenv("PIP_INDEX_URL", index.url)
        with pytest.raises(E2Error, match=r"the package index has no vllm-9.9.0.tar.gz; and "
                                          r"from git: cannot fetch v9.9.0"):
            UpstreamCache(Cache(tmp_path / "cache")).ensure(upstream)
