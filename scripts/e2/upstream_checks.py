"""The pinned release's own checks over the files the series adds or changes (for
e2 verify): its pre-commit hooks for ruff check and ruff format (ruff at the
version it pins, with its pyproject.toml), the SPDX header, the forbidden imports
and the config docstrings (its tools/pre_commit/ scripts).

Everything comes from the release's tree (the upstream commit), so the checks
follow whatever release the series is pinned to. Each file is checked twice, as
stock has it and as the series leaves it, in throwaway trees; a finding fails
only if stock's version of the file does not already have it. Findings are
matched by rule and the text of the offending line, as a multiset, so lines
that merely moved still match. Ruff and the hooks' Python dependencies live in
a venv in the cache, made once per requirement set, and stock's findings are
kept there too. The hooks themselves, and running them, are precommit.py's.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import git

from e2 import console, precommit, pysource
from e2.cache import Cache
from e2.errors import E2Error
from e2.fsio import write_atomic
from e2.precommit import CONFIG, LOCAL_HOOKS, TOOLS, Finding, Toolset, read_toolset, tree_findings

MARKER = "e2-tools.json"


# -- the tools' venv


def ensure_tools(cache: Cache, requirements: list[str]) -> Path:
    """The python of a venv with ``requirements`` installed (made once, under its lock)."""
    wanted = {"requirements": requirements, "python": str(Path(sys.executable).resolve())}
    digest = hashlib.sha256(json.dumps(wanted, sort_keys=True).encode()).hexdigest()[:12]
    root = cache.tools_venv(f"checks-{digest}")
    python = root / "bin" / "python"
    if _recorded(root) == wanted:
        return python
    root.parent.mkdir(parents=True, exist_ok=True)
    with Cache.lock(root):
        if _recorded(root) == wanted:  # another run made it while we waited
            return python
        if root.exists():
            shutil.rmtree(root)  # half made: no marker
        steps = [([sys.executable, "-m", "venv", str(root)], f"creating {root}"),
                 ([str(python), "-m", "pip", "install", "--no-input", "-q", *requirements],
                  f"installing {' '.join(requirements)} into {root}")]
        for command, what in steps:
            with console.status(what):
                done = subprocess.run(command, capture_output=True, text=True,
                                      stdin=subprocess.DEVNULL)
            if done.returncode != 0:
                tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
                raise E2Error(f"{what} failed (exit {done.returncode}): " + " | ".join(tail),
                              hint="check the package index pip is configured with")
        write_atomic(root / MARKER, json.dumps(wanted, indent=2) + "\n")  # last: complete
    return python


def _recorded(root: Path) -> dict | None:
    try:
        return json.loads((root / MARKER).read_text())
    except (OSError, ValueError):
        return None


# -- the two trees


def changed_files(repo: git.Repo, base: str, head: str) -> list[str]:
    """Every file the commits after ``base`` add or change (deletions have nothing to check)."""
    out = repo.git.diff("--name-only", "--no-renames", "--diff-filter=d", base, head)
    return sorted(out.splitlines())


def _extract(repo: git.Repo, commit: str, specs: list[str], dest: Path) -> None:
    data = repo.git.archive("--format=tar", commit, "--", *specs, stdout_as_string=False)
    with tarfile.open(fileobj=io.BytesIO(data)) as archive:
        archive.extractall(dest, filter="data")


def _write_tree(repo: git.Repo, commit: str, paths: list[str], dest: Path) -> list[str]:
    """The ``paths`` ``commit`` has (returned) under ``dest``, and an empty stand-in for
    each other file of ``commit`` whose existence ruff looks at (a whole tree of
    stand-ins would cost seconds of file creation)."""
    listing = set(repo.git.ls_tree("-r", "--name-only", commit).splitlines())
    present = sorted(set(paths) & listing)
    if present:
        _extract(repo, commit, present, dest)
    folders = {name.rsplit("/", 1)[0] for name in listing if "/" in name}
    files, dirs = _looked_at(dest, present)
    for folder in dirs & folders:
        (dest / folder).mkdir(parents=True, exist_ok=True)
    for name in (files & listing) - set(present):
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        (dest / name).touch()
    return present


def _looked_at(root: Path, paths: list[str]) -> tuple[set[str], set[str]]:
    """The files and folders whose existence ruff checks for ``paths``: the packages
    above each (its INP rule) and the modules their imports name (import sorting
    calls a module first-party when it is there)."""
    files: set[str] = set()
    dirs: set[str] = set()
    for path in paths:
        parts = path.split("/")[:-1]
        files.update("/".join(parts[:i]) + "/__init__.py" for i in range(1, len(parts) + 1))
        if not path.endswith((".py", ".pyi")):
            continue
        imports = _imports((root / path).read_bytes())
        if imports is None:
            continue  # ruff reports it
        for node in imports:
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            for name in names:
                segments = name.split(".")
                for i in range(1, len(segments) + 1):
                    base = "/".join(segments[:i])
                    dirs.add(base)
                    files.update((f"{base}.py", f"{base}.pyi", f"{base}/__init__.py",
                                  f"{base}/__init__.pyi"))
    return files, dirs


def _imports(source: bytes) -> tuple[ast.Import | ast.ImportFrom, ...] | None:
    """The import statements of a file, None where it does not compile; from the
    outline the rebase's hot spots already read of the same text, where it has one."""
    try:
        text = source.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or text.startswith("\ufeff"):  # what only a parse of the bytes reads
        try:
            tree = pysource.parse(source)
        except (SyntaxError, ValueError):
            return None
        return pysource.imports_of(tree)
    found = pysource.outline(text)
    return None if found is None else found.imports


