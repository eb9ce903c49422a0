"""e2 verify runs the pinned release's own checks (its pre-commit hooks, ruff at its
pin) over the files the series changes, and fails on what stock does not have.

Real tools on the real sdist's tree: the release named in series.yaml, its
.pre-commit-config.yaml, pyproject.toml and tools/pre_commit/ scripts.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import git
import pytest
import yaml

from conftest import REPO_ROOT
from e2.errors import E2Error
from e2.precommit import CONFIG, Finding, read_toolset
from e2.series import load_series
from e2.upstream_checks import ensure_tools, new_findings, run

ENVS = "vllm/envs.py"
ANCHOR = "def get_default_config_root():\n"
SERIES = load_series(REPO_ROOT / "series.yaml")
# A new file: its imports sorted as vLLM's isort wants them once vllm's modules are
# first-party (the check's trees must show them), but no SPDX header.
NEW_FILE = ('import torch\n\nfrom vllm.sampling_params import SamplingParams\n\n'
            'SWITCH = "VLLM_E2_PLANTED"\n__all__ = ["SWITCH", "SamplingParams", "torch"]\n')
SPDX = ("# SPDX-License-Identifier: Apache-2.0\n"
        "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n")
CHECK = (f"{SERIES.upstream.tag}'s own checks find nothing new in the files the series "
         "changes")


def problems_of(out: str, check: str) -> list[str]:
    """The lines verify printed under ``check``."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.endswith(" " + check))
    rest = lines[start + 1:]
    return [line.strip() for line in rest[:next((i for i, line in enumerate(rest)
                                                 if not line.startswith("     ")), len(rest))]]


def plant(e2, files: dict[str, str], message: str) -> None:
    repo = e2.worktree()
    for path, text in files.items():
        (e2.work / path).write_text(text)
    repo.git.add(*files)
    repo.git.commit("-q", "-m", message)


def test_planted_violations_fail_verify_naming_file_and_line(e2):
    e2("apply")
    envs = (e2.work / ENVS).read_text()
    long_line = f'    _ = "{"x" * 90}"\n'
    envs = envs.replace(ANCHOR, ANCHOR + long_line, 1)
    line = envs.splitlines(keepends=True).index(long_line) + 1
    plant(e2, {ENVS: envs, "vllm/e2_planted.py": NEW_FILE},
          "envs: planted findings")
    e2("export", expect=1)  # the new patch needs its metadata
    e2.fill_metadata(None, "VLLM_E2_PLANTED")
    e2("overlay")
    _, out, _ = e2("verify", expect=1)
    assert re.findall(r"^FAIL (.+)$", out, re.MULTILINE) == [CHECK]
    found = problems_of(out, CHECK)
    assert len(found) == 2, found
    assert found[0] == "vllm/e2_planted.py:1: check-spdx-header The following files are " \
                       "missing the SPDX header"
    assert re.fullmatch(rf"{ENVS}:{line}: E501 Line too long \(\d+ > \d+\)", found[1])

    # fixed in the patch, the check passes
    e2("apply", "--force")
    fixed = {ENVS: (e2.work / ENVS).read_text().replace(long_line, '    _ = "x"\n'),
             "vllm/e2_planted.py": SPDX + NEW_FILE}
    repo = e2.worktree()
    for path, text in fixed.items():
        (e2.work / path).write_text(text)
    repo.git.add(*fixed)
    repo.git.commit("-q", "--amend", "--no-edit")
    e2("export")
    e2("overlay")
    _, out, _ = e2("verify")
    assert f"ok   {CHECK}" in out


@pytest.fixture
def upstream_tree(e2):
    """A worktree at the pinned release (no patches) to commit a stock and a series on."""
    e2("apply")
    return e2.worktree()


def commit(repo: git.Repo, files: dict[str, str], message: str, remove: str = "") -> str:
    assert repo.working_tree_dir is not None
    if remove:
        repo.git.rm("-rq", remove)
    for path, text in files.items():
        (Path(repo.working_tree_dir) / path).write_text(text)
    repo.git.add("-A")
    repo.git.commit("-q", "-m", message)
    return repo.head.commit.hexsha


