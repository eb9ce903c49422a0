"""e2 probe capacity against the real vLLM venv: pinned numbers, bad input, no leaks.

The pinned figures were measured on the CPU reference host (see
docs/validation/capacity-*.md) and each is re-derived here from config.json,
so a change in vLLM's planner or in the worker shows up as a mismatch of
one against the other. The attention backend is vLLM 0.31.0's own CUDA
selection run for the target compute capability (8.6 unless a test says
otherwise), so the backend facts below are vLLM's, pinned.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from conftest import E2
from e2 import cli
from e2.apply import UpstreamOptions
from e2.options import GlobalOptions
from e2.probes import capacity, capacity_matrix
from e2.probes.runtime import Runtime, ensure_image_packages, make_runtime
from e2.series import Project
from e2.upstream import UpstreamCache

REPO = Path(__file__).resolve().parents[2]

GIB = 1 << 30
MODEL = "Qwen3.5-0.8B"


@pytest.fixture(scope="module")
def venv_python(cache) -> Path:
    """The CPU test env's python, made (about 80 s) or reused as by e2 env."""
    from e2 import testenv
    from e2.series import load_series

    series = load_series(Path(__file__).resolve().parents[2] / "series.yaml")
    return testenv.ensure_env(testenv.env_for(cache, series, "cpu")).python


@pytest.fixture
def e2_capacity(capsys, cache):
    """`e2 probe capacity` on this checkout (read only) with the tests' cache. The
    upstream sdist is not fetched: the probe runs the release from the CPU venv."""
    return E2(REPO, UpstreamCache(cache), capsys).command("probe", "capacity")


def _options(upstream_cache) -> GlobalOptions:
    """What the CLI hands probe's functions: this checkout and the tests' cache."""
    return GlobalOptions(Project(REPO), upstream_cache.cache, UpstreamOptions(upstream_cache))


@pytest.fixture(scope="module")
def runtime(venv_python, upstream_cache) -> Runtime:
    python = venv_python
    import subprocess
    missing = subprocess.run([str(python), "-c", "import importlib.util as u; "
                              "print(u.find_spec('torchvision') is None)"],
                             capture_output=True, text=True).stdout.strip() == "True"
    packages = ensure_image_packages(_options(upstream_cache), python)
    return Runtime(python, None, "stock only in this fixture", missing, packages)


@pytest.fixture(scope="module")
def e2_runtime(upstream_cache) -> Runtime:
    """Stock and E2 (the view of this checkout's overlay) as `e2 probe capacity` runs them."""
    return make_runtime(_options(upstream_cache))


def _settings(**changes) -> capacity.Settings:
    """Defaults of the CLI (capability 8.6) and three lengths."""
    base = dict(budget_gib=10.0, tp=1, max_num_seqs=256, max_model_len=32768,
                kv_dtype="auto", mamba_cache_mode="none", lengths=(128, 4096, 32768))
    base.update(changes)
    return capacity.Settings(**base)


@pytest.fixture(scope="module")
def qwen08(runtime) -> dict:
    return capacity.run_worker(runtime, "stock", capacity.ZOO / MODEL, _settings())


def _config() -> dict:
    return json.loads((capacity.ZOO / MODEL / "config.json").read_text())["text_config"]


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
    # RTX 3090, KV auto: FlashAttention (FA2) heads vLLM's list on SM86 and takes bf16
    backend = qwen08["backend"]
    assert (backend["name"], backend["capability"]) == ("FLASH_ATTN", "8.6")
    assert backend["kernel_block_sizes"] == ["MultipleOf(16)"]
    assert backend["hybrid_block_size"] == block
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
    result = capacity.run_worker(runtime, "stock", capacity.ZOO / MODEL,
                                 _settings(mamba_cache_mode="align", lengths=(4096,)))
    assert result["facts"]["states_per_request"] == 2
    row = result["workload"][0]
    assert row["distinct"]["leaked_blocks"] == row["shared_prefix"]["leaked_blocks"] == 0
    # prefix caching shares the prefix's KV blocks, so at least as many fit
    assert row["shared_prefix"]["saturation"] >= row["distinct"]["saturation"]


def test_budget_too_small_names_the_minimum(e2_capacity, tmp_path):
    code, _, err = e2_capacity("--model", MODEL, "--budget-gib", "0.25", "--stock-only",
                       "--lengths", "128", "--max-model-len", "32768", "--no-record")
    # one request: 61 KV blocks + 3 state blocks, plus the null block, of 6 pages each
    minimum = (61 + 3 + 1) * 6 * 544 * 2048 / GIB
    assert code == 1
    assert "too small" in err and f"{minimum:.4f} GiB" in err


