"""e2 probe serve on the CPU: real stock and E2 engines, token for token.

One module-scoped run of the whole probe (seven engine boots: sync and
async on each side, the align mode on each side and E2's align reference
without prefix caching; 6 to 15 minutes on two cores, by their load) feeds
the checks; the failing controls re-judge that run's recorded results with
a deliberately different E2 side, so they cost no further engine.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from conftest import E2, copy_checkout
from e2 import cli
from e2.probes import serve_cases, serve_compare, serve_report, serve_settings
from e2.upstream import UpstreamCache


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A copy of this checkout: the probe keeps its engines' logs under the project's .e2/."""
    return copy_checkout(tmp_path_factory.mktemp("serve-project") / "project")


@pytest.fixture
def serve_main(capsys, cache, project):
    """`e2 probe serve` on the copy of this checkout with the tests' cache."""
    return E2(project, UpstreamCache(cache), capsys).command("probe", "serve")


@pytest.fixture(scope="module")
def probe_run(tmp_path_factory, cache, project) -> dict:
    # the CPU test env is made (or reused) by the probe itself, as e2 env would
    report = tmp_path_factory.mktemp("serve")
    code = cli.main(["--project", str(project), "--cache", str(cache.root), "probe", "serve",
                     "--report", str(report)])
    record = json.loads((report / "serve-cpu.json").read_text())
    return {"code": code, "record": record, "report": report,
            "markdown": (report / "serve-cpu.md").read_text()}


def test_cpu_probe_stock_and_e2_match_on_every_case(probe_run):
    record = probe_run["record"]
    assert probe_run["code"] == 0, json.dumps(record["rows"], indent=1)
    assert record["ok"]
    header = record["header"]
    assert header["upstream_version"] == "0.31.0" and len(header["series_digest"]) == 64
    assert header["runner"] == "local" and header["device"].startswith("CPU")
    stock_block = record["sides"]["stock"]["modes"]["sync"]["engine"]["block_size"]
    preemptions = {}
    for side in serve_settings.SIDES:
        sync = record["sides"][side]["modes"]["sync"]
        engine = sync["engine"]
        assert "KV cache size:" in engine["kv_line"]
        assert (engine["e2_banner"] is not None) == (side == "e2")
        cases = sync["cases"]
        # both sides run the cases cut from the block size stock's engine reported,
        # and the edges of the kernel block sizes below it (E2's natural block is one)
        assert [cases[n]["requests"][0]["prompt_tokens"]
                for n in ("len-block-1", "len-block", "len-block+1")] == [
                    stock_block - 1, stock_block, stock_block + 1]
        assert engine["block_size"] in serve_cases.edge_blocks(stock_block)
        assert cases["shared-prefix"]["prefix_cache_hits"] > 0
        over = cases["oversubscribed"]
        demand = sum(r["prompt_tokens"] for r in over["requests"]) + \
            over["max_tokens"] * len(over["requests"])
        assert demand > engine["kv_capacity_tokens"]
        # per engine step (its own counters): some ran, never all at once; the gauge's
        # readings are a floor that never passes the requests posted
        assert 1 <= over["mean_running"] < len(over["requests"])
        assert 0 <= over["peak_running"] < len(over["requests"])
        preemptions[side] = over["preemptions"]
        for case in cases.values():
            assert all(serve_compare.complete(r, case["max_tokens"]) for r in case["requests"])
    # the oversubscribed case makes stock preempt; E2's admission reserves decode
    # growth, so it preempts no more than stock
    assert preemptions["stock"] > 0 and preemptions["e2"] <= preemptions["stock"]
    # requests far shorter than stock's block: E2's natural blocks run more at once
    short = {side: record["sides"][side]["modes"]["sync"]["cases"]["oversubscribed-short"]
             for side in serve_settings.SIDES}
    assert short["e2"]["mean_running"] > short["stock"]["mean_running"]
    assert short["e2"]["preemptions"] <= short["stock"]["preemptions"]
    e2_block = record["sides"]["e2"]["modes"]["sync"]["engine"]["block_size"]
    assert e2_block < stock_block  # the CPU's natural attention block, not the aligned one
    rows = {(r["mode"], r["case"]): r for r in record["rows"]}
    # every request the same, or (a concurrent case, batched differently by the two
    # sides) parted at a near tie: each side's token among the other's top ones
    assert all(r["matched"] + r["close"] == r["requests"] and r["ok"]
               for (m, _), r in rows.items() if m == "sync")
    assert all(r["close"] == 0 for (m, c), r in rows.items()
               if m == "sync" and not c.startswith("oversubscribed"))
    # vLLM's CPU platform turns async scheduling off: reported, not passed
    for side in serve_settings.SIDES:
        async_mode = record["sides"][side]["modes"]["async"]
        assert async_mode["engine"]["async_requested"] is True
        assert async_mode["engine"]["async_resolved"] is False
        assert async_mode["skipped"] == serve_settings.CPU_ASYNC_SKIP
    assert rows[("async", "(all)")]["verdict"] == "skipped"
    assert serve_settings.CPU_ASYNC_SKIP in probe_run["markdown"]
    assert "all cases match" in probe_run["markdown"]


