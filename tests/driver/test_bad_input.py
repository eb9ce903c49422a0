"""Bad input, as a careless or hostile user gives it: one clear line, nothing changed.

Every case breaks a copy of this checkout (series.yaml, patches/, overlay/,
images/, Dockerfile, committed to git) in one way, runs the CLI and asserts
that it exits non-zero without a traceback (and not through the crash
handler), names the file or input at fault, and leaves every file of the
checkout and its `git status` exactly as they were.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import git
import pytest
from filelock import FileLock

from conftest import AUTHOR, REPO_ROOT, TEST_CACHE_ENV
from e2 import cli
from e2.cache import Cache
from e2.gitops import clone_worktree

TRACKED = ("series.yaml", "patches", "overlay", "images", "Dockerfile", ".gitignore")


@pytest.fixture(scope="module")
def golden(tmp_path_factory, upstream_cache) -> Path:
    """This checkout's series, overlay and image template, committed in a fresh repo."""
    root = tmp_path_factory.mktemp("golden") / "project"
    root.mkdir()
    for name in TRACKED:
        source = REPO_ROOT / name
        if source.is_dir():
            shutil.copytree(source, root / name)
        else:
            shutil.copy2(source, root / name)
    repo = git.Repo.init(root)
    with repo.config_writer() as config:
        for key, value in AUTHOR.items():
            config.set_value(*key.split("."), value)
    repo.git.add("-A")
    repo.git.commit("-q", "-m", "golden")
    return root


@pytest.fixture
def checkout(golden, tmp_path) -> Path:
    root = tmp_path / "project"
    shutil.copytree(golden, root, symlinks=True)
    return root


def snapshot(root: Path) -> tuple[dict, str]:
    """Every file outside .git and .e2 (links as their target), and git status."""
    files = {}
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if relative.parts[0] in (".git", ".e2"):
            continue
        if path.is_symlink():
            files[str(relative)] = ("link", os.readlink(path))
        elif path.is_file():
            files[str(relative)] = path.read_bytes()
    return files, git.Repo(root).git.status("--porcelain", "--ignored")


# ---------------------------------------------------------------- ways to break it


def edit(path: str, old: str, new: str) -> Callable[[Path], None]:
    def apply(root: Path) -> None:
        target = root / path
        text = target.read_text()
        assert old in text, f"{old!r} not in {path}"
        target.write_text(text.replace(old, new, 1))
    return apply


def write(path: str, data: bytes | str) -> Callable[[Path], None]:
    def apply(root: Path) -> None:
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data.encode() if isinstance(data, str) else data)
    return apply


def write_bytes_in(path: str, old: bytes, new: bytes) -> Callable[[Path], None]:
    def apply(root: Path) -> None:
        target = root / path
        target.write_bytes(target.read_bytes().replace(old, new, 1))
    return apply


def first_patch(root: Path) -> Path:
    return sorted((root / "patches").glob("0001-*.patch"))[0]


def empty_patch(root: Path) -> None:
    first_patch(root).write_bytes(b"")


def truncated_patch(root: Path) -> None:
    patch = first_patch(root)
    data = patch.read_bytes()
    cut = data.index(b"\n@@ ") + 200  # inside the first hunk
    patch.write_bytes(data[:cut])


def prose_patch(root: Path) -> None:
    first_patch(root).write_text("This is not a diff, just some notes.\n")


def plain_diff_patch(root: Path) -> None:
    """The patch as `git diff` prints it: the diff alone, no mail header."""
    patch = first_patch(root)
    data = patch.read_bytes()
    patch.write_bytes(data[data.index(b"diff --git "):])


# a billion laughs in small: each line holds nine of the one before
ALIAS_BOMB = "lol0: &l0 lol\n" + "".join(
    f"lol{n}: &l{n} [{', '.join([f'*l{n - 1}'] * 9)}]\n" for n in range(1, 6))


def alias_bomb(root: Path) -> None:
    series = root / "series.yaml"
    text = series.read_text()
    start = text.index("upstream:")
    series.write_text(text[:start] + ALIAS_BOMB + text[start:])


def one_file_two_ids(root: Path) -> None:
    """The second entry lists the first one's file; its own file is gone."""
    first, second = sorted(p.name for p in (root / "patches").glob("*.patch"))[:2]
    series = root / "series.yaml"
    series.write_text(series.read_text().replace(f"file: {second}", f"file: {first}"))
    (root / "patches" / second).unlink()


def overlay_file(root: Path) -> Path:
    manifest = json.loads((root / "overlay/MANIFEST.json").read_text())
    return root / "overlay" / next(f["path"] for f in manifest["files"] if not f["generated"])


