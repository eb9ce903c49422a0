"""A vLLM release's pre-commit hooks that e2 verify runs (upstream_checks.py), as its
``.pre-commit-config.yaml`` defines them, and running them over one tree of files:
ruff check and ruff format (ruff-pre-commit's hooks, with the args the release
adds), and the release's own scripts for the SPDX header, the forbidden imports
and the config docstrings. Each finding is one line with the text of the line it
is about, so two trees' findings can be compared.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from unidiff import Hunk, PatchSet

from e2.errors import E2Error

CONFIG = ".pre-commit-config.yaml"
TOOLS = "tools/pre_commit"
RUFF_REPO = "ruff-pre-commit"
# The release's local hooks that run here, by their id in its pre-commit config.
LOCAL_HOOKS = ("check-spdx-header", "check-forbidden-imports", "validate-config")
# ruff-pre-commit's own hook definitions (that repo's .pre-commit-hooks.yaml, not the
# release's tree); the release's config adds args, of which --fix and the output
# format are replaced: the checks report, they never rewrite.
RUFF_HOOKS = {"ruff-check": ["check", "--force-exclude"],
              "ruff-format": ["format", "--force-exclude"]}
RUFF_TYPES = ("python", "pyi", "jupyter")
DROPPED_ARGS = {"--fix": 0, "--output-format": 1, "--diff": 0, "--check": 0}
# pre-commit's file types (the identify library's tags) that these hooks filter on,
# by suffix; an executable with a python shebang and no suffix is not seen as python.
TYPE_SUFFIXES = {"python": ".py", "pyi": ".pyi", "jupyter": ".ipynb", "rust": ".rs",
                 "proto": ".proto"}


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    code: str
    message: str
    text: str  # the offending line ("" for a finding about the whole file)

    @property
    def key(self) -> tuple[str, str]:
        return self.code, self.text.strip()

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.code} {self.message}"


@dataclass
class Hook:
    id: str
    command: list[str]  # for ruff: ruff's arguments; for a local hook: its script and args
    files: str = ""
    exclude: str = "^$"
    types: list[str] = field(default_factory=lambda: ["file"])
    types_or: list[str] = field(default_factory=list)
    exclude_types: list[str] = field(default_factory=list)

    def selects(self, path: str, global_exclude: str) -> bool:
        tags = {"file"} | {t for t, s in TYPE_SUFFIXES.items() if path.endswith(s)}
        return (bool(re.search(self.files, path)) and not re.search(self.exclude, path)
                and not re.search(global_exclude, path) and set(self.types) <= tags
                and (not self.types_or or bool(tags & set(self.types_or)))
                and not tags & set(self.exclude_types))


@dataclass
class Toolset:
    """What the release's pre-commit config says to run, and with what."""

    ruff_version: str
    hooks: dict[str, Hook]
    exclude: str
    deps: list[str]

    @property
    def requirements(self) -> list[str]:
        return [f"ruff=={self.ruff_version}", *sorted(set(self.deps))]


def read_toolset(text: str, where: str) -> Toolset:
    """The hooks of a release's .pre-commit-config.yaml (``where`` names it in errors)."""
    try:
        config = yaml.safe_load(text)
        repos = config["repos"]
    except (yaml.YAMLError, TypeError, KeyError) as exc:
        raise E2Error(f"{where}: not a pre-commit config with repos: {exc}") from None
    hooks: dict[str, Hook] = {}
    deps: list[str] = []
    version = None
    for repo in repos:
        url = str(repo.get("repo", ""))
        for entry in repo.get("hooks", []):
            hook_id = entry.get("id")
            if url.rstrip("/").endswith(RUFF_REPO) and hook_id in RUFF_HOOKS:
                version = _ruff_version(text, str(repo.get("rev", "")), where)
                command = RUFF_HOOKS[hook_id] + _kept_args(entry.get("args", []))
                hooks[hook_id] = _hook(hook_id, command, entry, RUFF_TYPES)
            elif url == "local" and hook_id in LOCAL_HOOKS:
                command = shlex.split(entry.get("entry", "")) + entry.get("args", [])
                if command[:1] != ["python"] or not command[1:2]:
                    raise E2Error(f"{where}: hook {hook_id} runs {entry.get('entry')!r}, "
                                  "not a python script")
                hooks[hook_id] = _hook(hook_id, command[1:], entry)
                deps += [str(d) for d in entry.get("additional_dependencies", [])]
    missing = [h for h in (*RUFF_HOOKS, *LOCAL_HOOKS) if h not in hooks]
    if missing or not version:
        raise E2Error(f"{where} has no hook {', '.join(missing) or 'ruff'} with a pinned rev",
                      hint="a release whose hooks are named otherwise needs RUFF_HOOKS and "
                           "LOCAL_HOOKS in scripts/e2/precommit.py updated")
    return Toolset(version, hooks, str(config.get("exclude", "^$")), deps)