def test_folder_without_config_json(e2_capacity, tmp_path):
    code, _, err = e2_capacity("--model", str(tmp_path), "--no-record")
    assert code == 1 and "no config.json" in err


def test_missing_architectures_key(e2_capacity, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_next"}))
    code, _, err = e2_capacity("--model", str(tmp_path), "--no-record")
    assert code == 1 and "`architectures`" in err


def test_unknown_architecture(e2_capacity, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(capacity.ZOO / MODEL, model)
    data = json.loads((model / "config.json").read_text())
    data["architectures"] = ["NoSuchHybridForCausalLM"]
    (model / "config.json").write_text(json.dumps(data))
    code, _, err = e2_capacity("--model", str(model), "--stock-only", "--no-record")
    assert code == 1
    assert "`architectures`" in err and "NoSuchHybridForCausalLM" in err


def test_tp_must_divide_heads(e2_capacity):
    code, _, err = e2_capacity("--model", MODEL, "--tp", "3", "--stock-only",
                       "--no-record")
    assert code == 1
    assert "tensor parallel size 3" in err and "num_attention_heads=8" in err


def _derived_block(kv_bytes: int) -> int:
    """_align_hybrid_block_size for a backend whose kernel block is 16: the smallest
    multiple of 16 tokens whose attention page holds one GDN state."""
    text = _config()
    attn_token = 2 * text["num_key_value_heads"] * text["head_dim"] * kv_bytes
    conv_dim = (2 * text["linear_num_key_heads"] * text["linear_key_head_dim"]
                + text["linear_num_value_heads"] * text["linear_value_head_dim"])
    state = ((text["linear_conv_kernel_dim"] - 1) * conv_dim * 2
             + text["linear_num_value_heads"] * text["linear_key_head_dim"]
             * text["linear_value_head_dim"] * 4)
    return 16 * math.ceil(state / (16 * attn_token))


@pytest.fixture(scope="module")
def selected(runtime, tmp_path_factory) -> dict:
    """Qwen3.5-0.8B planned for SM86 and SM90 with KV auto and fp8 (stock, one
    worker per capability, L=128 only)."""
    out = tmp_path_factory.mktemp("selection")
    results = {}
    for capability in ("8.6", "9.0"):
        runs = [(_settings(kv_dtype=kv, lengths=(128,), capability=capability),
                 out / f"{capability}-{kv}.json") for kv in ("auto", "fp8")]
        capacity.run_jobs(runtime, "stock", capacity.ZOO / MODEL, runs)
        for settings, path in runs:
            results[capability, settings.kv_dtype] = capacity.read_result(
                path, capacity.ZOO / MODEL, "stock", settings)
    return results


def test_sm86_fp8_selects_flashinfer_with_its_block_sizes(selected):
    """FA2 (all a 3090 runs) has no fp8 KV cache, so vLLM falls to its second
    choice, FlashInfer, whose kernel blocks are exact sizes, not multiples of 16."""
    auto, fp8 = selected["8.6", "auto"]["backend"], selected["8.6", "fp8"]["backend"]
    assert auto["name"] == "FLASH_ATTN" and fp8["name"] == "FLASHINFER"
    assert fp8["class"] == "vllm.v1.attention.backends.flashinfer.FlashInferBackend"
    assert fp8["kernel_block_sizes"] == [16, 32, 64]
    assert fp8["candidates"][0] == "FLASHINFER"
    assert "kv_cache_dtype not supported" in fp8["rejected"]["FLASH_ATTN"]
    assert "FLASH_ATTN" not in auto["rejected"]
    # fp8 halves the attention page, so the hybrid block doubles (to a multiple of 16)
    assert auto["hybrid_block_size"] == _derived_block(2) == 544
    assert fp8["hybrid_block_size"] == _derived_block(1) == 1072
    planner = selected["8.6", "fp8"]["planner"]
    assert planner["block_size"] == 1072
    assert selected["8.6", "fp8"]["facts"]["kv_bytes_per_token"] == 6 * 2 * 2 * 256


def test_sm90_differs_where_fa3_takes_fp8(selected):
    """On SM90 FlashAttention resolves to FA3, which reads an fp8 KV cache: it stays
    first for fp8, where SM86 had to give it up."""
    auto, fp8 = selected["9.0", "auto"]["backend"], selected["9.0", "fp8"]["backend"]
    assert (auto["name"], fp8["name"]) == ("FLASH_ATTN", "FLASH_ATTN")
    assert fp8["capability"] == "9.0"
    assert fp8["kernel_block_sizes"] == ["MultipleOf(16)"]
    assert fp8["candidates"][:2] == ["FLASH_ATTN", "FLASHINFER"]
    assert fp8["name"] != selected["8.6", "fp8"]["backend"]["name"]
    assert fp8["hybrid_block_size"] == 1072


def test_capability_must_be_major_minor(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["probe", "capacity", "--model", MODEL, "--capability", "86"])
    assert exit_info.value.code == 2
    assert "MAJOR.MINOR" in capsys.readouterr().err


def test_e2_cuts_attention_at_the_selected_backends_block(e2_capacity, tmp_path):
    """With fp8 on a 3090 (FlashInfer), stock plans 1072-token attention blocks; E2
    (patch 0002) cuts them into FlashInfer's smallest kernel block, 16, packs the
    states two to a page (one pads 66.25 blocks to 67, two fill 133) and holds more
    requests of 4k tokens. The record names the version, digest, command and backend."""
    code, _, err = e2_capacity("--model", MODEL, "--kv-dtype", "fp8", "--lengths", "4096",
                       "--results", str(tmp_path))
    assert code == 0, err
    [record_file] = tmp_path.glob("capacity-*.json")
    record = json.loads(record_file.read_text())
    assert record["upstream_version"] == "0.31.0"
    assert len(record["series_digest"]) == 64
    assert record["command"].startswith("e2 ")
    assert record["capability"] == "8.6" and record["backend"]["name"] == "FLASHINFER"
    sides = record["models"][MODEL]
    assert record["view"] is not None, record["why_no_view"]
    assert "e2-views" in sides["e2"]["vllm_file"]
    assert "e2-views" not in sides["stock"]["vllm_file"]
    stock, e2 = sides["stock"], sides["e2"]
    assert e2["backend"]["name"] == stock["backend"]["name"] == "FLASHINFER"
    assert stock["planner"]["e2_attention_block_size"] is None
    assert e2["planner"]["e2_attention_block_size"] == 16
    [stock_attn] = [g for g in stock["planner"]["groups"] if g["kind"] == "FullAttentionSpec"]
    [e2_attn] = [g for g in e2["planner"]["groups"] if g["kind"] == "FullAttentionSpec"]
    assert (stock_attn["block_size"], stock_attn["blocks_per_page"]) == (1072, 1)
    assert (e2_attn["block_size"], e2_attn["blocks_per_page"]) == (16, 133)
    # the same bytes in half as many pages of two states or 133 blocks, cut finer
    assert e2["planner"]["num_blocks"] == stock["planner"]["num_blocks"] * 67 // 133
    assert "block_size 1072 -> 16" in "; ".join(record["differences"])
    s_row, e_row = stock["workload"][0], e2["workload"][0]
    assert s_row["ideal"] == e_row["ideal"]
    assert e_row["distinct"]["saturation"] > s_row["distinct"]["saturation"]
    assert e_row["distinct"]["leaked_blocks"] == 0
    assert (tmp_path / record_file.name.replace(".json", ".md")).is_file()


def test_matrix_resumes_and_renders(e2_runtime, tmp_path):
    """Each run's JSON is kept; a rerun only runs what is missing or failed, and the
    baseline renders from what is on disk."""
    scenarios = [(MODEL, _settings(lengths=(128,)))]
    results = capacity_matrix.run_matrix(e2_runtime, tmp_path, scenarios)
    assert set(results) == {(MODEL, "10g-tp1-256-auto-none", side) for side in capacity.SIDES}
    stock_file = tmp_path / MODEL / "10g-tp1-256-auto-none-stock.json"
    e2_file = tmp_path / MODEL / "10g-tp1-256-auto-none-e2.json"
    kept = stock_file.stat().st_mtime_ns
    e2_file.write_text(json.dumps({"ok": False, "input_error": False, "message": "killed",
                                   "traceback": ""}))
    results = capacity_matrix.run_matrix(e2_runtime, tmp_path, scenarios)
    assert stock_file.stat().st_mtime_ns == kept
    assert json.loads(e2_file.read_text())["ok"] is True
    record = capacity_matrix.matrix_record(Project(REPO), e2_runtime, tmp_path, scenarios,
                                           results)
    record["record"] = "capacity.json"
    [run] = record["runs"]
    assert run["stock"]["backend"] == run["e2"]["backend"] == "FLASH_ATTN"
    assert (run["stock"]["attention_block_size"], run["e2"]["attention_block_size"]) == (
        544, 16)
    assert run["e2"]["rows"][0]["distinct_ratio"] == record["e2_min_ratio"] == 1.0
    assert record["flags"] == []
    text = capacity_matrix.render_matrix(record, "plot.png")
    assert f"| {MODEL} | FLASH_ATTN | 544 → 16 | 1.000 |" in text


def test_matrix_flags_name_every_e2_shortfall():
    row = {"length": 4096, "ideal": 100, "distinct_saturation": 97, "distinct_ratio": 0.97,
           "distinct_preemptions": 3, "distinct_preemptions_below_ideal": 2,
           "distinct_leaked_blocks": 0, "shared_prefix_saturation": 100,
           "shared_prefix_ratio": 1.0, "shared_prefix_preemptions": 0,
           "shared_prefix_preemptions_below_ideal": 0, "shared_prefix_leaked_blocks": 1}
    good = {**row, "distinct_ratio": 0.99, "distinct_preemptions_below_ideal": 0,
            "shared_prefix_leaked_blocks": 0}
    runs = [{"model": "M", "setting": "s", "stock": {"rows": [row]}, "e2": {"rows": [row]}},
            {"model": "N", "setting": "s", "stock": {"rows": [row]}, "e2": {"rows": [good]}}]
    flags = capacity_matrix.matrix_flags(runs)
    assert flags == ["M s L=4096: distinct: ratio 0.970 (97/100), 2 preemptions below "
                     "the ideal; shared prefix: 1 leaked blocks"]
    # E2 preempting more than stock in the same workload is a regression
    runs[1]["stock"]["rows"] = [{**good, "distinct_preemptions": 1}]
    assert capacity_matrix.matrix_flags(runs)[1:] == ["N s L=4096: distinct: 3 preemptions (stock 1)"]
    # admitting past the ideal and preempting after is over-admission, whatever stock does
    over = {**good, "distinct_saturation": 120, "distinct_ratio": 1.2}
    runs[1]["stock"]["rows"] = runs[1]["e2"]["rows"] = [over]
    assert capacity_matrix.matrix_flags(runs)[1:] == [
        "N s L=4096: distinct: admitted 120 of an ideal 100, then preempted"]


def test_matrix_covers_the_issues_scenarios():
    scenarios = capacity_matrix.matrix_scenarios("8.6")
    zoo = capacity.zoo_names()
    assert len(zoo) == 6
    assert len(scenarios) == len(zoo) * 2 * 2 * 2 + 4
    labels = {(name, settings.label()) for name, settings in scenarios}
    assert len(labels) == len(scenarios)
    assert ("Qwen3.5-27B", "6g-tp4-64-fp8-align") in labels
    assert all(s.lengths == (128, 1024, 4096, 16384, 32768) and s.capability == "8.6"
               for _, s in scenarios)


def test_boot_reads_the_engines_kv_line_stock_and_e2(e2_capacity, tmp_path):
    """--boot starts the real engine on the config-only model (dummy weights) for each
    side and records its boot line; with the budget passed as KV bytes, the tokens
    follow from the CPU engine's own geometry, and both sides agree."""
    code, _, err = e2_capacity("--model", MODEL, "--boot", "--lengths", "128",
                       "--max-model-len", "4096", "--max-num-seqs", "8", "--budget-gib", "2",
                       "--results", str(tmp_path))
    assert code == 0, err
    [record_file] = tmp_path.glob("capacity-*.json")
    sides = json.loads(record_file.read_text())["models"][MODEL]
    stock, e2 = sides["stock"]["boot"], sides["e2"]["boot"]
    assert stock["kv_line"].startswith("CPU KV cache size: ")
    # 2 GiB of KV on the CPU engine's geometry (mamba `align`: the engine turns prefix
    # caching on for a hybrid): stock pads every state page to the aligned attention
    # page; E2 cuts it to whole 32-token blocks, one state a page (prefix-cached states
    # stay in the page pool's LRU order), so the same bytes count 13.0% more tokens
    assert (stock["tokens"], e2["tokens"]) == (86_016, 97_182)
    assert f"{stock['tokens']:,} tokens" in stock["kv_line"]
    assert "## Boot line" in record_file.with_suffix(".md").read_text()
    code, _, err = e2_capacity("--model", MODEL, "--boot", "--tp", "2", "--stock-only",
                       "--lengths", "128", "--no-record")
    assert code == 1 and "--boot runs one engine process on this host" in err


def test_docker_options_need_boot_and_an_engine(e2_capacity, monkeypatch):
    code, _, err = e2_capacity("--model", MODEL, "--docker", "--no-record")
    assert code == 1 and "go with --boot" in err
    code, _, err = e2_capacity("--model", MODEL, "--boot", "--gpus", "all", "--no-record")
    assert code == 1 and "go with --docker" in err
    monkeypatch.setenv("DOCKER_HOST", "tcp://127.0.0.1:9")
    code, _, err = e2_capacity("--model", MODEL, "--boot", "--docker", "--stock-only",
                       "--lengths", "128", "--no-record")
    assert code == 1 and "no Docker daemon reachable at tcp://127.0.0.1:9" in err