def test_align_mode_resumes_off_stocks_block_grid_with_the_same_tokens(probe_run):
    """The align geometry: stock raises its block past E2's 256-token state block,
    E2 attends in its natural block. Chunked prefills cache states, siblings
    resume from them, and E2's tokens equal stock's and its own with prefix
    caching off, which takes no hit."""
    record = probe_run["record"]
    stock, e2 = (record["sides"][side]["modes"]["align"] for side in ("stock", "e2"))
    reference = e2["no_prefix_caching"]
    stock_block = stock["engine"]["block_size"]
    assert stock_block > 256 > e2["engine"]["block_size"]
    assert stock["engine"]["mamba_cache_mode"] == e2["engine"]["mamba_cache_mode"] == "align"
    assert reference["engine"]["enable_prefix_caching"] is False
    assert reference["engine"]["e2_banner"] is not None
    assert all(case["prefix_cache_hits"] == 0 for case in reference["cases"].values())
    for side in (stock, e2):
        for name in ("align-siblings", "align-siblings-concurrent"):
            assert side["cases"][name]["prefix_cache_hits"] > 0
    # E2's hits land on its own grid (256-token states, 32-token partial tails),
    # not on multiples of stock's block: the states it resumed from are its own.
    assert e2["cases"]["align-siblings"]["prefix_cache_hits"] % stock_block != 0
    rows = {r["case"]: r for r in record["rows"] if r["mode"] == "align"}
    assert set(rows) == set(e2["cases"]) == set(reference["cases"])
    assert all(r["ok"] and r["reference"] is not None for r in rows.values())
    for name in ("align-chunked", "align-siblings"):  # sequential: every token, both ways
        assert rows[name]["matched"] == rows[name]["requests"]
        assert rows[name]["reference"] == f"{rows[name]['requests']}/{rows[name]['requests']}"
    assert "e2 vs e2 without prefix caching" in probe_run["markdown"]


def test_e2_parting_from_itself_without_prefix_caching_fails(probe_run, tmp_path, capsys):
    """A hit that resumed from a wrong state: E2 agrees with stock's record here
    (the reference is changed instead), so only the reference comparison sees it."""
    record = copy.deepcopy(probe_run["record"])
    reference = record["sides"]["e2"]["modes"]["align"]["no_prefix_caching"]
    request = reference["cases"]["align-siblings"]["requests"][0]
    request["token_ids"][3] = next(t for t in range(3, serve_settings.VOCAB)
                                   if t != request["token_ids"][3])
    code, judged, err = _rejudge(record, tmp_path, capsys)
    assert code == 1
    assert [r["case"] for r in judged["rows"] if not r["ok"]] == ["align-siblings"]
    assert ("request 0: e2's token ids differ from position 3 from e2's with prefix "
            "caching off") in err


