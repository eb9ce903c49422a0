"""The cache directory: one Cache owns its layout, the tests have their own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT, state_listing
from e2 import cli
from e2.cache import Cache
from e2.commands import status


def test_the_layout_keeps_the_folder_names_existing_caches_have(tmp_path):
    cache = Cache(tmp_path)
    assert {name: getattr(cache, name).relative_to(tmp_path).as_posix() for name in (
        "downloads", "upstream_repo", "hub_stores", "models", "probe_packages", "base_cpu",
        "debs", "crash_log")} == {
        "downloads": "downloads", "upstream_repo": "upstream.git", "hub_stores": "hub-stores",
        "models": "models", "probe_packages": "probe-packages", "base_cpu": "base-cpu",
        "debs": "debs", "crash_log": "crash.log"}
    assert cache.venv("cpu-0.31.0") == tmp_path / "venvs" / "cpu-0.31.0"
    assert cache.upstream_lock.lock_file == str(tmp_path / "lock")
    assert cache.upstream_lock is cache.upstream_lock  # one lock object, taken again by its holder
    assert Cache.lock(cache.venv("cpu-0.31.0")).lock_file == str(tmp_path / "venvs" /
                                                                  "cpu-0.31.0.lock")


def _cli_cache_dockerd(env: dict[str, str]) -> str:
    """What `e2` without --cache takes for the daemon's state (in a process of its own:
    this session refuses the user's cache)."""
    return subprocess.run([sys.executable, "-c", "from e2.cache import Cache; "
                           "print(Cache.at(None).dockerd)"], env=env, capture_output=True,
                          text=True, check=True).stdout.strip()


def _script_dockerd(env: dict[str, str]) -> str:
    return subprocess.run(["sh", str(REPO_ROOT / "ci" / "dockerd.sh"), "dir"], env=env,
                          capture_output=True, text=True, check=True).stdout.strip()


def test_dockerd_script_and_cache_agree_on_the_daemons_state(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "E2_DOCKERD_DIR"}
    env.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), PYTHONPATH=str(REPO_ROOT / "scripts"))
    expected = str(tmp_path / "xdg" / "vllm-e2" / "dockerd")
    assert _script_dockerd(env) == _cli_cache_dockerd(env) == expected
    env["E2_DOCKERD_DIR"] = str(tmp_path / "elsewhere")
    assert _script_dockerd(env) == _cli_cache_dockerd(env) == str(tmp_path / "elsewhere")


def test_an_e2_call_without_the_test_cache_is_refused(e2):
    with pytest.raises(AssertionError, match="a test reached for the user's cache"):
        cli.main(["--project", str(e2.root), "status"])


def test_a_verb_keeps_to_the_test_cache_and_out_of_the_checkout(e2, cache, monkeypatch):
    user_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm-e2"
    assert cache.root != user_cache and not cache.root.is_relative_to(user_cache)
    checkout_state = state_listing(REPO_ROOT / ".e2")
    e2("apply")
    assert e2.upstream_cache.repo_dir == cache.upstream_repo
    assert (cache.upstream_repo / "HEAD").is_file() and cache.downloads.is_dir()
    assert e2.work.is_relative_to(e2.root)

    def broken(options, args):
        raise KeyError("a bug")

    monkeypatch.setattr(status, "run", broken)
    log = cache.crash_log
    kept = log.stat().st_size if log.is_file() else 0
    try:
        _, _, err = e2("status", expect=3)
        assert f"(details in {log})" in err
        assert "KeyError: 'a bug'" in log.read_text()[kept:]
    finally:  # the tests' cache keeps no crash of this test's making
        if kept:
            with log.open("r+") as handle:
                handle.truncate(kept)
        else:
            log.unlink(missing_ok=True)
    assert state_listing(REPO_ROOT / ".e2") == checkout_state
