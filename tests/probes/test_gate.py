"""The serve probe's GPU gate (``e2 probe serve --mode gate``), without booting an engine:
its cases, its engines' arguments and its verdict on records made here.

The records are synthetic: every request of every case answered alike on each
engine, then changed the way a fault would change it (E2 hitting fewer prefix
tokens than the gate allows, a reference engine that hit the cache, a token
that differs from the reference, a CUDA error in a log).
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import pytest

from conftest import REPO_ROOT
from e2 import cli
from e2.probes import serve_cases, serve_gate, serve_report
from e2.probes.engines import DockerRunner, LocalRunner, mode_args, runs_eager
from e2.probes.serve_settings import MAX_TOKENS

CASE_NAMES = ["gate-repeat", "gate-beside-decodes", "gate-siblings", "gate-mixed"]


def test_the_gate_cases_are_the_issues_workloads():
    cases = {c.name: c for c in serve_cases.build_gate_cases()}
    assert list(cases) == CASE_NAMES
    repeat = cases["gate-repeat"]
    assert len(repeat.prompts) == 4 and not repeat.concurrent
    assert all(p == repeat.prompts[0] and len(p) == 3000 for p in repeat.prompts)
    beside = cases["gate-beside-decodes"]
    short, family = beside.prompts[:32], beside.prompts[32:]
    assert beside.concurrent and len(short) == 32 and len(family) == 8
    assert max(map(len, short)) < 64 and min(map(len, family)) > 1800
    assert all(p[:1800] == family[0][:1800] for p in family)
    siblings = cases["gate-siblings"]
    assert siblings.concurrent and siblings.expect == "prefix_hits"
    assert len(siblings.prompts) == 8
    assert all(p[:1800] == family[0][:1800] and p not in family for p in siblings.prompts)
    mixed = cases["gate-mixed"]
    assert mixed.concurrent and len(mixed.prompts) == 64 and mixed.expect == "prefix_hits"
    of_long = [p for p in mixed.prompts if p[:50] == repeat.prompts[0][:50]]
    of_prefix = [p for p in mixed.prompts if p[:50] == family[0][:50]]
    assert len(of_long) == len(of_prefix) == 16
    everything = [p for c in cases.values() for p in c.prompts]
    assert max(map(len, everything)) + MAX_TOKENS <= serve_gate.GATE_MAX_MODEL_LEN
    assert all(3 <= t < serve_gate.GATE_VOCAB for p in everything for t in p)
    # queued quickly into the paused engine, in order
    assert {c.gap for c in cases.values() if c.concurrent} == {serve_gate.GATE_QUEUE_GAP_S}


def test_the_fp8_mode_runs_fewer_cases_and_the_scale_shortens_prompts():
    fp8 = serve_cases.build_gate_cases(mode="gate-fp8")
    assert [c.name for c in fp8] == list(serve_gate.FP8_CASES) == CASE_NAMES[:3]
    full, small = serve_cases.build_gate_cases(), serve_cases.build_gate_cases(0.2)
    assert [len(c.prompts) for c in small] == [len(c.prompts) for c in full]
    assert len(small[0].prompts[0]) == 600
    assert serve_cases.build_gate_cases() == full  # seeded: every engine, the same prompts


def test_gate_engines_run_as_served_by_default_with_dummy_weights():
    assert serve_gate.GATE_MODEL.name == "Qwen3.5-0.8B"
    assert serve_gate.has_vision(serve_gate.GATE_MODEL)
    assert not runs_eager("gate", on_cpu=False) and not runs_eager("gate-fp8", on_cpu=False)
    assert runs_eager("gate", on_cpu=True)
    gpu = mode_args("/model", 8000, "gate", 1, 0, True, eager=False)
    assert "--enforce-eager" not in gpu
    assert gpu[gpu.index("--load-format") + 1] == "dummy"
    assert gpu[gpu.index("--kv-cache-memory-bytes") + 1] == str(1 << 30)
    assert gpu[gpu.index("--max-model-len") + 1] == "4096"
    assert {"--enable-prefix-caching", "--language-model-only",
            "--skip-tokenizer-init"} <= set(gpu)
    # vLLM's defaults otherwise: scheduling, prefill budget, model runner, dtype
    assert not {"--async-scheduling", "--no-async-scheduling", "--max-num-batched-tokens",
                "--kv-cache-dtype", "--tensor-parallel-size"} & set(gpu)
    tp2 = mode_args("/model", 8000, "gate", 2, 0, False, eager=False)
    assert tp2[tp2.index("--tensor-parallel-size") + 1] == "2"
    assert "--no-enable-prefix-caching" in tp2
    fp8 = mode_args("/model", 8000, "gate-fp8", 1, 0, True, eager=False)
    assert fp8[fp8.index("--kv-cache-dtype") + 1] == "fp8"
    assert fp8[fp8.index("--attention-backend") + 1] == "FLASHINFER"
    assert "--enforce-eager" not in fp8


def test_the_local_runner_serves_the_zoo_config(tmp_path):
    runner = LocalRunner(Path("/venv/bin/python"), None, {}, {}, tmp_path)
    command = runner.command("e2", "gate", 8000, prefix_caching=False)
    assert command[command.index("--model") + 1] == str(serve_gate.GATE_MODEL)
    assert "--enforce-eager" in command and "--no-enable-prefix-caching" in command


class _FakeDocker:
    def info(self) -> dict:
        return {"Name": "gpu-host", "NCPU": 16}


def test_the_docker_runner_copies_the_config_in_and_keeps_a_compile_cache(tmp_path,
                                                                          monkeypatch):
    made = {}

    class Box:
        def __init__(self, client, image, command, **kwargs):
            made.update(image=image, command=command, **kwargs)

        def __enter__(self):
            raise RuntimeError("stop here")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(DockerRunner, "_image", lambda self, ref: {"ref": ref})
    monkeypatch.setattr("e2.probes.engines.Container", Box)
    runner = DockerRunner(_FakeDocker(), {"stock": "s", "e2": "e"}, "all", 2, tmp_path)
    with pytest.raises(RuntimeError, match="stop here"), runner.start("e2", "gate"):
        pass
    assert made["image"] == "e" and made["files"] == {"/model": serve_gate.GATE_MODEL}
    assert "--enforce-eager" not in made["command"]
    assert made["command"][made["command"].index("--tensor-parallel-size") + 1] == "2"
    assert made["env"]["VLLM_CACHE_ROOT"] == DockerRunner.COMPILE_CACHE
    assert list(made["volumes"]) == ["e2-gate-vllm-cache-e2"]


# ---------------------------------------------------------------- the verdict


def _engine(side: str, prefix_caching: bool = True) -> dict:
    return {"side": side, "mode": "gate", "boot_s": 60.0, "block_size": 544 if side == "stock"
            else 16, "num_blocks": 160, "kv_capacity_tokens": 87040,
            "kv_line": "GPU KV cache size: 87,040 tokens", "async_requested": False,
            "async_resolved": True, "enable_prefix_caching": prefix_caching,
            "mamba_cache_mode": "align" if prefix_caching else "none",
            "e2_banner": "vLLM E2 series 3 patches" if side == "e2" else None}


def _cases(hits: int) -> dict:
    cases = {}
    for case in serve_cases.build_gate_cases(0.05):
        requests = []
        for index, prompt in enumerate(case.prompts):
            ids = [(prompt[-1] + 7 * index + k) % 1000 + 3 for k in range(case.max_tokens)]
            request = {"prompt_tokens": len(prompt), "token_ids": ids,
                       "finish_reason": "length", "error": None}
            if case.concurrent:
                request["top_logprobs"] = [[[t, -1.0], [t + 1, -1.1]] for t in ids]
            requests.append(request)
        cases[case.name] = {"case": case.name, "requests": requests, "what": case.what,
                            "max_tokens": case.max_tokens, "expect": case.expect,
                            "prefix_cache_hits": hits if case.expect else 0,
                            "prefix_cache_queries": 0, "preemptions": 0,
                            "peak_running": None, "mean_running": None}
    return cases


def _record(stock_hits: int = 1000, e2_hits: int = 1000) -> dict:
    e2 = {"engine": _engine("e2"), "cases": _cases(e2_hits), "log_errors": [],
          "no_prefix_caching": {"engine": _engine("e2", False), "cases": _cases(0),
                                "log_errors": []}}
    sides = {"stock": {"modes": {"gate": {"engine": _engine("stock"), "cases": _cases(stock_hits),
                                          "log_errors": []},
                                 "gate-fp8": {"skipped": "not run on the CPU"}}},
             "e2": {"modes": {"gate": e2, "gate-fp8": {"skipped": "not run on the CPU"}}}}
    header = {"upstream_version": "0.31.0", "upstream_tag": "v0.31.0", "series_digest": "0" * 64,
              "runner": "local", "runner_detail": {}, "host": "here", "device": "CPU",
              "model": "Qwen3.5-0.8B", "command": "e2 probe serve --mode gate",
              "date": "2025-01-01", "seconds": 1.0}
    return {"format": 1, "header": header, "sides": sides}


def _judge(record: dict, tmp_path: Path, capsys) -> tuple[int, dict, str]:
    capsys.readouterr()
    code = serve_report.conclude(record, tmp_path, "gate-control")
    _, err = capsys.readouterr()
    return code, json.loads((tmp_path / "gate-control.json").read_text()), err


def test_a_gate_record_alike_on_every_engine_passes(tmp_path, capsys):
    code, judged, err = _judge(_record(1000, 950), tmp_path, capsys)
    assert code == 0 and judged["ok"], err
    rows = {(r["mode"], r["case"]): r for r in judged["rows"]}
    assert set(rows) == {("gate", n) for n in CASE_NAMES} | {("gate", "(prefix hits)"),
                                                           ("gate-fp8", "(all)")}
    assert all(rows[("gate", n)]["reference"] == f"{rows[('gate', n)]['requests']}/"
               f"{rows[('gate', n)]['requests']}" for n in CASE_NAMES)
    assert rows[("gate", "(prefix hits)")]["exercised"] == {
        "stock": "3000 prefix-cache hit tokens", "e2": "2850 prefix-cache hit tokens"}
    assert rows[("gate-fp8", "(all)")]["verdict"] == "skipped"
    markdown = (tmp_path / "gate-control.md").read_text()
    assert "all cases match" in markdown and "(prefix hits)" in markdown


def test_e2_hitting_under_095_of_stocks_prefix_tokens_fails(tmp_path, capsys):
    code, judged, err = _judge(_record(1000, 949), tmp_path, capsys)
    assert code == 1
    assert [r["case"] for r in judged["rows"] if not r["ok"]] == ["(prefix hits)"]
    assert "e2 hit 2847 prefix tokens, under 0.95 of stock's 3000" in err


def test_a_reference_that_hit_the_prefix_cache_fails(tmp_path, capsys):
    record = _record()
    reference = record["sides"]["e2"]["modes"]["gate"]["no_prefix_caching"]
    reference["cases"]["gate-repeat"]["prefix_cache_hits"] = 2720
    reference["engine"]["enable_prefix_caching"] = True
    code, _, err = _judge(record, tmp_path, capsys)
    assert code == 1
    assert "e2 with prefix caching off: 2720 prefix-cache hit tokens" in err
    assert "the reference engine resolved prefix caching on" in err


def test_a_token_differing_from_the_reference_fails(tmp_path, capsys):
    """E2 agrees with stock; only its own engine without prefix caching disagrees,
    on the third repeat of the long prompt (a hit that resumed from a wrong state)."""
    record = _record()
    reference = record["sides"]["e2"]["modes"]["gate"]["no_prefix_caching"]
    ids = reference["cases"]["gate-repeat"]["requests"][2]["token_ids"]
    ids[0] += 1
    code, judged, err = _judge(record, tmp_path, capsys)
    assert code == 1
    assert [r["case"] for r in judged["rows"] if not r["ok"]] == ["gate-repeat"]
    assert ("request 2: e2's token ids differ from position 0 from e2's with prefix "
            "caching off") in err


def test_a_token_differing_from_stock_in_a_sequential_case_fails(tmp_path, capsys):
    record = _record()
    record["sides"]["e2"]["modes"]["gate"]["cases"]["gate-repeat"]["requests"][3][
        "token_ids"][5] += 1
    code, _, err = _judge(record, tmp_path, capsys)
    assert code == 1 and "request 3: token ids differ from position 5" in err


def test_a_cuda_error_in_a_log_and_a_missing_reference_fail(tmp_path, capsys):
    record = _record()
    line = "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert serve_gate.log_errors(f"INFO fine\n{line}\nINFO after") == [line]
    record["sides"]["e2"]["modes"]["gate"]["log_errors"] = [line]
    code, _, err = _judge(record, tmp_path, capsys)
    assert code == 1 and f"e2: the engine logged {line!r}" in err
    record = _record()
    del record["sides"]["e2"]["modes"]["gate"]["no_prefix_caching"]
    code, _, err = _judge(copy.deepcopy(record), tmp_path, capsys)
    assert code == 1 and "e2 did not run the cases with prefix caching off" in err


def test_the_gate_scale_is_checked(cache):
    args = ["--project", str(REPO_ROOT), "--cache", str(cache.root), "probe", "serve",
            "--mode", "gate", "--no-record"]
    assert cli.main([*args, "--gate-scale", "2"]) == 1
    assert cli.main([*args, "--gate-scale", "0.5", "--docker"]) == 1


def test_make_probe_gpu_runs_the_gate_at_tp_1_and_2():
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert "probe-gpu: install\n\tscripts/probe-gate.sh" in makefile
    assert "probe-gpu-full: install\n\tscripts/probe-gpu.sh" in makefile
    script = (REPO_ROOT / "scripts/probe-gate.sh").read_text()
    assert "e2 image build --no-fallback" in script
    assert "--mode gate --mode gate-fp8 --tp 1" in script
    assert "--mode gate --tp 2" in script
    assert "--enforce-eager" not in script
    result = subprocess.run([str(REPO_ROOT / "scripts/probe-gate.sh")], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "usage: scripts/probe-gate.sh DOCKER_HOST" in result.stderr


def test_the_record_keeps_its_innermost_lists_on_one_line():
    """The JSON record reads back whole, with each request's token ids and each
    position's top tokens on one line (indented whole, the CPU record took 3.4 MB)."""
    record = _record()
    text = serve_report.record_json(record)
    assert json.loads(text) == record
    request = record["sides"]["stock"]["modes"]["gate"]["cases"]["gate-siblings"]["requests"][0]
    assert f'"token_ids": {json.dumps(request["token_ids"])}' in text
    assert json.dumps(request["top_logprobs"][0]) in text
    assert len(text) < len(json.dumps(record, indent=2, sort_keys=True)) / 2