def test_a_reference_that_hit_the_prefix_cache_fails(probe_run, tmp_path, capsys):
    """The control must really run the other way: no prefix-cache hit, E2's overlay in."""
    record = copy.deepcopy(probe_run["record"])
    reference = record["sides"]["e2"]["modes"]["align"]["no_prefix_caching"]
    reference["cases"]["align-siblings"]["prefix_cache_hits"] = 32
    reference["engine"]["e2_banner"] = None
    code, _, err = _rejudge(record, tmp_path, capsys)
    assert code == 1
    assert "e2 with prefix caching off: 32 prefix-cache hit tokens" in err
    assert "the E2 engine with prefix caching off did not log E2's boot report" in err


def _rejudge(record: dict, tmp_path: Path, capsys) -> tuple[int, dict, str]:
    capsys.readouterr()
    code = serve_report.conclude(record, tmp_path, "serve-control")
    _, err = capsys.readouterr()
    return code, json.loads((tmp_path / "serve-control.json").read_text()), err


def _same_request(record: dict, case: str) -> tuple[int, dict, dict]:
    """The first request of a sync case whose token ids agree on both sides."""
    sides = [record["sides"][side]["modes"]["sync"]["cases"][case]["requests"]
             for side in ("stock", "e2")]
    index = next(i for i, (s, e) in enumerate(zip(*sides)) if s["token_ids"] == e["token_ids"])
    return index, sides[0][index], sides[1][index]


def _row(judged: dict, case: str) -> dict:
    return next(r for r in judged["rows"] if (r["mode"], r["case"]) == ("sync", case))


def test_a_different_e2_token_is_a_mismatch_and_fails(probe_run, tmp_path, capsys):
    """A token stock does not rank among its top ones at that position: what a
    wrong state or KV block gives, not a near tie."""
    record = copy.deepcopy(probe_run["record"])
    before = _row(probe_run["record"], "oversubscribed")
    index, stock, e2 = _same_request(record, "oversubscribed")
    ranked = {token for token, _ in stock["top_logprobs"][7]}
    e2["token_ids"][7] = next(t for t in range(3, serve_settings.VOCAB) if t not in ranked)
    code, judged, err = _rejudge(record, tmp_path, capsys)
    assert code == 1 and not judged["ok"]
    bad = [r for r in judged["rows"] if not r["ok"]]
    assert [(r["mode"], r["case"]) for r in bad] == [("sync", "oversubscribed")]
    assert (bad[0]["matched"], bad[0]["close"]) == (before["matched"] - 1, before["close"])
    assert f"request {index}: token ids differ from position 7" in err
    assert "not a near tie" in err
    assert "FAIL" in (tmp_path / "serve-control.md").read_text()


def test_outputs_parting_at_a_near_tie_pass_in_a_concurrent_case(probe_run, tmp_path,
                                                                  capsys):
    """Where each side's token is among the other's top ones, a concurrent case
    (batched differently by the two sides) counts the request as parted at a near
    tie; a sequential case, batched alike, still wants every token."""
    record = copy.deepcopy(probe_run["record"])
    before = _row(probe_run["record"], "oversubscribed")
    _, stock, e2 = _same_request(record, "oversubscribed")
    runner_up = next(t for t, _ in stock["top_logprobs"][5] if t != stock["token_ids"][5])
    e2["token_ids"][5:] = [runner_up] * (len(e2["token_ids"]) - 5)
    code, judged, _ = _rejudge(record, tmp_path, capsys)
    assert code == 0 and judged["ok"]
    row = _row(judged, "oversubscribed")
    assert (row["matched"], row["close"]) == (before["matched"] - 1, before["close"] + 1)
    assert f"(+{row['close']} at a near tie)" in (tmp_path / "serve-control.md").read_text()
    case = record["sides"]["e2"]["modes"]["sync"]["cases"]["len-block"]
    case["requests"][0]["token_ids"][5] = runner_up
    code, judged, _ = _rejudge(record, tmp_path, capsys)
    assert code == 1 and not _row(judged, "len-block")["ok"]