# -- stock against the series


def new_findings(stock: list[Finding], patched: list[Finding]) -> list[Finding]:
    """The patched findings stock's version of the same file does not have (per file, by
    rule and line text, as many times as stock has each)."""
    budget: dict[str, Counter] = {}
    for finding in stock:
        budget.setdefault(finding.path, Counter())[finding.key] += 1
    new = []
    for finding in sorted(patched, key=lambda f: (f.path, f.line, f.code)):
        left = budget.setdefault(finding.path, Counter())
        if left[finding.key] > 0:
            left[finding.key] -= 1
        else:
            new.append(finding)
    return new


def run(repo: git.Repo, base: str, head: str, cache: Cache, workdir: Path,
        release: str) -> list[Finding]:
    """The findings of ``release``'s checks (its tree at ``base``) in the files ``head``
    adds or changes that stock's files do not have; ``workdir`` holds the trees."""
    paths = changed_files(repo, base, head)
    if not paths:
        return []
    listing = set(repo.git.ls_tree("-r", "--name-only", base).splitlines())
    if CONFIG not in listing or not any(p.startswith(TOOLS + "/") for p in listing):
        raise E2Error(f"{release}'s tree has no {CONFIG} or no {TOOLS}/: its own checks "
                      "cannot run",
                      hint="the checks come from the release's sdist; pin a release whose "
                           "tree has them")
    toolset = read_toolset(repo.git.show(f"{base}:{CONFIG}"), f"{release}'s {CONFIG}")
    for hook in toolset.hooks.values():
        if hook.id in LOCAL_HOOKS and hook.command[0] not in listing:
            raise E2Error(f"{release}'s {CONFIG} runs {hook.command[0]} for {hook.id}, "
                          "which its tree does not have")
    python = ensure_tools(cache, toolset.requirements)
    stock_paths = sorted(set(paths) & listing)
    saved = _saved(cache, repo.commit(base).hexsha, toolset, stock_paths)
    with tempfile.TemporaryDirectory(dir=workdir, prefix="checks-") as tmp, \
            console.status(f"running {release}'s checks (ruff {toolset.ruff_version}) on "
                           f"{len(paths)} files"), ThreadPoolExecutor(2) as pool:
        patched = pool.submit(_checked_tree, repo, base, head, paths, Path(tmp) / "patched",
                              python, toolset)
        if saved.is_file():
            stock = [Finding(**f) for f in json.loads(saved.read_text())]
        else:
            stock = _checked_tree(repo, base, base, stock_paths, Path(tmp) / "stock", python,
                                  toolset)
            write_atomic(saved, json.dumps([vars(f) for f in stock]))
        return new_findings(stock, patched.result())


def _checked_tree(repo: git.Repo, base: str, commit: str, paths: list[str], root: Path,
                  python: Path, toolset: Toolset) -> list[Finding]:
    """The findings in ``paths`` as ``commit`` has them, with ``base``'s config and tools
    (the release's own, whatever the series did to them)."""
    _write_tree(repo, commit, paths, root)
    _extract(repo, base, ["pyproject.toml", CONFIG, TOOLS], root)
    return tree_findings(python, root, toolset, paths)


def _saved(cache: Cache, commit: str, toolset: Toolset, paths: list[str]) -> Path:
    """Where stock's findings in ``paths`` are kept: they change only with the release,
    its tools and these modules, and they are half of each run's time."""
    code = [hashlib.sha256(Path(m).read_bytes()).hexdigest() for m in (__file__,
                                                                        precommit.__file__)]
    key = {"commit": commit, "requirements": toolset.requirements, "paths": paths,
           "code": code}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache.stock_findings / f"{digest}.json"
