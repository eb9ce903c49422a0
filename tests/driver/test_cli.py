"""The installed `e2` command: help for every verb, clear errors, exit codes."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import copy_checkout


def e2(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(["e2", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


VERBS = ("apply", "overlay", "verify", "export", "status", "rebase", "drift", "env", "test",
         "image", "probe", "models")


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


def e2_without_git(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """`e2 ARGS` with a PATH that holds no git (the interpreter named by its full path)."""
    bare = tmp_path / "bin"
    bare.mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-m", "e2.cli", *args], cwd=tmp_path,
                          env={"PATH": str(bare), "HOME": str(tmp_path)},
                          capture_output=True, text=True, timeout=120)


def test_help_works_without_git(tmp_path):
    result = e2_without_git(tmp_path, "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: e2")
    assert result.stderr == ""


@pytest.mark.parametrize("verb", ["status", "apply", "verify"])
def test_a_verb_without_git_says_so_in_one_line(tmp_path, verb):
    (tmp_path / "series.yaml").write_text("upstream: {}\n")
    result = e2_without_git(tmp_path, "--cache", str(tmp_path / "cache"), verb)
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines()[0] == "error: git is not on PATH (e2 needs it)"
    assert len(result.stderr.splitlines()) <= 2  # the line and its hint
    assert "Traceback" not in result.stderr
    assert not (tmp_path / ".e2").exists() and not (tmp_path / "cache").exists()


def test_image_render_needs_no_git(tmp_path):
    project = copy_checkout(tmp_path / "project")
    result = e2_without_git(tmp_path, "--project", str(project), "--cache",
                            str(tmp_path / "cache"), "image", "render")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "Dockerfile already up to date\n"


def test_a_ctrl_c_while_the_modules_load_says_interrupted():
    """A real SIGINT sent as the command starts importing the driver (e2.cli and
    all it loads): one line and exit 130, as while a verb runs, no traceback."""
    # A terminal's Ctrl-C: Python's own handler, even where the job that runs the
    # tests was started with SIGINT ignored (a background job of a script), which
    # the child would inherit.
    starts = (
        "import builtins, os, signal\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "real = builtins.__import__\n"
        "def importing(name, *args, **kwargs):\n"
        "    if name == 'e2.cli':\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "    return real(name, *args, **kwargs)\n"
        "builtins.__import__ = importing\n"
        "from e2.entry import main\n"
        "raise SystemExit(main())\n")
    result = subprocess.run([sys.executable, "-c", starts], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 130
    assert result.stderr.strip() == "error: interrupted"