def test_a_changed_sampling_parameter_on_e2_fails(probe_run, tmp_path, capsys):
    """As if E2 had honoured a different max_tokens: short outputs, incomplete requests."""
    record = copy.deepcopy(probe_run["record"])
    case = record["sides"]["e2"]["modes"]["sync"]["cases"]["len-block"]
    case["requests"][0]["token_ids"] = case["requests"][0]["token_ids"][:-1]
    code, judged, err = _rejudge(record, tmp_path, capsys)
    assert code == 1
    assert "e2: 0/1 complete" in err and "request 0: token ids differ" in err


def test_a_case_that_missed_its_path_fails(probe_run, tmp_path, capsys):
    record = copy.deepcopy(probe_run["record"])
    record["sides"]["stock"]["modes"]["sync"]["cases"]["oversubscribed"]["preemptions"] = 0
    code, _, err = _rejudge(record, tmp_path, capsys)
    assert code == 1 and "stock: no preemption" in err


def test_e2_preempting_more_than_stock_fails(probe_run, tmp_path, capsys):
    record = copy.deepcopy(probe_run["record"])
    stock = record["sides"]["stock"]["modes"]["sync"]["cases"]["oversubscribed"]
    e2 = record["sides"]["e2"]["modes"]["sync"]["cases"]["oversubscribed"]
    e2["preemptions"] = stock["preemptions"] + 1
    code, _, err = _rejudge(record, tmp_path, capsys)
    assert code == 1 and f"e2 preempted {stock['preemptions'] + 1} times" in err


def test_e2_running_no_more_short_requests_than_stock_fails(probe_run, tmp_path, capsys):
    record = copy.deepcopy(probe_run["record"])
    stock = record["sides"]["stock"]["modes"]["sync"]["cases"]["oversubscribed-short"]
    e2 = record["sides"]["e2"]["modes"]["sync"]["cases"]["oversubscribed-short"]
    e2["mean_running"] = stock["mean_running"]
    code, _, err = _rejudge(record, tmp_path, capsys)
    assert code == 1
    assert f"e2 ran {stock['mean_running']} requests per step, stock" in err


def test_a_gauge_that_missed_the_run_is_reported_not_judged(probe_run, tmp_path, capsys):
    """A short case can finish between two readings of the running gauge (stock's
    16+8 case on a 2-core host): the verdict stands on the engine's step counters."""
    record = copy.deepcopy(probe_run["record"])
    stock = record["sides"]["stock"]["modes"]["sync"]["cases"]["oversubscribed-short"]
    stock["peak_running"] = 0
    code, judged, _ = _rejudge(record, tmp_path, capsys)
    assert code == 0 and judged["ok"]
    assert "gauge read none" in (tmp_path / "serve-control.md").read_text()


def test_a_case_without_a_counted_step_fails_as_unmeasured(probe_run, tmp_path, capsys):
    record = copy.deepcopy(probe_run["record"])
    e2 = record["sides"]["e2"]["modes"]["sync"]["cases"]["oversubscribed"]
    e2["mean_running"] = 0.0
    code, _, err = _rejudge(record, tmp_path, capsys)
    assert code == 1 and "e2: the engine counted no step with a running request" in err


def test_an_e2_side_without_the_overlay_fails(probe_run, tmp_path, capsys):
    record = copy.deepcopy(probe_run["record"])
    for mode in record["sides"]["e2"]["modes"].values():
        mode["engine"]["e2_banner"] = None
    code, _, err = _rejudge(record, tmp_path, capsys)
    assert code == 1 and "the overlay is not in effect" in err


