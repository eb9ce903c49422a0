"""A terminal that cannot encode what e2 prints (a title's dash, a spinner) gets stand-ins,
never a UnicodeEncodeError, whatever its encoding."""

from __future__ import annotations

import os
import subprocess
import sys

import git
import pytest

from conftest import copy_real_patches


def run(e2, encoding: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONIOENCODING": encoding}
    return subprocess.run([sys.executable, "-m", "e2.cli", "--project", str(e2.root),
                           "--cache", str(e2.cache.root), *args],
                          env=env, capture_output=True, timeout=600)


@pytest.mark.parametrize("encoding", ["ascii", "latin-1", "cp1252", "iso8859-5"])
def test_status_on_a_terminal_that_lacks_the_titles_characters(e2, encoding):
    copy_real_patches(e2)
    title = e2.project.load().patches[1].title
    assert any(ord(c) > 127 for c in title)  # the real series' 0002 has a dash
    e2("overlay")
    result = run(e2, encoding, "status")
    assert result.returncode == 0, result.stderr
    assert b"Traceback" not in result.stderr and b"unexpected" not in result.stderr
    assert title[:24].encode(encoding, errors="replace") in result.stdout  # the dash or a ?
    assert b"in sync" in result.stdout


def test_apply_on_an_ascii_terminal_finishes_and_says_so(e2):
    copy_real_patches(e2)
    result = run(e2, "ascii", "apply")
    assert result.returncode == 0, result.stderr
    assert b"Traceback" not in result.stderr and b"unexpected" not in result.stderr
    assert b"clean  0002 v1/core: state pool ? attention" in result.stdout
    assert len(list(git.Repo(e2.work).iter_commits("refs/tags/v0.31.0..HEAD"))) == 2
