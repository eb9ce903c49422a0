"""The installed `e2` command: help for every verb, clear errors, exit codes."""

from __future__ import annotations

import re
import subprocess

import pytest


def e2(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(["e2", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


VERBS = ("apply", "overlay", "verify", "export", "status", "rebase", "env", "test", "image",
         "probe", "models")


def test_top_level_help_lists_every_verb():
    result = e2("--help")
    assert result.returncode == 0
    # Each verb opens its own line of the command list, with its summary:
    # the word anywhere in the description would not do.
    listed = re.findall(r"^    ([a-z]+)\s{2,}\S", result.stdout, re.MULTILINE)
    assert listed == list(VERBS)


@pytest.mark.parametrize("verb", VERBS)
def test_each_verb_has_help(verb):
    result = e2(verb, "--help")
    assert result.returncode == 0
    assert result.stdout.startswith(f"usage: e2 {verb}")


def test_outside_a_checkout_the_error_says_where_it_looked(tmp_path):
    result = e2("status", cwd=tmp_path)
    assert result.returncode == 1
    assert f"error: no series.yaml in {tmp_path} or any parent" in result.stderr
    assert "hint: run e2 inside a vLLM E2 checkout, or pass --project DIR" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_series_exits_non_zero_with_location(tmp_path):
    (tmp_path / "series.yaml").write_text("upstream:\n  version: [\n")
    result = e2("verify", cwd=tmp_path)
    assert result.returncode == 1
    assert f"error: {tmp_path}/series.yaml:3:1: invalid YAML" in result.stderr


def test_unknown_verb_is_a_usage_error():
    result = e2("frobnicate")
    assert result.returncode == 2
    assert "invalid choice: 'frobnicate'" in result.stderr