def test_cases_follow_the_block_size_and_capacity():
    small = serve_cases.build_cases(16, 200)
    assert [len(c.prompts[0]) for c in small[:3]] == [15, 16, 17]
    big = serve_cases.build_cases(256, 3000)
    # Edges of the engine's block and of the kernel blocks below it (E2's
    # natural attention blocks).
    assert serve_cases.edge_blocks(256) == [256, 128, 64, 32, 16]
    assert serve_cases.edge_blocks(544) == [544, 256, 128, 64, 32, 16]
    assert [len(c.prompts[0]) for c in big[:15]] == [
        n + d for n in (256, 128, 64, 32, 16) for d in (-1, 0, 1)]
    over = big[-2]
    assert over.name == "oversubscribed"
    assert over.concurrent and len(over.prompts) * (len(over.prompts[0]) + over.max_tokens) > 4 * 3000
    # The short case: an eighth of the block in, a sixteenth out, max_num_seqs of them.
    short = big[-1]
    assert (short.name, short.expect, short.max_tokens) == ("oversubscribed-short",
                                                            "more_running", 16)
    assert [len(p) for p in short.prompts] == [32] * serve_settings.MAX_NUM_SEQS
    shared = min(3 * 256, serve_settings.MAX_MODEL_LEN // 2)  # three blocks, within max-model-len
    prefix = big[15]
    assert prefix.prompts[0][:shared] == prefix.prompts[1][:shared]
    assert prefix.prompts[0][shared:] != prefix.prompts[1][shared:]


def test_align_cases_chunk_long_prompts_and_share_their_prefixes():
    cases = {c.name: c for c in serve_cases.build_align_cases(384, budget=600)}
    assert list(cases) == ["align-chunked", "align-siblings", "align-beside-decodes",
                           "align-siblings-concurrent"]
    prompt = cases["align-chunked"].prompts[0]
    # three chunks or more at the budget, the prompt's end inside a 256-token block
    assert len(prompt) > 2 * 600 and len(prompt) % 256 and len(prompt) % 384
    for siblings, source in (("align-siblings", prompt),
                             ("align-siblings-concurrent",
                              cases["align-beside-decodes"].prompts[0])):
        for sibling in cases[siblings].prompts:
            shared = next(i for i, (a, b) in enumerate(zip(sibling, source)) if a != b)
            assert len(sibling) == len(source) and 256 < shared < len(source)
        assert cases[siblings].expect == "prefix_hits"
    assert cases["align-beside-decodes"].concurrent
    assert cases["align-siblings-concurrent"].concurrent
    with pytest.raises(ValueError, match="not longer than stock's block"):
        serve_cases.build_align_cases(2048, budget=600)


def test_the_align_mode_captures_cuda_graphs_on_a_gpu_only():
    from e2.probes.engines import engine_args, runs_eager

    assert not runs_eager("align", on_cpu=False)
    assert runs_eager("align", on_cpu=True) and runs_eager("sync", on_cpu=False)
    gpu_align = engine_args("/model", 8000, "align", 1, eager=False)
    assert "--enforce-eager" not in gpu_align
    assert gpu_align[gpu_align.index("--max-num-batched-tokens") + 1] == str(
        serve_settings.ALIGN_BATCHED_TOKENS)
    assert "--enforce-eager" in engine_args("/model", 8000, "sync", 1)
    assert "--no-enable-prefix-caching" in engine_args("/model", 8000, "align", 1,
                                                       prefix_caching=False)


def test_unreachable_docker_host_is_a_clear_error(serve_main, monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", "tcp://127.0.0.1:9")
    code, _, err = serve_main("--docker", "--stock-image", "vllm/vllm-openai:v0.31.0",
                         "--e2-image", "vllm-e2:test", "--gpus", "all", "--tp", "2",
                         "--no-record")
    assert code == 1
    assert "no Docker daemon reachable at tcp://127.0.0.1:9" in err
    assert "DOCKER_HOST" in err  # the hint
    assert "Traceback" not in err


def test_docker_only_options_without_docker_are_refused(serve_main):
    code, _, err = serve_main("--gpus", "all", "--no-record")
    assert code == 1 and "go with --docker" in err


def test_a_tensor_parallel_size_the_model_cannot_split_over_is_refused(serve_main):
    code, _, err = serve_main("--docker", "--gpus", "all", "--tp", "3", "--no-record")
    assert code == 1 and "--tp 3" in err and "1, 2, 4" in err