def _ruff_version(text: str, rev: str, where: str) -> str:
    """ruff's version from its pre-commit rev: a tag (v0.14.0), or a commit frozen by
    ``pre-commit autoupdate --freeze``, whose comment names the tag."""
    if not re.fullmatch(r"[0-9a-f]{40}", rev):
        return rev.removeprefix("v")
    frozen = re.search(rf"rev:\s*['\"]?{rev}['\"]?\s*#\s*frozen:\s*v?(\S+)", text)
    if not frozen:
        raise E2Error(f"{where} pins {RUFF_REPO} to commit {rev} with no '# frozen: <tag>' "
                      "comment naming its version")
    return frozen.group(1)


def _kept_args(args: list[str]) -> list[str]:
    kept, skip = [], 0
    for arg in args:
        if skip:
            skip -= 1
        elif arg.split("=", 1)[0] in DROPPED_ARGS:
            skip = 0 if "=" in arg else DROPPED_ARGS[arg]
        else:
            kept.append(str(arg))
    return kept


def _hook(hook_id: str, command: list[str], entry: dict,
          types_or: tuple[str, ...] = ()) -> Hook:
    hook = Hook(hook_id, command, types_or=list(types_or))
    for name in ("files", "exclude"):
        if name in entry:
            setattr(hook, name, str(entry[name]))
    for name in ("types", "types_or", "exclude_types"):
        if name in entry:
            setattr(hook, name, list(entry[name]))
    unknown = {t for t in (*hook.types, *hook.types_or, *hook.exclude_types)
               if t != "file" and t not in TYPE_SUFFIXES}
    if unknown:
        raise E2Error(f"hook {hook_id} filters on file type {', '.join(sorted(unknown))}, "
                      "which e2 does not map to file names",
                      hint="add it to TYPE_SUFFIXES in scripts/e2/precommit.py")
    return hook


def _lines(root: Path, paths: list[str]) -> dict[str, list[str]]:
    return {p: (root / p).read_text(encoding="utf-8", errors="replace").splitlines()
            for p in paths}


def _finding(lines: dict[str, list[str]], path: str, line: int, code: str,
             message: str) -> Finding:
    text = lines[path][line - 1] if 0 < line <= len(lines[path]) else ""
    return Finding(path, line, code, message.strip(), text)


def _ruff(python: Path, root: Path, args: list[str]) -> subprocess.CompletedProcess:
    done = subprocess.run([str(python), "-m", "ruff", *args], cwd=root, capture_output=True,
                          text=True, stdin=subprocess.DEVNULL)
    if done.returncode not in (0, 1):
        raise E2Error(f"ruff {args[0]} failed (exit {done.returncode}): "
                      f"{done.stderr.strip()[-500:]}")
    return done


def ruff_check(python: Path, root: Path, hook: Hook, paths: list[str],
               lines: dict[str, list[str]]) -> list[Finding]:
    done = _ruff(python, root, [*hook.command, "--no-fix", "--output-format", "json",
                                "--", *paths])
    findings = []
    for item in json.loads(done.stdout or "[]"):
        path = Path(item["filename"]).resolve().relative_to(root.resolve()).as_posix()
        findings.append(_finding(lines, path, item["location"]["row"],
                                 item.get("code") or "syntax-error", item["message"]))
    return findings


def ruff_format(python: Path, root: Path, hook: Hook, paths: list[str]) -> list[Finding]:
    """One finding per file ruff format would rewrite, at its first changed line."""
    done = _ruff(python, root, [*hook.command, "--diff", "--", *paths])
    findings = []
    for patched in PatchSet(done.stdout):
        findings.append(Finding(patched.path, _first_change(patched[0]), hook.id,
                                f"ruff format would change this file in {len(patched)} "
                                "place(s), the first here", ""))
    return findings


