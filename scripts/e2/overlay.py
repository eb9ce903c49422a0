"""The files of the ``vllm`` package that the series adds or changes (e2 overlay;
the verb is commands/overlay.py).

``overlay/`` is laid over the vllm package of the base image (and of the CPU
test env). It holds every changed file under ``vllm/``, the generated
``vllm/e2_series.json`` the engine reports at boot, and ``MANIFEST.json``
with the upstream hash of every file it replaces, so that consumers can
refuse a base that carries another vLLM release.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import git

from e2 import manifest as manifest_file
from e2.apply import AppliedTree
from e2.errors import E2Error
from e2.fsio import read_tree, replace_dir
from e2.series import Project, Series, series_digest

PACKAGE = "vllm"
MANIFEST = "MANIFEST.json"
SERIES_INFO = f"{PACKAGE}/e2_series.json"
MANIFEST_FORMAT = manifest_file.FORMAT

# What an overlay of Python files cannot carry: anything compiled into the
# wheel's extension modules or deciding what gets built and installed.
COMPILED_PATTERNS = (
    "csrc/*", "cmake/*", "rust/*", "CMakeLists.txt", "setup.py", "pyproject.toml",
    "requirements/*", "*.cu", "*.cuh", "*.cpp", "*.cc", "*.c", "*.h", "*.hpp",
    "*.so", "*.pyd", "*.pyx", "*.pxd", "*.rs",
)


@dataclass(frozen=True)
class OverlayFile:
    path: str                 # relative to the directory holding the vllm package
    data: bytes
    upstream_sha256: str | None
    patches: tuple[str, ...]
    generated: bool = False

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


@dataclass(frozen=True)
class Deletion:
    path: str
    upstream_sha256: str
    patches: tuple[str, ...]


@dataclass(frozen=True)
class OverlayPlan:
    files: tuple[OverlayFile, ...]
    deleted: tuple[Deletion, ...]
    manifest: dict

    def contents(self) -> dict[str, bytes]:
        """Every file of overlay/ by relative path, MANIFEST.json included."""
        out = {f.path: f.data for f in self.files}
        out[MANIFEST] = (json.dumps(self.manifest, indent=2, sort_keys=True) + "\n").encode()
        return out


def compiled_reason(path: str) -> str | None:
    for pattern in COMPILED_PATTERNS:
        if fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(Path(path).name, pattern):
            return pattern
    return None


def plan_overlay(series: Series, project: Project, tree: AppliedTree) -> OverlayPlan:
    repo = tree.repo
    patch_of_commit = {r.commit: r.patch.id for r in tree.results}
    touched: dict[str, list[str]] = {}
    moded: dict[str, list[str]] = {}  # the patches that change a path's mode or kind
    log = repo.git.log("--reverse", "--no-renames", "--format=%x00%H", "--raw",
                       f"{tree.base_commit}..HEAD")
    for chunk in log.split("\x00")[1:]:
        commit, *entries = chunk.strip().splitlines()
        for entry in filter(None, entries):  # ":<old mode> <new mode> <ids> <kind>\t<path>"
            fields, path = entry.split("\t", 1)
            touched.setdefault(path, []).append(patch_of_commit[commit])
            old_mode, new_mode = fields.lstrip(":").split()[:2]
            if _unfit_mode(old_mode, new_mode):
                moded.setdefault(path, []).append(patch_of_commit[commit])
    refused = [(path, ids, reason) for path, ids in touched.items()
               if (reason := compiled_reason(path))]
    if refused:
        lines = [f"{path} (patch {', '.join(dict.fromkeys(ids))}; matches {reason})"
                 for path, ids, reason in refused]
        raise E2Error("the series changes compiled or build sources, which an overlay of "
                      "Python files cannot carry (the base image's extensions and "
                      "dependencies stay as built):\n  " + "\n  ".join(lines),
                      hint="express the change in Python under vllm/, or build a full "
                           "wheel instead of an overlay")
    # a path's mode-changing patches, else (a file deleted and added again) every
    # patch that touched it
    status = _package_changes(repo, tree.base_commit, touched | moded)
    base = repo.commit(tree.base_commit).tree
    head = repo.head.commit.tree
    files, deleted = [], []
    for path in sorted(status):
        ids = tuple(dict.fromkeys(touched.get(path, [])))
        upstream_sha = _blob_sha256(base, path)
        if status[path] == "D":
            deleted.append(Deletion(path, upstream_sha or "", ids))
        else:
            files.append(OverlayFile(path, head[path].data_stream.read(), upstream_sha, ids))
    digest = series_digest(series, project.patches_dir)
    files.append(_series_info(series, digest))
    manifest = {
        "format": MANIFEST_FORMAT,
        "upstream": {"project": series.upstream.project, "version": series.upstream.version,
                     "tag": series.upstream.tag, "sdist_sha256": series.upstream.sdist_sha256},
        "series_digest": digest,
        "patches": [r.patch.id for r in tree.results],
        "files": [{"path": f.path, "sha256": f.sha256, "upstream_sha256": f.upstream_sha256,
                   "patches": list(f.patches), "generated": f.generated} for f in files],
        "deleted": [{"path": d.path, "upstream_sha256": d.upstream_sha256,
                     "patches": list(d.patches)} for d in deleted],
    }
    return OverlayPlan(tuple(files), tuple(deleted), manifest)


def _package_changes(repo: git.Repo, base: str, blamed: dict[str, list[str]]) -> dict[str, str]:
    """Each path under vllm/ the series changes, with git's kind (A, M, D); a symbolic
    link, a submodule or a mode change is refused, naming the patches in ``blamed``:
    an overlay carries contents only."""
    status, unfit = {}, []
    raw = repo.git.diff("--no-renames", "--raw", "-z", base, "HEAD", "--",
                        PACKAGE).split("\x00")
    for fields, path in zip(raw[0:-1:2], raw[1::2]):  # ":<modes> <ids> <kind>", then the path
        old_mode, new_mode, *_, kind = fields.lstrip(":").split()
        status[path] = kind
        problem = _unfit_mode(old_mode, new_mode)
        if problem:
            unfit.append(f"{path} (patch {', '.join(dict.fromkeys(blamed.get(path, [])))}: "
                         f"{problem})")
    if unfit:
        raise E2Error("the series changes what an overlay of plain files cannot carry (the "
                      "overlay copies file contents only):\n  " + "\n  ".join(unfit),
                      hint="keep the file a regular file with its upstream mode (a new "
                           "file not executable), and change its contents instead")
    return status


def _unfit_mode(old: str, new: str) -> str | None:
    """Why a file of this mode change cannot go in the overlay, or None."""
    names = {"120000": "a symbolic link", "160000": "a submodule", "100755": "executable"}
    if new in ("120000", "160000"):
        return f"makes it {names[new]}"
    if old != "000000" and new != "000000" and old != new:
        return f"changes its mode {old} -> {new}"
    if old == "000000" and new == "100755":
        return "adds it executable"
    return None


def _blob_sha256(tree: git.Tree, path: str) -> str | None:
    try:
        blob = tree[path]
    except KeyError:
        return None
    return hashlib.sha256(blob.data_stream.read()).hexdigest()


def _series_info(series: Series, digest: str) -> OverlayFile:
    info = {
        "series_digest": digest,
        "upstream_version": series.upstream.version,
        "patches": [{"id": p.id, "title": p.title, "switch": p.switch.name,
                     "default": p.switch.default} for p in series.patches],
    }
    data = (json.dumps(info, indent=2, sort_keys=True) + "\n").encode()
    return OverlayFile(SERIES_INFO, data, None, (), generated=True)


# ---------------------------------------------------------------- disk


def write_overlay(project: Project, plan: OverlayPlan) -> None:
    replace_dir(project.overlay_dir, plan.contents())


def overlay_drift(project: Project, plan: OverlayPlan) -> list[str]:
    """What differs between overlay/ on disk and what the series generates."""
    want, have = plan.contents(), read_tree(project.overlay_dir)
    drift = [f"missing: overlay/{p}" for p in sorted(want.keys() - have.keys())]
    drift += [f"extra: overlay/{p}" for p in sorted(have.keys() - want.keys())]
    drift += [f"differs: overlay/{p}" for p in sorted(want.keys() & have.keys())
              if want[p] != have[p]]
    return drift


def load_manifest(project: Project) -> dict | None:
    """overlay/MANIFEST.json, checked against its schema (e2.manifest)."""
    return manifest_file.load(project.overlay_dir / MANIFEST)


def sync_problems(project: Project, series: Series) -> list[str]:
    """Why overlay/ is not what series.yaml and patches/ say, without applying anything.

    The one "overlay in sync" check: status, verify, the image build and the
    test env all ask it. It catches another series or pin, a hand-edited,
    missing or extra overlay file, and a manifest of the wrong shape.
    """
    if project.overlay_dir.is_symlink():
        return ["overlay/ is a symbolic link (e2 overlay writes a directory; remove it)"]
    try:
        manifest = load_manifest(project)
    except E2Error as exc:
        return [exc.message]
    if manifest is None:
        return [f"overlay/ has no {MANIFEST} (run e2 overlay)"]
    problems = []
    pinned = series.upstream
    made_for = manifest["upstream"]
    if (made_for["version"], made_for["tag"], made_for["sdist_sha256"]) != (
            pinned.version, pinned.tag, pinned.sdist_sha256):
        problems.append(f"overlay/ was made for vLLM {made_for['version']} "
                        f"({made_for['sdist_sha256'][:12]}), series.yaml pins "
                        f"{pinned.version} ({pinned.sdist_sha256[:12]}) (run e2 overlay)")
    try:
        digest = series_digest(series, project.patches_dir)
    except E2Error as exc:
        digest = None
        problems.append(exc.message)
    if digest and manifest["series_digest"] != digest:
        problems.append(f"overlay/ was made from series {manifest['series_digest'][:12]}, "
                        f"series.yaml and patches/ are {digest[:12]} (run e2 overlay)")
    if digest and manifest["series_digest"] == digest:
        info = project.overlay_dir / SERIES_INFO
        if info.is_file() and info.read_bytes() != _series_info(series, digest).data:
            problems.append(f"overlay/{SERIES_INFO} does not say what series.yaml does (a "
                            "title or switch changed since e2 overlay; run e2 overlay)")
    listed = {entry["path"] for entry in manifest["files"]}
    problems += [problem for entry in manifest["files"]
                 if (problem := _checked_file(project, entry)[1]) is not None]
    for extra in sorted(set(read_tree(project.overlay_dir)) - listed - {MANIFEST}):
        problems.append(f"overlay/{extra} is not in overlay/{MANIFEST} (run e2 overlay)")
    return problems


def _checked_file(project: Project, entry: dict) -> tuple[bytes | None, str | None]:
    """An overlay file's bytes when they are the ones MANIFEST.json lists, else why not."""
    path = project.overlay_dir / entry["path"]
    if not path.is_file():
        return None, f"overlay/{entry['path']} is missing (run e2 overlay)"
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        return None, (f"overlay/{entry['path']} does not match overlay/{MANIFEST} "
                      "(edited after e2 overlay wrote it; run e2 overlay)")
    return data, None


def read_overlay(project: Project, manifest: dict) -> dict[str, bytes]:
    """overlay/'s files by path, each checked against the sha256 MANIFEST.json gives it."""
    contents = {}
    for entry in manifest["files"]:
        data, problem = _checked_file(project, entry)
        if data is None:
            raise E2Error(str(problem), hint="regenerate it: e2 overlay")
        contents[entry["path"]] = data
    return contents


def synced_manifest(project: Project, series: Series) -> dict:
    """overlay/MANIFEST.json, refused unless overlay/ is in sync with series.yaml."""
    problems = sync_problems(project, series)
    if problems:
        raise E2Error("overlay/ is out of sync: " + "; ".join(problems[:3])
                      + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""),
                      hint="run e2 overlay")
    manifest = load_manifest(project)
    assert manifest is not None  # sync_problems reports a missing one
    return manifest
