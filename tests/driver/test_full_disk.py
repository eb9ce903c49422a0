"""`e2 overlay` on a full disk: one line naming it, and nothing changed.

Real files on a real, small disk: a tmpfs mounted for the test (skipped where
mounting is not permitted), shrunk before each run to leave a given amount free,
from nothing (too small to start) up to the first amount that is enough, then
bisected down to one page short of it (just too small to finish). Every run
either writes the overlay or exits 1 with the one line "no space left on
device: <the disk>", leaving the project's files byte for byte as they were.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from conftest import E2, copy_checkout
from e2.series import dump_series

PAGE = 4096
STEP = 1 << 20           # the coarse sweep's step: free space from 0 up to enough
ENOUGH = 32 << 20        # more than overlay ever needs: never reaching success is a failure
ROOMY_BYTES = 256 << 20  # a tmpfs only takes what is written to it
ROOMY = f"size={ROOMY_BYTES // 1024}k"


def _mount(where: Path, options: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    try:
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                                capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no mount command here")
    if result.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {result.stderr.strip()}")


def _resize(where: Path, size: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size // 1024}k", str(where)],
                   check=True, capture_output=True)


def _used(where: Path) -> int:
    stats = os.statvfs(where)
    return (stats.f_blocks - stats.f_bfree) * stats.f_frsize


def _files(root: Path) -> dict[str, bytes | None]:
    """Every file (bytes) and folder (None) under ``root`` but .e2/, the tool's own."""
    found: dict[str, bytes | None] = {}
    for folder, dirs, names in os.walk(root):
        here = Path(folder)
        dirs[:] = [d for d in dirs if not (here == root and d == ".e2")]
        found.update({str((here / d).relative_to(root)) + "/": None for d in dirs})
        found.update({str((here / n).relative_to(root)): (here / n).read_bytes()
                      for n in names})
    return found


@pytest.fixture
def mounts(tmp_path: Path) -> Iterator[list[Path]]:
    """The tmpfs mounts a test makes (append as mounted); unmounted innermost first."""
    made: list[Path] = []
    yield made
    for where in reversed(made):
        subprocess.run(["umount", str(where)], check=False, capture_output=True)


@pytest.mark.parametrize("layout", ["one disk", "overlay's disk, .e2 elsewhere"])
def test_overlay_on_a_full_disk_says_so_and_changes_nothing(tmp_path, upstream_cache, capsys,
                                                          mounts, layout):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    root = tmp_path / "project"
    _mount(root, ROOMY)
    mounts.append(root)
    if layout != "one disk":  # the scratch apply has room; only writing overlay/ can fail
        _mount(root / ".e2", ROOMY)
        mounts.append(root / ".e2")
    pristine = copy_checkout(tmp_path / "pristine")
    # another switch doc: another series digest, so overlay/ must be rewritten
    data = yaml.safe_load((pristine / "series.yaml").read_text())
    data["patches"][0]["switch"]["doc"] += " (reworded)"
    (pristine / "series.yaml").write_text(dump_series(data))
    shutil.copytree(pristine, root, dirs_exist_ok=True)
    before = _files(root)
    e2 = E2(root, upstream_cache, capsys)

    def overlay_with(free: int) -> bool:
        """Run e2 overlay with ``free`` bytes left on the disk; whether it succeeded."""
        _resize(root, ROOMY_BYTES)
        shutil.rmtree(root / "overlay")  # a success rewrote it: the stale one back
        shutil.copytree(pristine / "overlay", root / "overlay")
        assert _files(root) == before
        _resize(root, _used(root) + free)
        try:
            code, out, err = e2("overlay", expect=None)
        finally:
            _resize(root, ROOMY_BYTES)
        if code == 0:
            assert "overlay/ written" in out, out
            return True
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 1 and len(lines) == 1, f"{free} bytes free: exit {code}\n{err}"
        assert lines[0].startswith(f"error: no space left on device: {root}"), \
            f"{free} bytes free: {lines[0]}"
        assert _files(root) == before, f"{free} bytes free: the project changed"
        assert set(os.listdir(root / ".e2")) <= {"lock"}, f"{free} bytes free: leftovers"
        return False

    assert not overlay_with(0)  # too small to start
    short, free = 0, STEP
    while not overlay_with(free):
        short, free = free, free + STEP
        assert free <= ENOUGH, "e2 overlay never succeeded"
    while free - short > PAGE:  # bisect to one page short of enough: too small to finish
        middle = (short + free) // 2 // PAGE * PAGE
        if overlay_with(middle):
            free = middle
        else:
            short = middle