def test_a_finding_stock_has_does_not_fail_where_it_moves(e2, upstream_tree, tmp_path):
    """The real release is clean, so a stock with findings is the release plus one commit."""
    repo, work = upstream_tree, e2.work
    envs = (work / ENVS).read_text()
    long_line = f'    _ = "{"stock" * 20}"\n'
    stock = commit(repo, {ENVS: envs.replace(ANCHOR, ANCHOR + long_line, 1)}, "stock: E501")
    assert [f.code for f in run(repo, f"{stock}~1", stock, e2.cache, tmp_path,
                                SERIES.upstream.tag)] == ["E501"]
    # the series moves the stock finding 5 lines down: not new
    moved = envs.replace(ANCHOR, "# moved\n" * 5 + ANCHOR + long_line, 1)
    head = commit(repo, {ENVS: moved}, "series: lines above")
    assert run(repo, stock, head, e2.cache, tmp_path, SERIES.upstream.tag) == []
    # a second copy of it is new, and is the one named
    twice = moved.replace(long_line, long_line * 2, 1)
    head = commit(repo, {ENVS: twice}, "series: a second copy")
    (found,) = run(repo, stock, head, e2.cache, tmp_path, SERIES.upstream.tag)
    second = twice.splitlines(keepends=True).index(long_line) + 2
    assert (found.path, found.line, found.code) == (ENVS, second, "E501")


def test_findings_match_by_rule_and_line_text_as_a_multiset():
    def at(line: int, text: str, code: str = "E501", path: str = "a.py") -> Finding:
        return Finding(path, line, code, "m", text)

    stock = [at(3, "x = 1"), at(9, "y = 2"), at(1, "", "check-spdx-header")]
    patched = [at(30, "x = 1"), at(31, "x = 1"), at(90, "  y = 2  "),
               at(1, "", "check-spdx-header"), at(2, "x = 1", "F401"), at(1, "x = 1", "E501",
                                                                          "new.py")]
    assert new_findings(stock, patched) == [at(2, "x = 1", "F401"), at(31, "x = 1"),
                                            at(1, "x = 1", "E501", "new.py")]


def test_ruff_is_the_version_the_pinned_release_pins(upstream_cache):
    tag = SERIES.upstream.tag
    config = git.Repo(upstream_cache.repo_dir).git.show(f"{tag}:{CONFIG}")
    pinned = next(repo["rev"] for repo in yaml.safe_load(config)["repos"]
                  if repo["repo"].endswith("/ruff-pre-commit"))
    toolset = read_toolset(config, CONFIG)
    assert toolset.requirements[0] == f"ruff=={pinned.removeprefix('v')}"
    python = ensure_tools(upstream_cache.cache, toolset.requirements)
    version = subprocess.run([str(python), "-m", "ruff", "--version"], capture_output=True,
                             text=True, check=True).stdout.split()
    assert version == ["ruff", pinned.removeprefix("v")]
    assert ensure_tools(upstream_cache.cache, toolset.requirements) == python  # made once


def test_a_rev_frozen_to_a_commit_pins_the_version_its_comment_names(upstream_cache):
    config = git.Repo(upstream_cache.repo_dir).git.show(f"{SERIES.upstream.tag}:{CONFIG}")
    rev = re.search(r"ruff-pre-commit\n  rev: (\S+)", config)
    assert rev, "the release's config names ruff-pre-commit and its rev"
    sha = "f368fb366ff7f2f808dd324b83a6d32267799e19"
    frozen = config.replace(rev.group(0), f"ruff-pre-commit\n  rev: {sha}  # frozen: v0.17.2")
    assert read_toolset(frozen, CONFIG).ruff_version == "0.17.2"
    with pytest.raises(E2Error, match=f"pins ruff-pre-commit to commit {sha} with no "):
        read_toolset(config.replace(rev.group(0), f"ruff-pre-commit\n  rev: {sha}"), CONFIG)


def test_a_release_without_its_checks_is_refused_in_one_line(e2, upstream_tree, tmp_path):
    repo, tag = upstream_tree, SERIES.upstream.tag
    envs = (e2.work / ENVS).read_text()
    stock = commit(repo, {}, "a release without tools/pre_commit", remove="tools/pre_commit")
    head = commit(repo, {ENVS: envs + "\n# changed\n"}, "series")
    with pytest.raises(E2Error) as caught:
        run(repo, stock, head, e2.cache, tmp_path, tag)
    assert caught.value.message == (f"{tag}'s tree has no {CONFIG} or no tools/pre_commit/: "
                                    "its own checks cannot run")
    repo.git.checkout("-q", tag, "--", "tools/pre_commit")
    config = (e2.work / CONFIG).read_text().replace("id: ruff-check", "id: ruff-lint")
    stock = commit(repo, {CONFIG: config}, "a release whose ruff hook is named otherwise")
    head = commit(repo, {ENVS: envs + "\n# changed again\n"}, "series")
    with pytest.raises(E2Error) as caught:
        run(repo, stock, head, e2.cache, tmp_path, tag)
    assert caught.value.message == f"{tag}'s {CONFIG} has no hook ruff-check with a pinned rev"
