"""A 20-patch series on the real pinned upstream, for the benchmarks.

Each patch touches its own vllm/ file and reads its own switch, so the series
passes `e2 verify`; the patches are real `e2 export` output.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import git
import yaml

from e2 import cli
from e2.series import dump_series

REPO_ROOT = Path(__file__).resolve().parents[2]
TARGETS = [
    "vllm/config/parallel.py", "vllm/config/cache.py", "vllm/config/scheduler.py",
    "vllm/v1/core/kv_cache_utils.py", "vllm/v1/core/sched/scheduler.py",
    "vllm/v1/core/block_pool.py", "vllm/v1/core/kv_cache_manager.py",
    "vllm/v1/core/single_type_kv_cache_manager.py", "vllm/v1/engine/core.py",
    "vllm/v1/worker/gpu_model_runner.py", "vllm/v1/kv_cache_interface.py",
    "vllm/platforms/interface.py", "vllm/model_executor/models/qwen3_next.py",
    "vllm/model_executor/layers/mamba/mamba_utils.py", "vllm/sampling_params.py",
    "vllm/outputs.py", "vllm/logger.py", "vllm/sequence.py", "vllm/config/model.py",
    "vllm/engine/arg_utils.py",
]


def build(root: Path, count: int = 20) -> Path:
    """Make a project at ``root`` holding a ``count``-patch series; return it."""
    if root.exists():
        shutil.rmtree(root)
    (root / "patches").mkdir(parents=True)
    series = (REPO_ROOT / "series.yaml").read_text()
    (root / "series.yaml").write_text(series[:series.index("patches:")] + "patches: []\n")
    run = lambda *args: cli.main(["--project", str(root), *args])  # noqa: E731
    assert run("apply") == 0
    work = git.Repo(root / ".e2" / "work")
    with work.config_writer() as config:
        config.set_value("user", "name", "E2 Bench")
        config.set_value("user", "email", "bench@vllm-e2.invalid")
    for number, target in enumerate(TARGETS[:count], start=1):
        path = root / ".e2" / "work" / target
        # two blank lines: what ruff format (upstream's own check) wants after a
        # top-level def or class, and allows after anything else
        line = f'_E2_BENCH_{number} = "VLLM_E2_BENCH_{number}"'
        path.write_text(path.read_text() + f"\n\n{line}\n")
        work.git.add(target)
        work.git.commit("-q", "-m", f"bench: patch {number} in {target}")
    run("export")
    data = yaml.safe_load((root / "series.yaml").read_text())
    for number, entry in enumerate(data["patches"], start=1):
        entry.update(switch={"name": f"VLLM_E2_BENCH_{number}", "default": "1",
                             "compiled": False, "doc": "benchmark switch"},
                     drop_when="never", tests=["tests/test_envs.py"])
    (root / "series.yaml").write_text(dump_series(data))
    assert run("overlay") == 0
    return root