def edited_overlay_file(root: Path) -> None:
    target = overlay_file(root)
    target.write_text(target.read_text() + "# hand edit\n")


def deleted_overlay_file(root: Path) -> None:
    overlay_file(root).unlink()


def manifest_without_files(root: Path) -> None:
    path = root / "overlay/MANIFEST.json"
    data = json.loads(path.read_text())
    del data["files"]
    path.write_text(json.dumps(data))


def overlay_as_symlink(root: Path) -> None:
    real = root.parent / "elsewhere"
    shutil.move(root / "overlay", real)
    (root / "overlay").symlink_to(real)


def worktree(root: Path) -> git.Repo:
    """A worktree on the pinned tag with no commits, as an interrupted apply may leave."""
    repo = clone_worktree(Cache(Path(os.environ[TEST_CACHE_ENV])).upstream_repo,
                          root / ".e2/work", "v0.31.0", sparse_paths=[])
    with repo.config_writer() as config:
        for key, value in AUTHOR.items():
            config.set_value(*key.split("."), value)
    return repo


def worktree_with_empty_commit(root: Path) -> None:
    worktree(root).git.commit("-q", "--allow-empty", "-m", "nothing here")


def worktree_with_ignored_file(root: Path) -> None:
    repo = worktree(root)
    (root / ".e2/work/pip-log.txt").write_text("the user's log\n")
    assert repo.git.status("--porcelain", "--ignored") == "!! pip-log.txt"


REBASE_STATE = {
    "source": {"project": "vllm", "version": "0.31.0", "tag": "v0.31.0",
               "sdist_sha256": "0" * 64, "git": None},
    "target": {"project": "vllm", "version": "0.32.0", "tag": "v0.32.0",
               "sdist_sha256": "1" * 64, "git": None},
    "patches": [{"id": "0001", "title": "envs: strict switches", "file": "0001-x.patch",
                 "status": "conflict"}],
    "phase": "conflict",
}


def stopped_rebase(root: Path) -> None:
    state = root / ".e2/rebase/state.json"
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps(REBASE_STATE))


def rebase_with_incomplete_backup(root: Path) -> None:
    stopped_rebase(root)
    (root / ".e2/rebase/backup/patches").mkdir(parents=True)  # series.yaml never copied


def damaged_rebase_state(root: Path) -> None:
    stopped_rebase(root)
    (root / ".e2/rebase/state.json").write_text('{"patches": 3}')


def other_release_tarball(root: Path) -> None:
    import io
    import tarfile

    with tarfile.open(root.parent / "vllm-0.31.0.tar.gz", "w:gz") as archive:
        data = b"Metadata-Version: 2.1\nName: vllm\nVersion: 0.31.0\n"
        info = tarfile.TarInfo("vllm-0.31.0/PKG-INFO")
        info.size = len(data)
        archive.addfile(info, io.BytesIO(data))


def nothing(root: Path) -> None:
    pass


@dataclass(frozen=True)
class Case:
    id: str
    breaks: Callable[[Path], None]
    args: tuple[str, ...]
    names: str                      # the file, patch or input the message must name
    held_lock: bool = False


