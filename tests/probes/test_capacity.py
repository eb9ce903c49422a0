"""e2 probe capacity against the real vLLM venv: pinned numbers, bad input, no leaks.

The pinned figures were measured on the CPU reference host (see
docs/validation/capacity-*.md) and each is re-derived here from config.json,
so a change in vLLM's planner or in the worker shows up as a mismatch of
one against the other.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from e2 import cli, probe

GIB = 1 << 30
MODEL = "Qwen3.5-0.8B"


@pytest.fixture(scope="module")
def venv_python(upstream_cache) -> Path:
    """The CPU test env's python, made (about 80 s) or reused as by e2 env."""
    from e2 import testenv
    from e2.series import load_series

    series = load_series(Path(__file__).resolve().parents[2] / "series.yaml")
    return testenv.ensure_env(testenv.env_for(upstream_cache.root, series, "cpu")).python


def _e2(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli.main(["probe", "capacity", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def runtime(venv_python) -> probe.Runtime:
    python = venv_python
    import subprocess
    missing = subprocess.run([str(python), "-c", "import importlib.util as u; "
                              "print(u.find_spec('torchvision') is None)"],
                             capture_output=True, text=True).stdout.strip() == "True"
    return probe.Runtime(python, None, "stock only in this fixture", missing)


def _settings(**changes) -> probe.Settings:
    base = dict(budget_gib=10.0, tp=1, max_num_seqs=256, max_model_len=32768,
                kv_dtype="auto", mamba_cache_mode="none", lengths=(128, 4096, 32768))
    base.update(changes)
    return probe.Settings(**base)


@pytest.fixture(scope="module")
def qwen08(runtime) -> dict:
    return probe.run_worker(runtime, "stock", probe.ZOO / MODEL, _settings())


def _config() -> dict:
    return json.loads((probe.ZOO / MODEL / "config.json").read_text())["text_config"]


def test_qwen35_08b_planner_pinned_and_derived(qwen08):
    text = _config()
    # attention: K and V, bf16, per token and layer
    attn_token = 2 * text["num_key_value_heads"] * text["head_dim"] * 2
    conv_dim = (2 * text["linear_num_key_heads"] * text["linear_key_head_dim"]
                + text["linear_num_value_heads"] * text["linear_value_head_dim"])
    state = ((text["linear_conv_kernel_dim"] - 1) * conv_dim * 2           # conv, bf16
             + text["linear_num_value_heads"] * text["linear_key_head_dim"]
             * text["linear_value_head_dim"] * 4)                           # SSM, float32
    # _align_hybrid_block_size: FlashAttention's MultipleOf(16), page >= state page
    block = 16 * math.ceil(state / (16 * attn_token))
    attn_layers = text["layer_types"].count("full_attention")
    state_layers = text["layer_types"].count("linear_attention")
    groups = 1 + state_layers // attn_layers        # equal-sized groups of 6 layers
    pool_block = attn_layers * block * attn_token
    blocks = 10 * GIB // pool_block
    per_request = math.ceil(32768 / block) + (groups - 1)
    planner = qwen08["planner"]
    assert (block, blocks, groups) == (544, 1606, 4)
    assert planner["block_size"] == block
    assert planner["num_groups"] == groups
    assert planner["num_blocks"] == blocks
    assert planner["max_concurrency"] == pytest.approx(blocks / per_request)
    assert planner["kv_cache_tokens"] == int(blocks / per_request * 32768) == 822_272
    facts = qwen08["facts"]
    assert facts["state_bytes_per_layer"] == state == 1_085_440
    assert facts["kv_bytes_per_token"] == attn_layers * attn_token == 12_288
    assert facts["state_dtypes"] == ["bfloat16", "float32"]


def test_qwen35_08b_workload_saturation_and_no_leaks(qwen08):
    rows = {row["length"]: row for row in qwen08["workload"]}
    assert sorted(rows) == [128, 4096, 32768]
    facts = qwen08["facts"]
    for length, row in rows.items():
        ideal = min(256, 10 * GIB // (facts["state_bytes_per_request"]
                                      + length * facts["kv_bytes_per_token"]))
        assert row["ideal"] == ideal
        for kind in ("distinct", "shared_prefix"):
            run = row[kind]
            assert run["leaked_blocks"] == 0
            assert run["finished"] == run["requests"]
    # usable blocks (less the null block) over blocks per request: 8 KV + 3 state
    assert rows[4096]["distinct"]["saturation"] == (1606 - 1) // (8 + 3) == 145
    assert rows[4096]["ideal"] == 153
    assert rows[32768]["distinct"]["saturation"] == 25 == rows[32768]["ideal"]
    assert rows[128]["distinct"]["saturation"] == 256       # max_num_seqs binds


def test_align_mode_holds_two_states_per_request(runtime):
    result = probe.run_worker(runtime, "stock", probe.ZOO / MODEL,
                              _settings(mamba_cache_mode="align", lengths=(4096,)))
    assert result["facts"]["states_per_request"] == 2
    row = result["workload"][0]
    assert row["distinct"]["leaked_blocks"] == row["shared_prefix"]["leaked_blocks"] == 0
    # prefix caching shares the prefix's KV blocks, so at least as many fit
    assert row["shared_prefix"]["saturation"] >= row["distinct"]["saturation"]


def test_budget_too_small_names_the_minimum(capsys, tmp_path):
    code, _, err = _e2(capsys, "--model", MODEL, "--budget-gib", "0.25", "--stock-only",
                       "--lengths", "128", "--max-model-len", "32768", "--no-record")
    # one request: 61 KV blocks + 3 state blocks, plus the null block, of 6 pages each
    minimum = (61 + 3 + 1) * 6 * 544 * 2048 / GIB
    assert code == 1
    assert "too small" in err and f"{minimum:.4f} GiB" in err


def test_folder_without_config_json(capsys, tmp_path):
    code, _, err = _e2(capsys, "--model", str(tmp_path), "--no-record")
    assert code == 1 and "no config.json" in err


def test_missing_architectures_key(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_next"}))
    code, _, err = _e2(capsys, "--model", str(tmp_path), "--no-record")
    assert code == 1 and "`architectures`" in err


def test_unknown_architecture(capsys, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(probe.ZOO / MODEL, model)
    data = json.loads((model / "config.json").read_text())
    data["architectures"] = ["NoSuchHybridForCausalLM"]
    (model / "config.json").write_text(json.dumps(data))
    code, _, err = _e2(capsys, "--model", str(model), "--stock-only", "--no-record")
    assert code == 1
    assert "`architectures`" in err and "NoSuchHybridForCausalLM" in err


def test_tp_must_divide_heads(capsys):
    code, _, err = _e2(capsys, "--model", MODEL, "--tp", "3", "--stock-only",
                       "--no-record")
    assert code == 1
    assert "tensor parallel size 3" in err and "num_attention_heads=8" in err


def test_stock_and_e2_agree_and_are_recorded(capsys, tmp_path):
    """Patch 0001 does not touch capacity: both columns must match, and the
    record names the upstream version, the series digest and the command."""
    code, _, err = _e2(capsys, "--model", MODEL, "--lengths", "4096",
                       "--results", str(tmp_path))
    assert code == 0, err
    [record_file] = tmp_path.glob("capacity-*.json")
    record = json.loads(record_file.read_text())
    assert record["upstream_version"] == "0.31.0"
    assert len(record["series_digest"]) == 64
    assert record["command"].startswith("e2 ")
    sides = record["models"][MODEL]
    assert record["view"] is not None, record["why_no_view"]
    assert "e2-views" in sides["e2"]["vllm_file"]
    assert "e2-views" not in sides["stock"]["vllm_file"]
    assert record["differences"] == []
    assert sides["e2"]["planner"]["num_blocks"] == sides["stock"]["planner"]["num_blocks"]
    assert (tmp_path / record_file.name.replace(".json", ".md")).is_file()


def test_boot_reads_the_engines_kv_line_stock_and_e2(capsys, tmp_path):
    """--boot starts the real engine on the config-only model (dummy weights) for each
    side and records its boot line; with the budget passed as KV bytes, the tokens
    follow from the CPU engine's own geometry, and both sides agree."""
    code, _, err = _e2(capsys, "--model", MODEL, "--boot", "--lengths", "128",
                       "--max-model-len", "4096", "--max-num-seqs", "8", "--budget-gib", "2",
                       "--results", str(tmp_path))
    assert code == 0, err
    [record_file] = tmp_path.glob("capacity-*.json")
    sides = json.loads(record_file.read_text())["models"][MODEL]
    stock, e2 = sides["stock"]["boot"], sides["e2"]["boot"]
    assert stock["kv_line"].startswith("CPU KV cache size: ")
    assert stock["tokens"] == e2["tokens"] > 4096
    assert f"{stock['tokens']:,} tokens" in stock["kv_line"]
    assert "## Boot line" in record_file.with_suffix(".md").read_text()
    code, _, err = _e2(capsys, "--model", MODEL, "--boot", "--tp", "2", "--stock-only",
                       "--lengths", "128", "--no-record")
    assert code == 1 and "--boot runs one engine process on this host" in err


def test_docker_options_need_boot_and_an_engine(capsys, monkeypatch):
    code, _, err = _e2(capsys, "--model", MODEL, "--docker", "--no-record")
    assert code == 1 and "go with --boot" in err
    code, _, err = _e2(capsys, "--model", MODEL, "--boot", "--gpus", "all", "--no-record")
    assert code == 1 and "go with --docker" in err
    monkeypatch.setenv("DOCKER_HOST", "tcp://127.0.0.1:9")
    code, _, err = _e2(capsys, "--model", MODEL, "--boot", "--docker", "--stock-only",
                       "--lengths", "128", "--no-record")
    assert code == 1 and "no Docker daemon reachable at tcp://127.0.0.1:9" in err
