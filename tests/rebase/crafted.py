"""A series crafted on vLLM 0.31.0 so that moving it to 0.32.0 or 0.33.0 meets
every status once, in this order:

0001 clean     vllm/scalar_type.py, untouched upstream
0002 offset    vllm/logging_utils/formatter.py, upstream inserted 4 lines above
0003 merged    vllm/entrypoints/mcp/tool.py, upstream changed a context line
0004 conflict  the project's patch 0001 as it was on 29 Nov 2026 (upstream added an import
               on the same line), kept in data/ so the series' own changes leave these
               tests alone
0005 obsolete  upstream's own 0.32.0 change to vllm/device_allocator/__init__.py
"""

from __future__ import annotations

import shutil
from pathlib import Path

import git
import pytest

from conftest import E2, REPO_ROOT

TARGETS = {"0.32.0": "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad",
           "0.33.0": "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"}
CRAFTED_STATUSES = ["clean", "offset", "merged", "resolved", "obsolete"]
# What the crafted patches declare as their tests: one upstream test that passes on
# stock too (so seam must fail them), one node so --validate's seam runs stay short.
ENV_TEST = "tests/test_envs.py::test_getattr_without_cache"


@pytest.fixture(scope="session")
def upstream_releases(upstream_cache):
    from e2.series import Upstream

    for version, sha in TARGETS.items():
        upstream_cache.ensure(Upstream(version=version, tag=f"v{version}", sdist_sha256=sha))
    return upstream_cache


def _craft(e2: E2) -> None:
    e2("apply")
    # each edit keeps upstream's own checks (ruff, its pre-commit hooks) quiet
    e2.commit_edit("vllm/scalar_type.py", "_SCALAR_TYPES_ID_MAP = {}\n",
                   '_SCALAR_TYPES_ID_MAP = {}\n_E2_CLEAN = "VLLM_E2_CLEAN"\n',
                   "scalar_type: clean")
    e2.commit_edit("vllm/logging_utils/formatter.py",
                   '        self.use_relpath = log_level == "DEBUG"\n',
                   '        self.use_relpath = log_level == "DEBUG"  # VLLM_E2_OFFSET\n',
                   "formatter: offset")
    e2.commit_edit("vllm/entrypoints/mcp/tool.py",
                   '                output=msg.content[0].text,\n                status="completed",\n',
                   '                output=msg.content[0].text,\n'
                   '                status="completed",  # VLLM_E2_MERGED\n',
                   "mcp tool: merged")
    repo = e2.worktree()
    real = Path(__file__).resolve().parent / "data" / "0001-switch-registry-on-0.31.0.patch"
    repo.git.am(str(real))
    cache_repo = git.Repo(e2.cache.upstream_repo)
    upstream_change = cache_repo.git.diff("refs/tags/v0.31.0", "refs/tags/v0.32.0", "--",
                                          "vllm/device_allocator/__init__.py")
    (e2.root / "obsolete.diff").write_text(upstream_change + "\n")
    repo.git.apply(str(e2.root / "obsolete.diff"))
    (e2.root / "obsolete.diff").unlink()
    repo.git.commit("-qam", "device_allocator: obsolete (VLLM_E2_OBSOLETE)")
    e2("export", expect=1)
    e2.fill_metadata("0001", "VLLM_E2_CLEAN", tests=ENV_TEST)
    e2.fill_metadata("0002", "VLLM_E2_OFFSET", tests=ENV_TEST)
    e2.fill_metadata("0003", "VLLM_E2_MERGED", tests=ENV_TEST)
    e2.fill_metadata("0004", "VLLM_E2_REPORT", tests="tests/e2/test_switch_registry.py")
    e2.fill_metadata("0005", "VLLM_E2_OBSOLETE", tests=ENV_TEST)
    e2("overlay")
    shutil.rmtree(e2.work)


@pytest.fixture(scope="session")
def crafted_template(tmp_path_factory, upstream_releases) -> Path:
    root = tmp_path_factory.mktemp("crafted") / "project"
    root.mkdir()
    series = (REPO_ROOT / "series.yaml").read_text()
    (root / "series.yaml").write_text(series[:series.index("patches:")] + "patches: []\n")
    (root / "patches").mkdir()

    class _NoCapture:
        def readouterr(self):
            return "", ""

    _craft(E2(root, upstream_releases, _NoCapture()))
    return root


@pytest.fixture
def crafted(e2, crafted_template) -> E2:
    """A fresh copy of the crafted project, as a git checkout with everything committed."""
    shutil.rmtree(e2.root)
    shutil.copytree(crafted_template, e2.root)
    repo = git.Repo.init(e2.root)
    (e2.root / ".gitignore").write_text("/.e2/\n")
    repo.git.add("-A")
    repo.git.commit("-qm", "crafted series", author="T <t@vllm-e2.invalid>",
                    env={"GIT_COMMITTER_NAME": "T", "GIT_COMMITTER_EMAIL": "t@vllm-e2.invalid"})
    return e2