CASES = [
    # 1. the pin cannot lie
    Case("pin-hash-edited-after-import",
         edit("series.yaml", "sdist_sha256: dde46f1e", "sdist_sha256: 00000000"),
         ("overlay",), "series.yaml pins v0.31.0 to sdist sha256 00000000"),
    Case("pin-version-and-tag-disagree", edit("series.yaml", "version: 0.31.0", "version: 0.32.0"),
         ("status",), "series.yaml:7:3: upstream.tag"),
    Case("upstream-path-missing", nothing, ("--upstream", "/nonexistent/vllm.tar.gz", "apply"),
         "--upstream /nonexistent/vllm.tar.gz: no such file or directory"),
    Case("upstream-tarball-of-another-release", other_release_tarball,
         ("--upstream", "{parent}/vllm-0.31.0.tar.gz", "rebase", "--onto", "0.32.0"),
         "vllm-0.31.0.tar.gz is vLLM 0.31.0, not 0.32.0"),
    Case("rebase-onto-empty", nothing, ("rebase", "--onto", ""),
         "--onto '' is not a release version"),
    # 2. nothing is lost
    Case("export-from-a-worktree-without-commits", worktree, ("export",),
         "has no commits on top of v0.31.0; exporting it would drop all"),
    Case("export-an-empty-commit", worktree_with_empty_commit, ("export",),
         "(nothing here) on refs/tags/v0.31.0 changes nothing"),
    Case("force-over-git-ignored-files", worktree_with_ignored_file, ("apply", "--force"),
         "holds git-ignored files that --force would delete: pip-log.txt"),
    Case("apply-while-another-command-runs", nothing, ("apply",),
         "another e2 command (apply, export, overlay or rebase) is changing", held_lock=True),
    Case("abort-with-an-incomplete-backup", rebase_with_incomplete_backup, ("rebase", "--abort"),
         "backup") ,
    Case("continue-with-a-damaged-rebase-state", damaged_rebase_state, ("rebase", "--continue"),
         ".e2/rebase/state.json: "),
    # 3. status tells the truth
    Case("status-hand-edited-overlay-file", edited_overlay_file, ("status",),
         "does not match overlay/MANIFEST.json (edited after e2 overlay wrote it"),
    Case("status-deleted-overlay-file", deleted_overlay_file, ("status",), "is missing"),
    Case("status-extra-overlay-file", write("overlay/vllm/extra.py", "x = 1\n"), ("status",),
         "overlay/vllm/extra.py is not in overlay/MANIFEST.json"),
    Case("status-edited-dockerfile", edit("Dockerfile", "FROM", "FROM  "), ("status",),
         "Dockerfile differs from what images/engine/Dockerfile.j2 renders"),
    Case("status-manifest-without-files", manifest_without_files, ("status",),
         "MANIFEST.json: files: Field required"),
    Case("status-rebase-stopped", stopped_rebase, ("status",),
         "a rebase from v0.31.0 onto v0.32.0 is in progress, stopped at 0001"),
    Case("export-during-a-stopped-rebase", stopped_rebase, ("export",),
         "not exporting: a rebase from v0.31.0 onto v0.32.0 is in progress, stopped at 0001"),
    # 4. one line, never a traceback
    Case("patch-empty", empty_patch, ("apply",), "(patch 0001) is empty"),
    Case("patch-truncated", truncated_patch, ("apply",), "(patch 0001) is not a valid diff"),
    Case("patch-not-a-diff", prose_patch, ("verify",), "(patch 0001) holds no diff"),
    Case("patch-plain-git-diff", plain_diff_patch, ("apply",),
         "(patch 0001) has no mail header: it is a plain diff, not git format-patch output "
         "(no 'From ' line and no 'Subject:')"),
    Case("patch-plain-git-diff-under-verify", plain_diff_patch, ("verify",),
         "(patch 0001) has no mail header: it is a plain diff, not git format-patch output"),
    Case("template-syntax-error", edit("images/engine/Dockerfile.j2", "FROM", "{% if %}\nFROM"),
         ("image", "render"), "Dockerfile.j2:"),
    Case("template-undefined-name", edit("images/engine/Dockerfile.j2", "FROM", "{{ nope }}\nFROM"),
         ("image", "render"), "Dockerfile.j2: cannot render: 'nope' is undefined"),
    Case("template-reaching-python-internals",
         edit("images/engine/Dockerfile.j2", "FROM", "{{ cycler.__init__.__globals__ }}\nFROM"),
         ("image", "render"), "Dockerfile.j2: cannot render: access to attribute '__init__'"),
    Case("template-include",
         edit("images/engine/Dockerfile.j2", "FROM", "{% include 'base.j2' %}\nFROM"),
         ("image", "render"), "Dockerfile.j2:11: {% include %} is not allowed"),
    Case("template-import",
         edit("images/engine/Dockerfile.j2", "FROM", "{% import 'macros.j2' as m %}\nFROM"),
         ("image", "render"), "Dockerfile.j2:11: {% import %} is not allowed"),
    Case("template-from-import",
         edit("images/engine/Dockerfile.j2", "FROM", "{% from 'macros.j2' import m %}\nFROM"),
         ("image", "render"), "Dockerfile.j2:11: {% from %} is not allowed"),
    Case("template-extends",
         edit("images/engine/Dockerfile.j2", "FROM", "{% extends 'base.j2' %}\nFROM"),
         ("verify",), "Dockerfile.j2:11: {% extends %} is not allowed"),
    Case("template-binary-junk", write("images/engine/Dockerfile.j2", b"\xff\xfe\x00\x9c junk"),
         ("image", "render"), "Dockerfile.j2: not UTF-8 text"),
    Case("template-broken-under-verify",
         edit("images/engine/Dockerfile.j2", "FROM", "{% for %}\nFROM"), ("verify",),
         "Dockerfile.j2:"),
    Case("manifest-wrong-shape", write("overlay/MANIFEST.json", "[1, 2, 3]\n"),
         ("image", "render"), "MANIFEST.json: (top level)"),
    Case("manifest-invalid-json", write("overlay/MANIFEST.json", "{\"format\": 1,\n"),
         ("image", "render"), "MANIFEST.json:2:1: invalid JSON"),
    Case("series-not-utf8",
         write_bytes_in("series.yaml", b"project: vllm", b"project: vllm # \xff"),
         ("status",), "series.yaml:5: not UTF-8 text"),
    Case("series-yaml-tag",
         edit("series.yaml", "project: vllm", "project: !!python/object:os.system vllm"),
         ("status",), "series.yaml:5:12: invalid YAML"),
    Case("series-yaml-alias-bomb", alias_bomb, ("status",),
         "series.yaml:4:7: YAML anchor &l0: series.yaml may not use anchors or aliases"),
    Case("series-yaml-alias-bomb-under-apply", alias_bomb, ("apply",),
         "series.yaml:4:7: YAML anchor &l0"),
    *[Case(f"series-one-file-two-ids-{'-'.join(args)}", one_file_two_ids, args,
           "0001-envs-strict-vllm-e2-switch-registry-and-e2-boot.patch is listed under two "
           "ids, 0001 and 0002")
      for args in (("apply",), ("overlay",), ("image", "render"), ("status",))],
    Case("overlay-is-a-symlink", overlay_as_symlink, ("overlay",), "overlay is a symbolic link"),
    Case("out-is-a-regular-file", write("notes.txt", "mine\n"),
         ("apply", "--out", "{root}/notes.txt"), "notes.txt exists and is not a directory"),
    Case("cache-is-a-regular-file", write("cachefile", "x\n"),
         ("--cache", "{root}/cachefile", "apply"), "cachefile"),
    Case("through-an-unknown-patch", nothing, ("apply", "--through", "0042"),
         "series.yaml has no patch 0042"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_clear_line_and_changes_nothing(case, checkout, upstream_cache,
                                                         capsys, monkeypatch):
    monkeypatch.setenv(TEST_CACHE_ENV, str(upstream_cache.cache.root))  # for worktree()
    case.breaks(checkout)
    (checkout / ".e2").mkdir(exist_ok=True)
    (checkout / ".e2" / "lock").touch()  # the checkout lock's file outlives every command
    before = snapshot(checkout)
    args = [a.format(root=checkout, parent=checkout.parent) for a in case.args]
    if "--cache" not in args:
        args = ["--cache", str(upstream_cache.cache.root), *args]
    capsys.readouterr()
    if case.held_lock:
        with FileLock(str(checkout / ".e2" / "lock")):
            code = cli.main(["--project", str(checkout), *args])
    else:
        code = cli.main(["--project", str(checkout), *args])
    out, err = capsys.readouterr()
    assert code not in (0, 3), f"exit {code}\n{out}\n{err}"   # 3: the crash handler
    assert "Traceback" not in out + err
    assert case.names in " ".join((out + err).split()), f"{case.names!r} not named:\n{out}\n{err}"
    assert snapshot(checkout) == before


def test_an_unexpected_error_is_one_line_and_a_crash_log(checkout, tmp_path, capsys,
                                                         monkeypatch):
    from e2.commands import status

    def broken(options, args):
        raise KeyError("a bug")

    monkeypatch.setattr(status, "run", broken)
    code = cli.main(["--project", str(checkout), "--cache", str(tmp_path / "cache"), "status"])
    _, err = capsys.readouterr()
    assert code == 3
    log = tmp_path / "cache" / "crash.log"
    assert err.splitlines()[0] == f"error: unexpected KeyError: 'a bug' (details in {log})"
    assert "Traceback" not in err
    text = log.read_text()
    assert "e2 version: " in text and "platform: " in text and "command: e2 " in text
    assert "Traceback (most recent call last)" in text and "KeyError: 'a bug'" in text


def test_a_multi_line_unexpected_error_still_names_the_crash_log(checkout, tmp_path, capsys,
                                                                  monkeypatch):
    from e2.commands import status

    def broken(options, args):
        raise ValueError("first line\nsecond line\nthird line")

    monkeypatch.setattr(status, "run", broken)
    code = cli.main(["--project", str(checkout), "--cache", str(tmp_path / "cache"), "status"])
    _, err = capsys.readouterr()
    assert code == 3
    log = tmp_path / "cache" / "crash.log"
    assert err.splitlines()[0] == (f"error: unexpected ValueError: first line (details in "
                                   f"{log})")
    assert "second line" not in err
    assert "second line" in log.read_text()