def _first_change(hunk: Hunk) -> int:
    """The stock line of the hunk's first change (for an insertion: the line it precedes)."""
    line = hunk.source_start - 1
    for row in hunk:
        if not row.is_context:
            return row.source_line_no or line + 1
        line = row.source_line_no or line
    return hunk.source_start


# Runs each local hook's script once per file, all in one process (pre-commit
# batches the files, and a script that stops at its first failure would hide the
# rest), with each run's exit status and output, and whether it changed the file
# (which pre-commit counts as a failure); the file is put back for the next run.
RUNNER = r"""
import contextlib, io, json, os, runpy, sys, traceback
results = {}
for hook, command, files in json.load(sys.stdin):
    script = command[0]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    for path in files:
        before = open(path, "rb").read()
        out, code, crash = io.StringIO(), 0, None
        sys.argv = [*command, path]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
            except BaseException:
                crash = traceback.format_exc()
        after = open(path, "rb").read()
        if after != before:
            open(path, "wb").write(before)
        results.setdefault(hook, []).append({"file": path, "code": code, "crash": crash,
                                             "output": out.getvalue(),
                                             "modified": after != before})
    sys.path.pop(0)
print(json.dumps(results))
"""
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# How the release's scripts name a line: "path:12: ..." (forbidden imports) or
# "line(12): ..." (validate_config).
LINE_REF = re.compile(r"^(?P<path>\S+?):(?P<line>\d+):\s*(?:error:\s*)?(?P<message>.*)$|"
                      r"line\((?P<line2>\d+)\):\s*(?P<message2>.*)$", re.MULTILINE)


def local_hooks(python: Path, root: Path, jobs: list[tuple[Hook, list[str]]],
                lines: dict[str, list[str]]) -> list[Finding]:
    if not jobs:
        return []
    hooks = {hook.id: hook for hook, _ in jobs}
    job = json.dumps([(hook.id, hook.command, paths) for hook, paths in jobs])
    done = subprocess.run([str(python), "-c", RUNNER], cwd=root, input=job,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise E2Error(f"the release's hook scripts could not run: "
                      f"{done.stderr.strip()[-500:]}")
    findings = []
    for hook_id, results in json.loads(done.stdout).items():
        for result in results:
            findings += _hook_findings(hooks[hook_id], result, lines)
    return findings


def _hook_findings(hook: Hook, result: dict, lines: dict[str, list[str]]) -> list[Finding]:
    path, output = result["file"], ANSI.sub("", result["output"])
    if result["crash"]:  # never a finding: stock would crash alike and hide it
        last = result["crash"].strip().splitlines()[-1]
        raise E2Error(f"{hook.id} ({' '.join(hook.command)}) crashed on {path}: {last}")
    if result["code"] == 0 and not result["modified"]:
        return []
    findings = []
    for ref in LINE_REF.finditer(output):
        if ref.group("line2"):
            findings.append(_finding(lines, path, int(ref.group("line2")), hook.id,
                                     ref.group("message2")))
        elif ref.group("path") == path:
            findings.append(_finding(lines, path, int(ref.group("line")), hook.id,
                                     ref.group("message")))
    if not findings:  # about the whole file: the script's own first line says what
        said = [s.strip().rstrip(":") for s in output.splitlines()
                if s.strip() and s.strip() != path]
        findings.append(Finding(path, 1, hook.id, said[0] if said else
                                f"{hook.command[0]} changed this file", ""))
    return findings


def tree_findings(python: Path, root: Path, toolset: Toolset,
                  paths: list[str]) -> list[Finding]:
    lines = _lines(root, paths)
    selected = {hook_id: [p for p in paths if hook.selects(p, toolset.exclude)]
                for hook_id, hook in toolset.hooks.items()}
    findings = []
    if selected["ruff-check"]:
        findings += ruff_check(python, root, toolset.hooks["ruff-check"],
                               selected["ruff-check"], lines)
    if selected["ruff-format"]:
        findings += ruff_format(python, root, toolset.hooks["ruff-format"],
                                selected["ruff-format"])
    jobs = [(toolset.hooks[h], selected[h]) for h in LOCAL_HOOKS if selected[h]]
    return findings + local_hooks(python, root, jobs, lines)
