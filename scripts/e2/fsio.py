"""Writes that never leave half a file or half a directory behind, and the one
line for a disk that filled up while writing."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from e2.errors import E2Error
from e2.faults import checkpoint

# Below this much free space a write git reports as failed (it often prints no
# errno) is taken to have failed for want of space: its largest single write, the
# index of a vLLM checkout, is about 1 MiB, and git frees it again when it fails.
LOW_SPACE = 4 << 20


class NoSpace(E2Error):
    """A write failed because the filesystem it went to is full."""


def no_space(path: Path | str | None) -> NoSpace:
    """The one line for a full disk: the filesystem that is full, and what was written."""
    if path is None:  # an OSError from a write names no file
        return NoSpace("no space left on device (free some and run the command again)")
    path = Path(path).absolute()
    mount = mount_point(path)
    return NoSpace(f"no space left on device: {mount}"
                   + ("" if mount == path else f" (writing {path})"))


def _existing(path: Path) -> Path:
    """``path``, or its nearest parent that exists (a failed write's staging is gone)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem ``path`` (or its nearest existing parent) is on."""
    path = _existing(path)
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def nearly_full(path: Path) -> bool:
    """Whether the filesystem holding ``path`` has less than LOW_SPACE free (or no inodes)."""
    try:
        stats = os.statvfs(_existing(path))
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize < LOW_SPACE or (stats.f_files > 0
                                                            and stats.f_favail == 0)


@contextmanager
def space_named(where: Path) -> Iterator[None]:
    """An OSError for want of space in the block becomes NoSpace naming ``where``."""
    try:
        yield
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        raise no_space(where) from None


def write_atomic(path: Path, content: str | bytes) -> None:
    """Replace ``path`` in one rename so a reader never sees half a file."""
    data = content.encode("utf-8") if isinstance(content, str) else content
    with space_named(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def staging_paths(target: Path) -> tuple[Path, Path]:
    """Where a replacement of ``target`` is built, and where the old one is set aside."""
    return _staging(target)


def _staging(target: Path) -> tuple[Path, Path]:
    return target.with_name(f".{target.name}.new"), target.with_name(f".{target.name}.old")


def refuse_link(path: Path) -> None:
    if path.is_symlink():
        raise E2Error(f"{path} is a symbolic link; e2 writes it as a directory of its own",
                      hint=f"remove the link (rm {path}) and run the command again")


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path, onerror=_writable_and_retry)


def _writable_and_retry(function: Callable[..., object], name: str, _: object) -> None:
    """A read-only folder in a tree e2 removes (its own staging or a worktree set
    aside) is made writable for its owner, then the removal tried again."""
    parent = os.path.dirname(name)
    os.chmod(parent, os.stat(parent).st_mode | 0o700)
    if os.path.isdir(name) and not os.path.islink(name):
        os.chmod(name, os.stat(name).st_mode | 0o700)
    function(name)


def remove_aside(path: Path) -> str | None:
    """Remove a tree set aside by a replace; why it could not be, or None."""
    try:
        _remove(path)
    except OSError as exc:
        return f"{exc.filename or path}: {exc.strerror or exc}"
    return None


def set_aside(target: Path) -> Path | None:
    """Where an interrupted ``replace_dir`` of ``target`` left the old tree (between
    its two renames, ``target`` missing), or None; recover_dir puts it back."""
    _, old = _staging(target)
    missing = not (target.exists() or target.is_symlink())
    return old if missing and (old.exists() or old.is_symlink()) else None


def recover_dir(target: Path) -> None:
    """Finish or undo a ``replace_dir`` that was interrupted."""
    aside = set_aside(target)
    if aside is not None:
        aside.rename(target)  # stopped between the two renames: put the old one back
    for leftover in _staging(target):
        _remove(leftover)


def replace_dir(target: Path, contents: dict[str, bytes]) -> None:
    """Make ``target`` hold exactly ``contents``; the old tree survives any failure."""

    def fill(staging: Path) -> None:
        for relative, data in sorted(contents.items()):
            write_file(staging / relative, data)

    replace_dir_with(target, fill)


def replace_dir_with(target: Path, fill: Callable[[Path], None]) -> None:
    """Make ``target`` what ``fill`` writes into an empty directory; the old tree
    survives any failure.

    ``fill`` writes into a staging dir first, swapped in with two renames;
    ``recover_dir`` repairs the one window between them.
    """
    recover_dir(target)
    refuse_link(target)
    new, old = _staging(target)
    with space_named(target):
        try:
            new.mkdir(parents=True)  # a fill that writes nothing still makes an (empty) dir
            fill(new)
            checkpoint("replace-dir-staged")
            if target.exists():
                target.rename(old)
            checkpoint("replace-dir-swapping")
            new.rename(target)
        except BaseException:  # a full disk, a Ctrl-C: the old tree goes back in place
            recover_dir(target)
            raise
    shutil.rmtree(old, ignore_errors=True)


def write_file(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def read_tree(root: Path, pattern: str = "*") -> dict[str, bytes]:
    if not root.is_dir():
        return {}
    return {str(p.relative_to(root)): p.read_bytes()
            for p in sorted(root.rglob(pattern)) if p.is_file()}
