"""--validate starts e2 test seam and e2 test upstream with the global options the
rebase itself was started with, so they validate against the same upstream cache,
source and local tree (not the default cache)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from e2 import cli
from e2.commands import rebase
from e2.options import GlobalOptions, RebaseOptions

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    root.mkdir()
    series = (REPO_ROOT / "series.yaml").read_text()
    (root / "series.yaml").write_text(series[:series.index("patches:")] + "patches: []\n")
    return root


def validate_as_started_with(monkeypatch, argv: list[str]) -> list:
    """Run validation_checks on the arguments cli.main builds for ``e2 ARGV rebase``."""
    found: list = []

    def validate_only(options: GlobalOptions, args: RebaseOptions) -> int:
        assert args.validate_suite == ("tests/no_such_suite.py",)  # repeated: a tuple
        found.extend(rebase.validation_checks(options, args))
        return 0

    monkeypatch.setattr(rebase, "run", validate_only)
    assert cli.main([*argv, "rebase", "--continue", "--validate",
                     "--validate-suite", "tests/no_such_suite.py"]) == 0
    return found


def test_children_get_the_cache_source_and_local_tree(project, tmp_path, monkeypatch):
    cache, tarball = tmp_path / "cache", tmp_path / "vllm-0.32.0.tar.gz"
    commands: list[list[str]] = []

    def record(command: list[str], **_: object) -> subprocess.CompletedProcess:
        commands.append(command)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(subprocess, "run", record)
    checks = validate_as_started_with(monkeypatch, [
        "--project", str(project), "--cache", str(cache), "--source", "git",
        "--upstream", str(tarball)])
    assert [c.name for c in checks] == ["e2 test seam", "e2 test upstream"]
    assert [c[c.index("test"):c.index("test") + 2] for c in commands] == [
        ["test", "seam"], ["test", "upstream"]]
    for command in commands:
        options = command[:command.index("test")]  # global options go before the verb
        assert options[options.index("--cache") + 1] == str(cache)
        assert options[options.index("--source") + 1] == "git"
        assert options[options.index("--upstream") + 1] == str(tarball)


def test_a_child_uses_the_rebases_cache(project, tmp_path, monkeypatch):
    """A cache path that is a file fails the child at once, naming it; with the
    default cache the child would get as far as the missing suite instead."""
    not_a_cache = tmp_path / "not-a-cache"
    not_a_cache.write_text("a file where the cache directory should be\n")
    checks = validate_as_started_with(monkeypatch, [
        "--project", str(project), "--cache", str(not_a_cache)])
    upstream = next(c for c in checks if c.name == "e2 test upstream")
    assert not upstream.ok
    assert str(not_a_cache) in upstream.problems[0], upstream.problems
    assert "no such suite" not in upstream.problems[0]
