"""Steps a person takes during a rebase, done the same way by the tests."""

from __future__ import annotations

import git

from e2.fsio import read_tree


def resolve_keeping_both(e2) -> list[str]:
    """Resolve every conflict as "keep both": upstream's new lines, then the patch's.

    That is the right resolution for patch 0001 on 0.32.0 and 0.33.0, where
    upstream added lines exactly where the patch adds its own. Returns the files.
    """
    work = git.Repo(e2.root / ".e2/rebase/work")
    files = sorted(set(work.git.diff("--name-only", "--diff-filter=U").split()))
    for name in files:
        path = e2.root / ".e2/rebase/work" / name
        out, part = [], None
        for line in path.read_text().split("\n"):
            if line.startswith("<<<<<<< "):
                part, ours, theirs = "ours", [], []
            elif part and line.startswith("||||||| "):
                part = "base"
            elif part and line == "=======":
                part = "theirs"
            elif part and line.startswith(">>>>>>> "):
                out += ours + theirs
                part = None
            elif part == "ours":
                ours.append(line)
            elif part == "theirs":
                theirs.append(line)
            elif part is None:
                out.append(line)
        path.write_text("\n".join(out))
        work.git.add(name)
    return files


def guarded_files(e2) -> dict:
    """Every byte a rebase may rewrite: series.yaml, patches/, overlay/, Dockerfile, docs/."""
    files = {"series.yaml": e2.project.series_file.read_bytes()}
    for folder in ("patches", "overlay", "docs"):
        files.update({f"{folder}/{k}": v for k, v in read_tree(e2.root / folder).items()})
    dockerfile = e2.root / "Dockerfile"
    if dockerfile.exists():
        files["Dockerfile"] = dockerfile.read_bytes()
    return files
